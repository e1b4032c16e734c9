"""What sequence-parallel attention costs: bytes sent per layer, and the pipeline's price.

:func:`attention_comm_bytes` is the formula of docs/sequence_parallel.md (the benchmark
checks the bytes the runtime sends against it). :func:`staged_attention_cost` prices the
attention custom ops of a captured pipeline stage (staged.py) for the partitioner, which
would otherwise see one opaque node and price it like an element-wise one.
"""

from __future__ import annotations

from torch import fx

from tessera.parallel.pipeline.cost import BWD_ATTENTION, NodeCost, value_bytes

META_BYTES_PER_TOKEN = 16  # two int64 per token: document id and position
GRAD_BYTES = 4  # gradients travelling around the ring are fp32


def attention_comm_bytes(mode: str, B: int, t: int, nh: int, nkv: int, hs: int, n: int,
                         e: int = 4) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends per attention layer.

    Args:
        mode: "ring", "rsa" or "ulysses".
        B, t: micro-batch rows and local tokens (L / n).
        nh, nkv, hs: query heads, key/value heads, head width.
        n: the sp degree.
        e: bytes per element of q, k, v.
    """
    kv, q, meta = B * t * nkv * hs * e, B * t * nh * hs * e, B * t * META_BYTES_PER_TOKEN
    kv_grads = B * t * nkv * hs * GRAD_BYTES
    if mode == "ring":  # fwd: (n-1) hops of k, v, meta; bwd: again + n hops of dk, dv
        hops = (n - 1) * (2 * kv + meta)
        return float(hops), float(hops + n * 2 * kv_grads)
    if mode == "rsa":  # fwd: k + meta, then v; bwd: v then k, each with its travelling grad
        return (float((n - 1) * (kv + meta) + (n - 1) * kv),
                float(2 * ((n - 1) * kv + n * kv_grads)))
    if mode == "ulysses":  # all-to-alls of q, k, v and the output, each way; meta once
        kv_sent = B * t * max(nkv, n) * hs * e  # kv heads repeated up to n when fewer
        a2a = (2 * q + 2 * kv_sent) * (n - 1) / n
        return a2a + (n - 1) * meta, a2a
    raise ValueError(f"sp_mode {mode!r}: expected ring, rsa or ulysses")


def staged_attention_cost(node: fx.Node, n: int) -> NodeCost:
    """Price one ``tessera::sp_ring_attention`` / ``tessera::sp_attention`` node.

    Each rank's t queries meet all n t keys: 4 B nh t (n t) hs FLOPs forward (the fused
    attention's count; causal masking is not discounted, as for SDPA). The ring's backward is
    its own (2.5x); rsa and ulysses run their forward again inside the backward (staged.py),
    so they pay one forward more in FLOPs and bytes.

    Args:
        node: the op's graph node; args (q (B, nh, t, hs), k (B, nkv, t, hs), v, meta,
            group name, [mode,] ...).
        n: the size of the sp group the op names.
    """
    ring = "sp_ring_attention" in str(node.target)
    q, k = node.args[0].meta["val"], node.args[1].meta["val"]
    B, nh, t, hs = q.shape
    mode = "ring" if ring else node.args[5]
    flops = 4.0 * B * nh * t * (n * t) * hs
    fwd, bwd = attention_comm_bytes(mode, B, t, nh, k.shape[1], hs, n, q.element_size())
    if ring:
        bwd_flops = BWD_ATTENTION * flops
    else:
        bwd_flops, bwd = (1 + BWD_ATTENTION) * flops, bwd + fwd
    out = value_bytes(node.meta.get("val"))
    return NodeCost(flops, bwd_flops, out, out, fwd, bwd)
