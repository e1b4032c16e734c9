"""This rank's share of the model under its original names, and the gradient rules for it.

:class:`StageModule` registers the very parameters of the user's model that this rank's stages
read, at their original dotted names (every name, when weights are tied). So its state dict
holds the single-device keys of this rank's share: DCP writes each stage's keys from its own
ranks, and the union is the single-device checkpoint, loadable at any pp.

Gradient rules after a step:
- tied weights (a GPT-2 embedding reused by the LM head) live on the first and last stage;
  their gradients are summed over the pp group (ranks without the weight add zeros), which is
  what one device accumulates into the shared tensor;
- data parallelism averages every trainable weight's gradient over the dp group: in buckets
  launched during each stage's last backward as their gradients become final
  (``overlap.py``), except weights whose rows other stages hold (their rows' gradients arrive
  after the drain); frozen weights keep no gradient;
  the tied weights' pp sum follows the average (both are linear: the order does not matter);
- the global gradient norm sums each weight once, on the lowest stage holding it.

Under tensor parallelism the parameters are DTensors: every rule works on the local shards
(each tp rank of a stage syncs its own shard with the same shard elsewhere), and the norm sums
the shards over the tp group, counting a replicated piece once.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from tessera.parallel.pipeline.overlap import (BUCKET_BYTES, FIRST_BUCKET_BYTES,
                                               OverlappedAverage, average_now, grad_or_zeros,
                                               local_shard)
from tessera.parallel.tensor.loss import replica_count


class StageModule(nn.Module):
    """A module tree holding ``params`` (name -> tensor) at their dotted names.

    Args:
        params: original name -> parameter, every alias of a tied weight included, in the
            model's ``named_parameters(remove_duplicate=False)`` order.
        buffers: original name -> persistent buffer this rank reads.
    """

    # Checkpoints key this rank's optimizer state by parameter name (train/checkpoint.py):
    # by group index, every stage's "group 0" would be saved under the same key.
    flat_optimizer_state = True

    def __init__(self, params: dict[str, nn.Parameter],
                 buffers: dict[str, torch.Tensor]) -> None:
        super().__init__()
        # In the model's order, so a tied weight's first name here (the one state dicts and
        # the flat optimizer state key it by) is the model's own: sorted, GPT-2's
        # "lm_head.weight" came before "transformer.wte.weight" and a pp checkpoint's
        # optimizer state missed that key at pp=1.
        for name, param in params.items():
            owner, leaf = self._owner(name)
            owner.register_parameter(leaf, param)
        for name, buf in sorted(buffers.items()):
            owner, leaf = self._owner(name)
            owner.register_buffer(leaf, buf)

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        *path, leaf = name.split(".")
        module: nn.Module = self
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
        return module, leaf

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline stage runs through PipelineEngine, not by calling it")


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers that appear in the model's state dict."""
    keys = set(model.state_dict().keys())
    return {name: buf for name, buf in model.named_buffers() if name in keys}


class GradSync:
    """Tied-weight and data-parallel gradient reduction, and the global gradient norm.

    Args:
        params: this rank's parameters, unique.
        norm_owned: those this rank counts in the global norm (lowest pp rank holding them).
        pp_group, dp_group: process groups of this rank's pp and dp axes.
        tied: every weight held by several pp ranks as (key, shape), in one global order so
            all pp ranks run the same all-reduces in the same order.
        tied_local: key -> this rank's tensor, for the tied weights this rank holds.
        device: where zeros stand in for tied weights this rank does not hold.
        tp_group: the tensor-parallel group when parameters are DTensor shards, else None.
    """

    def __init__(self, params: list[nn.Parameter], norm_owned: list[nn.Parameter], pp_group,
                 dp_group, tied: list[tuple[str, tuple[int, ...]]],
                 tied_local: dict[str, nn.Parameter], device: torch.device,
                 tp_group=None) -> None:
        self.params, self.norm_owned = params, norm_owned
        self.pp_group, self.dp_group, self.tp_group = pp_group, dp_group, tp_group
        self.tied, self.tied_local, self.device = tied, tied_local, device
        self.held_back: set[int] = set()  # rows' homes: averaged only after the drain
        self._average: OverlappedAverage | None = None
        self.overlap = True  # False: average only after the pipeline drains (measurement)
        self._bucket_bytes = (FIRST_BUCKET_BYTES, BUCKET_BYTES)

    @property
    def bucket_bytes(self) -> tuple[int, int]:
        """(first, later) dp bucket sizes in bytes; settable before the first step only."""
        return self._bucket_bytes

    @bucket_bytes.setter
    def bucket_bytes(self, sizes: tuple[int, int]) -> None:
        if self._average is not None:
            raise RuntimeError("bucket_bytes must be set before the first step")
        self._bucket_bytes = sizes

    def hold_back(self, params) -> None:
        """Average ``params`` only after the drain (their gradients change after it: rows)."""
        if self._average is not None:
            raise RuntimeError("hold_back() must come before the first step")
        self.held_back |= {id(p) for p in params}

    @contextlib.contextmanager
    def accumulate(self, key=None):
        """Context for one step's schedule, ``key`` naming its micro-batch count and shape:
        the dp buckets launch inside it as their gradients become final."""
        average = self._overlapped()
        if average is None or key is None:
            yield
            return
        average.arm(key, self.overlap)
        try:
            yield
        except BaseException:
            average.disarm()
            raise

    def sync(self) -> None:
        """Average gradients over dp (finishing the buckets the last backward launched),
        then sum tied ones over pp: both are linear, so the order does not matter."""
        average = self._overlapped()
        if average is not None:
            average.finish()
        rest = self.averaged_after_drain
        if dist.get_world_size(self.dp_group) > 1 and rest:
            average_now(rest, self.dp_group)
        for key, shape in self.tied:
            param = self.tied_local.get(key)
            grad = (grad_or_zeros(param) if param is not None
                    else torch.zeros(shape, device=self.device))
            dist.all_reduce(grad, group=self.pp_group)

    @property
    def buckets_launched_in_backward(self) -> int:
        """How many dp buckets the last step launched before the pipeline drained."""
        return 0 if self._average is None else self._average.launched_in_backward

    @property
    def averaged_after_drain(self) -> list[nn.Parameter]:
        """Trainable weights outside the buckets: rows' homes, and all of them before the
        first step. Frozen weights are not averaged: their gradient stays None, so the
        optimizer leaves them alone."""
        inside = set() if self._average is None else {id(p) for p in self._average.params}
        return [p for p in self.params if id(p) not in inside and p.requires_grad]

    def _overlapped(self) -> OverlappedAverage | None:
        """The bucketed average of the trainable weights not held back (built at the first
        step, so that chunk memory, which replaces this sync, never hooks them; a frozen
        weight cannot take a gradient hook)."""
        if self._average is None and dist.get_world_size(self.dp_group) > 1:
            free = [p for p in self.params if id(p) not in self.held_back and p.requires_grad]
            if free:
                self._average = OverlappedAverage(free, self.dp_group, self.bucket_bytes)
        return self._average

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip all stages' gradients to a global 2-norm; returns the norm before clipping.

        Same formula as torch.nn.utils.clip_grad_norm_, so pp=1 and pp>1 clip alike.
        """
        sq = torch.zeros((), device=self.device)
        tp = 1 if self.tp_group is None else dist.get_world_size(self.tp_group)
        for p in self.norm_owned:
            if p.grad is not None:
                copies = replica_count(p.grad, tp) if self.tp_group is not None else 1
                sq += local_shard(p.grad).detach().float().pow(2).sum() / copies
        if self.tp_group is not None:
            dist.all_reduce(sq, group=self.tp_group)
        dist.all_reduce(sq, group=self.pp_group)
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self.params:
            if p.grad is not None:
                local_shard(p.grad).detach().mul_(coef.to(p.grad.dtype))
        return norm
