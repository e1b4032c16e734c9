"""Cost of one graph node from the shapes torch.export recorded: FLOPs, bytes, time.

Every value in an exported graph carries a fake tensor in ``node.meta["val"]``, so costs come
from shapes alone and work on the meta device (a model larger than memory is priced before it
exists). The factors follow the planner (tessera.planner.compute): a matmul's backward is two
matmuls of the same size (2x), fused attention's backward recomputes the scores (2.5x), and an
element-wise kernel's backward reads and writes about twice its forward traffic (2x).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from tessera.parallel.tensor.ops_seq import SEQ_COLLECTIVES, SEQ_LINEAR_NAME, seq_comm_bytes

BWD_MATMUL = 2.0
BWD_ATTENTION = 2.5
BWD_ELEMENTWISE = 2.0

# Ops that only reinterpret memory: no FLOPs, no new activation storage. ``clone`` and
# ``contiguous`` are here for the ops a weight is read through (graph_spec, capture); as
# compute nodes, node_cost prices the copies they make (COPY_OPS).
VIEW_OPS = frozenset({
    "view", "view_as", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand",
    "unsqueeze",
    "squeeze", "slice", "select", "alias", "detach", "split", "split_with_sizes", "unbind",
    "getitem", "_assert_tensor_metadata", "contiguous", "clone", "lift_fresh_copy",
    "access_subclass_inner_tensor",  # a DTensor parameter's local shard (tensor parallel)
})

# Copies: forward writes the output once; backward passes the gradient through untouched.
# ``contiguous`` copies only a non-contiguous input (an attention output after its transpose).
COPY_OPS = frozenset({"clone", "contiguous"})

# Tensor-parallel collectives (tensor/ops.py): which pass, forward or backward, all-reduces.
# A ring all-reduce sends and receives about twice the payload, whatever the group size.
TP_COMM_FWD = frozenset({"tp_reduce"})
TP_COMM_BWD = frozenset({"tp_copy"})
ALL_REDUCE_TRAFFIC = 2.0
# Matmuls of row groups by their own matrices: Mixture-of-Experts layers, as transformers
# (grouped_mm_fallback) and torch (_grouped_mm) capture them.
GROUPED_MATMUL_OPS = frozenset({"grouped_mm_fallback", "_grouped_mm", "grouped_mm"})
# Reductions read every input element for each few they write: priced by their input.
REDUCTION_OPS = frozenset({"logsumexp", "sum", "mean", "var", "var_mean", "std", "amax",
                           "amin", "max", "min", "prod", "norm", "linalg_vector_norm"})
# Sequence-parallel attention as one custom op each (sequence/staged.py): priced by
# sequence/cost.py, its ring or all-to-all bytes counted like a tensor-parallel collective's.
SP_ATTENTION_OPS = frozenset({"sp_ring_attention", "sp_attention"})


@dataclass(frozen=True)
class DeviceRates:
    """How fast a device computes and moves bytes (only the ratio matters for balance)."""

    flops: float = 1e11  # sustained FLOP/s of a large matmul
    memory_bw: float = 2e10  # bytes/s for element-wise kernels
    p2p_bw: float = 5e9  # bytes/s between neighbouring pipeline stages
    collective_bw: float = 5e9  # bytes/s into a tensor-parallel all-reduce


@dataclass(frozen=True)
class NodeCost:
    """Shape-derived cost of one node for one micro-batch."""

    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    out_bytes: int = 0  # bytes of the value the node produces
    # Bytes written (0 for views): the element-wise traffic, and the activations kept when
    # the graph cannot run on fake tensors (kept.py measures what autograd keeps)
    saved_bytes: int = 0
    fwd_comm_bytes: float = 0.0  # bytes a tp collective or sp attention moves in forward
    bwd_comm_bytes: float = 0.0  # ... and in backward

    def fwd_time(self, rates: DeviceRates) -> float:
        return (self.fwd_flops / rates.flops + self.saved_bytes / rates.memory_bw
                + self.fwd_comm_bytes / rates.collective_bw)

    def bwd_time(self, rates: DeviceRates) -> float:
        factor = BWD_ELEMENTWISE if self.fwd_flops == 0 else self.bwd_flops / self.fwd_flops
        return (self.bwd_flops / rates.flops + factor * self.saved_bytes / rates.memory_bw
                + self.bwd_comm_bytes / rates.collective_bw)


def value_bytes(val: Any) -> int:
    """Bytes of a (fake) tensor or of the tensors in a tuple/list of them."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(value_bytes(v) for v in val)
    return 0


def op_name(node: fx.Node) -> str:
    """The aten op of a node without its overload ("linear.default" -> "linear")."""
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]  # "linear.default" -> "linear"


def _shape(node: Any) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def matmul_flops(node: fx.Node) -> float:
    """Forward FLOPs of the matrix products (linear, addmm, mm, bmm, matmul, baddbmm, addbmm,
    grouped expert matmuls, sdpa and tp_dropout_attention, summa_linear), else 0."""
    op, args = op_name(node), node.args
    out = _shape(node)
    if op == "linear":  # x (..., K) @ w (N, K)^T
        k = _shape(args[1])[-1] if len(_shape(args[1])) == 2 else 1
        return 2.0 * math.prod(out) * k
    if op == "addmm":  # bias + (M, K) @ (K, N)
        return 2.0 * math.prod(out) * _shape(args[1])[-1]
    if op in GROUPED_MATMUL_OPS and len(_shape(args[0])) == len(_shape(args[1])) == 2:
        # (M, K) @ (K, N) with K split into groups (MoE weight gradients): out (G, M, N)
        return 2.0 * math.prod(out[-2:]) * _shape(args[0])[-1]
    if op in ("mm", "bmm", "matmul") or op in GROUPED_MATMUL_OPS:
        # grouped: x (T, K) rows, each multiplied by its group's (K, N) matrix (MoE experts)
        return 2.0 * math.prod(out) * _shape(args[0])[-1]
    if op in ("baddbmm", "addbmm"):  # input + batch1 (b, M, K) @ batch2 (b, K, N)
        return 2.0 * math.prod(_shape(args[1])) * _shape(args[2])[-1]
    if op == SEQ_LINEAR_NAME:  # linear(full (..., K), shard, w (N, K), bias)
        return 2.0 * math.prod(out) * _shape(args[0])[-1]
    if op == "summa_linear":  # a 2D tensor-parallel layer (tensor/ops2d.py)
        from tessera.parallel.tensor.ops2d import summa_linear_flops

        return summa_linear_flops(node)
    if op in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "tp_dropout_attention"):
        # (tp_dropout_attention: 1D tp's attention dropout, tensor/attention.py)
        q, k = _shape(args[0]), _shape(args[1])  # (B, nh, Tq, hs), (B, nkv, Tk, hs)
        return 4.0 * math.prod(q) * k[-2]  # q k^T and p v, each 2 * B nh Tq Tk hs
    return 0.0


def _copies(node: fx.Node) -> bool:
    """Whether a clone / contiguous node writes a new tensor (contiguous of a contiguous
    input returns the input itself)."""
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    if op_name(node) == "clone":
        return True
    source = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) \
        else None
    return isinstance(source, torch.Tensor) and not source.is_contiguous()


def node_cost(node: fx.Node) -> NodeCost:
    """Cost of one ``call_function`` node of an exported graph."""
    op = op_name(node)
    out = value_bytes(node.meta.get("val"))
    if op in COPY_OPS and _copies(node):
        # one element-wise pass: priced like one, with no backward work (bwd_flops 0)
        return NodeCost(float(node.meta["val"].numel()), 0.0, out, out)
    if op in VIEW_OPS:
        return NodeCost(out_bytes=out)
    if op in TP_COMM_FWD or op in TP_COMM_BWD:  # communication only; nothing kept for backward
        traffic = ALL_REDUCE_TRAFFIC * out
        return NodeCost(out_bytes=out, fwd_comm_bytes=traffic if op in TP_COMM_FWD else 0.0,
                        bwd_comm_bytes=traffic if op in TP_COMM_BWD else 0.0)
    if op in SEQ_COLLECTIVES:  # communication only; nothing kept for backward
        fwd, bwd = seq_comm_bytes(op, node)
        return NodeCost(out_bytes=out, fwd_comm_bytes=fwd, bwd_comm_bytes=bwd)
    if op in SP_ATTENTION_OPS:  # sequence-parallel attention (sequence/staged.py)
        from tessera.parallel.sequence.cost import staged_attention_cost
        from tessera.parallel.sequence.staged import group_named

        return staged_attention_cost(node, group_named(node.args[4]).size())
    flops = matmul_flops(node)
    if op == "summa_linear":  # 2D tensor parallelism: SUMMA broadcasts and reduces blocks
        from tessera.parallel.tensor.ops2d import summa_linear_comm_bytes

        comm = summa_linear_comm_bytes(node)
        return NodeCost(flops, BWD_MATMUL * flops, out, out, comm, BWD_MATMUL * comm)
    if op == SEQ_LINEAR_NAME:  # a matmul whose backward gathers its input again
        return NodeCost(flops, BWD_MATMUL * flops, out, out, 0.0, seq_comm_bytes(op, node)[1])
    if flops:
        factor = BWD_ATTENTION if "attention" in op else BWD_MATMUL
        return NodeCost(flops, factor * flops, out, out)
    val = node.meta.get("val")
    numel = val.numel() if isinstance(val, torch.Tensor) else 0
    source = node.args[0] if node.args else None
    if op in REDUCTION_OPS and isinstance(getattr(source, "meta", {}).get("val"), torch.Tensor):
        numel = source.meta["val"].numel()  # a norm's mean, a sliced LM head's logsumexp
    # Element-wise: about one operation per output element; reductions per input element.
    return NodeCost(float(numel), BWD_ELEMENTWISE * numel, out, out)
