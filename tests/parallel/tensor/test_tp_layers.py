"""Parity of every 1D and 2D layer and of whole models, in one 4-rank launch.

The launch builds three meshes on 4 ranks: 1D tp=2 (two tp groups, under dp=2), 1D tp=4 and
the 2x2 grid, and checks each layer kind and each model (reference GPT-2 and Llama style,
Hugging Face GPT-2 and Llama) against the same module on one device. It also counts the
all-reduces of one 1D backward (exact counts, no tolerance): one per block input.

Tolerance: fp32 on CPU. A tensor-parallel layer sums the same products in a different order
(partial sums over shards, then a collective), so results agree to rounding, not bit for bit:
1e-5 absolute on outputs, input gradients and weight gradients of unit-scale tensors, and on
losses of about 5.5. A wrong shard, a missing reduction or a double count is off by O(1e-2)
or more (gradients are also compared relative to their own size).
"""

from __future__ import annotations

import pytest
import torch

from tessera.parallel.sequence.dropout import AttentionDropout
from tessera.parallel.tensor.attention import SEED_RANGE
from tessera.testing import run_distributed

import tp_checks

TOL = 1e-5
MESHES = ("1d_tp2", "1d_tp4", "2d_2x2")
MODELS = ("ref-gpt", "ref-llama", "hf-gpt2", "hf-llama")
# Hugging Face classes laid out with Llama's policy (policy.LLAMA_LAYOUT), and with policies
# derived from it for other norms and a scaled embedding (Gemma 1-3, Cohere with and without
# q/k norms; Qwen 3 with its per-head q/k norms), and policies of their own: Phi and GPT-J
# (biased head, partial rotary, parallel layers) and GPT-NeoX (each head's q|k|v fused); and
# Ernie 4.5 and StableLM (LayerNorms; also with parallel residual) under Llama's, at 1D tp=2,
# built at tiny Llama's shape.
LLAMA_LAYOUT = ("hf-mistral", "hf-qwen2", "hf-granite", "hf-smollm3", "hf-arcee", "hf-helium",
                "hf-gemma", "hf-gemma2", "hf-gemma3_text", "hf-cohere", "hf-cohere_qk",
                "hf-phi", "hf-gpt_neox", "hf-gptj", "hf-qwen3", "hf-ernie4_5", "hf-stablelm",
                "hf-stablelm_par")
# Policies of their own whose styles 2D builds too: NeoX's fused q|k|v, unpermuted, on the grid
OWN_POLICY_2D = ("hf-phi", "hf-gpt_neox", "hf-gptj")
# Models whose residual dropout under Megatron sequence parallelism drops chunks: Phi's one
# module drops both blocks' outputs of its parallel layers.
MEGATRON_SP_DROPOUT = ("ref", "hf-gpt2", "hf-phi", "hf-gpt_neox", "hf-gptj")
# (mesh, model, layers): tp=2 reference Llama (eager, and the custom ops pipeline stages
# run), GPT-2's fused q|k|v, tp=4 Llama whose 2 kv heads are replicated, and Cohere's parallel
# layers (one norm feeding attention and MLP: policy.PARALLEL_LAYERS), eager, as custom ops
# and under chunk memory (whose hooks hand the blocks a view of the norm's output); Phi's,
# GPT-J's (parallel too) and NeoX's (two norms: 2 a layer).
ALL_REDUCE_CASES = (("1d_tp2", "ref-llama", "eager"), ("1d_tp2", "ref-llama", "ops"),
                    ("1d_tp2", "hf-gpt2", "eager"), ("1d_tp4", "hf-llama", "eager"),
                    ("1d_tp2", "hf-cohere", "eager"), ("1d_tp2", "hf-cohere", "ops"),
                    ("1d_tp4", "hf-cohere", "chunk"), ("1d_tp2", "hf-phi", "eager"),
                    ("1d_tp2", "hf-gpt_neox", "eager"), ("1d_tp2", "hf-gptj", "eager"),
                    ("1d_tp2", "hf-stablelm_par", "eager"), ("1d_tp2", "hf-stablelm", "eager"))
# Attention dropout under 1D tp (tensor/attention.py): (mesh, model, exportable) for every
# model at tp=2, Llama at tp=4 (each rank holds one query head and a replicated kv head), and
# two models as pipeline stages build them (the custom op in eval too), run eagerly.
ATTENTION_DROPOUT_CASES = (*(("1d_tp2", kind, False) for kind in MODELS),
                           ("1d_tp4", "ref-llama", False), ("1d_tp4", "hf-llama", False),
                           ("1d_tp2", "ref-llama", True), ("1d_tp2", "hf-gpt2", True))


def _all_checks(rank, world_size, folder):
    counts = tp_checks.record_gradient_counts()
    out = {"layers": {}, "models": {}}
    meshes = tp_checks.meshes()
    for name, mesh in meshes.items():
        out["layers"][name] = tp_checks.layer_checks(mesh)
        for kind in MODELS:
            out["models"][name, kind] = tp_checks.model_parity(mesh, kind)
        if name.startswith("1d"):
            for kind in MODELS:  # Megatron sequence parallelism (tp_seq=on)
                out["models"][name, kind + "+sp"] = tp_checks.model_parity(mesh, kind, True)
    for kind in LLAMA_LAYOUT:
        out["models"]["1d_tp2", kind] = tp_checks.model_parity(meshes["1d_tp2"], kind)
        out["models"]["1d_tp2", kind + "+sp"] = tp_checks.model_parity(meshes["1d_tp2"], kind,
                                                                       True)
    for kind in OWN_POLICY_2D:
        out["models"]["2d_2x2", kind] = tp_checks.model_parity(meshes["2d_2x2"], kind)
    out["from_meta"] = {(m, kind): tp_checks.from_meta(meshes[m], kind)
                        for m, kind in (("1d_tp2", "hf-gpt2"), ("2d_2x2", "ref-llama"))}
    out["attention_dropout"] = {case: tp_checks.attention_dropout_parity(meshes[case[0]],
                                                                         *case[1:])
                                for case in ATTENTION_DROPOUT_CASES}
    out["counts"] = counts
    out["all_reduces"] = {case: tp_checks.backward_all_reduces(meshes[case[0]], *case[1:])
                          for case in ALL_REDUCE_CASES}
    out["recomputed_gathers"] = {kind: tp_checks.recomputed_block_gathers(meshes["1d_tp2"],
                                                                          kind)
                                 for kind in ("ref-llama", "hf-gpt2")}
    out["scaler"] = tp_checks.grad_scaler_overflow(meshes["1d_tp2"])
    out["refusals"] = tp_checks.refusals(meshes["2d_2x2"])
    out["refusals"]["no_block"] = tp_checks.refusal_without_block(meshes["1d_tp2"])
    out["refusals"]["parallel_layer"] = tp_checks.refusal_parallel_layer(meshes["1d_tp2"])
    out["megatron_sp_dropout"] = {(name, kind): tp_checks.megatron_sp_dropout_parity(
        meshes[name], kind) for name in ("1d_tp2", "1d_tp4") for kind in MEGATRON_SP_DROPOUT}
    out["refusals"]["one_d_style"] = tp_checks.refusal_one_d_style(meshes["2d_2x2"])
    out["direct_call"] = tp_checks.refusal_direct_call(meshes["1d_tp2"])
    out["refusals"].update(tp_checks.refusals_tp_seq(meshes["1d_tp2"]))
    out["checkpoints"] = {(m, kind): tp_checks.checkpoint_roundtrip(meshes[m], kind,
                                                                     f"{folder}/{m}-{kind}")
                          for m in ("1d_tp4", "2d_2x2") for kind in ("ref-gpt", "hf-gpt2")}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp_checkpoints")
    return run_distributed(_all_checks, world_size=4, args=(str(folder),), timeout=300)


@pytest.mark.slow
def test_fp16_loss_scaler_skips_on_every_tp_rank_alike(results):
    # inf in one tp rank's gradient shard: all ranks skip the step and halve 2^16.
    for rank, res in enumerate(results):
        assert res["scaler"] == {"found_inf": 1.0, "scale": 2.0 ** 15, "moved": 0.0}, rank


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_every_layer_matches_single_device(results, mesh):
    expected = {"1d": {"column", "row", "conv1d_column", "conv1d_row", "vocab_embedding",
                       "layernorm", "sp_column", "sp_row", "sp_rmsnorm", "sp_vocab_embedding",
                       "cross_entropy"},
                "2d": {"linear", "conv1d", "layernorm", "rmsnorm", "embedding",
                       "cross_entropy"}}[mesh[:2]]
    for rank, res in enumerate(results):
        layers = res["layers"][mesh]
        assert set(layers) == expected
        for layer, diffs in layers.items():
            assert "out" in diffs and len(diffs) >= 2, (layer, diffs)  # outputs and gradients
            for what, diff in diffs.items():
                assert diff <= TOL, f"rank {rank} {mesh} {layer} {what}: {diff:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("mesh, kind", [(m, k) for m in MESHES for k in MODELS]
                         + [(m, k + "+sp") for m in MESHES[:2] for k in MODELS]
                         + [("1d_tp2", k + s) for k in LLAMA_LAYOUT for s in ("", "+sp")]
                         + [("2d_2x2", k) for k in OWN_POLICY_2D])
def test_whole_model_matches_single_device(results, mesh, kind):
    for rank, res in enumerate(results):
        got = res["models"][mesh, kind]
        assert got["params"] > 10  # every parameter was compared
        assert got["loss"] <= TOL, (rank, got)
        assert got["grad"] <= TOL, (rank, got)
        assert got["grad_rel"] <= 1e-3, (rank, got)
        assert got["state_dict"] == 0.0, (rank, got)  # gathering and cutting are exact copies


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["1d_tp2", "1d_tp4"])
@pytest.mark.parametrize("kind", MEGATRON_SP_DROPOUT)
def test_megatron_sequence_parallel_dropout_drops_each_chunk_as_one_device(results, mesh, kind):
    # Until 2026-11-28 a model with dropout was refused here: tp peers share a random stream
    # and would have dropped their sequence chunks alike. Each chunk now takes its rows of
    # the mask one device draws; Hugging Face GPT-2's too since 2026-11-29 (its policy says
    # which dropout acts on a chunk: resid and MLP dropout; its embedding dropout runs before
    # the first layer cuts the sequence). Tolerance: TOL, as every model parity here.
    for rank, res in enumerate(results):
        got = res["megatron_sp_dropout"][(mesh, kind)]
        assert got["loss"] < TOL and got["grad"] < TOL, (rank, got)
        assert got["params"] > 0
        # Another mask moves the loss ~1e-3 (9e-4 seen), 10x TOL and more: parity within
        # TOL means these masks, not merely some dropout or none.
        assert got["other_mask_loss_gap"] > 10 * TOL, got


@pytest.mark.slow
def test_each_autograd_function_returns_one_gradient_per_input(results):
    seen = {}
    for res in results:
        for name, pairs in res["counts"].items():
            seen.setdefault(name, set()).update(pairs)
    ran = {fn.__name__ for fn in tp_checks.AUTOGRAD_FUNCTIONS}
    assert ran == set(seen)  # every function ran backward at least once
    for name, pairs in seen.items():
        for n_inputs, n_grads in pairs:
            assert n_inputs == n_grads, f"{name}: {n_inputs} inputs, {n_grads} gradients"


@pytest.mark.slow
def test_bad_input_is_refused_with_the_rule_named(results):
    got = results[0]["refusals"]
    assert "mbs=1 must be divisible by 2" in got["mbs"]
    assert "vocab_size=255 is not divisible by 2" in got["vocab"]
    assert "n_kv_heads=1 must be divisible by 2" in got["kv_heads"]
    # 1D column layers leave the input-gradient sum to their attention / MLP block's hook.
    assert "blocks.0.attn.q_proj of Transformer is column-parallel but not inside a module " \
           "of style 'attention' or 'mlp'" in got["no_block"]
    # A module listed as a parallel layer must hold an attention and an MLP.
    assert got["parallel_layer"].startswith(
        "norm of Transformer is listed in PARALLEL_LAYERS (tessera/parallel/tensor/policy.py) "
        "as a layer whose attention and MLP read one input, but it holds 0 modules of style "
        "'attention' or 'mlp'"), got["parallel_layer"]
    # The model called directly after parallelize would give each rank its vocabulary
    # slice of the logits (until 2026-11-28 it did, generate disagreeing across ranks).
    for rank, res in enumerate(results):
        assert 5.0 < res["direct_call"]["loss"] < 6.0, rank  # tessera's own call: ln 256
        assert res["direct_call"]["message"].startswith(
            "this model is laid out over tp=2 tensor-parallel ranks (tp_mode=1d)"), rank
    # Megatron sequence parallelism: each rank takes 1/tp of the tokens (the reference model
    # splits in its embedding, a Hugging Face model at its first layer); a Hugging Face model
    # with a dropout module its policy gives no dropout style is refused (what it drops is
    # not known).
    for key in ("length", "hf_length"):
        assert got[key].startswith("tp_seq=on splits the sequence over tp=2: this batch's "
                                   "length 17 is not divisible by tp"), got[key]
    assert "with tp_seq=on: GPT2LMHeadModel drops activations in modules of no dropout " \
           "style (transformer.h.1.mlp.extra): Megatron sequence parallelism splits the " \
           "tokens between the layers and must know what each dropout acts on" \
           in got["hf_dropout"], got["hf_dropout"]
    # Gemma's scaled embedding and (1 + w) norms are built by the 1D layers only.
    assert got["one_d_style"].startswith("model.embed_tokens: GemmaTextScaledWordEmbedding "
                                         "scales its embedding (Gemma's): built for "
                                         "tp_mode=1d only")


@pytest.mark.slow
def test_checkpoints_hold_the_unsharded_model_and_adam_states(results):
    # After one AdamW step: the TP run's get_state_dict (what torch.distributed.checkpoint
    # saves) equals the single-device one, including GPT-2's fused q|k|v and its Adam moments,
    # and a fresh TP model loads it back. Same tolerance as parity (one step of rounding).
    # 4 cases ran: 1D tp=4 and 2D, reference and GPT-2.
    for (mesh, kind), got in results[0]["checkpoints"].items():
        assert got["saved"] <= TOL, (mesh, kind, got)
        assert got["loaded"] == 0.0, (mesh, kind, got)  # loading copies
    assert results[0]["checkpoints"]["2d_2x2", "hf-gpt2"]["permuted"] == 1.0


@pytest.mark.slow
def test_a_meta_model_is_sharded_one_module_at_a_time(results):
    # Built on meta and given a DeferredInit, each transformer block's weights (each other
    # module's) are materialised whole just before being cut into shards: the shards equal
    # those of the model materialised whole first, bit for bit (the same per-name seeded
    # initialisation), no request holds more than the largest such unit, and there is one
    # request per unit holding weights (the tied head asks for nothing: its weight is the
    # embedding's, converted once). 2 cases ran: 1D tp=2 HF GPT-2 (tied embedding, fused
    # q|k|v) and 2D 2x2 reference Llama.
    for rank_out in results:
        for (mesh, kind), got in rank_out["from_meta"].items():
            assert got["shard_diff"] == 0.0 and got["loss_diff"] == 0.0, (mesh, kind, got)
            assert got["shard_std"] > 0.01 and got["left_on_meta"] == 0, (mesh, kind, got)
            assert got["peak_over_largest_unit"] <= 1.0, (mesh, kind, got)
            tied = 1 if kind == "hf-gpt2" else 0
            assert got["requests"] == got["units"] - tied, (mesh, kind, got)
            assert got["peak_over_model"] < 0.5, (mesh, kind, got)


@pytest.mark.slow
def test_one_input_gradient_all_reduce_per_attention_and_mlp_block(results):
    # Megatron's f once per block input, not once per column layer: 2 per layer (attention,
    # MLP) + 1 for the output layer's input, where summing in each column layer took 5 per
    # Llama layer (q, k, v, gate, up) and 4 per GPT-2 layer (fused q|k|v counts 1, plus c_fc
    # counts 1: 2 already, checked for the fused path). The embedding's backward needs none.
    # Cohere's, Phi's and GPT-J's attention and MLP read one norm's output, entered once: 1
    # per layer (2 before policy.PARALLEL_LAYERS; parity: test_whole_model_matches_...).
    for rank, res in enumerate(results):
        for (mesh, kind, layers), got in res["all_reduces"].items():
            case = (rank, mesh, kind, layers, got)
            per_layer = 1 if kind in ("hf-cohere", "hf-phi", "hf-gptj", "hf-stablelm_par") else 2
            assert got["activations"] == per_layer * got["layers"] + 1, case
            # tp=4 replicates tiny-llama's 2 kv heads: k and v weight gradients are summed.
            assert got["other"] == (2 * got["layers"] if mesh == "1d_tp4" else 0), case


@pytest.mark.slow
def test_a_checkpointed_block_gathers_its_input_once_in_backward_under_tp_seq(results):
    # tp_seq=on, one backward. Without checkpoints: each block input's kept shard gathered
    # again (2 a layer), each row layer's output gradient gathered (2 a layer), and the
    # embedding's (or a Hugging Face model's first-layer split's) gradient: 4 L + 1, and for
    # the reference model one more, its head gathering its kept input shard again. With
    # every block checkpointed the recomputation gathers each block input and its column
    # layers keep it whole, so the backward gathers no more (keeping the shard there too
    # gathered each block input twice: 2 L more). Gradients: the same ops on the same values
    # (the recomputation is the forward again), so within TOL, measured 0.
    for rank, res in enumerate(results):
        for kind, got in res["recomputed_gathers"].items():
            case = (rank, kind, got)
            assert got["kept"] == 4 * got["layers"] + (2 if kind == "ref-llama" else 1), case
            assert got["recomputed"] == got["kept"], case
            assert got["grad"] < TOL, case


@pytest.mark.slow
@pytest.mark.parametrize("case", ATTENTION_DROPOUT_CASES)
def test_attention_dropout_equals_one_device_dropping_the_same_pairs(results, case):
    # Attention dropout p=0.3, every other dropout 0: the tp model (hashed masks on each
    # rank's heads, tensor/attention.py) against one device whose dense fp32 attention drops
    # the pairs the hashed mask drops over all heads under the same seed. Same tolerance as
    # the plain model parity (TOL): both sides are fp32, the tp side sums in another order
    # (explicit blocks, row-parallel all-reduce); kept probabilities are scaled by 1/(1-p) =
    # 1.43, still unit scale. A head group dropped with another group's mask moves the loss
    # and gradients by O(1e-2).
    for rank, res in enumerate(results):
        got = res["attention_dropout"][case]
        assert "tp_attention_dropout" in got["features"], (rank, got["features"])
        assert got["params"] > 10
        assert got["loss"] <= TOL, (rank, got)
        assert got["grad"] <= TOL, (rank, got)
        assert got["grad_rel"] <= 1e-3, (rank, got)
        # Dropout took effect: it moves the loss of these tiny models by 3e-4 to 7e-3, well
        # above TOL, so the parity above is not that of an undropped model.
        assert got["dropped"] > 10 * TOL, (rank, got)
        # In eval nothing drops: SDPA on both sides (HF: transformers' sdpa path), or under
        # pipeline stages the op's fused block against SDPA.
        assert got["eval_loss"] <= TOL, (rank, got)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ("ref-gpt", "ref-llama"))
def test_tp_ranks_drop_their_head_groups_with_different_masks(results, kind):
    # The installed attention of tp ranks 0 and 1 (global ranks 0, 1; 2 and 3 are the other
    # tp group), probed with 2 local heads under one torch seed: rank r's first local head is
    # head 2r of the layer, and its mask is one device's mask of that head (exact: booleans).
    masks = [res["attention_dropout"]["1d_tp2", kind, False]["mask"] for res in results]
    assert not torch.equal(masks[0], masks[1])  # before the fix: one mask on both ranks
    torch.manual_seed(tp_checks.MASK_SEED)
    seed = int(torch.randint(0, SEED_RANGE, (), dtype=torch.int64))
    T = tp_checks.T
    index = torch.arange(T).expand(1, T)
    meta = torch.stack((index, torch.zeros_like(index)), -1)  # (1, T, 2)
    keep = AttentionDropout(tp_checks.P_ATTN, seed).keep_scale(meta, meta, 4)[0] > 0
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for rank, mask in enumerate(masks):
        assert torch.equal(mask, keep[2 * (rank % 2)] & causal), rank
