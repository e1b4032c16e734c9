"""Sub-pipelined tensor parallelism's runner (pipeline/subpipe.py, subpipe_run.py) on a real
tp=2 group: the interleaved halves give the plain run's outputs and gradients, and the
all-reduces of one half, forward and backward, run while the other half computes.

One 2-rank launch. The plain run is the same graph on the whole micro-batch, its f and g
synchronous custom ops with autograd's backward. Tolerance 1e-6 relative to the largest
output / gradient (fp32): the halves' weight gradients are two matmuls summed where the
plain run does one, so they differ by rounding (measured 1.6e-7 relative; outputs equal);
a lost gradient all-reduce is off by the other rank's share, of the order of the gradient
itself. A CUDA case (2 GPUs, NCCL) runs the same check where GPUs are present.
The end-to-end runs (dp x tp x pp, recomputation, tied weights) are in test_tp_pipeline.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import fx, nn

from tessera.parallel.pipeline.subpipe import SubPipelined, cut_at_collectives
from tessera.testing import run_distributed

TOL = 1e-6
# On GPUs (NCCL, the all-reduces on NCCL's stream): 1e-5, as cuBLAS may pick another
# algorithm for the half-size matmuls, which rounds differently.
GPU_TOL = 1e-5


class ShardedStack(nn.Module):
    """What a tensor-parallel stage holds: f, column shard, g per block, a residual stream,
    a split whose items are read after a collective, and an argument returned as is."""

    def __init__(self, group: str, rank: int) -> None:
        super().__init__()
        torch.manual_seed(rank)  # each rank its own shards
        self.group = group
        self.col = nn.ModuleList(nn.Linear(8, 6) for _ in range(2))  # (O/tp, C)
        self.row = nn.ModuleList(nn.Linear(6, 8, bias=False) for _ in range(2))

    def forward(self, x, skip):
        for col, row in zip(self.col, self.row):
            h = torch.tanh(col(torch.ops.tessera.tp_copy(x, self.group)))
            a, b = h.split(3, dim=-1)  # items used on both sides of the g below
            reduced = torch.ops.tessera.tp_reduce(row(torch.cat([b, a], -1)), self.group)
            x = x + reduced[:, :]  # an index of a collective's value: computed after it
            x = x * a.mean(-1, keepdim=True)
        return x, skip


def _grads(model, *tensors):
    return [p.grad.clone() for p in model.parameters()] + [t.grad.clone() for t in tensors]


def _run(gm, model, x, skip):
    out, passed = gm(x, skip)
    ((out * out).sum() + (passed * passed).sum()).backward()
    return out.detach(), _grads(model, x, skip)


def _two_ranks(rank, world_size, device):
    from tessera.parallel.pipeline import subpipe_run
    from tessera.parallel.tensor.comm import TPGroup
    from tessera.parallel.tensor.ops import register_group

    if device == "cuda":
        torch.cuda.set_device(rank)
    name = register_group(TPGroup(dist.new_group([0, 1])))
    model = ShardedStack(name, rank).to(device)
    gm = fx.symbolic_trace(model)
    torch.manual_seed(7)  # the same activations on both ranks, as tensor parallelism has
    x, skip = torch.randn(4, 5, 8, device=device), torch.randn(4, 5, 8, device=device)
    inputs = [t.clone().requires_grad_() for t in (x, skip)]
    plain_out, plain_grads = _run(gm, model, *inputs)
    model.zero_grad()

    sub = SubPipelined(gm)
    accumulated = {name: 0 for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():  # as chunk memory and the dp average see them
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: accumulated.__setitem__(name, accumulated[name] + 1))
    log = []  # the order of all-reduces and segment backwards on this rank
    apply, finish = subpipe_run._apply, subpipe_run._Pending.finish

    def logged_apply(*args):  # "S" where a collective starts
        now, started = apply(*args)
        if started is not None:
            log.append("S")
        return now, started

    subpipe_run._apply = logged_apply
    subpipe_run._Pending.finish = lambda self: log.append("W") or finish(self)
    for index, segment in enumerate(sub.cut.segments):
        if segment.module is not None:
            segment.module.register_forward_pre_hook(lambda m, a, i=index: log.append(f"F{i}"))
            segment.module.register_full_backward_pre_hook(
                lambda m, g, i=index: log.append(f"B{i}"))
    try:
        inputs = [t.clone().requires_grad_() for t in (x, skip)]
        sub_out, sub_grads = _run(sub, model, *inputs)
        once = set(accumulated.values()) == {1}
        with torch.no_grad():
            no_grad_out = sub(x, skip)[0]
        ids = torch.zeros(4, 5, 8, device=device)  # no gradient wanted: weights still get theirs
        model.zero_grad()
        with warnings.catch_warnings():  # the test's backward hooks see no input gradient
            warnings.simplefilter("ignore", UserWarning)
            sub(ids, ids)[0].sum().backward()
        weights_reached = all(p.grad is not None for p in model.parameters())
    finally:
        subpipe_run._apply, subpipe_run._Pending.finish = apply, finish
    scale = plain_out.abs().max()
    return {"out": ((sub_out - plain_out).abs().max() / scale).item(),
            "no_grad_out": ((no_grad_out - plain_out).abs().max() / scale).item(),
            "grads": max(((a - b).abs().max() / b.abs().max()).item()
                         for a, b in zip(sub_grads, plain_grads)),
            "kinds": [s.kind for s in sub.cut.segments], "log": log,
            "weights_reached": weights_reached, "accumulated_once": once}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")])])
def test_interleaved_halves_equal_the_plain_run_and_overlap_both_passes(device):
    out = run_distributed(_two_ranks, world_size=2, args=(device,), timeout=120,
                          backend="gloo" if device == "cpu" else "nccl")
    tol = TOL if device == "cpu" else GPU_TOL
    for rank in out:
        assert rank["out"] <= tol and rank["no_grad_out"] <= tol and rank["grads"] <= tol
        assert rank["weights_reached"]
        # Each weight's two halves are summed and accumulated once, as a plain backward does.
        assert rank["accumulated_once"]
    # Segments: 0 f, 1 compute, 2 g, 3 compute | 4 f, 5 compute, 6 g, 7 compute.
    assert out[0]["kinds"] == ["copy", "compute", "reduce", "compute"] * 2
    # F<i> / B<i>: segment i's forward / backward; S / W: an all-reduce started / waited for.
    forward = ["F1", "S",                    # h0 up to its first g, all-reduce started
               "F1", "S",                    # h1 computes meanwhile, then starts its own
               "W", "F3", "F5", "S",         # h0: its sum, on to the next g
               "W", "F3", "F5", "S",         # h1 likewise, under h0's all-reduce
               "W", "F7", "W", "F7"]
    backward = ["B7", "B5", "S",             # h0 back to block 2's f: its gradient summed
                "B7", "B5", "S",             # ... while h1's segments run backward
                "W", "B3", "B1", "S",        # h0 on, under h1's all-reduce
                "W", "B3", "B1", "S",
                "W", "W"]
    for rank in out:
        assert rank["log"][:32] == forward + backward


def test_a_tensor_hook_on_a_weight_is_refused_by_name():
    # Each half's gradient and then their sum would pass through it: refused before any
    # collective runs (the group name is never resolved).
    model = ShardedStack("tp:unregistered", 0)
    sub = SubPipelined(fx.symbolic_trace(model))
    model.col[0].weight.register_hook(lambda g: 2 * g)
    x = torch.randn(2, 3, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="tensor hook.*tp_overlap=none"):
        sub(x, x)


class _IndexAfterCollective(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        idx = torch.ops.tessera.tp_reduce(x, "tp:unregistered").argmax(-1)
        return (h[:, idx],)  # a tensor index read after the collective


def test_an_item_moves_to_its_source_only_with_a_constant_index():
    cut = cut_at_collectives(fx.symbolic_trace(_IndexAfterCollective()))
    assert [s.kind for s in cut.segments] == ["compute", "reduce", "compute"]
    assert cut.segments[0].outputs == ["proj"]  # h crosses; the getitem runs after idx
    assert cut.results == ["getitem"] and "getitem" in cut.segments[2].outputs
