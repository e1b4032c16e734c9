"""Block attention on CPU through PyTorch's fused flash kernel, which also returns the LSE.

``aten._scaled_dot_product_flash_attention_for_cpu`` computes softmax attention in tiles
(never the whole score matrix) and returns each row's log-sum-exp; its backward takes the
*final* output and LSE, which is exactly what a ring step's backward needs (the row's softmax
share of this block, flash-attention style). blocks.block_forward / block_backward route CPU
tensors here; everything stays fp32 (inputs are cast, as in blocks.py).

Masks. The kernel takes an additive float mask as large as the scores it covers, so a mask is
avoided wherever the tokens' metadata allows (:func:`structure`): with one non-padding segment
per row, a block is either wholly visible (non-causal, or every key before every query: every
ring step but the first under zigzag) or the same tokens on both sides in ascending order (the
kernel's own causal mask: a ring's first step, Ulysses' whole sequence). Otherwise (padding,
packed documents) the mask is built for a piece of query rows at a time, its elements no more
than the block's queries' (blocks.piece_rows with the mask's missing head dimension counted),
like the fallback path's score pieces. Under a causal mask with keys in ascending order (every
layout here) a piece only takes the keys up to its last query's index: the rest are in its
future, so the tiles the kernel's own causal mask would skip are not computed either.

Rows with no visible key: the kernel returns a zero row with a finite LSE; the LSE is set to
-inf here, as blocks.py defines. In backward a row's final LSE is -inf only when it sees no key
in any block, so every score of it is masked; it is passed as 0 (exp(-inf - 0) = 0, no NaN).

Key/value heads are repeated for their query groups (the kernel has no grouped-query mode), and
their gradients summed back over each group.

Versions: before torch 2.5 the kernel returned NaN for a row whose first key tile was wholly
masked although later keys were visible (pytorch#127055, fixed by pytorch#130014); blocks.py
takes this path only from 2.5 on (:func:`available`).
"""

from __future__ import annotations

import torch

from tessera.parallel.sequence import blocks

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

ALL, CAUSAL, MASK = "all", "causal", "mask"
_FIXED_IN = (2, 5)  # the first release with the fully-masked-tile fix (see the module doc)


def available(q: torch.Tensor) -> bool:
    """Whether ``q``'s blocks take the fused kernel: CPU tensors, torch 2.5 or later."""
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    return q.device.type == "cpu" and version >= _FIXED_IN


def structure(meta_q: torch.Tensor, meta_k: torch.Tensor, causal: bool) -> str:
    """How a block's mask can be given to the kernel: ``ALL`` (every key visible, no mask),
    ``CAUSAL`` (the kernel's causal mask is the block's) or ``MASK`` (an explicit mask).

    Args:
        meta_q: (B, Tq, 2), meta_k: (B, Tk, 2) [index, segment] (see blocks.block_mask).
        causal: whether keys after a query are hidden from it.
    """
    seg_q, seg_k = meta_q[..., 1], meta_k[..., 1]
    first = seg_q[:, :1]  # (B, 1): each row's segment, if it has only one
    if not bool((first >= 0).all() and (seg_q == first).all() and (seg_k == first).all()):
        return MASK
    if not causal:
        return ALL
    idx_q, idx_k = meta_q[..., 0], meta_k[..., 0]  # (B, Tq), (B, Tk)
    if bool((idx_k.amax(-1) <= idx_q.amin(-1)).all()):
        return ALL
    if (idx_q.shape == idx_k.shape and torch.equal(idx_q, idx_k)
            and bool((idx_q[:, 1:] > idx_q[:, :-1]).all())):
        return CAUSAL  # key j visible to query i exactly when j <= i: lower triangular
    return MASK


def _repeat_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, nkv, T, hs) fp32 -> (B, nh, T, hs): each key/value head once per query head."""
    group = n_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _sum_groups(grad: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(B, nh, T, hs) per query head -> (B, nkv, T, hs) per key/value head."""
    B, nh, T, hs = grad.shape
    return grad if nh == n_kv else grad.view(B, n_kv, nh // n_kv, T, hs).sum(2)


def _visible_prefix(meta_q, meta_k, causal: bool):
    """A function of query rows giving how many leading keys they may see: all keys, or under
    a causal mask with ascending key indices the keys up to the rows' last index."""
    Tk = meta_k.shape[1]
    idx_q, idx_k = meta_q[..., 0], meta_k[..., 0]  # (B, Tq), (B, Tk)
    if not causal or not bool((idx_k[:, 1:] >= idx_k[:, :-1]).all()):
        return lambda rows: Tk
    # (B,) last visible key per batch row; the prefix is the longest over the batch
    return lambda rows: int((idx_k <= idx_q[:, rows].amax(-1, keepdim=True)).sum(-1).max())


def _mask_pieces(meta_q, meta_k, causal: bool, n_heads: int, head_size: int):
    """(rows, keys, additive mask or None, visible rows or None) per piece of query rows;
    ``keys`` is the prefix of keys that may be visible to them. A piece with no visible key
    at all yields mask None and visible all-False."""
    Tq, Tk = meta_q.shape[1], meta_k.shape[1]
    step = blocks.piece_rows(n_heads * Tq, Tk, head_size)  # the mask has no head dimension
    prefix = _visible_prefix(meta_q, meta_k, causal)
    for start in range(0, Tq, step):
        rows = slice(start, min(start + step, Tq))
        keys = slice(0, prefix(rows))
        allowed = blocks.block_mask(meta_q[:, rows], meta_k[:, keys], causal)[:, 0]  # (B,1,r,k)
        visible = allowed.any(-1)  # (B, 1, r)
        if keys.stop > 0 and bool(allowed.all()):
            yield rows, keys, None, None
        elif keys.stop == 0 or not bool(visible.any()):
            yield rows, keys, None, visible
        else:
            mask = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
            yield rows, keys, mask.masked_fill_(~allowed, blocks.NEG_INF), visible


def block_forward(q, k, v, meta_q, meta_k, causal: bool, scale: float):
    """blocks.block_forward through the fused kernel (same arguments and results)."""
    nh = q.shape[1]
    qf = q.float()
    kf, vf = _repeat_heads(k.float(), nh), _repeat_heads(v.float(), nh)  # (B, nh, Tk, hs)
    kind = structure(meta_q, meta_k, causal)
    if kind != MASK:
        return _FORWARD(qf, kf, vf, 0.0, kind == CAUSAL, scale=scale)  # (out, lse)
    out = torch.zeros_like(qf)  # (B, nh, Tq, hs)
    lse = qf.new_full(qf.shape[:-1], blocks.NEG_INF)  # (B, nh, Tq)
    for rows, keys, mask, visible in _mask_pieces(meta_q, meta_k, causal, nh, q.shape[-1]):
        if visible is not None and mask is None:
            continue  # no key visible to any of these rows: out 0, lse -inf
        o, l = _FORWARD(qf[:, :, rows], kf[:, :, keys], vf[:, :, keys], 0.0, False,
                        attn_mask=mask, scale=scale)
        if visible is not None:
            o = o.masked_fill(~visible.unsqueeze(-1), 0.0)
            l = l.masked_fill(~visible, blocks.NEG_INF)
        out[:, :, rows], lse[:, :, rows] = o, l
    return out, lse


def block_backward(q, k, v, meta_q, meta_k, causal: bool, scale: float, dout, out, lse):
    """blocks.block_backward through the fused kernel (same arguments and results)."""
    nh, n_kv = q.shape[1], k.shape[1]
    qf, dof, of = q.float(), dout.float().contiguous(), out.float().contiguous()
    kf, vf = _repeat_heads(k.float(), nh), _repeat_heads(v.float(), nh)  # (B, nh, Tk, hs)
    lse = blocks.safe_lse(lse.float()).contiguous()  # (B, nh, Tq)
    kind = structure(meta_q, meta_k, causal)
    if kind != MASK:
        dq, dk, dv = _BACKWARD(dof, qf, kf, vf, of, lse, 0.0, kind == CAUSAL, scale=scale)
        return dq, _sum_groups(dk, n_kv), _sum_groups(dv, n_kv)
    dq = torch.zeros_like(qf)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)  # (B, nh, Tk, hs)
    for rows, keys, mask, visible in _mask_pieces(meta_q, meta_k, causal, nh, q.shape[-1]):
        if visible is not None and mask is None:
            continue  # nothing visible: no gradient flows through these rows
        dq_r, dk_r, dv_r = _BACKWARD(dof[:, :, rows], qf[:, :, rows], kf[:, :, keys],
                                     vf[:, :, keys], of[:, :, rows], lse[:, :, rows], 0.0,
                                     False, attn_mask=mask, scale=scale)
        dq[:, :, rows] = dq_r
        dk[:, :, keys] += dk_r
        dv[:, :, keys] += dv_r
    return dq, _sum_groups(dk, n_kv), _sum_groups(dv, n_kv)
