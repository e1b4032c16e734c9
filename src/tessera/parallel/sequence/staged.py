"""Sequence parallelism inside pipeline stages (dp x sp x pp).

The pipeline captures the model with ``torch.export`` and runs the captured graph in pieces
(parallel/pipeline/). Two things must survive that capture:

1. **The attention and its collectives.** ``torch.export`` inlines an autograd.Function into
   its forward, so the ring's backward passes would be lost. :func:`sp_attention_op` is a
   ``torch.library`` custom op instead: one opaque graph node whose registered autograd formula
   runs when a stage's backward reaches it. A process group cannot be an op argument, so the
   ops take the group's name and resolve it on each call, as torch's functional collectives
   do. The ring op returns (out, lse) and its backward is the ring's own backward pass, as
   without pipelining. The rsa / ulysses op keeps only q, k, v and the metadata; its backward
   runs the mode's forward again with autograd (one more forward of the attention per layer)
   and differentiates it, trading compute for not exposing their internals as op outputs.
2. **This rank's tokens.** Position ids and the token metadata differ per sp rank, so they
   must be graph inputs, not constants baked in at capture time. :class:`StageInputs` gives
   the model a forward ``(input_ids, position_ids, meta)`` (an instance attribute: parameter
   names stay those of the user's model), supplies example inputs for capture, shards every
   micro-batch before the pipeline sees it, and computes the last stage's loss scaled like
   :meth:`SequenceParallel.forward_loss`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.parallel.sequence.dropout import AttentionDropout
from tessera.parallel.sequence.layout import padded_length
from tessera.parallel.sequence.ring import ring_backward, ring_forward
from tessera.parallel.sequence.rsa import rsa_attention
from tessera.parallel.sequence.ulysses import ulysses_attention
from tessera.parallel.tensor.loss import IGNORE_INDEX


def group_named(name: str) -> dist.ProcessGroup:
    """The process group an op argument names (ops cannot take a group object)."""
    return dist.distributed_c10d._resolve_process_group(name)


def sp_attention(q, k, v, meta, group: dist.ProcessGroup, mode: str, causal: bool,
                 scale: float, layout: str, dropout_p: float = 0.0,
                 seed: torch.Tensor | None = None, head_offset: int = 0) -> torch.Tensor:
    """Sequence-parallel attention through the custom ops (what a captured graph holds).

    ``seed``: with ``dropout_p`` > 0, a () int64 tensor, the attention dropout's seed
    (dropout.py); a graph input of the op, so that the graph draws it on every run.
    ``head_offset``: the layer's index of q's first head (tp)."""
    drop = [dropout_p, float(head_offset)]
    if mode == "ring":
        return ring_attention_op(q, k, v, meta, group.group_name, causal, scale, layout,
                                 drop, seed)[0]
    return sp_attention_op(q, k, v, meta, group.group_name, mode, causal, scale, layout,
                           drop, seed)


def _dropout(drop: list[float], seed: torch.Tensor | None) -> AttentionDropout | None:
    """``drop``: [probability, head offset], as the ops take them."""
    p, heads = drop
    return AttentionDropout(p, int(seed), int(heads)) if p > 0 else None


# ------------------------------------------------------------------------------ ring
@torch.library.custom_op("tessera::sp_ring_attention", mutates_args=())
def ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: torch.Tensor,
                      group_name: str, causal: bool, scale: float, layout: str,
                      drop: list[float], seed: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention as one op: out (B, nh, T/sp, hs) and lse (B, nh, T/sp) fp32."""
    return ring_forward(q, k, v, meta, group_named(group_name), causal, scale, layout,
                        _dropout(drop, seed))


@ring_attention_op.register_fake
def _(q, k, v, meta, group_name, causal, scale, layout, drop, seed):
    # Contiguous, as ring_forward returns it (empty_like would copy q's strides, a transposed
    # view's): the pipeline's activation estimate (pipeline/kept.py) runs these fakes, and
    # a head-major output makes the output projection's reshape a copy, which it saves.
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _ring_setup(ctx, inputs, output):
    q, k, v, meta, *ctx.args = inputs
    ctx.save_for_backward(q, k, v, meta, *output)


def _ring_backward(ctx, dout, _dlse):  # lse is a by-product: nothing differentiates it
    q, k, v, meta, out, lse = ctx.saved_tensors
    group_name, causal, scale, layout, drop, seed = ctx.args
    dq, dk, dv = ring_backward(q, k, v, meta, out, lse, dout.contiguous(), group_named(group_name),
                               causal, scale, layout, _dropout(drop, seed))
    return dq, dk, dv, None, None, None, None, None, None, None


ring_attention_op.register_autograd(_ring_backward, setup_context=_ring_setup)


# ------------------------------------------------------------------------------ rsa, ulysses
def _attend(q, k, v, meta, group_name: str, mode: str, causal: bool, scale: float,
            layout: str, drop: list[float], seed: torch.Tensor | None) -> torch.Tensor:
    group, dropout = group_named(group_name), _dropout(drop, seed)
    if mode == "rsa":
        return rsa_attention(q, k, v, meta, group, causal, scale, dropout)
    return ulysses_attention(q, k, v, meta, group, causal, scale, dropout)


@torch.library.custom_op("tessera::sp_attention", mutates_args=())
def sp_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: torch.Tensor,
                    group_name: str, mode: str, causal: bool, scale: float,
                    layout: str, drop: list[float], seed: torch.Tensor | None) -> torch.Tensor:
    """rsa or ulysses attention of q (B, nh, T/sp, hs), k, v (B, nkv, T/sp, hs) as one op."""
    with torch.no_grad():
        return _attend(q, k, v, meta, group_name, mode, causal, scale, layout, drop, seed)


@sp_attention_op.register_fake
def _(q, k, v, meta, group_name, mode, causal, scale, layout, drop, seed):
    return q.new_empty(q.shape)  # contiguous, as rsa and ulysses return it


def _setup_context(ctx, inputs, output):
    q, k, v, meta, *ctx.args = inputs
    ctx.save_for_backward(q, k, v, meta)


def _backward(ctx, dout):
    q, k, v, meta = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = _attend(*leaves, meta, *ctx.args)  # the forward again, now recorded
        dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    return dq, dk, dv, None, None, None, None, None, None, None, None


sp_attention_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------ inputs
class StageInputs:
    """What the pipeline asks of sequence parallelism (see the module docstring).

    Args:
        sp: the job's SequenceParallel; its attention switches to the custom op.
        model: the user's model; it gets the forward the pipeline captures.
    """

    def __init__(self, sp, model: nn.Module) -> None:
        self.sp, self.model = sp, model
        sp.exportable = True
        inner = model.forward

        def forward(input_ids, position_ids, meta):
            sp.set_tokens(meta)  # under capture a graph input; the attention op reads it
            return inner(input_ids, position_ids=position_ids)

        model.forward = forward

    def example(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Keyword inputs for capturing the model with (B, T/sp) ``input_ids``."""
        return {"position_ids": torch.zeros_like(input_ids),
                "meta": input_ids.new_zeros(*input_ids.shape, 2)}

    def local_len(self, length: int) -> int:
        """Tokens per rank of a ``length``-token sample, padded for the layout as ``shard``
        pads it."""
        return padded_length(length, self.sp.size, self.sp.layout,
                             self.sp.token_ways) // self.sp.size

    def shard(self, batch: dict[str, torch.Tensor], training: bool = True
              ) -> dict[str, torch.Tensor]:
        """This rank's tokens of a micro-batch, with the whole micro-batch's label count;
        ``training``: for the training graph, which draws dropout masks (the evaluation
        graph is captured in eval mode, whatever the user's model's flag says)."""
        if training:
            self.sp.refuse_dropout()
        local = self.sp.shard(batch)
        local["token_count"] = self.sp.token_count(batch)
        return local

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor],
             per_token: bool = False) -> torch.Tensor:
        """The last stage's loss from this rank's logits (B, T/sp, V) and sharded batch; with
        ``per_token`` the stage already returns each token's loss (B, T/sp) (a sliced LM
        head, pipeline/head.py)."""
        labels = batch["labels"]
        summed = ((logits * (labels != IGNORE_INDEX)).sum() if per_token
                  else self.sp.token_loss(logits, labels))
        return self.sp.scale_loss(summed, batch["token_count"])
