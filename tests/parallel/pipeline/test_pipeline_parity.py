"""Pipeline parity with one device, scp recomputation placement, pp=2 <-> pp=1 checkpoints.

Two launches: 2 ranks (every schedule at pp=2 on the reference model, HF GPT-2 and Llama,
and HF Qwen2 and Phi, which the pipeline takes with no policy of theirs;
the timeline of scp; the checkpoint round trip through the Trainer; a model built on the meta
device, through the Trainer with chunk memory and init_from) and 4 ranks (every schedule at
pp=4, dp=2 x pp=2 for the three models).

The "bigvocab" runs (a 4096-token vocabulary) have their LM head sliced over the vocabulary
across the last stages (pipeline/head.py); they also compare an eval-mode loss.

Tolerance: fp32, 1e-5 absolute on losses (about 5.5) and on gradients, over 3 AdamW steps. A
stage runs the same aten ops as the single-device model on the same micro-batch, and gradients
accumulate over micro-batches in the same order, so most differences are exactly 0; what is
left is rounding in the tied-weight and dp all-reduces (sums in another order, ~1e-8) and in
the global gradient norm (a sum of per-stage partial sums). A wrong boundary, a missing
tied-weight sync or a double-counted gradient is off by 1e-3 or more. The sliced head's
log-sum-exp merge rounds differently from one cross-entropy kernel, and a weight held as
rows (pipeline/rows.py) sums its gradient in another order: measured up to 1.9e-6 on losses
and 3.3e-6 to 5.0e-6 on gradients.
"""

from __future__ import annotations

import pytest

from tessera.testing import run_distributed

import pp_checks

TOL = 1e-5
PP2 = {  # name: (model, strategy); 4 micro-batches per step
    "ref_gpipe": ("ref", "pp=2,mbs=2,gbs=8,schedule=gpipe"),
    "ref_1f1b_half_recompute": ("ref", "pp=2,mbs=2,gbs=8,schedule=1f1b,recompute=0.5"),
    "ref_interleaved": ("ref", "pp=2,mbs=2,gbs=8,schedule=interleaved"),
    "ref_scp": ("ref", "pp=2,mbs=2,gbs=8,schedule=scp,recompute=full"),
    "gpt2_scp": ("gpt2", "pp=2,mbs=2,gbs=8,schedule=scp,recompute=full"),
    "llama_interleaved": ("llama", "pp=2,mbs=2,gbs=8,schedule=interleaved"),
    # A 4096-token vocabulary: the LM head outweighs a stage and is sliced (pipeline/head.py).
    "ref_bigvocab_sliced_head": ("ref-bigvocab", "pp=2,mbs=2,gbs=8,schedule=1f1b"),
    # Built on the meta device: each rank materialises only its stages' weights.
    "gpt2_meta_1f1b": ("gpt2-meta", "pp=2,mbs=2,gbs=8,schedule=1f1b"),
    # Hugging Face architectures captured with no policy of theirs (pp_checks.OTHER_HF).
    "qwen2_1f1b": ("qwen2", "pp=2,mbs=2,gbs=8,schedule=1f1b"),
    "phi_interleaved": ("phi", "pp=2,mbs=2,gbs=8,schedule=interleaved"),
}
PP4 = {
    "ref_pp4_gpipe": ("ref", "pp=4,mbs=2,gbs=8,schedule=gpipe"),
    "ref_pp4_1f1b": ("ref", "pp=4,mbs=2,gbs=8,schedule=1f1b"),
    "ref_pp4_interleaved": ("ref", "pp=4,mbs=2,gbs=8,schedule=interleaved"),
    "ref_pp4_scp": ("ref", "pp=4,mbs=2,gbs=8,schedule=scp,recompute=0.5"),
    "gpt2_dp2_pp2": ("gpt2", "dp=2,pp=2,mbs=2,gbs=16,schedule=1f1b"),
    "llama_dp2_pp2": ("llama", "dp=2,pp=2,mbs=2,gbs=16,schedule=gpipe,recompute=full"),
    # On meta and interleaved: ranks holding only head rows never materialise the weight.
    "gpt2_bigvocab_meta_pp4_sliced_head": ("gpt2-bigvocab-meta",
                                           "pp=4,mbs=2,gbs=8,schedule=interleaved"),
    "llama_bigvocab_pp4_sliced_head": ("llama-bigvocab",
                                       "pp=4,mbs=2,gbs=8,schedule=gpipe,recompute=full"),
    "llama_meta_dp2_pp2": ("llama-meta", "dp=2,pp=2,mbs=2,gbs=16,schedule=scp,recompute=full"),
}
ON_META = ("gpt2_meta_1f1b", "llama_meta_dp2_pp2", "gpt2_bigvocab_meta_pp4_sliced_head")
FINER = ("llama_interleaved", "ref_pp4_interleaved", "llama_dp2_pp2")
SLICED = ("ref_bigvocab_sliced_head", "gpt2_bigvocab_meta_pp4_sliced_head",
          "llama_bigvocab_pp4_sliced_head")


def _two_ranks(rank, world_size, root):
    out = {name: pp_checks.parity(arch, text) for name, (arch, text) in PP2.items()}
    out["ckpt"] = pp_checks.checkpoint_round_trip(root)
    out["meta_trainer"] = pp_checks.meta_trainer_round_trip(root)
    out["budget"] = pp_checks.budget_trainer(root)
    out["estimate"] = {arch: pp_checks.estimate_against_saved(arch) for arch in ("ref", "llama")}
    return out


def _four_ranks(rank, world_size):
    out = {name: pp_checks.parity(arch, text) for name, (arch, text) in PP4.items()}
    out["estimate_sp"] = pp_checks.estimate_against_saved("llama", "sp=2,pp=2", ("fp32",))
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    return run_distributed(_two_ranks, world_size=2, args=(str(root),), timeout=400)


@pytest.fixture(scope="module")
def four():
    return run_distributed(_four_ranks, world_size=4, timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PP2))
def test_pp2_schedules_equal_one_device(two, name):
    for rank_out in two:
        assert rank_out[name]["loss"] <= TOL, rank_out[name]
        assert rank_out[name]["grad"] <= TOL, rank_out[name]
    assert two[0][name]["loss_value"] == two[1][name]["loss_value"]  # every rank reports it


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PP4))
def test_pp4_and_dp2_pp2_equal_one_device(four, name):
    for rank_out in four:
        assert rank_out[name]["loss"] <= TOL, rank_out[name]
        assert rank_out[name]["grad"] <= TOL, rank_out[name]


@pytest.mark.slow
def test_a_heavy_lm_head_is_sliced_across_stages(two, four):
    # Without this the sliced-head parity runs above could pass with the head whole.
    for name in SLICED:
        rank_out = (two if name in PP2 else four)[0][name]
        assert rank_out["head_slices"] > 1 and rank_out["head_stages"] >= 2, rank_out
    assert two[0]["ref_gpipe"]["head_slices"] == 1  # a 256-token head stays whole


@pytest.mark.slow
def test_stages_reading_only_head_slices_hold_only_those_rows(two, four):
    # pipeline/rows.py: one rank (the home) holds the head weight whole and checkpoints it;
    # every other rank reading it only through vocabulary slices holds just their rows, with
    # no state-dict key. The parity runs above then show the rows are refreshed from the
    # home and their gradients reach it.
    for name in SLICED:
        ranks = [r[name] for r in (two if name in PP2 else four)]
        holders = [(r["rows_held"], set(r["keys"])) for r in ranks if r["rows_held"]]
        assert holders, (name, [r["rows_held"] for r in ranks])
        for rows_held, keys in holders:
            for weight, shape in rows_held.items():
                assert shape[0] < pp_checks.BIG_VOCAB and weight not in keys, (name, shape)
        if name in ON_META:  # the weight itself stays on meta where only rows are held
            for r in ranks:
                for shape in r["rows_held"].values():
                    assert r["params_left_on_meta"] >= pp_checks.BIG_VOCAB * shape[1], name
        union = set().union(*(r["keys"] for r in ranks))
        assert union == set(pp_checks.make_model(name_arch(name)).state_dict())


def name_arch(run: str) -> str:
    return (PP2 | PP4)[run][0]


@pytest.mark.slow
def test_uneven_splits_cut_inside_attention_or_the_mlp(two, four):
    # Where block-level cuts leave the slowest stage > 1.05 x the mean, the partitioner cuts
    # inside attention / the MLP; these parity runs above are the ones that do (finer=True).
    for name in FINER:
        rank_out = (two if name in PP2 else four)[0][name]
        assert rank_out["finer_cuts"] >= 1, (name, rank_out["finer_cuts"])
    assert two[0]["gpt2_scp"]["finer_cuts"] == 0  # balanced enough at block boundaries


@pytest.mark.slow
def test_stages_hold_disjoint_shares_with_original_names(two):
    keys = [set(r["gpt2_scp"]["keys"]) for r in two]
    full = set(pp_checks.make_model("gpt2").state_dict())
    assert keys[0] | keys[1] == full and keys[0] != keys[1]
    # GPT-2 ties the LM head to the token embedding: first and last stage both hold it.
    tied = {"transformer.wte.weight", "lm_head.weight"}
    assert tied <= keys[0] and tied <= keys[1]
    assert len((keys[0] & keys[1]) - tied) == 0


@pytest.mark.slow
def test_scp_moves_recomputation_off_the_critical_path(two):
    base, scp = two[0]["ref_1f1b_half_recompute"]["timeline"], two[0]["ref_scp"]["timeline"]
    last_stage = two[1]["ref_scp"]["timeline"]
    # 1F1B with recomputation: every micro-batch of stage 0 recomputes after its gradient.
    recomputed = [(s, m) for k, s, m in base if k == "R"]
    assert recomputed == [(0, m) for m in range(4)]
    for s, m in recomputed:
        assert base.index(("W", s, m)) < base.index(("R", s, m))
    # scp: stages keep micro-batches whole (the last stage: skips recomputation) only within
    # 1F1B's memory, and a recomputing micro-batch starts *before* its gradient arrives.
    keep = two[0]["ref_scp"]["keep"]
    for rank, timeline in ((0, scp), (1, last_stage)):
        recomputed = [(s, m) for k, s, m in timeline if k == "R"]
        assert recomputed == [(rank, m) for m in range(4 - min(keep[rank], 4))]
        for s, m in recomputed:
            assert timeline.index(("R", s, m)) < timeline.index(("W", s, m))
    assert keep[0] <= 1 and keep[1] in (0, 4)  # the last stage: all or none
    assert any(k == "R" for k, _, _ in two[1]["ref_1f1b_half_recompute"]["timeline"])


@pytest.mark.slow
def test_scp_keeps_the_last_micro_batches_of_each_stage_at_pp4(four):
    keeps = [rank_out["ref_pp4_scp"]["keep"][stage] for stage, rank_out in enumerate(four)]
    assert all(k <= 4 - 1 - s for s, k in enumerate(keeps[:3])) and keeps[3] in (0, 4)
    assert any(keeps)  # half recomputation leaves room under 1F1B's peak to keep some
    for stage, rank_out in enumerate(four):
        recomputed = sorted(m for k, s, m in rank_out["ref_pp4_scp"]["timeline"] if k == "R")
        # stage s keeps its last keep[s] (at most S-1-s; the last stage all or none)
        assert recomputed == list(range(4 - keeps[stage])), (stage, recomputed)


@pytest.mark.slow
def test_checkpoints_load_across_pp2_and_pp1(two):
    ckpt = two[0]["ckpt"]
    assert len(ckpt["pp2_first"]) == 3
    # Trainer-level parity: pp=2 equals dp=2 (the same global batch) over the first 3 steps.
    for a, b in zip(ckpt["pp2_first"], ckpt["dp2_first"]):
        assert abs(a - b) <= TOL
    # Step 4 after loading the pp=2 checkpoint: the same at pp=2 and at pp=1 (dp=2).
    assert len(ckpt["pp1_step4"]) == 1 and len(ckpt["pp2_step4"]) == 1
    assert abs(ckpt["pp1_step4"][0] - ckpt["pp2_step4"][0]) <= TOL
    # A dp=2 checkpoint (the same 3 steps, within TOL) resumed at pp=2: step 4 agrees too.
    assert len(ckpt["pp2_step4_from_pp1"]) == 1
    assert abs(ckpt["pp2_step4_from_pp1"][0] - ckpt["pp1_step4"][0]) <= TOL
    assert two[1]["ckpt"]["pp2_step4"] == ckpt["pp2_step4"]  # the last stage's loss, on all
    # Below ln(4096) = 8.3, the loss of a uniform guess over the 4096-token vocabulary.
    assert ckpt["eval_pp2"] and all(4.0 < v < 8.0 for v in ckpt["eval_pp2"])
    # The second stage held only its rows of the tied head (rows.py), refreshed on resume.
    assert not ckpt["rows_held"] and two[1]["ckpt"]["rows_held"], two[1]["ckpt"]


@pytest.mark.slow
def test_a_meta_model_is_materialised_per_stage(two, four):
    # The parity runs ON_META above start from a model built on the meta device (the
    # reference materialises all of it with the same per-name seeds): each rank leaves the
    # weights of the other stages on meta, so it never holds the whole model.
    for name in ON_META:
        for rank_out in (two if name in PP2 else four):
            assert rank_out[name]["params_left_on_meta"] > 0, (name, rank_out)


@pytest.mark.slow
def test_trainer_materialises_and_loads_only_its_stages(two):
    # pp=2 x chunk memory, init_from a saved model: the meta-device model trains exactly like
    # the one given on the device (same ops, same weights: equal, not merely close).
    runs = two[0]["meta_trainer"]
    assert len(runs["on_meta"]) == 3 and runs["on_meta"] == runs["on_device"]
    assert runs["on_meta_eval"] == runs["on_device_eval"]
    # dp=2: the layout materialises the whole model first, with the same per-name seeds.
    assert len(runs["dp_on_meta"]) == 2 and runs["dp_on_meta"] == runs["dp_materialised_first"]
    for rank_out in two:
        left = rank_out["meta_trainer"]["params_left_on_meta"]
        assert 0 < left < rank_out["meta_trainer"]["total_params"]
    # save_model gathers every stage's share to rank 0 (it wrote rank 0's stages only before)
    saved = runs["saved"]
    assert saved["complete"] and saved["keys_equal"] and saved["max_diff"] == 0.0
    assert saved["hf_reloaded_params"] == saved["hf_params"]  # GPT-2 from meta, reloaded


@pytest.mark.slow
def test_stage_activation_estimate_is_what_a_pipeline_step_saves(two):
    # The estimate is the fake run of the graph the stages run, times the micro-batches
    # 1F1B holds, plus fp32 logits on the last stage. What it leaves out is the loss's
    # int64 targets and its scalars (1 KB here: the targets, the fp32 total weight, the int64
    # label count it divides by, and the step's fp32 loss weights, one per micro-batch of
    # the 4, which the weighted loss keeps), so it must be within that, fp32 and bf16,
    # also where a stage's input is cast once for several readers (HF Llama's last stage
    # starts after a norm: its q, k and v projections share the bf16 copy of their input),
    # and where stage 0's two micro-batches in flight share one bf16 copy of each weight
    # (PipelineProgram.step_casts; a copy each would be 196,608 bytes more there).
    loss_extras = pp_checks.MBS * pp_checks.SEQ * 8 + 4 + 8 + 4 * 4
    for rank_out in two:
        for arch, by_precision in rank_out["estimate"].items():
            for precision, (estimate, saved) in by_precision.items():
                assert abs(estimate - saved) <= loss_extras, (arch, precision, estimate, saved)
            # At 128 tokens per micro-batch bf16 differs from fp32 (the weights' 16-bit
            # copies against halved activations).
            assert by_precision["bf16"][1] != by_precision["fp32"][1], (arch, by_precision)


@pytest.mark.slow
def test_a_sequence_parallel_stage_estimate_is_what_a_pipeline_step_saves(four):
    # sp=2 x pp=2 (ring attention as one custom op, each rank 32 of the 64 tokens): within
    # the loss's targets too. Before the op's fake output was made contiguous as the real
    # one is, the estimate missed the output projection's copy of it (4.5% under).
    loss_extras = pp_checks.MBS * pp_checks.SEQ * 8 + 4
    for rank, out in enumerate(four):
        for precision, (estimate, saved) in out["estimate_sp"].items():
            assert abs(estimate - saved) <= loss_extras, (rank, precision, estimate, saved)


@pytest.mark.slow
def test_a_stage_memory_budget_chooses_each_stages_recomputation(two):
    out = two[0]["budget"]
    assert out["need"][1.0] < out["budget"] < out["need"][0.0], out
    # Stage 0 holds two micro-batches in flight, stage 1 one: the earlier stage recomputes
    # at least as much, and something is recomputed (the budget is under the no-recompute
    # need) but not everything (it is over the full-recomputation need).
    first, last = out["ratios"]
    assert first >= last and 0 < first + last < 2, out["ratios"]
    assert two[1]["budget"]["ratios"] == out["ratios"]  # both ranks chose alike
    # The chosen ratios run exactly as the same ratios given in the strategy.
    assert len(out["chosen"]) == 3 and out["chosen"] == out["given"]
    assert "stage_memory_budget" in out["refused"] and "fullest stage needs" in out["refused"]
    # Partitioned at the run's shape, whose capture the training stages then ran (one
    # torch.export per Trainer, not a second one at the run's shape).
    assert out["partition_shape"] == out["run_shape"] and out["reused"], out
