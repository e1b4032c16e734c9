"""What `parallelize` returns: the module to run and how to compute one rank's loss.

Each parallelism may replace a piece:
- tensor parallelism computes the loss from vocabulary-sharded logits (no full logits);
- sequence parallelism gives each rank its slice of the sequence (and position ids);
- sharded parameters need a gradient norm reduced over the ranks that hold the shards.
The Engine and Trainer only ever call these, so they do not change as parallelisms land.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

Batch = dict[str, torch.Tensor]


def causal_lm_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) of a reference model (returns a tensor) or a HF model (``.logits``)."""
    out = model(input_ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; labels equal to -100 are ignored (none left:
    0 with a zero gradient, not F.cross_entropy's 0/0, so a micro-batch of padding alone
    does not poison the step)."""
    total = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                            reduction="sum")
    return total / (labels != -100).sum().clamp_min(1)


def refuse_extra_losses(model: nn.Module) -> None:
    """Refuse a model whose own loss adds a term to the next-token loss, which every layout
    trains alone (from the logits): a Mixture-of-Experts router's load-balancing loss, added
    when ``output_router_logits=True`` unless its coefficient is 0.

    Raises:
        ValueError: naming the setting and the way out.
    """
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return
    coefficients = _aux_loss_coefficients(model, config)
    if coefficients and not any(coefficients.values()):
        return  # every term the model adds is multiplied by 0
    named = ", ".join(f"{k}={v}" for k, v in coefficients.items()) or "its coefficient"
    raise ValueError(
        f"{type(model).__name__} is built with output_router_logits=True: its own loss adds "
        f"the router's load-balancing loss (x {named}), which tessera does not train (every "
        "layout trains the next-token loss of the logits alone). Build it with "
        "output_router_logits=False, or the coefficient 0")


def _aux_loss_coefficients(model: nn.Module, config) -> dict[str, float]:
    """The router loss coefficients a Hugging Face model reads, under the names its family
    uses (Mixtral's router_aux_loss_coef, JetMoE's aux_loss_coef, DBRX's moe_loss_weight)."""
    found = {}
    for owner, name in ((model, "router_aux_loss_coef"), (config, "router_aux_loss_coef"),
                        (config, "aux_loss_coef"),
                        (getattr(config, "ffn_config", None), "moe_loss_weight"),
                        (getattr(config, "text_config", None), "router_aux_loss_coef")):
        value = getattr(owner, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            found[name] = float(value)
    return found


def default_forward_loss(module: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean loss of a whole micro-batch on one rank."""
    return lm_loss(causal_lm_logits(module, batch["input_ids"]), batch["labels"])


# Batch keys every layout reads; others only where the layout honours them (batch_keys).
READ_ALWAYS = frozenset({"input_ids", "labels"})


def labels_without_padding(batch: Batch) -> torch.Tensor:
    """The batch's labels with padding ignored (-100), whatever they held: positions with
    ``attention_mask == 0`` or a negative document id, which attend to nothing."""
    labels = batch["labels"]
    if "attention_mask" in batch:
        labels = labels.masked_fill(batch["attention_mask"] == 0, -100)
    if "document_ids" in batch:
        labels = labels.masked_fill(batch["document_ids"] < 0, -100)
    return labels


# What a token added after a batch's end holds: a padding position that no loss reads and no
# real token attends to (causal attention; attention_mask 0 and document_ids < 0 mark it).
PAD_FILL = {"input_ids": 0, "labels": -100, "attention_mask": 0, "document_ids": -1,
            "position_ids": 0}


def pad_batch(batch: Batch, length: int) -> Batch:
    """``batch`` with its (B, T) tensors right-padded to ``length`` tokens (PAD_FILL): the
    same loss and gradients, for a runtime that needs one shape for several micro-batches.

    Raises:
        ValueError: for a key without a known padding value, or a batch longer than length.
    """
    current = batch["input_ids"].shape[1]
    if current == length:
        return batch
    if current > length:
        raise ValueError(f"a batch of {current} tokens cannot be padded to {length}")
    unknown = sorted(set(batch) - set(PAD_FILL))
    if unknown:
        raise ValueError(f"batch keys {unknown} have no padding value: micro-batches of "
                         f"different lengths cannot be padded to one shape")
    return {key: F.pad(value, (0, length - current), value=PAD_FILL[key])
            for key, value in batch.items()}


def fit_batch(batch: Batch, honoured: frozenset[str]) -> Batch:
    """``batch`` as a layout that reads ``READ_ALWAYS`` and ``honoured`` runs it exactly.

    An ``attention_mask`` the layout does not pass to the model is exact only for right
    padding (causal attention: real tokens never see the padding after them): it is then
    dropped, its padded positions' labels ignored (-100).

    Raises:
        ValueError: naming keys the layout would ignore (``document_ids``, ``position_ids``,
            ...), or an ``attention_mask`` with padding before real tokens.
    """
    extra = set(batch) - READ_ALWAYS - honoured
    if "attention_mask" in extra:
        mask = batch["attention_mask"]
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError(
                "attention_mask has padding before real tokens (left padding, or holes): this "
                "layout calls the model with input_ids only, which is exact for right padding "
                "alone. Pad on the right (tokenizer.padding_side = 'right'), or use sp > 1, "
                "whose attention reads the mask")
        labels = labels_without_padding(batch)
        batch = {k: v for k, v in batch.items() if k != "attention_mask"}
        batch["labels"] = labels
        extra.discard("attention_mask")
    if extra:
        where = ("" if honoured else " document_ids, attention_mask and position_ids are "
                 "honoured under sequence parallelism (sp > 1);")
        raise ValueError(
            f"batch keys {sorted(extra)} would be ignored: this layout reads "
            f"{sorted(READ_ALWAYS | honoured)} (an attention_mask of right padding too, "
            f"through the labels).{where} drop the other keys from the batch")
    return batch


def default_clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip all gradients to a total 2-norm of ``max_norm``; returns the norm before clipping."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


@dataclass
class Parallelized:
    """A model laid out under a Strategy.

    Attributes:
        module: what forward runs on (may wrap ``model``, e.g. DDP).
        model: the user's model, parallelised in place: parameters and state dicts.
        forward_loss: ``(module, micro_batch) -> loss`` of this rank's share, a scalar whose
            average over ``loss_group`` is the micro-batch's mean loss.
        clip_grad_norm: ``(model, max_norm) -> total norm`` over all ranks' shards.
        loss_group: ranks whose losses average to the global loss (the dp group, plus the
            sp group under sequence parallelism).
        features: names of the steps applied, in order (for logs and tests).
        build_optimizer: when set, the Trainer builds its optimizer with this instead of
            :func:`tessera.train.optim.build_optimizer` (same signature); chunk memory
            returns its HybridAdam here.
        grad_scaler: when set, the fp16 loss scaler the Engine uses instead of GradScaler
            (same ``scale``/``unscale_``/``step``/``update`` interface).
        memory: the chunk-memory runtime when memory=chunk (statistics, timeline).
        pipeline: this rank's pipeline stages and schedule when pp > 1 (run by
            :class:`tessera.parallel.pipeline.PipelineEngine`).
        pending_shards: tp x pp of a model on meta: the tensor-parallel shards still on meta,
            which the pipeline fills for its stages (tensor/deferred.py).
        batch_keys: batch keys ``forward_loss`` reads besides input_ids and labels
            (sequence parallelism's document_ids, attention_mask, position_ids); see
            :func:`fit_batch`.
    """

    module: nn.Module
    model: nn.Module
    loss_group: dist.ProcessGroup | None
    forward_loss: Callable[[nn.Module, Batch], torch.Tensor] = default_forward_loss
    clip_grad_norm: Callable[[nn.Module, float], torch.Tensor] = default_clip_grad_norm
    features: list[str] = field(default_factory=list)
    build_optimizer: Callable[..., torch.optim.Optimizer] | None = None
    grad_scaler: Any = None
    memory: Any = None
    pipeline: Any = None
    pending_shards: Any = None
    batch_keys: frozenset[str] = frozenset()

    def loss(self, batch: Batch) -> torch.Tensor:
        return self.forward_loss(self.module, batch)
