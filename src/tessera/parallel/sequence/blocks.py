"""Attention on one (query block, key block) pair, and the log-sum-exp merge: all numerics here.

Every sequence-parallel mode reduces to these pieces, so the numerically delicate parts live in
one file and are computed in fp32 whatever the input dtype, also under a caller's autocast
(:func:`fp32_numerics`):

- :func:`block_mask` says which keys each query may see, from per-token metadata (built per
  piece of query rows, never for a whole block);
- :func:`block_forward` returns a block's output and log-sum-exp (LSE) per query row;
- :func:`merge_into` folds a block's (out, lse) into running accumulators (online softmax);
- :func:`block_backward` gives dq, dk, dv of a block from the final output and its LSE.

On CPU both run PyTorch's fused flash kernel (fused.py, torch 2.5 or later: 4-10x faster than
explicit matmuls on this machine's blocks); on other devices, and as the reference the fused
path is tested against, :func:`explicit_forward` / :func:`explicit_backward` compute the block
with plain matmuls in pieces of query rows.

Metadata: each token carries ``meta[..., 0]``, its index in the (padded) full sequence, and
``meta[..., 1]``, its segment: the document id for packed sequences, -1 for padding. A query
sees a key when both are in the same segment, the key is not padding, and (causal) the key's
index is not after the query's. Rows with no visible key (padding queries, or a block that is
wholly in the future) get LSE = -inf and contribute exactly zero, never NaN.

Grouped-query attention: q has nh heads, k and v have nkv heads; the explicit path views q as
(B, nkv, nh/nkv, T, hs) and broadcasts it against k, so key/value heads are never copied.
"""

from __future__ import annotations

import functools

import torch

from tessera.parallel.sequence.dropout import AttentionDropout, grouped_keep_scale

NEG_INF = float("-inf")


def fp32_numerics(fn):
    """Run ``fn`` with autocast disabled on the device of its first tensor argument.

    Mixed-precision training (precision=bf16) runs the model, and so the attention hook,
    inside ``torch.autocast``, which would cast these matmuls to bf16: the fp32 ``out=``
    buffers then raise a dtype error, and the score and softmax sums would lose the fp32
    accuracy the merge depends on. Inputs are cast with ``.float()`` explicitly instead.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        with torch.autocast(device, enabled=False):
            return fn(*args, **kwargs)

    return wrapper


def block_mask(meta_q: torch.Tensor, meta_k: torch.Tensor, causal: bool) -> torch.Tensor:
    """Which keys each query may attend to.

    Args:
        meta_q: (B, Tq, 2) int64 [index, segment] of the queries.
        meta_k: (B, Tk, 2) int64 [index, segment] of the keys.
        causal: forbid keys whose index is after the query's.

    Returns:
        (B, 1, 1, Tq, Tk) bool, broadcastable over (kv heads, group).
    """
    seg_q, seg_k = meta_q[..., 1, None], meta_k[:, None, :, 1]  # (B, Tq, 1), (B, 1, Tk)
    allowed = (seg_q == seg_k) & (seg_k >= 0)
    if causal:
        allowed &= meta_k[:, None, :, 0] <= meta_q[..., 0, None]
    return allowed[:, None, None]


MIN_PIECE_ROWS = 64  # fewer rows per matmul would cost more in overhead than it saves


def piece_rows(q_rows: int, n_keys: int, head_size: int) -> int:
    """Query rows per piece: the piece's scores (rows x keys) hold no more elements than the
    block's queries (q_rows x head_size), so the fp32 temporaries grow like the activations,
    linearly in the sequence length, never like rows x keys."""
    return max(MIN_PIECE_ROWS, q_rows * head_size // max(1, n_keys))


def _grouped(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    B, nh, T, hs = q.shape
    return q.view(B, n_kv, nh // n_kv, T, hs)  # (B, nkv, g, T, hs)


def _pieces(q: torch.Tensor, n_keys: int):
    """Slices of query rows, :func:`piece_rows` at a time."""
    Tq, hs = q.shape[-2], q.shape[-1]
    rows = piece_rows(Tq, n_keys, hs)
    for start in range(0, Tq, rows):
        yield slice(start, min(start + rows, Tq))


def _masked_scores(qg, kg, meta_q, meta_k, causal, scale):
    """Scaled scores with -inf where masked: (B, nkv, g, Tq, Tk) fp32, one allocation."""
    scores = torch.matmul(qg, kg.transpose(-1, -2)).mul_(scale)
    return scores.masked_fill_(~block_mask(meta_q, meta_k, causal), NEG_INF)


def safe_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf replaced by 0, so exp(scores - lse) is 0 (not NaN) on empty rows."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


@fp32_numerics
def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta_q: torch.Tensor,
                  meta_k: torch.Tensor, causal: bool, scale: float,
                  dropout: AttentionDropout | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block, normalised within the block.

    CPU tensors take the fused kernel (fused.py), others :func:`explicit_forward`; both keep
    temporaries the size of the queries however long the block is. With ``dropout`` every
    device takes the explicit path (the fused kernel takes no mask of ours).

    Args:
        q: (B, nh, Tq, hs); k, v: (B, nkv, Tk, hs).
        meta_q: (B, Tq, 2), meta_k: (B, Tk, 2) token metadata (see :func:`block_mask`).
        causal: causal mask by token index.
        scale: multiplier of the scores (usually hs ** -0.5).
        dropout: attention dropout (dropout.py): the output is that of the dropped
            probabilities, the LSE that of the undropped ones.

    Returns:
        out (B, nh, Tq, hs) fp32 and lse (B, nh, Tq) fp32 (-inf on rows with no visible key).
    """
    from tessera.parallel.sequence import fused  # imports this module: bound at call

    if dropout is None and fused.available(q):
        return fused.block_forward(q, k, v, meta_q, meta_k, causal, scale)
    return explicit_forward(q, k, v, meta_q, meta_k, causal, scale, dropout)


@fp32_numerics
def explicit_forward(q, k, v, meta_q, meta_k, causal: bool, scale: float,
                     dropout: AttentionDropout | None = None):
    """:func:`block_forward` with plain matmuls, query rows in pieces (:func:`piece_rows`)."""
    B, nh, Tq, hs = q.shape
    n_kv = k.shape[1]
    qg = _grouped(q.float(), n_kv)  # (B, nkv, g, Tq, hs)
    kg, vg = k.float().unsqueeze(2), v.float().unsqueeze(2)  # (B, nkv, 1, Tk, hs)
    out = qg.new_empty(qg.shape)
    lse = qg.new_empty(qg.shape[:-1])  # (B, nkv, g, Tq)
    for rows in _pieces(q, k.shape[2]):
        scores = _masked_scores(qg[..., rows, :], kg, meta_q[:, rows], meta_k, causal, scale)
        lse[..., rows] = torch.logsumexp(scores, dim=-1)
        probs = scores.sub_(safe_lse(lse[..., rows]).unsqueeze(-1)).exp_()  # exp(-inf) = 0
        if dropout is not None:
            probs.mul_(grouped_keep_scale(dropout, meta_q[:, rows], meta_k, n_kv, nh // n_kv))
        torch.matmul(probs, vg, out=out[..., rows, :])
    return out.reshape(B, nh, Tq, hs), lse.reshape(B, nh, Tq)


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
               block_lse: torch.Tensor) -> None:
    """Fold one block's softmax result into the running (out, lse), in place, in fp32.

    With m = max(lse, block_lse): out' = (e^(lse-m) out + e^(block_lse-m) block_out) / s and
    lse' = m + log s, s = e^(lse-m) + e^(block_lse-m). Shifting by m keeps the exponents <= 0;
    when both are -inf the row stays (0, -inf) instead of becoming NaN.

    Args:
        out: (B, nh, Tq, hs) fp32 accumulator; lse: (B, nh, Tq) fp32 accumulator.
        block_out, block_lse: the same shapes, from :func:`block_forward`.
    """
    m = safe_lse(torch.maximum(lse, block_lse))
    w_old, w_new = torch.exp(lse - m), torch.exp(block_lse - m)
    total = w_old + w_new
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out.mul_((w_old / denom).unsqueeze(-1)).add_(block_out * (w_new / denom).unsqueeze(-1))
    lse.copy_(m + torch.log(total))


@fp32_numerics
def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta_q: torch.Tensor,
                   meta_k: torch.Tensor, causal: bool, scale: float, dout: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor,
                   dropout: AttentionDropout | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *final* LSE of its query rows.

    The probabilities are recomputed as exp(scores - lse) with the row's final LSE, so each
    block's share of the softmax is exact without storing it (flash-attention backward).

    Args:
        q: (B, nh, Tq, hs); k, v: (B, nkv, Tk, hs); meta_q, meta_k, causal: as forward.
        scale: the forward's score multiplier.
        dout: (B, nh, Tq, hs) gradient of the final output.
        out: (B, nh, Tq, hs) the final output of these rows (all blocks merged).
        lse: (B, nh, Tq) final log-sum-exp of the rows.
        dropout: the forward's attention dropout (its mask is regenerated, dropout.py).

    Returns:
        dq (B, nh, Tq, hs), dk and dv (B, nkv, Tk, hs), all fp32.
    """
    from tessera.parallel.sequence import fused

    if dropout is None and fused.available(q):
        return fused.block_backward(q, k, v, meta_q, meta_k, causal, scale, dout, out, lse)
    return explicit_backward(q, k, v, meta_q, meta_k, causal, scale, dout, out, lse, dropout)


@fp32_numerics
def explicit_backward(q, k, v, meta_q, meta_k, causal: bool, scale: float, dout, out, lse,
                      dropout: AttentionDropout | None = None):
    """:func:`block_backward` with plain matmuls, query rows in pieces."""
    n_kv, group = k.shape[1], q.shape[1] // k.shape[1]
    delta = row_delta(dout, out)  # (B, nh, Tq)
    qg, dog = _grouped(q.float(), n_kv), _grouped(dout.float(), n_kv)  # (B, nkv, g, Tq, hs)
    kg, vg = k.float().unsqueeze(2), v.float().unsqueeze(2)  # (B, nkv, 1, Tk, hs)
    lse_g, delta_g = _grouped(lse.unsqueeze(-1), n_kv), _grouped(delta.unsqueeze(-1), n_kv)
    dq = torch.empty_like(qg)
    dk = k.new_zeros(k.shape, dtype=torch.float32)  # (B, nkv, Tk, hs)
    dv = torch.zeros_like(dk)
    for rows in _pieces(q, k.shape[2]):
        qr, dor = qg[..., rows, :], dog[..., rows, :]
        probs = _masked_scores(qr, kg, meta_q[:, rows], meta_k, causal, scale)
        probs.sub_(safe_lse(lse_g[..., rows, :])).exp_()  # (B, nkv, g, rows, Tk)
        dscores = torch.matmul(dor, vg.transpose(-1, -2))  # dP, then dS in place
        if dropout is None:
            dv += torch.matmul(probs.transpose(-1, -2), dor).sum(2)
        else:  # dV = (P K)^T dO, dP = (dO V^T) K
            keep = grouped_keep_scale(dropout, meta_q[:, rows], meta_k, n_kv, group)
            dv += torch.matmul((probs * keep).transpose(-1, -2), dor).sum(2)
            dscores.mul_(keep)
        dscores.sub_(delta_g[..., rows, :]).mul_(probs).mul_(scale)
        torch.matmul(dscores, kg, out=dq[..., rows, :])
        dk += torch.matmul(dscores.transpose(-1, -2), qr).sum(2)
    return dq.reshape(q.shape), dk, dv


def row_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """rowsum(dout * out) in fp32: (B, nh, Tq). Equals rowsum(P * dP) of the full softmax."""
    return (dout.float() * out.float()).sum(-1)
