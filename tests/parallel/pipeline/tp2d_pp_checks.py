"""Multi-rank checks of 2D (SUMMA) tensor parallelism for test_tp2d_pipeline.py: the custom
ops against the eager functions, and one bf16 step against one device.

The ops of tensor/ops2d.py must compute what the eager autograd functions of layers2d.py
compute, forward and backward, and must survive torch.export as single nodes whose backward
runs when the exported graph is differentiated (what a pipeline stage does).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.mesh import Mesh
from tessera.parallel import parallelize
from tessera.parallel.pipeline import PipelineEngine
from tessera.parallel.pipeline.cost import node_cost
from tessera.parallel.plan import Parallelized
from tessera.parallel.tensor.comm import Grid
from tessera.parallel.tensor.layers2d import (AddBias2DFn, Conv1D2DFn, Embedding2DFn,
                                              Linear2DFn, Norm2DFn)
from tessera.parallel.tensor.ops2d import (register_grid, summa_add_bias, summa_embedding,
                                           summa_linear, summa_norm)
from tessera.strategy import Strategy
from tessera.train.engine import Engine

import pp_checks

B, T, C, O, V = 4, 8, 16, 32, 64  # whole sizes; a rank holds (B/q, T, C/q) and blocks
EPS = 1e-5


def _eager(grid: Grid, x, w, b, nw, nb, wc, rw, ids, emb):
    """Linear + bias -> layernorm (+ embedding) -> Conv1D -> rmsnorm with the eager functions."""
    y = AddBias2DFn.apply(Linear2DFn.apply(x, w, grid), b, grid)  # (B/q, T, O/q)
    y = Norm2DFn.apply(y, nw, nb, EPS, False, O, grid) + Embedding2DFn.apply(ids, emb, grid)
    z = Conv1D2DFn.apply(y, wc, grid)  # (B/q, T, C/q)
    return Norm2DFn.apply(z, rw, None, EPS, True, C, grid)


class OpChain(nn.Module):
    """The same chain through the custom ops (what an exported 2D model holds)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, x, w, b, nw, nb, wc, rw, ids, emb):
        g = self.name
        y = summa_add_bias(summa_linear(x, w, g, False), b, g)
        y = summa_norm(y, nw, nb, EPS, False, O, g)[0] + summa_embedding(ids, emb, g)
        z = summa_linear(y, wc, g, True)
        return summa_norm(z, rw, None, EPS, True, C, g)[0]


def _inputs(grid: Grid) -> list[torch.Tensor]:
    torch.manual_seed(11 + grid.q * grid.i + grid.j)  # each rank its own blocks...
    q = grid.q
    blocks = [torch.randn(B // q, T, C // q), torch.randn(O // q, C // q), torch.randn(O // q),
              1 + torch.randn(O // q), torch.randn(O // q), torch.randn(O // q, C // q),
              1 + torch.randn(C // q)]
    # ... but the token ids of a batch slice are the same along its grid row.
    ids = torch.randint(0, V, (B // q, T), generator=torch.Generator().manual_seed(grid.i))
    return [*blocks, ids, torch.randn(V // q, O // q)]


def _run(fn, inputs) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return [out.detach()] + [t.grad for t in leaves if t.is_floating_point()]


def op_parity(mesh: Mesh) -> dict:
    """Max differences of the op chain (direct and exported) against the eager chain, the
    op names the export holds, and the cost model's FLOPs for the first linear."""
    grid = Grid.from_mesh(mesh)
    name = register_grid(grid)
    inputs = _inputs(grid)
    want = _run(lambda *a: _eager(grid, *a), inputs)
    chain = OpChain(name)
    direct = _run(chain, inputs)
    program = torch.export.export(chain, tuple(inputs), strict=False)
    exported = _run(program.module(), inputs)
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    first = next(n for n in program.graph.nodes if "summa_linear" in str(n.target))
    rows = (B // grid.q) * T
    return {"direct": max((a - b).abs().max().item() for a, b in zip(want, direct)),
            "exported": max((a - b).abs().max().item() for a, b in zip(want, exported)),
            "grads": len(want) - 1,
            "targets": sorted({t for t in targets if t.startswith("tessera.")}),
            "other_targets": sorted({t for t in targets if not t.startswith("tessera.")}),
            "flops": node_cost(first).fwd_flops,
            "flops_expected": 2.0 * rows * C * O / grid.q,
            # q steps, each a (O/q, C/q) weight block broadcast and a (rows, O/q) partial
            # reduced, 4-byte floats; the backward's two products twice that.
            "comm": (node_cost(first).fwd_comm_bytes, node_cost(first).bwd_comm_bytes),
            "comm_expected": grid.q * (O * C / grid.q**2 + rows * O / grid.q) * 4}


def bf16_step(text: str) -> dict[str, float]:
    """One bf16 step of ``text`` (tp=4 (2d), 8 ranks) against one device in bf16: losses and
    gradient norms. Under pp > 1 through the PipelineEngine, else the plain Engine."""
    strategy, cpu = Strategy.parse(text), torch.device("cpu")
    ref = pp_checks.make_model("gpt2")
    one = Engine(Parallelized(ref, ref, None), Strategy(precision="bf16"), cpu)
    model = pp_checks.make_model("gpt2")
    plan = parallelize(model, strategy, Mesh(strategy, "cpu"))
    engine = (PipelineEngine if strategy.pp > 1 else Engine)(plan, strategy, cpu)
    batches = pp_checks.micro_batches(0, strategy.grad_accum_steps * strategy.dp)
    # Every dp rank gets the same micro-batches, so the dp average is the one-device gradient.
    mine = batches[:strategy.grad_accum_steps]
    want, got = one.forward_backward(mine), engine.forward_backward(mine)
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    norm = float(plan.clip_grad_norm(plan.module, 1e9))
    return {"loss": abs(float(want.loss) - float(got.loss)),
            "norm_rel": abs(norm - ref_norm) / ref_norm, "features": list(plan.features)}
