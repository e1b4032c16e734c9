"""dp x tp x pp (2 x 2 x 2 on 8 CPU workers) equals one device; its checkpoints are single-device.

One launch of 8 ranks runs every check: the reference model (1f1b with Megatron sequence
parallelism, and 1f1b sub-pipelined), Hugging Face GPT-2 (scp with recomputation,
fused q|k|v, tied embedding across stages: built on meta with Megatron sequence parallelism,
and sub-pipelined), Gemma 3 and Cohere with their own q/k norms (Cohere, gpipe, with Megatron
sequence parallelism), then the checkpoint round trip, Llama in bf16 with and without the
shared 16-bit shard copies, and the activation estimate of Llama's stages (with and without
Megatron sequence parallelism) against what a step keeps.

Each dp rank trains on its own micro-batches, one device on all of them (tp_pp_checks.parity),
so the data-parallel average over DTensor shards is exercised.

Tolerance, fp32: 1e-5 absolute on losses (about 5.5); on the first step's gradients (gathered
whole) 1e-6, on later steps' 3e-5. Tensor parallelism sums partial products over 2 ranks in
another order than one device's matmul, and the dp average adds two ranks' means where one
device takes one mean, so the first step's gradients differ by rounding (measured <= 1.2e-7).
Later gradients are taken at weights AdamW has already moved apart (below): measured up to
7.0e-6 on Gemma 3 (1.9e-5 on plain Llama stages, a case since folded into Cohere's). Weights
after 3 steps: 1e-4, because Adam divides each gradient by its own running magnitude, so a
1e-9 rounding difference on a gradient of 1e-6 becomes a 1e-3 relative difference of that
weight's step (lr 1e-2: 1e-5 per step; measured <= 1.7e-5, 4.3e-5 on plain Llama). A lost backward
all-reduce (what torch.export's inlining of autograd Functions would cause) or a gradient
counted twice is off by 1e-3 or more on gradients and by about lr = 1e-2 on weights. The
checkpoint test compares losses at 1e-5.
"""

from __future__ import annotations

import pytest

from tessera.testing import run_distributed

import pp_checks
import tp_pp_checks

TOL = 1e-5
FIRST_GRAD_TOL = 1e-6
GRAD_TOL = 3e-5
PARAM_TOL = 1e-4
CASES = {  # name: (model, strategy); dp=2 x tp=2 x pp=2, 2 micro-batches per dp rank
    # Megatron sequence parallelism (tensor/ops_seq.py): the reference model scatters in its
    # embedding and gathers in its head; Hugging Face models at their first and after their
    # last decoder layer (GPT-2 with recomputation, which runs the gathers again; Cohere's
    # separate q, k, v and gate, up share one re-gather per layer in backward, its one norm
    # feeding both blocks). Plain 1d stages: the sub-pipelined cases, Gemma 3, the
    # checkpoints and bf16 Llama below.
    "ref_1f1b_seq": ("ref", "dp=2,tp=2,pp=2,mbs=2,gbs=8,schedule=1f1b,tp_seq=on"),
    # Built on meta: each rank materialises only its stages' shards, one block at a time.
    "gpt2_meta_scp_seq": ("gpt2-meta", "dp=2,tp=2,pp=2,mbs=2,gbs=8,schedule=scp,"
                                       "recompute=full,tp_seq=on"),
    # Sub-pipelined: each micro-batch of 2 runs as two interleaved halves of 1.
    "ref_1f1b_subpipe": ("ref", "dp=2,tp=2,pp=2,mbs=2,gbs=8,schedule=1f1b,tp_overlap=subpipe"),
    # ... with recomputation (a no-grad forward, then the interleaved one again), the tied
    # embedding across stages and the vocabulary-parallel loss.
    "gpt2_scp_subpipe": ("gpt2", "dp=2,tp=2,pp=2,mbs=2,gbs=8,schedule=scp,recompute=full,"
                                 "tp_overlap=subpipe"),
    # ... and with Megatron sequence parallelism: the halves take turns at its all-gathers and
    # reduce-scatters (since 2026-11-29).
    "ref_1f1b_subpipe_seq": ("ref", "dp=2,tp=2,pp=2,mbs=2,gbs=8,schedule=1f1b,tp_seq=on,"
                                    "tp_overlap=subpipe"),
    # Norms of their own (pp_checks.POLICY_HF): Gemma 3's q/k norm gradient summed over tp
    # inside the captured stages, Cohere's per-head q/k norms split by heads.
    "gemma3_1f1b": ("gemma3_text", "dp=2,tp=2,pp=2,mbs=2,gbs=8,schedule=1f1b"),
    "cohere_qk_gpipe_seq": ("cohere_qk", "dp=2,tp=2,pp=2,mbs=2,gbs=8,schedule=gpipe,"
                                         "tp_seq=on"),
}

# bf16, 4 micro-batches per dp rank: 2 in flight on stage 0 (1f1b), 1 on stage 1.
SHARD_CASTS = {"plain": "dp=2,tp=2,pp=2,mbs=2,gbs=16,schedule=1f1b,precision=bf16",
               "subpipe": "dp=2,tp=2,pp=2,mbs=2,gbs=16,schedule=1f1b,precision=bf16,"
                          "tp_overlap=subpipe"}


def _eight_ranks(rank, world_size, root):
    out = {name: tp_pp_checks.parity(arch, text) for name, (arch, text) in CASES.items()}
    out["ckpt"] = tp_pp_checks.checkpoint_to_one_device(root)
    # Llama's plain stages: the estimate is checked on the shard-cast run of the same layout.
    out["estimate_seq"] = pp_checks.estimate_against_saved("llama", "dp=2,tp=2,pp=2,tp_seq=on",
                                                           ("bf16",))["bf16"]
    # HF Llama with mbs=2: sub-pipelined halves of 1 row, whose capture export numbers
    # otherwise (program.stage_groups matches it by position).
    out["shard_casts"] = {name: tp_pp_checks.shard_casts_shared_against_not("llama", text)
                          for name, text in SHARD_CASTS.items()}
    return out


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_pipeline")
    return run_distributed(_eight_ranks, world_size=8, args=(str(root),), timeout=600)


@pytest.mark.parametrize("name", sorted(CASES))
def test_dp2_tp2_pp2_equals_one_device(eight, name):
    for rank, out in enumerate(eight):
        got = out[name]
        split = ["tp_sequence_parallel"] if name.endswith("_seq") else []
        assert got["features"] == ["tensor_parallel_1d", *split, "pipeline"], got["features"]
        assert got["loss"] < TOL, (name, rank, got)
        assert got["grad_first_step"] < FIRST_GRAD_TOL, (name, rank, got)
        assert got["grad"] < GRAD_TOL, (name, rank, got)
        assert got["param"] < PARAM_TOL, (name, rank, got)
        # Saved in the single-device layout (GPT-2's fused q|k|v unpermuted): same weights.
        assert got["saved"] < PARAM_TOL, (name, rank, got)
        assert got["one_capture"], (name, rank)
        # From meta, the other stage's shards are never materialised.
        assert (got["shard_elements_left_on_meta"] > 0) == ("meta" in name), (name, rank, got)


def test_megatron_sequence_parallel_stages_pass_sequence_shards(eight):
    # Between the blocks every rank holds T/tp tokens: stage 0 sends (mbs, T/2, C), not
    # (mbs, T, C), and the captured graph holds the ops of tensor/ops_seq.py in place of
    # the all-reduces: per layer two block inputs gathered (one in a parallel layer), two
    # outputs reduce-scattered; the reference model's embedding reduce-scatters and its head
    # gathers, a Hugging Face model scatters once and gathers once. 4 layers, whose column
    # layers keep the shard:
    # GPT-2's fused q|k|v and its MLP's input, the reference model's q, k, v and MLP input
    # (and its head), Cohere's q, k, v and gate, up (its attention and MLP read one norm's
    # output, gathered once for both: one gather a layer, not two).
    want = {"ref_1f1b_seq": {"tp_seq_gather": 9, "tp_seq_reduce_scatter": 9,
                             "tp_seq_linear": 17},
            "gpt2_meta_scp_seq": {"tp_seq_gather": 8, "tp_seq_reduce_scatter": 8,
                                  "tp_seq_linear": 8, "tp_seq_scatter": 1,
                                  "tp_seq_gather_whole": 1},
            "cohere_qk_gpipe_seq": {"tp_seq_gather": 4, "tp_seq_reduce_scatter": 8,
                                    "tp_seq_linear": 20, "tp_seq_scatter": 1,
                                    "tp_seq_gather_whole": 1}}
    for rank, out in enumerate(eight):
        assert {name: out[name]["seq_ops"] for name in want} == want, rank
        for name in want:
            assert [s[:2] for s in out[name]["boundary"]] == [(2, 32)], (rank, name, out[name])
        for name in ("ref_1f1b_subpipe", "gemma3_1f1b"):
            assert out[name]["seq_ops"] == {}, (rank, name, out[name]["seq_ops"])
            assert [s[:2] for s in out[name]["boundary"]] == [(2, 64)], (rank, name, out[name])


def test_a_tp_stage_activation_estimate_is_what_a_pipeline_step_saves(eight):
    # As test_pipeline_parity's check of plain stages, on 1d tensor-parallel stages of HF
    # Llama in bf16 (weights and activations sharded; autocast's copies of the shards): the
    # estimate leaves out only the loss's per-token tensors (its 2 x 64 int64 targets and
    # a few per-token values of the vocabulary-parallel loss: 1,796 bytes measured).
    # Under Megatron sequence parallelism too (tp_seq=on), where the norms, the residual
    # stream and the column layers' kept inputs (tensor/ops_seq.tp_seq_linear) are the
    # rank's half of the tokens: the stage keeps about 0.7x (measured 0.66x on stage 0, 0.70x
    # on stage 1; the attention and MLP insides are split by heads either way).
    # Plain stages: the shard-cast runs of the same layout (4 micro-batches per dp rank,
    # 1f1b, bf16), their micro-batches sharing their casts as a run's do; also sub-pipelined,
    # whose graph is captured at half the micro-batch and priced for both halves (CostTable's
    # batch_parts: activations twice, the 16-bit weight copies the halves share once).
    for rank, out in enumerate(eight):
        for name, got in out["shard_casts"].items():
            assert abs(got["estimate"] - got["peaks"][0]) <= 2048, (rank, name, got)
        saved = out["shard_casts"]["plain"]["peaks"][0]
        seq_estimate, seq_saved = out["estimate_seq"]
        assert abs(seq_estimate - seq_saved) <= 2048, (rank, seq_estimate, seq_saved)
        assert seq_saved < 0.75 * saved, (rank, seq_saved, saved)


def test_micro_batches_in_flight_share_one_16_bit_copy_of_each_shard(eight):
    # pipeline/shard_casts.py against every micro-batch casting its own copy: the same
    # casts, made once, so losses and gradients are equal bit for bit; stage 0 (2 in flight)
    # keeps one copy of its shards fewer (the 16-bit weights of a Llama stage shard); the
    # sub-pipelined halves share theirs in both runs.
    for rank, out in enumerate(eight):
        for name, got in out["shard_casts"].items():
            assert got["losses"][0] == got["losses"][1], (rank, name, got["losses"])
            assert got["grad_diff"] == 0.0, (rank, name, got)
            assert got["reads"] >= 7, (rank, name, got)  # every linear of the stage's blocks
            shared, own = got["peaks"]
            if got["stage"] == 0:
                assert own - shared > 0.05 * own, (rank, name, got["peaks"])
            else:
                assert shared == own, (rank, name, got["peaks"])


def test_subpipelined_stages_take_turns_at_megatron_sequence_parallel_collectives(eight):
    # The reference model's 4 layers over 2 stages, 2 a stage: each layer's 2 block inputs
    # gathered and 2 row outputs reduce-scattered; stage 0 also reduce-scatters its
    # embedding, stage 1 gathers its head's input. Cut at each: compute segments in between.
    # No g (the row layers reduce-scatter); f stays only where the replicated norms' weights
    # sum their gradients. Without tp_seq the cut is at Megatron's f and g instead.
    for rank, out in enumerate(eight):
        seq, plain = out["ref_1f1b_subpipe_seq"], out["ref_1f1b_subpipe"]
        gathers = 4 + (rank // 4 == 1)  # mesh order pp, dp, tp: ranks 4-7 hold stage 1
        scatters = 4 + (rank // 4 == 0)
        kinds = seq["subpipe_segments"]
        assert kinds.get("tp_seq_gather") == gathers, (rank, kinds)
        assert kinds.get("tp_seq_reduce_scatter") == scatters, (rank, kinds)
        assert "reduce" not in kinds, (rank, kinds)
        assert {"reduce", "copy"} <= set(plain["subpipe_segments"]), (rank, plain)
        assert [s[:2] for s in seq["boundary"]] == [(2, 32)], (rank, seq["boundary"])
        assert seq["losses"] == pytest.approx(out["ref_1f1b_seq"]["losses"], abs=TOL)


def test_subpipelined_run_equals_the_sequence_parallel_one(eight):
    # The same model, data and schedule, its 1d collectives sub-pipelined or split over the
    # sequence: the same sums in another order, so the same losses step by step (both also
    # equal one device).
    for out in eight:
        assert out["ref_1f1b_subpipe"]["losses"] == pytest.approx(
            out["ref_1f1b_seq"]["losses"], abs=TOL)


def test_tp_pp_loads_and_saves_the_single_device_checkpoint(eight):
    ckpt = eight[0]["ckpt"]
    assert len(ckpt["straight"]) == 5 and len(ckpt["3d_step4"]) == len(ckpt["dp_step5"]) == 1
    assert ckpt["3d_step4"] == pytest.approx(ckpt["straight"][3:4], abs=TOL)
    assert ckpt["dp_step5"] == pytest.approx(ckpt["straight"][4:], abs=TOL)
