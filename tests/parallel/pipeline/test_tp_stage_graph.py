"""Tensor-parallel collectives as graph nodes: export keeps them, the cost model prices them,
and the Strategy field that asks for sub-pipelining around them.

Single process: nothing here runs a collective (export traces on fake tensors). The
sub-pipelined runner is in test_subpipe.py (2 ranks); numerical parity of whole runs is in
test_tp_pipeline.py (8 ranks).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.parallel.pipeline.capture import capture
from tessera.parallel.pipeline.cost import ALL_REDUCE_TRAFFIC, DeviceRates
from tessera.parallel.tensor import ops, ops_seq
from tessera.strategy import Strategy, StrategyError

GROUP = "tp:test"  # never resolved: nothing runs


class TwoRowLayers(nn.Module):
    """Embedding, then column -> row twice: the shape of a 1D tensor-parallel MLP stack."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.col = nn.ModuleList(nn.Linear(8, 4) for _ in range(2))  # (O/tp, C)
        self.row = nn.ModuleList(nn.Linear(4, 8, bias=False) for _ in range(2))

    def forward(self, ids):
        x = self.embed(ids)  # (B, T, 8)
        for col, row in zip(self.col, self.row):
            h = torch.relu(F.linear(ops.tp_copy(x, GROUP), col.weight, col.bias))
            x = x + ops.tp_reduce(F.linear(h, row.weight), GROUP)
        return x


def _targets(graph) -> list[str]:
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


def test_export_keeps_tp_collectives_as_single_priced_nodes():
    graph = capture(TwoRowLayers(), batch_size=2, seq_len=4)
    nodes = {p.node.target: p for p in graph.nodes.values() if p.kind == "compute"}
    copy, reduce = nodes[ops.TP_COPY], nodes[ops.TP_REDUCE]
    assert sum(str(t).startswith("tessera.tp_") for t in _targets(graph.program.graph)) == 4
    rates, payload = DeviceRates(), 2 * 4 * 8 * 4  # (B, T, C) fp32
    # g all-reduces in forward, f in backward; neither keeps an activation for backward.
    assert reduce.cost.fwd_comm_bytes == 2 * payload and reduce.cost.bwd_comm_bytes == 0
    assert copy.cost.bwd_comm_bytes == 2 * payload and copy.cost.fwd_comm_bytes == 0
    assert copy.cost.saved_bytes == reduce.cost.saved_bytes == 0
    assert reduce.cost.fwd_time(rates) == pytest.approx(2 * payload / rates.collective_bw)


def test_tp_overlap_field_text_form_and_rules():
    text = "dp=1,tp=2,pp=2,mbs=2,gbs=4,tp_overlap=subpipe"
    strategy = Strategy.parse(text)
    assert strategy.tp_overlap == "subpipe" and strategy.to_text() == text
    assert Strategy.parse("dp=1,tp=2,pp=2,mbs=2,gbs=4").tp_overlap == "none"
    for bad in ("dp=1,tp=1,pp=2,mbs=2,gbs=4", "dp=1,tp=2,pp=1,mbs=2,gbs=4",
                "dp=1,tp=2,pp=2,mbs=3,gbs=6"):
        with pytest.raises(StrategyError, match="tp_overlap=subpipe"):
            Strategy.parse(bad + ",tp_overlap=subpipe")
    with pytest.raises(StrategyError, match="tp_overlap must be one of"):
        Strategy.parse("tp_overlap=async")


def test_tp_with_pp_is_runnable_in_1d_and_2d_without_2d_subpipelining():
    assert Strategy.parse("dp=2,tp=2,pp=2,mbs=2,gbs=8").is_runnable()
    assert Strategy.parse("dp=1,tp=4,tp_mode=2d,pp=2,mbs=2,gbs=8").is_runnable()
    # Sub-pipelining overlaps 1D all-reduces; SUMMA layers have none: refused, not ignored.
    assert not Strategy.parse("dp=1,tp=4,tp_mode=2d,pp=2,mbs=2,gbs=8,"
                              "tp_overlap=subpipe").is_runnable()


class RowBias(nn.Module):
    """A row layer's product, then its bias as the captured 1D layer adds it."""

    def __init__(self) -> None:
        super().__init__()
        self.row = nn.Linear(8, 6)

    def forward(self, x):
        return ops.tp_add_bias(F.linear(x, self.row.weight), self.row.bias)


def test_a_captured_row_bias_adds_in_the_dtype_the_product_runs_in():
    torch.manual_seed(0)
    model, x = RowBias(), torch.randn(2, 4, 8)
    graph = torch.export.export(model, (x,)).module()  # captured in fp32, as stages are
    eager = nn.Linear(8, 6)  # the eager 1D row layer: the product, then the bias in its dtype
    eager.load_state_dict(model.row.state_dict())
    with torch.autocast("cpu", torch.bfloat16):
        got = graph(x)
        product = F.linear(x, eager.weight)
        want = product + eager.bias.to(product.dtype)  # (RowLinearFn)
        assert eager(x).dtype == torch.bfloat16  # nn.Linear's output on one device
    # Under autocast the 16-bit product stays 16-bit (a plain + promoted it to fp32: a wider
    # output, and wider dropout noise, than the eager layers and one device give).
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    grad = torch.randn_like(got)
    got.backward(grad)
    want.backward(grad)
    for ours, theirs in ((graph.row.bias, eager.bias), (graph.row.weight, eager.weight)):
        assert ours.grad.dtype == torch.float32
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0)
    # 16-bit parameters (chunk memory) run the fp32 capture: nothing fixed the capture's dtype.
    low = graph.to(torch.bfloat16)
    assert low(x.to(torch.bfloat16)).dtype == torch.bfloat16


class SeqBlock(nn.Module):
    """A Megatron sequence-parallel block (tensor/ops_seq.py): the input shard gathered,
    read by three column layers (q, k, v), one row layer's output reduce-scattered."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.cols = nn.ModuleList(nn.Linear(8, 4) for _ in range(3))  # (O/tp, C)
        self.row = nn.Linear(12, 8, bias=False)  # (C, 3 O/tp)

    def forward(self, ids):
        x = self.embed(ids)  # (B, T/tp, C): this rank's tokens
        full = ops_seq.tp_seq_gather(x, SEQ_GROUP, "b0")  # (B, T, C)
        h = torch.cat([ops_seq.tp_seq_linear(full, x, c.weight, c.bias, SEQ_GROUP, "b0")
                       for c in self.cols], dim=-1)
        return x + ops_seq.tp_seq_reduce_scatter(F.linear(h, self.row.weight), SEQ_GROUP)


class TwoRanks:
    """Stand-in for a 2-rank tp group: the ops' fakes read its size; nothing runs."""

    size, rank = 2, 0


SEQ_GROUP = "tp:test_seq"


def test_sequence_parallel_ops_are_priced_as_the_all_reduce_plus_one_regather():
    ops._GROUPS[SEQ_GROUP] = TwoRanks()
    try:
        graph = capture(SeqBlock(), batch_size=2, seq_len=4)
    finally:
        del ops._GROUPS[SEQ_GROUP]
    costs = {}
    for p in graph.nodes.values():
        if p.kind == "compute" and "tp_seq" in str(p.node.target):
            costs.setdefault(str(p.node.target).split(".")[1], []).append(p.cost)
    payload = 2 * 8 * 8 * 4  # the gathered (B, T, C) in fp32
    (gather,), (scatter,), columns = (costs["tp_seq_gather"], costs["tp_seq_reduce_scatter"],
                                      costs["tp_seq_linear"])
    # Forward: an all-gather and a reduce-scatter, together an all-reduce's traffic
    assert gather.fwd_comm_bytes + scatter.fwd_comm_bytes == ALL_REDUCE_TRAFFIC * payload
    # Backward: the same again, plus the kept shard gathered once for the three columns
    assert gather.bwd_comm_bytes + scatter.bwd_comm_bytes == ALL_REDUCE_TRAFFIC * payload
    assert len(columns) == 3 and sum(c.bwd_comm_bytes for c in columns) == payload
    assert all(c.fwd_comm_bytes == 0 and c.fwd_flops == 2 * 2 * 8 * 4 * 8 for c in columns)
