"""2D (SUMMA) tensor parallelism inside pipeline stages: tp=4 (2 x 2 grid) x pp=2 on 8 ranks.

One launch of 8 ranks runs every check: the 2D custom ops against the eager 2D functions
(direct and through torch.export), then training parity against one device for the reference
model (1f1b), Hugging Face GPT-2 (scp with full recomputation: fused q|k|v, Conv1D, learned
positions, the embedding tied to the LM head across stages) and Llama (gpipe: RMSNorm, no
biases), one bf16 step with and without the pipeline, then checkpoints both ways between
tp=4 (2d) x pp=2 and dp=8.

Tolerances, fp32, as in test_tp_pipeline.py: 1e-5 absolute on losses (about 5.5) and on
gradients (gathered whole), over 3 AdamW steps. SUMMA sums its q = 2 partial products and the
norms' statistics over 2 ranks in another order than one device's matmul, so differences are
rounding (measured <= 1.2e-6 on gradients). Weights after 3 steps: 1e-4, because Adam divides
each gradient by its own running magnitude, so rounding on a tiny gradient becomes a relative
difference of that weight's step of lr = 1e-2 (measured <= 7.3e-5 on Llama). A lost backward
collective (what torch.export's inlining of autograd functions would cause) or a gradient
counted twice is off by 1e-3 or more on gradients and by about lr = 1e-2 on weights.

The op checks compare the custom ops with the eager functions they share their code with:
1e-6, since the same kernels run in the same order (measured 0); a wrongly wired autograd
formula (a gradient for the wrong input, a missing reduction) is off by O(1).
"""

from __future__ import annotations

import pytest

from tessera.mesh import Mesh
from tessera.strategy import Strategy
from tessera.testing import run_distributed

import pp_checks
import tp2d_pp_checks
import tp_pp_checks

TOL = 1e-5
PARAM_TOL = 1e-4
OP_TOL = 1e-6
CASES = {  # name: (model, strategy); tp=4 as a 2 x 2 grid, pp=2; mbs=2 is 1 row per grid row
    "ref_1f1b": ("ref", "tp=4,tp_mode=2d,pp=2,mbs=2,gbs=4,schedule=1f1b"),
    "gpt2_scp": ("gpt2", "tp=4,tp_mode=2d,pp=2,mbs=2,gbs=8,schedule=scp,recompute=full"),
    # Built on meta: each rank fills only its stage's 2D blocks, one block at a time.
    "llama_meta_gpipe": ("llama-meta", "tp=4,tp_mode=2d,pp=2,mbs=2,gbs=4,schedule=gpipe"),
}
BF16 = ["tp=4,tp_mode=2d,pp=2,mbs=2,gbs=4,precision=bf16",  # through the pipeline's ops
        "dp=2,tp=4,tp_mode=2d,mbs=2,gbs=8,precision=bf16"]  # the eager functions, pp=1
BF16_LOSS_TOL, BF16_NORM_RTOL = 1e-3, 1e-2
OPS = ["tessera.summa_add_bias.default", "tessera.summa_embedding.default",
       "tessera.summa_linear.default", "tessera.summa_norm.default"]


def _eight_ranks(rank, world_size, root):
    mesh = Mesh(Strategy.parse(CASES["ref_1f1b"][1]), "cpu")
    out = {"ops": tp2d_pp_checks.op_parity(mesh)}
    out.update({name: tp_pp_checks.parity(arch, text) for name, (arch, text) in CASES.items()})
    out["bf16"] = {text: tp2d_pp_checks.bf16_step(text) for text in BF16}
    out["ckpt"] = tp_pp_checks.checkpoint_to_one_device(
        root, "tp=4,tp_mode=2d,pp=2,mbs=2,gbs=8")
    out["estimate"] = pp_checks.estimate_against_saved("llama", "tp=4,tp_mode=2d,pp=2",
                                                       ("bf16",))
    return out


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2d_pipeline")
    return run_distributed(_eight_ranks, world_size=8, args=(str(root),), timeout=600)


def test_summa_ops_equal_the_eager_functions_and_survive_export(eight):
    for rank, out in enumerate(eight):
        ops = out["ops"]
        assert ops["grads"] == 8, ops  # every floating input got a gradient
        assert ops["direct"] < OP_TOL, (rank, ops)
        assert ops["exported"] < OP_TOL, (rank, ops)
        # One node per layer; no collective was traced into the graph.
        assert ops["targets"] == OPS, ops
        assert not any("c10d" in t or "broadcast" in t for t in ops["other_targets"]), ops
        # The partitioner prices a SUMMA linear by its per-rank FLOPs (2 m C O / q).
        assert ops["flops"] == ops["flops_expected"], ops
        assert ops["comm"] == (ops["comm_expected"], 2 * ops["comm_expected"]), ops


def test_tp4_2d_runs_in_bf16_like_one_device(eight):
    # SUMMA runs its products in autocast's dtype (both operands cast: it accumulates in
    # place) and its backward in the weights' dtype; before, 2D crashed in bf16 on a dtype
    # mismatch. Tolerances: bf16 keeps 8 mantissa bits (~4e-3 relative per product) and the
    # grid rounds other partial sums than one device; measured 1.7e-5 (loss), 1.6e-4 (norm).
    for rank, out in enumerate(eight):
        for text, got in out["bf16"].items():
            assert got["loss"] < BF16_LOSS_TOL, (rank, text, got)
            assert got["norm_rel"] < BF16_NORM_RTOL, (rank, text, got)


def test_a_2d_stage_activation_estimate_is_what_a_pipeline_step_saves(eight):
    # As test_pipeline_parity's check of plain stages, on 2 x 2 SUMMA stages of HF Llama:
    # the estimate leaves out only the loss's int64 targets, the embedding's row of ids
    # (each 1 x 64 int64 per micro-batch here) and the loss's scalar. Before the fake run
    # gave the SUMMA linear's output autocast's dtype (its fake cannot see autocast), the
    # bf16 estimate was 1.46x what is saved.
    unestimated = 2 * 2 * 64 * 8 + 4
    for rank, out in enumerate(eight):
        for precision, (estimate, saved) in out["estimate"].items():
            assert abs(estimate - saved) <= unestimated, (rank, precision, estimate, saved)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp4_2d_pp2_equals_one_device(eight, name):
    for rank, out in enumerate(eight):
        got = out[name]
        assert got["features"] == ["tensor_parallel_2d", "pipeline"], got["features"]
        assert got["loss"] < TOL, (name, rank, got)
        assert got["grad"] < TOL, (name, rank, got)
        assert got["param"] < PARAM_TOL, (name, rank, got)
        # Saved in the single-device layout (GPT-2's fused q|k|v unpermuted): same weights.
        assert got["saved"] < PARAM_TOL, (name, rank, got)
        # From meta, the other stage's blocks are never materialised.
        assert (got["shard_elements_left_on_meta"] > 0) == ("meta" in name), (name, rank, got)


def test_tp4_2d_pp2_loads_and_saves_the_single_device_checkpoint(eight):
    ckpt = eight[0]["ckpt"]
    assert len(ckpt["straight"]) == 5 and len(ckpt["3d_step4"]) == len(ckpt["dp_step5"]) == 1
    assert ckpt["3d_step4"] == pytest.approx(ckpt["straight"][3:4], abs=TOL)
    assert ckpt["dp_step5"] == pytest.approx(ckpt["straight"][4:], abs=TOL)
