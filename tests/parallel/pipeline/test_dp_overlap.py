"""Data-parallel averaging overlapped with the last backward under dp x pp (overlap.py).

One 4-rank launch (dp=2 x pp=2). Unlike the parity runs of test_pipeline_parity.py, the two
dp ranks train on different micro-batches, so a missing, partial or misplaced average shows:
the reference is one device running both ranks' micro-batches in one step (the mean over all
of them is the dp average of the per-rank means). Buckets are made small (4 KiB, then 32 KiB)
so that the tiny models have many and most launch inside the backward.

Tolerance: fp32, 1e-5 on gradients (about 1e-2 in size here): the pipeline sums the same
products as the single device, only the dp all-reduce and the tied-weight sum add in another
order (~1e-8). A bucket averaged before its last accumulation is off by a whole micro-batch's
gradient (1e-3 or more).

Overlap on and off must give the same bits: both average the same two numbers per element.
"""

from __future__ import annotations

import pytest
import torch

from tessera.mesh import Mesh
from tessera.parallel import parallelize
from tessera.parallel.pipeline import PipelineEngine
from tessera.parallel.plan import Parallelized
from tessera.strategy import Strategy
from tessera.testing import run_distributed
from tessera.train.engine import Engine

import pp_checks

TOL = 1e-5
SMALL_BUCKETS = (4096, 32768)
# micro-batches per dp rank in each step: a new count starts a new recording step
COUNTS = (4, 4, 2, 4)
CASES = {
    "ref_1f1b": ("ref", "dp=2,pp=2,mbs=2,gbs=16,schedule=1f1b"),
    "llama_interleaved_recompute": ("llama",
                                    "dp=2,pp=2,mbs=2,gbs=16,schedule=interleaved,recompute=full"),
    "gpt2_scp": ("gpt2", "dp=2,pp=2,mbs=2,gbs=16,schedule=scp,recompute=full"),
    # a sliced LM head: the home's weight gets its rows' gradients after the drain
    "ref_bigvocab_rows": ("ref-bigvocab", "dp=2,pp=2,mbs=2,gbs=16,schedule=1f1b"),
}
# A frozen weight cannot take a gradient hook, and gets no gradient (the optimizer skips it).
FROZEN = {"ref_1f1b": "blocks.3.mlp_norm.weight"}


def _run(name: str, arch: str, text: str, overlap: bool) -> dict:
    strategy = Strategy.parse(text)
    cpu = torch.device("cpu")
    ref, model = pp_checks.make_model(arch), pp_checks.make_model(arch)
    frozen = FROZEN.get(name)
    if frozen:
        ref.get_parameter(frozen).requires_grad_(False)
    ref_engine = Engine(Parallelized(ref, ref, None), Strategy(), cpu)
    mesh = Mesh(strategy, "cpu")
    plan = parallelize(model, strategy, mesh)
    if frozen:  # frozen after parallelize, before the first step: still kept out of hooks
        model.get_parameter(frozen).requires_grad_(False)
    sync = plan.pipeline.grad_sync
    sync.overlap, sync.bucket_bytes = overlap, SMALL_BUCKETS
    engine = PipelineEngine(plan, strategy, cpu)
    vocab, dp_rank = pp_checks.split_arch(arch)[1], mesh.rank("dp")
    diffs, launched, grads = [], [], []
    for step, count in enumerate(COUNTS):
        per_rank = [pp_checks.micro_batches(10 * step + r, count, vocab) for r in range(2)]
        engine.forward_backward(per_rank[dp_rank])
        ref_engine.forward_backward(per_rank[0] + per_rank[1])
        diffs.append(max((_grad_diff(p, ref.get_parameter(key))
                          for key, p in plan.module.named_parameters()), default=0.0))
        launched.append(sync.buckets_launched_in_backward)
        grads.append({key: p.grad.clone() for key, p in plan.module.named_parameters()
                      if p.grad is not None})
        with torch.no_grad():  # the same plain step on both, so later steps differ
            for p in [*plan.module.parameters(), *ref.parameters()]:
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
        for p in [*plan.module.parameters(), *ref.parameters()]:
            p.grad = None
    average = sync._average
    return {"diff": diffs, "launched": launched, "grads": grads,
            "params": sum(1 for _ in plan.module.parameters()),
            "buckets": len(average.buckets) if average is not None else 0,
            "held_back": len(sync.averaged_after_drain),
            "holds_frozen": any(key == FROZEN.get(name) for key, _ in
                                plan.module.named_parameters())}


def _grad_diff(param, ref_param) -> float:
    if ref_param.grad is None:  # frozen: no gradient on either side (inf flags one)
        return 0.0 if param.grad is None else float("inf")
    return (param.grad - ref_param.grad).abs().max().item()


def _four_ranks(rank, world_size):
    out = {}
    for name, (arch, text) in CASES.items():
        on, off = _run(name, arch, text, True), _run(name, arch, text, False)
        out[name] = {"diff_on": on["diff"], "diff_off": off["diff"],
                     "launched_on": on["launched"], "launched_off": off["launched"],
                     "buckets": on["buckets"], "held_back": on["held_back"],
                     "params": on["params"], "holds_frozen": on["holds_frozen"],
                     "bitwise_equal": all(torch.equal(a[k], b[k]) for a, b in
                                          zip(on["grads"], off["grads"]) for k in a)}
    return out


@pytest.fixture(scope="module")
def four():
    return run_distributed(_four_ranks, world_size=4, timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_overlapped_average_equals_one_device_on_different_data(four, name):
    for out in four:
        case = out[name]
        assert max(case["diff_on"]) <= TOL, case["diff_on"]
        assert max(case["diff_off"]) <= TOL, case["diff_off"]
        assert case["bitwise_equal"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_buckets_launch_inside_the_backward_once_counts_are_known(four, name):
    holding = [out[name] for out in four if out[name]["params"]]
    assert len(holding) >= 2  # a rank holding only a sliced head's rows has no weights
    for case in holding:
        assert case["buckets"] >= 3, case
        launched = case["launched_on"]
        # Steps 0 and 2 are the first with their micro-batch count: they only count.
        assert launched[0] == 0 and launched[2] == 0, launched
        assert launched[1] >= 1 and launched[3] >= 1, launched
        assert case["launched_off"] == [0] * len(COUNTS)


@pytest.mark.slow
def test_only_row_homes_wait_for_the_drain_and_frozen_weights_get_no_gradient(four):
    # ref ties embedding and head: the tied weight is averaged in a bucket, then summed over
    # pp. The bigvocab head's home waits for its rows' gradients; a frozen weight has no
    # hook and no gradient (its diff above is inf if the pipeline gave it one).
    for out in four:
        assert out["llama_interleaved_recompute"]["held_back"] == 0
        assert out["gpt2_scp"]["held_back"] == 0
        assert out["ref_1f1b"]["held_back"] == 0  # the frozen weight is not averaged at all
    assert any(out["ref_1f1b"]["holds_frozen"] for out in four)
    assert any(out["ref_bigvocab_rows"]["held_back"] == 1 for out in four)  # the head's home
