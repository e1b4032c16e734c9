"""Multi-rank checks of tensor x pipeline (x data) parallelism, run from test_tp_pipeline.py.

Like pp_checks.parity, each check trains the same model, micro-batches and optimizer on one
device in the same process; shards are gathered whole (and fused q|k|v unpermuted) before
comparing, so every tp rank of a stage takes part in the same gathers in the same order.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tessera.mesh import Mesh
from tessera.models.materialize import DeferredInit, has_meta, materialize
from tessera.parallel import parallelize
from tessera.parallel.pipeline import PipelineEngine
from tessera.parallel.pipeline.tp import stage_batch
from tessera.parallel.plan import Parallelized
from tessera.parallel.tensor.shard import unsharded
from tessera.strategy import Strategy
from tessera.train.engine import Engine
from tessera.train.optim import build_optimizer

import pp_checks

STEPS = 3
# AdamW with eps 1e-6 (not 1e-8): Adam's first steps move each weight by about lr * sign(g),
# so weights whose gradient is near eps (k-bias gradients are exactly 0 up to rounding) would
# turn the 1e-9 rounding differences of tensor-parallel sums into 1e-3 weight differences.
# With eps 1e-6 such gradients are in Adam's linear range and differences stay at rounding.
ADAM = (1e-2, 0.1, (0.9, 0.95), 1e-6, torch.device("cpu"))


def parity(arch: str, text: str) -> dict[str, float]:
    """Max loss, gradient and final parameter differences against one device.

    Each dp rank trains on its own micro-batches and the device on all of them in one step
    (the mean over all is the dp average of the ranks' means), so the data-parallel average
    (pipeline/overlap.py, on DTensor shards here) is exercised, not an identity.
    """
    strategy = Strategy.parse(text)
    n = strategy.grad_accum_steps
    ref = pp_checks.make_model(arch)
    deferred = None
    if has_meta(ref):  # one device materialises all of it, each rank its stages' shards
        materialize(ref, "cpu", seed=0)
        deferred = DeferredInit(torch.device("cpu"), seed=0)
    ref_engine = Engine(Parallelized(ref, ref, None), Strategy(), torch.device("cpu"))
    ref_opt = build_optimizer(ref, *ADAM)
    model = pp_checks.make_model(arch)
    mesh = Mesh(strategy, "cpu")
    plan = parallelize(model, strategy, mesh, deferred=deferred)
    dp_rank = mesh.rank("dp")
    on_meta = sum(p.to_local().numel() for p in model.parameters() if p.to_local().is_meta)
    engine = PipelineEngine(plan, strategy, torch.device("cpu"))
    opt = plan.build_optimizer(model, *ADAM)
    loss_diff = grad_diff = 0.0
    losses, first = [], None
    for step in range(STEPS):
        per_rank = ([pp_checks.micro_batches(step, n)] if strategy.dp == 1 else
                    [pp_checks.micro_batches(10 * step + r, n) for r in range(strategy.dp)])
        want = ref_engine.forward_backward([b for batches in per_rank for b in batches])
        got = engine.forward_backward(per_rank[dp_rank]).loss.detach().clone()
        if strategy.dp > 1:  # this replica's mean -> the mean over all micro-batches
            dist.all_reduce(got, op=dist.ReduceOp.AVG, group=mesh.group("dp"))
        loss_diff = max(loss_diff, abs(float(want.loss) - float(got)))
        losses.append(float(got))
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
        norm = float(plan.clip_grad_norm(model, 1.0))
        grads = _whole(plan.module, lambda p: p.grad)
        step_diff = max(abs(ref_norm - norm), _diff(grads, ref, lambda p: p.grad))
        first = step_diff if first is None else first
        grad_diff = max(grad_diff, step_diff)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    params = _whole(plan.module, lambda p: p.detach())
    # The stages built for the run (under 2D, each grid row's mbs / q rows; another shape
    # would capture again).
    built = plan.pipeline.program.get((stage_batch(strategy), pp_checks.SEQ), training=True)
    return {"loss": loss_diff, "grad": grad_diff, "grad_first_step": first,
            "param": _diff(params, ref, lambda p: p),
            "saved": _saved_diff(plan.module, ref), "losses": losses,
            "features": list(plan.features), "shard_elements_left_on_meta": on_meta,
            "seq_ops": _seq_ops(built.graph.program.graph),
            # the stages run the partition's capture, not a second one (sub-pipelined: both
            # are at half the micro-batch)
            "one_capture": built.graph is plan.pipeline.program.graph,
            "boundary": [tuple(spec.shape) for spec in built.out_specs[0]],
            "subpipe_segments": _subpipe_segments(built)}


def _subpipe_segments(built) -> dict[str, int]:
    """How many segments of each kind this rank's sub-pipelined pieces were cut into
    (pipeline/subpipe.py; empty when the stages are not sub-pipelined)."""
    from tessera.parallel.pipeline.subpipe import SubPipelined

    out: dict[str, int] = {}
    for runner in built.runners.values():
        for _, piece in runner.pieces():
            if isinstance(piece.module, SubPipelined):
                for segment in piece.module.cut.segments:
                    out[segment.kind] = out.get(segment.kind, 0) + 1
    return out


def _seq_ops(graph) -> dict[str, int]:
    """How many nodes of each Megatron sequence-parallel op (tensor/ops_seq.py) the whole
    captured model holds."""
    out: dict[str, int] = {}
    for node in graph.nodes:
        name = str(node.target).split(".")
        if node.op == "call_function" and len(name) > 1 and name[1].startswith("tp_seq"):
            out[name[1]] = out.get(name[1], 0) + 1
    return out


def _saved_diff(stage: torch.nn.Module, ref: torch.nn.Module) -> float:
    """This rank's state dict (what a checkpoint writes) against the single-device one."""
    want, worst = ref.state_dict(), 0.0
    for key, value in stage.state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        worst = max(worst, (value - want[key]).abs().max().item())
    return worst


def _whole(stage: torch.nn.Module, pick) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in stage.named_parameters():
        owner, _, leaf = name.rpartition(".")
        value = pick(param)
        assert value is not None, f"{name} got no gradient"
        out[name] = unsharded(stage.get_submodule(owner), leaf, value)
    return out


def _diff(whole: dict[str, torch.Tensor], ref: torch.nn.Module, pick) -> float:
    return max((whole[n] - pick(ref.get_parameter(n))).abs().max().item() for n in whole)


def checkpoint_to_one_device(root: str, three_d: str = "dp=2,tp=2,pp=2,mbs=2,gbs=8"
                             ) -> dict[str, list[float]]:
    """Checkpoints between ``three_d`` (8 ranks, gbs=8) and dp=8 (one model per rank), both
    ways, with one ``three_d`` Trainer (the costly one to build): dp=8 trains 5 steps, saving
    at step 3; ``three_d`` resumes that checkpoint for step 4 and saves; dp=8 resumes that
    one for step 5. Step 4's loss checks that the tp x pp stages loaded the single-device
    layout; step 5's, that they saved it, AdamW moments included (all runs share one
    5-step learning-rate schedule)."""
    from tessera.run import build_datasets, build_model, build_tokenizer
    from tessera.testing import tiny_run_config
    from tessera.train.checkpoint import step_dirname
    from tessera.train.trainer import Trainer

    def train(out: Path, strategy: str, until=None, **args):
        config = tiny_run_config(out, strategy, train={"max_steps": 5, **args},
                                 model={"preset": "tiny", "n_layers": 4})
        tokenizer = build_tokenizer(config)
        train_ds, val_ds = build_datasets(config, tokenizer)
        trainer = Trainer(build_model(config), config.train, train_ds, val_ds,
                          strategy=config.strategy)
        return trainer.train(until_step=until)

    root, dp = Path(root), "dp=8,tp=1,pp=1,mbs=1,gbs=8"
    straight = train(root / "dp", dp, save_steps=3)
    on_3d = train(root / "3d", three_d, until=4,
                  resume_from=str(root / "dp" / "checkpoints" / step_dirname(3)))
    back = train(root / "back", dp, resume_from=str(root / "3d" / "checkpoints" / step_dirname(4)))
    return {"straight": straight.losses, "3d_step4": on_3d.losses, "dp_step5": back.losses}


def shard_casts_shared_against_not(arch: str, text: str) -> dict[str, object]:
    """One step of ``text`` (bf16) with the micro-batches in flight sharing one 16-bit copy
    of each tp shard (shard_casts.py) and the same step again, from the same weights, with
    every micro-batch casting its own (the sharing is a context around the step: one build
    serves both): losses, gradients (this rank's shards) and the peak bytes saved for
    backward of each, the partition's estimate of that peak (with the sharing), how many
    shard reads the stages' graphs rewrote, and this rank's pipeline stage."""
    from unittest import mock

    from tessera.memory.saved_peak import SavedPeak
    from tessera.parallel.pipeline import program, shard_casts

    strategy = Strategy.parse(text)
    n = strategy.grad_accum_steps
    model = pp_checks.make_model(arch)
    mesh = Mesh(strategy, "cpu")
    plan = parallelize(model, strategy, mesh, seq_len=pp_checks.SEQ)
    engine = PipelineEngine(plan, strategy, torch.device("cpu"))
    engine.forward_backward(pp_checks.micro_batches(0, n))  # builds the stages (a capture)
    runs = {}
    for shared in (True, False):
        plan.module.zero_grad(set_to_none=True)
        with (mock.patch.object(program, "shared_shard_casts", _no_sharing) if not shared
              else contextlib.nullcontext()), SavedPeak(model.parameters()) as probe:
            out = engine.forward_backward(pp_checks.micro_batches(1, n))
        grads = {name: p.grad.to_local().clone() for name, p in plan.module.named_parameters()}
        runs[shared] = dict(loss=float(out.loss), grads=grads, peak=probe.peak)
    reads = sum(node.target is shard_casts.dtensor_local_cast
                for runner in plan.pipeline.program.get(
                    (strategy.micro_batch_size, pp_checks.SEQ), True).runners.values()
                for _, piece in runner.pieces()
                for gm in piece.module.modules() if isinstance(gm, torch.fx.GraphModule)
                for node in gm.graph.nodes)  # a sub-pipelined piece: its segments
    on, off = runs[True], runs[False]
    return {"losses": (on["loss"], off["loss"]), "peaks": (on["peak"], off["peak"]),
            "estimate": pp_checks.stage_activation_estimate(plan, strategy, n),
            "grad_diff": max((on["grads"][k] - off["grads"][k]).abs().max().item()
                             for k in on["grads"]),
            "reads": reads, "stage": mesh.rank("pp")}


@contextlib.contextmanager
def _no_sharing():
    yield
