"""Hybrid Adam: AdamW over flat chunk buffers, on the device for some chunks, the host for the rest.

Each chunk's update is a handful of vectorised operations over its whole flat buffers (master,
gradient, momentum, variance), on the tier the placement chose for that chunk: the device when
its optimizer states fit in the margin left after backward, the host otherwise. The arithmetic
is that of ``torch.optim.AdamW`` (decoupled weight decay on matrices only, bias-corrected), so
runs agree with it to rounding.

Its ``state_dict`` has the layout of ``torch.optim.AdamW``'s (per-parameter ``step``,
``exp_avg``, ``exp_avg_sq``; the same parameter groups), gathered from the chunks of every rank,
so checkpoints load into a plain AdamW, a different data-parallel size, or back into chunks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tessera.memory.chunk import Chunk, Kind
from tessera.memory.shards import as_layout, to_local_value

if TYPE_CHECKING:
    from tessera.memory.runtime import ChunkRuntime


class HybridAdam(torch.optim.Optimizer):
    """AdamW whose parameters, gradients and states live in chunks.

    Args:
        runtime: the chunk runtime of the model (manager + hooks).
        model: the model (its trainable parameters form the two groups, as in
            :func:`tessera.train.optim.build_optimizer`).
        lr, weight_decay, betas, eps: AdamW hyper-parameters.
    """

    def __init__(self, runtime: "ChunkRuntime", model: nn.Module, lr: float, weight_decay: float,
                 betas: tuple[float, float], eps: float) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        # Shapes from the chunk layout: a parameter off the device is an empty placeholder.
        matrix = {p: len(runtime.manager.slot_of[p][1].shape) >= 2 for p in params}
        groups = [{"params": [p for p in params if matrix[p]], "weight_decay": weight_decay},
                  {"params": [p for p in params if not matrix[p]], "weight_decay": 0.0}]
        # AdamW's own defaults, so the state dict's groups look exactly like AdamW's.
        defaults = dict(torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=betas, eps=eps).defaults)
        super().__init__(groups, defaults)
        self.runtime, self.steps = runtime, 0
        self._group_of = {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}
        # The real states live in chunks. These placeholders carry AdamW's state names, which
        # torch.distributed.checkpoint reads from ``optimizer.state`` (a non-empty state also
        # keeps it from running a dummy step to create them).
        for p in params:
            self.state[p] = {"step": torch.zeros(()), "exp_avg": torch.empty(0),
                             "exp_avg_sq": torch.empty(0)}

    # ---------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        rt = self.runtime
        rt.hooks.flush()
        manager = rt.manager
        if not manager.adam_tier:
            manager.adam_tier = manager.policy.adam_tiers(manager)
        self.steps += 1
        for chunk in manager.own_chunks():
            if chunk.slots:
                manager.tracer.tick(f"adam chunk {chunk.index}", manager.device.used)
                self._update(chunk)
        rt.end_iteration()

    def skip_step(self) -> None:
        """End the iteration without updating (fp16 overflow)."""
        self.runtime.hooks.flush()
        self.runtime.end_iteration()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.runtime.drop_grads()

    def _update(self, chunk: Chunk) -> None:
        m = self.runtime.manager
        tier = m.adam_tier[chunk.index]
        kinds = (Kind.PARAM, Kind.GRAD, Kind.MASTER, Kind.MOMENTUM, Kind.VARIANCE)
        protect = {(chunk.index, k) for k in kinds}
        if Kind.GRAD not in chunk.tier:
            return  # no parameter of this chunk received a gradient
        separate = m.dtype != torch.float32 or tier != "device"
        if separate and Kind.MASTER not in chunk.tier:
            # First host update of an fp32 chunk: its master is a copy; the parameter chunk
            # itself stays where it is (pinned on the device under static).
            master = m.alloc(chunk, Kind.MASTER, tier, protect, torch.float32)
            param = self.runtime.readable(chunk, Kind.PARAM)
            master.copy_(param)
            if chunk.tier[Kind.PARAM] != tier:
                m.transfers.add(chunk.tier[Kind.PARAM], tier, param.numel() * param.element_size())
        master = m.place(chunk, Kind.MASTER if separate else Kind.PARAM, tier, protect)
        grad = m.place(chunk, Kind.GRAD, tier, protect)
        states = []
        for kind in (Kind.MOMENTUM, Kind.VARIANCE):
            if kind not in chunk.tier:
                m.alloc(chunk, kind, tier, protect)
            states.append(m.place(chunk, kind, tier, protect))
        for kind in kinds:
            if kind in chunk.tier:
                m.tracer.access((chunk.index, kind))
        m.device.note_peak()
        m.tracer.note_accounted(m.device.used, m.device.nonmodel)
        n = chunk.used
        self._adamw(chunk, master[:n], grad[:n].float(), states[0][:n], states[1][:n])
        if separate:
            self._write_back(chunk, master, tier, protect)
        m.drop(chunk, Kind.GRAD)

    def _adamw(self, chunk: Chunk, p: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor) -> None:
        # Decoupled weight decay, per parameter group's segments of the flat buffer.
        for slot in chunk.slots:
            group = self.param_groups[self._group_of[slot.param]]
            if group["weight_decay"]:
                p[slot.offset: slot.end].mul_(1 - group["lr"] * group["weight_decay"])
        # One vectorised update per chunk needs one lr, betas and eps for all its groups.
        group = self.param_groups[0]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        if any((g["lr"], g["betas"], g["eps"]) != (lr, (beta1, beta2), eps)
               for g in self.param_groups):
            raise ValueError("HybridAdam needs the same lr, betas and eps in every group")
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1 = 1 - beta1 ** self.steps
        bias2_sqrt = math.sqrt(1 - beta2 ** self.steps)
        # In place after the first op: one chunk-sized temporary, not two at once.
        denom = exp_avg_sq.sqrt().div_(bias2_sqrt).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-lr / bias1)

    def _write_back(self, chunk: Chunk, master: torch.Tensor, tier: str, protect: set) -> None:
        """Copy the updated fp32 master into the compute-precision parameter chunk."""
        m = self.runtime.manager
        if chunk.tier.get(Kind.PARAM) == "disk":
            m.place(chunk, Kind.PARAM, "host", protect)
        m.wait(chunk, Kind.PARAM)  # a prefetch still copying in would land after the update
        param = chunk.payload[Kind.PARAM]
        param.copy_(master.to(param.device, non_blocking=param.is_cuda))
        if chunk.tier[Kind.PARAM] != tier:
            m.transfers.add(tier, chunk.tier[Kind.PARAM], param.numel() * param.element_size())

    # ---------------------------------------------------------------------- state dicts
    def state_dict(self) -> dict[str, Any]:
        """AdamW layout: ``{"state": {i: {step, exp_avg, exp_avg_sq}}, "param_groups"}``."""
        moments = self.runtime.full_optimizer_state()
        state, groups, index = {}, [], 0
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                exp_avg, exp_avg_sq = moments[p]
                # Under tp: DTensors in the parameter's placements, as AdamW's states are.
                state[index] = {"step": torch.tensor(float(self.steps)),
                                "exp_avg": as_layout(p, exp_avg),
                                "exp_avg_sq": as_layout(p, exp_avg_sq)}
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        out = {"state": state, "param_groups": groups}
        # This method replaces torch's, which runs the registered hooks (tp: unpermuting
        # fused q|k|v moments); run them here the same way.
        for hook in self._optimizer_state_dict_post_hooks.values():
            out = hook(self, out) or out
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an AdamW-layout state dict (from this class or a plain AdamW) into chunks."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        params = [p for g in self.param_groups for p in g["params"]]
        saved_groups = state_dict["param_groups"]
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        ids = [i for g in saved_groups for i in g["params"]]
        values = {}
        for param, i in zip(params, ids):
            entry = state_dict["state"].get(i)
            if entry is not None:
                values[param] = (to_local_value(param, entry["exp_avg"]),
                                 to_local_value(param, entry["exp_avg_sq"]))
                self.steps = int(float(entry["step"]))
        self.runtime.load_optimizer_state(values)
