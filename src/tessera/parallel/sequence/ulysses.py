"""Ulysses (DeepSpeed-Ulysses, arXiv 2309.14509): all-to-all from sequence to heads and back.

Each rank holds L/N tokens of every head. One all-to-all per tensor regroups them so each rank
holds all L tokens of nh/N heads; attention is then ordinary full-sequence attention (here the
masked fp32 block of blocks.py, so padding and documents behave as in the ring modes); a last
all-to-all returns the output to the sequence split. Per rank and layer, forward sends
(3 or 2 + 2 nkv/nh) * B*L*H/N * (N-1)/N elements: q, k, v and out.

Grouped key/value heads: if nkv is divisible by N each rank takes nkv/N of them; if N is
divisible by nkv each kv head is repeated N/nkv times first, so that every rank's query heads
[r*nh/N, (r+1)*nh/N) find their kv head (h // (nh/nkv)) among the heads it receives.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from tessera.parallel.sequence import comm
from tessera.parallel.sequence.blocks import block_backward, block_forward
from tessera.parallel.sequence.dropout import AttentionDropout
from tessera.parallel.sequence.layout import SequenceParallelError


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, n, T/N, hs) sequence-split -> (B, n/N, T, hs) head-split (contiguous layout)."""
    N = dist.get_world_size(group)
    B, n, t, hs = x.shape
    chunks = x.reshape(B, N, n // N, t, hs).transpose(0, 1)  # (N, B, n/N, T/N, hs): to rank j
    got = comm.all_to_all(chunks, group)  # (N, B, n/N, T/N, hs): from rank i = tokens chunk i
    return got.permute(1, 2, 0, 3, 4).reshape(B, n // N, N * t, hs)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, n/N, T, hs) head-split -> (B, n, T/N, hs) sequence-split; inverse of the above."""
    N = dist.get_world_size(group)
    B, m, T, hs = x.shape
    chunks = x.reshape(B, m, N, T // N, hs).permute(2, 0, 1, 3, 4)  # (N, B, n/N, T/N, hs)
    got = comm.all_to_all(chunks, group)  # from rank i: its heads, our tokens
    return got.transpose(0, 1).reshape(B, N * m, T // N, hs)


class SeqToHeads(torch.autograd.Function):
    """All-to-all sequence -> heads; its gradient is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """All-to-all heads -> sequence; its gradient is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


class LocalAttention(torch.autograd.Function):
    """Masked fp32 attention of whole sequences on one rank; one gradient per input."""

    @staticmethod
    def forward(ctx, q, k, v, meta, causal, scale, dropout):
        out, lse = block_forward(q, k, v, meta, meta, causal, scale, dropout)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, meta, out, lse)
        ctx.causal, ctx.scale, ctx.dropout = causal, scale, dropout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, meta, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(q, k, v, meta, meta, ctx.causal, ctx.scale, dout, out,
                                    lse, ctx.dropout)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def check_heads(n_heads: int, n_kv_heads: int, sp: int) -> None:
    """Refuse head counts Ulysses cannot split.

    Raises:
        SequenceParallelError: naming the rule.
    """
    if n_heads % sp:
        raise SequenceParallelError(
            f"sp_mode=ulysses: n_heads={n_heads} must be divisible by sp={sp}")
    if n_kv_heads % sp and sp % n_kv_heads:
        raise SequenceParallelError(
            f"sp_mode=ulysses: n_kv_heads={n_kv_heads} must divide or be divisible by sp={sp}")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: torch.Tensor,
                      group, causal: bool = True, scale: float | None = None,
                      dropout: AttentionDropout | None = None) -> torch.Tensor:
    """Exact attention by head redistribution (contiguous layout).

    Args:
        q: (B, nh, T/sp, hs); k, v: (B, nkv, T/sp, hs).
        meta: (B, T/sp, 2) int64 [index in full sequence, segment (-1 = padding)].
        group: the sequence-parallel process group.
        causal: causal mask by token index.
        scale: score multiplier (default hs ** -0.5).
        dropout: attention dropout (dropout.py); under one seed on every rank it drops the
            pairs one device would.

    Returns:
        (B, nh, T/sp, hs) in q's dtype.

    Raises:
        SequenceParallelError: when heads cannot be split over the group.
    """
    N = dist.get_world_size(group)
    check_heads(q.shape[1], k.shape[1], N)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if k.shape[1] % N:  # fewer kv heads than ranks: repeat so each rank receives one
        k, v = (t.repeat_interleave(N // t.shape[1], dim=1) for t in (k, v))
    full_meta = comm.all_gather_cat(meta, group, dim=1)  # (B, T, 2)
    qh, kh, vh = (SeqToHeads.apply(t, group) for t in (q, k, v))  # (B, n/N, T, hs)
    if dropout is not None:  # this rank's heads: keep the masks those of the layer's heads
        dropout = replace(dropout, head_offset=dropout.head_offset
                          + dist.get_rank(group) * qh.shape[1])
    out = LocalAttention.apply(qh, kh, vh, full_meta, causal, scale, dropout)  # (B, nh/N, T, hs)
    return HeadsToSeq.apply(out, group)  # (B, nh, T/N, hs)
