"""One 16-bit copy of a tensor-parallel shard per step (pipeline/shard_casts.py), and stages
built from a capture whose node names differ from the partition's (program.stage_groups).

Single process: the graph rewrite on a hand-built graph, the cast's sharing rules, and the
op list autocast's behaviour is pinned against. The multi-rank check (shared against not,
bit for bit, and the bytes it saves) runs in test_tp_pipeline.py's 8-rank launch.
"""

from __future__ import annotations

import contextlib

import torch
from torch import fx

from tessera.models import Transformer
from tessera.models.config import preset
from tessera.parallel.pipeline.capture import capture
from tessera.parallel.pipeline.partition import Partition
from tessera.parallel.pipeline.program import stage_groups
from tessera.parallel.pipeline.shard_casts import (LOWER_PRECISION_OPS, dtensor_local,
                                                   dtensor_local_cast, read_casts_of_shards,
                                                   shared_shard_casts)

aten = torch.ops.aten
X2, X3 = torch.randn(4, 4), torch.randn(2, 4, 4)
C = {1: torch.randn(1, 2, 8), 2: torch.randn(1, 2, 8, 8), 3: torch.randn(1, 2, 4, 4, 4)}
W = {1: torch.randn(2, 2, 3), 2: torch.randn(2, 2, 3, 3), 3: torch.randn(2, 2, 3, 3, 3)}
RUNS = {
    "linear": lambda: aten.linear(X2, X2), "mm": lambda: aten.mm(X2, X2),
    "addmm": lambda: aten.addmm(X2, X2, X2), "bmm": lambda: aten.bmm(X3, X3),
    "baddbmm": lambda: aten.baddbmm(X3, X3, X3), "addbmm": lambda: aten.addbmm(X2, X3, X3),
    "matmul": lambda: aten.matmul(X2, X2),
    **{f"conv{d}d": (lambda d=d: getattr(aten, f"conv{d}d")(C[d], W[d])) for d in (1, 2, 3)},
    **{f"conv_transpose{d}d": (lambda d=d: getattr(aten, f"conv_transpose{d}d")(C[d], W[d]))
       for d in (1, 2, 3)},
}


def test_every_op_named_runs_in_16_bits_under_autocast():
    # The rewrite hands these ops a 16-bit shard: that must be what autocast would cast it to.
    assert set(RUNS) == LOWER_PRECISION_OPS
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dtypes = {name: run().dtype for name, run in RUNS.items()}
    assert set(dtypes.values()) == {torch.bfloat16}, dtypes


def _graph() -> fx.GraphModule:
    """``linear(x, t(view_as(shard)))`` twice, + ``mul(x, shard[:, :4].sum())``, hand
    built: two 16-bit reads of one shard and an fp32 one."""
    root = torch.nn.Module()
    root.w = torch.nn.Parameter(torch.randn(4, 6))  # stored (in, out), as GPT-2 does
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("w")
    shard = g.call_function(dtensor_local, (w,))
    view = g.call_function(aten.view_as.default, (shard, shard))
    t = g.call_function(aten.t.default, (view,))
    y = g.call_function(aten.linear.default, (x, t))  # (N, 6)
    y2 = g.call_function(aten.linear.default, (g.call_function(aten.sin.default, (x,)), t))
    part = g.call_function(aten.slice.Tensor, (view, 0, 0, 4))
    scale = g.call_function(aten.sum.default, (part,))
    z = g.call_function(aten.mul.Tensor, (x, scale))
    g.output((y, y2, z))
    return fx.GraphModule(root, g)


def _run(gm: fx.GraphModule, x: torch.Tensor, shared: bool):
    """Outputs and the weight's gradient under bf16 autocast. autocast's own cache is off:
    a stage's shard is not a leaf, so each read casts it anew (what the rewrite replaces)."""
    with (shared_shard_casts() if shared else contextlib.nullcontext()), \
            torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        out = gm(x)
    return out, torch.autograd.grad(sum(v.float().sum() for v in out), gm.w)[0]


def test_matmul_reads_go_through_the_cast_the_others_stay_fp32():
    gm = _graph()
    x = torch.randn(3, 4)
    want, want_grad = _run(gm, x, shared=False)
    assert read_casts_of_shards(gm.graph) == 2
    gm.recompile()
    linears = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    chains = [linear.args[1] for linear in linears]  # t(view_as(cast)), one per read
    assert all(c.args[0].args[0].target is dtensor_local_cast for c in chains)
    assert chains[0] is not chains[1]  # each read's gradient reaches the shard in fp32
    mul_chain = next(n for n in gm.graph.nodes if n.target is aten.slice.Tensor)
    assert mul_chain.args[0].args[0].target is dtensor_local  # fp32 read kept
    for shared in (False, True):
        got, grad = _run(gm, x, shared)
        # Bit for bit: the same casts, made before the layout ops instead of after; the two
        # reads' gradients summed in fp32, as with a cast per read.
        assert all(torch.equal(a, b) for a, b in zip(got, want)), shared
        assert torch.equal(grad, want_grad), shared


def test_the_cast_is_made_once_inside_the_context_and_only_under_autocast_with_grad():
    w = torch.nn.Parameter(torch.randn(4, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dtensor_local_cast(w) is w  # outside: autocast casts the shard itself
        with shared_shard_casts():
            first = dtensor_local_cast(w)
            assert first.dtype == torch.bfloat16
            # Each read is its own node over one copy: the same memory.
            assert dtensor_local_cast(w).data_ptr() == first.data_ptr()
            with shared_shard_casts():  # nested: the enclosing one's copy
                assert dtensor_local_cast(w).data_ptr() == first.data_ptr()
            with torch.no_grad():
                assert dtensor_local_cast(w) is w
        with shared_shard_casts():
            assert dtensor_local_cast(w).data_ptr() != first.data_ptr()  # a new step's
    with shared_shard_casts():
        assert dtensor_local_cast(w) is w  # no autocast: nothing to cast


def test_stages_of_a_capture_whose_names_shift_are_matched_by_position():
    # The reference model at batch 1 and 2: where export numbers nodes otherwise at another
    # shape (HF Llama drops a batch expand at batch 1), the same ops in the same modules in
    # the same order are matched by position; here the names happen to agree too.
    model = Transformer(preset("tiny"))
    seed, other = capture(model, 2, 16), capture(model, 1, 16)
    n = len(seed.compute)
    part = Partition([0, n // 2, n], (0.0, 0.0), [1.0, 1.0], [0.0, 0.0], [0])
    want = stage_groups(other, seed, part)
    renamed = {name: f"renamed_{i}" for i, name in enumerate(other.compute)}
    other.compute = [renamed[name] for name in other.compute]
    other.nodes = {renamed.get(k, k): v for k, v in other.nodes.items()}
    got = stage_groups(other, seed, part)
    assert [[renamed[n] for n in group] for group in want] == got
    # A different op sequence is refused, naming the cause.
    other.compute = other.compute[1:]
    try:
        stage_groups(other, seed, part)
    except RuntimeError as err:
        assert "depends on the input shape" in str(err)
    else:
        raise AssertionError("a graph with other ops was matched")
