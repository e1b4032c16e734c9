"""Element-wise cost of real transformer layers, measured by ``tessera profile``.

A layer's matmuls and attention are priced from their measured tables; what a layer costs
beyond them (norms, residual adds, rope, the activation and their backward) scales with its
element-wise work ``E = n (14 h + c f)`` (see :func:`tessera.planner.compute.layer_elements`).
On a CPU that work is compute-bound (erf, sigmoid, per-row reductions) rather than
bandwidth-bound, so a plain add's bandwidth prices it several times too cheap.

This module times the reference :class:`tessera.models.transformer.Block`, forward and
backward, at a few shapes for each activation style (GPT-2: layernorm + gelu + learned
positions; Llama: rmsnorm + swiglu + rope), subtracts the simulator's own matmul, attention
and fixed per-layer prices, and fits the remainder as seconds per element of ``E`` (least
squares through the origin, forward and backward separately). The model trained by the local
validation is not among the shapes; nothing is fitted to validation runs.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from tessera.models.config import ModelConfig
from tessera.planner.cluster import Cluster
from tessera.planner.compute import layer_core_time, layer_elements

# (micro-batch, sequence, d_model, heads): head dims 32-64, 256-2048 tokens. Chosen to span
# the sizes a CPU worker trains, not to match any validated model.
SHAPES = [(1, 256, 96, 3), (4, 64, 192, 6), (2, 256, 192, 3), (1, 512, 256, 4),
          (4, 256, 64, 2)]
STYLES = {"gelu": dict(norm="layernorm", activation="gelu", position="learned"),
          "swiglu": dict(norm="rmsnorm", activation="swiglu", position="rope")}


def _best_of(fn: Callable[[], object], rounds: int = 5, calls: int = 3) -> float:
    """Fastest mean over ``rounds`` runs of ``calls`` calls (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def time_block(config: ModelConfig, batch: int, seq: int) -> tuple[float, float]:
    """(forward, backward) seconds of one reference block on a (batch, seq, d_model) input,
    with autograd recording as in training."""
    from tessera.models.transformer import Block, rope_tables

    torch.manual_seed(0)
    block = Block(config)
    rope = None
    if config.position == "rope":
        rope = rope_tables(config.head_dim, seq, config.rope_theta)  # (T, hs/2) cos, sin
    x = torch.randn(batch, seq, config.d_model, requires_grad=True)
    grad = torch.randn(batch, seq, config.d_model)
    forward = _best_of(lambda: block(x, rope))

    def step():
        block(x, rope).backward(grad)

    both = _best_of(step)
    return forward, max(0.0, both - forward)


def calibrate_elementwise(cluster: Cluster) -> dict[str, float]:
    """Seconds per element of forward and backward element-wise work for each activation
    style: ``{"elem_fwd_gelu": ..., "elem_bwd_gelu": ..., "elem_fwd_swiglu": ..., ...}``.

    ``cluster`` must already carry the measured matmul table, attention efficiency and fixed
    per-layer overheads; its compute share is not used (one process measures alone)."""
    fixed = cluster.device.overheads
    out = {}
    for style, fields in STYLES.items():
        sums = {"fwd": [0.0, 0.0], "bwd": [0.0, 0.0]}  # sum(r * E), sum(E * E)
        for batch, seq, d_model, heads in SHAPES:
            config = ModelConfig(n_layers=1, d_model=d_model, n_heads=heads, vocab_size=16,
                                 max_seq_len=seq, dropout=0.0, **fields)
            forward, backward = time_block(config, batch, seq)
            core = layer_core_time(cluster, config, batch, seq, 1, "1d", 1, "fp32")
            elements = layer_elements(config, batch * seq, 1)
            for phase, measured, modelled in (
                    ("fwd", forward, core.forward + fixed.get("layer_fwd", 0.0)),
                    ("bwd", backward, core.backward + fixed.get("layer_bwd", 0.0))):
                sums[phase][0] += max(0.0, measured - modelled) * elements
                sums[phase][1] += elements * elements
        for phase, (cross, square) in sums.items():
            out[f"elem_{phase}_{style}"] = cross / square
    return out


# (batch, heads, query rows, keys, head size) of sequence-parallel attention blocks: small
# ones (where the per-call cost shows) to large ones (where the per-element cost does).
BLOCK_SHAPES = [(1, 2, 16, 32, 32), (2, 4, 32, 32, 32), (1, 4, 64, 256, 32),
                (2, 4, 128, 128, 32), (1, 2, 128, 512, 64), (2, 4, 64, 128, 64),
                (1, 8, 256, 256, 16)]


def time_attention_block(batch: int, heads: int, rows: int, keys: int, head_size: int,
                         dropout: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one step of the sequence-parallel runtime's block
    attention (on CPU the fused kernel, sequence/fused.py; with ``dropout`` the explicit path
    with a hashed mask, p = 0.1) on one block, every key visible: forward is
    ``blocks.block_forward`` and the online-softmax merge into the running output (as a ring
    step does), backward is ``block_backward`` and the accumulation of the query gradient."""
    from tessera.parallel.sequence.blocks import block_backward, block_forward, merge_into
    from tessera.parallel.sequence.dropout import AttentionDropout

    torch.manual_seed(0)
    q = torch.randn(batch, heads, rows, head_size)
    k, v = (torch.randn(batch, heads, keys, head_size) for _ in range(2))
    meta_q = torch.stack([torch.arange(rows), torch.zeros(rows, dtype=torch.long)], -1)
    meta_k = torch.stack([torch.arange(keys), torch.zeros(keys, dtype=torch.long)], -1)
    meta_q, meta_k = meta_q.expand(batch, -1, -1), meta_k.expand(batch, -1, -1)  # (B, T, 2)
    scale = head_size ** -0.5
    drop = AttentionDropout(0.1, seed=1) if dropout else None
    out, lse = block_forward(q, k, v, meta_q, meta_k, False, scale, drop)
    dout = torch.randn_like(out)
    acc_out, acc_lse, dq = out.clone(), lse.clone(), torch.zeros_like(q)

    def forward():
        merge_into(acc_out, acc_lse, *block_forward(q, k, v, meta_q, meta_k, False, scale,
                                                    drop))

    def backward():
        dq_block, _, _ = block_backward(q, k, v, meta_q, meta_k, False, scale, dout, out,
                                        lse, drop)
        dq.add_(dq_block)

    return _best_of(forward), _best_of(backward)


def calibrate_block_attention(dropout: bool = False) -> dict[str, float]:
    """Seconds of the sequence-parallel runtime's block attention as ``c + E (a + b hs)`` for
    a call on E score elements: ``attn_fwd_call`` (c, kernel launches and the merge),
    ``attn_fwd_elem`` (a, the element-wise passes over the scores: scale, mask,
    log-sum-exp, exp) and ``attn_fwd_elem_hs`` (b, the two matmuls per score); likewise
    ``attn_bwd_*``. With ``dropout``, the hashed-dropout path's, as ``attn_drop_*``. Least
    squares over :data:`BLOCK_SHAPES`, kept non-negative."""
    rows = []
    for shape in BLOCK_SHAPES:
        batch, heads, q_rows, keys, head_size = shape
        elements = batch * heads * q_rows * keys
        rows.append((elements, head_size, *time_attention_block(*shape, dropout=dropout)))
    out, key = {}, "attn_drop" if dropout else "attn"
    for phase, col in (("fwd", 2), ("bwd", 3)):
        c, a, b = _fit_call_elements(rows, col)
        out[f"{key}_{phase}_call"], out[f"{key}_{phase}_elem"] = c, a
        out[f"{key}_{phase}_elem_hs"] = b
    return out


def _fit_call_elements(rows: list[tuple], col: int) -> tuple[float, float, float]:
    """Least squares of t = c + a E + b E hs (relative errors weighted alike), each >= 0:
    a negative coefficient is dropped and the rest refitted."""
    keep = [0, 1, 2]
    while True:
        design = torch.tensor([[1.0, e, e * hs] for e, hs, *_ in rows], dtype=torch.float64)
        times = torch.tensor([r[col] for r in rows], dtype=torch.float64)
        weight = 1.0 / times.unsqueeze(1)  # fit relative error: small and large blocks count
        coef = torch.linalg.lstsq(design[:, keep] * weight, (times * weight[:, 0]).unsqueeze(1)
                                  ).solution[:, 0]
        if (coef >= 0).all() or len(keep) == 1:
            full = [0.0, 0.0, 0.0]
            for index, value in zip(keep, coef.tolist()):
                full[index] = max(0.0, value)
            return full[0], full[1], full[2]
        keep = [i for i, value in zip(keep, coef.tolist()) if value >= 0] or [0]
