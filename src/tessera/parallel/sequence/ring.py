"""Ring attention: key/value blocks circulate, softmax merged online; never (L/sp x L) scores.

Each rank keeps its queries. Key/value blocks (with their tokens' metadata) travel one hop per
step while the current block is computed (comm.ring_pass overlaps the two); each block's
(out, lse) is folded into fp32 accumulators by blocks.merge_into. Memory per rank: one
(L/sp x L/sp) block pair at a time, itself computed in pieces of query rows
(blocks.piece_rows); the saved activations are q, k, v, out and lse.

Backward circulates key/value blocks again, recomputes each block's probabilities from the
final LSE, and sends each block's dk/dv contributions along with it so they end at the owner
(comm.ring_pass_with_grads). The blocks used in backward are the ones received in backward,
never tensors saved from a forward step (stale blocks give silently wrong gradients).

Causal work is balanced by the zigzag layout: see the note in layout.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.parallel.sequence import comm
from tessera.parallel.sequence.blocks import block_backward, block_forward, merge_into
from tessera.parallel.sequence.dropout import AttentionDropout
from tessera.parallel.sequence.layout import (check_layout, check_shard_layout,
                                              ring_step_slices)


def ring_forward(q, k, v, meta, group, causal: bool, scale: float, layout: str,
                 dropout: AttentionDropout | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward ring pass: out (B, nh, T/sp, hs) in q's dtype and lse (B, nh, T/sp) in fp32."""
    rank, T = dist.get_rank(group), q.shape[2]
    out = q.new_zeros(q.shape, dtype=torch.float32)  # (B, nh, T/sp, hs)
    lse = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)  # (B, nh, T/sp)

    def step(_, src, held):
        k_blk, v_blk, meta_blk = held
        sl = ring_step_slices(src, rank, T, causal, layout)
        if sl is None:
            return
        qs, ks = sl
        blk_out, blk_lse = block_forward(q[:, :, qs], k_blk[:, :, ks], v_blk[:, :, ks],
                                         meta[:, qs], meta_blk[:, ks], causal, scale, dropout)
        merge_into(out[:, :, qs], lse[:, :, qs], blk_out, blk_lse)

    comm.ring_pass(group, [k, v, meta], step)
    return out.to(q.dtype), lse


def ring_backward(q, k, v, meta, out, lse, dout, group, causal: bool, scale: float,
                  layout: str, dropout: AttentionDropout | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward ring pass from the forward's out and lse: dq, dk, dv in the inputs' dtypes."""
    rank, T = dist.get_rank(group), q.shape[2]
    dq = torch.zeros_like(q, dtype=torch.float32)

    def step(_, src, held):
        k_blk, v_blk, meta_blk = held  # received in this pass, not saved from forward
        dk = torch.zeros_like(k_blk, dtype=torch.float32)
        dv = torch.zeros_like(v_blk, dtype=torch.float32)
        sl = ring_step_slices(src, rank, T, causal, layout)
        if sl is not None:
            qs, ks = sl
            dq_b, dk[:, :, ks], dv[:, :, ks] = block_backward(
                q[:, :, qs], k_blk[:, :, ks], v_blk[:, :, ks], meta[:, qs], meta_blk[:, ks],
                causal, scale, dout[:, :, qs], out[:, :, qs], lse[:, :, qs], dropout)
            dq[:, :, qs] += dq_b
        return [dk, dv]

    dk, dv = comm.ring_pass_with_grads(group, [k, v, meta], step)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Ring attention over a sequence-parallel group; one gradient per forward input."""

    @staticmethod
    def forward(ctx, q, k, v, meta, group, causal, scale, layout, dropout):
        out, lse = ring_forward(q, k, v, meta, group, causal, scale, layout, dropout)
        ctx.save_for_backward(q, k, v, meta, out, lse)
        ctx.args = group, causal, scale, layout, dropout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, meta, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, meta, out, lse, dout, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: torch.Tensor,
                   group, causal: bool = True, scale: float | None = None,
                   layout: str = "zigzag", verify_layout: bool = True,
                   dropout: AttentionDropout | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries against the whole sequence, by ring passes.

    Args:
        q: (B, nh, T/sp, hs) local queries; k, v: (B, nkv, T/sp, hs) local keys and values.
        meta: (B, T/sp, 2) int64 [index in full sequence, segment (-1 = padding)].
        group: the sequence-parallel process group.
        causal: causal mask by token index.
        scale: score multiplier (default hs ** -0.5).
        layout: how tokens were distributed, "zigzag" (causal only) or "contiguous".
        verify_layout: check ``meta``'s token indices against ``layout`` (one host sync on a
            GPU); SequenceParallel, whose shards are made in its own layout, skips it.
        dropout: attention dropout (dropout.py); under one seed on every rank it drops the
            pairs one device would.

    Returns:
        (B, nh, T/sp, hs) in q's dtype.

    Raises:
        SequenceParallelError: for zigzag without a causal mask, or a ``meta`` whose token
            indices are not ``layout``'s for this rank.
    """
    check_layout(layout, causal)
    if verify_layout:
        check_shard_layout(meta, dist.get_world_size(group), dist.get_rank(group), layout)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, meta, group, causal, scale, layout, dropout)
