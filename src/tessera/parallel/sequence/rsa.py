"""Ring Self-Attention (RSA) as published (arXiv 2105.13120): keys first, then values.

Forward, for this rank's queries Q_n (B, nh, L/N, hs):

1. RingQK: pass key blocks around the ring; block j's scores Q_n K_j^T fill columns
   [j*L/N, (j+1)*L/N) of a full-row score buffer S (B, nh, L/N, L).
2. An exact softmax over each full row of length L: P = softmax(S).
3. RingAV: pass value blocks around the ring; O_n = sum_j P[:, :, :, block j] V_j.

With attention dropout, step 3 multiplies each P_j by its mask, regenerated in backward
(dropout.py). P is kept for backward, so memory grows as L^2/N per rank: this is the
quadratic cost the ring mode removes. Backward runs two ring passes, values then keys,
mirroring the forward:

- values: dP_j = dO V_j^T, dS_j = P_j * (dP_j - rowsum(dO * O)), dV_j = P_j^T dO;
- keys:   dQ += dS_j K_j * scale, dK_j = dS_j^T Q_n * scale.

dV_j and dK_j travel with their block back to its owner (comm.ring_pass_with_grads). The
authors' code instead materialises full-length dK/dV and all-reduces them; the result is the
same and the ring form needs no (B, L, H) buffer. Their division of dQ/dK by N belongs to their
gradient handler, not to attention, and is not copied.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.parallel.sequence import comm
from tessera.parallel.sequence.blocks import block_mask, fp32_numerics, row_delta
from tessera.parallel.sequence.dropout import AttentionDropout, grouped_keep_scale


def _grouped(x: torch.Tensor, n_kv: int) -> torch.Tensor:
    B, nh, T, last = x.shape
    return x.view(B, n_kv, nh // n_kv, T, last)  # (B, nkv, g, T, *)


def _cols(src: int, width: int) -> slice:
    return slice(src * width, (src + 1) * width)


class RingSelfAttention(torch.autograd.Function):
    """RSA over a sequence-parallel group; one gradient per forward input."""

    @staticmethod
    @fp32_numerics  # the score and value matmuls stay fp32 under a bf16 autocast
    def forward(ctx, q, k, v, meta, group, causal, scale, dropout):
        B, nh, T, hs = q.shape
        n, n_kv = dist.get_world_size(group), k.shape[1]
        qg = _grouped(q.float(), n_kv)  # (B, nkv, g, T/N, hs)
        scores = q.new_empty((B, n_kv, nh // n_kv, T, n * T), dtype=torch.float32)
        masks = torch.empty((B, 1, 1, T, n * T), dtype=torch.bool, device=q.device)
        key_meta = meta.new_empty((B, n * T, 2))  # every key's metadata, for dropout masks

        def ring_qk(_, src, held):  # step 1: fill the score columns of block src
            k_blk, meta_blk = held
            cols = _cols(src, T)
            scores[..., cols] = torch.matmul(qg, k_blk.float().unsqueeze(2).transpose(-1, -2))
            masks[..., cols] = block_mask(meta, meta_blk, causal)
            key_meta[:, cols] = meta_blk

        comm.ring_pass(group, [k, meta], ring_qk)
        probs = _softmax_rows(scores.mul_(scale), masks)  # step 2, in place: (B, nkv, g, T/N, L)
        out = torch.zeros_like(qg)

        def ring_av(_, src, held):  # step 3: accumulate P_j V_j (P_j dropped, if dropout)
            p = probs[..., _cols(src, T)]
            if dropout is not None:
                p = p * _keep(dropout, meta, key_meta[:, _cols(src, T)], n_kv, nh)
            out.add_(torch.matmul(p, held[0].float().unsqueeze(2)))

        comm.ring_pass(group, [v], ring_av)
        out = out.reshape(q.shape).to(q.dtype)
        ctx.save_for_backward(q, k, v, probs, out, meta, key_meta)
        ctx.group, ctx.scale, ctx.dropout = group, scale, dropout
        return out

    @staticmethod
    @fp32_numerics
    def backward(ctx, dout):
        q, k, v, probs, out, meta, key_meta = ctx.saved_tensors
        T, n_kv, dropout = q.shape[2], k.shape[1], ctx.dropout
        dog = _grouped(dout.float(), n_kv)  # (B, nkv, g, T/N, hs)
        delta = _grouped(row_delta(dout, out).unsqueeze(-1), n_kv)  # (B, nkv, g, T/N, 1)
        dscores = torch.empty_like(probs)

        def values(_, src, held):  # dP_j, dS_j and dV_j from the value block of src
            v_blk, p = held[0].float().unsqueeze(2), probs[..., _cols(src, T)]
            dprobs = torch.matmul(dog, v_blk.transpose(-1, -2))
            dropped = p
            if dropout is not None:  # dP = (dO V^T) K, dV = (P K)^T dO
                keep = _keep(dropout, meta, key_meta[:, _cols(src, T)], n_kv, q.shape[1])
                dprobs.mul_(keep)
                dropped = p * keep
            dscores[..., _cols(src, T)] = p * (dprobs - delta) * ctx.scale
            return [torch.matmul(dropped.transpose(-1, -2), dog).sum(2)]

        (dv,) = comm.ring_pass_with_grads(ctx.group, [v], values)
        qg, dq = _grouped(q.float(), n_kv), torch.zeros_like(dog)

        def keys(_, src, held):  # dQ and dK_j from the key block of src
            ds = dscores[..., _cols(src, T)]
            dq.add_(torch.matmul(ds, held[0].float().unsqueeze(2)))
            return [torch.matmul(ds.transpose(-1, -2), qg).sum(2)]

        (dk,) = comm.ring_pass_with_grads(ctx.group, [k], keys)
        dq = dq.reshape(q.shape).to(q.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _keep(dropout: AttentionDropout, meta_q, meta_k, n_kv: int, n_heads: int) -> torch.Tensor:
    return grouped_keep_scale(dropout, meta_q, meta_k, n_kv, n_heads // n_kv)


def _softmax_rows(scores: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Exact softmax over full rows; rows with no visible key become all zeros (not NaN)."""
    scores.masked_fill_(~masks, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return scores.sub_(lse).exp_()


def rsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: torch.Tensor,
                  group, causal: bool = True, scale: float | None = None,
                  dropout: AttentionDropout | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries by Ring Self-Attention (contiguous layout).

    Args:
        q: (B, nh, T/sp, hs) local queries; k, v: (B, nkv, T/sp, hs).
        meta: (B, T/sp, 2) int64 [index in full sequence, segment (-1 = padding)].
        group: the sequence-parallel process group.
        causal: causal mask by token index.
        scale: score multiplier (default hs ** -0.5).
        dropout: attention dropout (dropout.py); under one seed on every rank it drops the
            pairs one device would.

    Returns:
        (B, nh, T/sp, hs) in q's dtype.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingSelfAttention.apply(q, k, v, meta, group, causal, scale, dropout)
