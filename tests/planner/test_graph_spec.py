"""Model description from a captured graph: Hugging Face architectures the planner has no
config reader for, the reference model, config.json files, the CLI and strategy=auto."""

import copy
import json

import pytest
import torch
import transformers as hf
from click.testing import CliRunner

from tessera.models import Transformer
from tessera.models.config import preset
from tessera.planner.cli import plan_group
from tessera.planner.graph_spec import MAX_GAP, describe_module
from tessera.planner.model_spec import (ModelSpecError, describe_model, from_hf_dict,
                                        from_hf_json)

SMALL = dict(vocab_size=512, num_hidden_layers=2, max_position_embeddings=128,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)

# (config, expected (layers, hidden, heads, kv_heads, ffn, norm, activation, position, tied)).
# vocab 512 for all; XGLM and BLOOM name their sizes in their own words.
# Each architecture reads its own way: fused q/k/v (GPT-NeoX, Falcon, GPT-2's Conv1D as
# addmm), multi-query (Falcon), grouped heads (Qwen2, Gemma, Phi-3), gate and up fused into one
# matmul (Phi-3), gated GELU (Gemma: swiglu-priced, same matmuls), parallel attention and MLP
# (Phi, Falcon, GPT-NeoX), learned positions with an offset (OPT), q/k/v-only biases (Qwen2).
ARCHITECTURES = {
    "qwen2": (hf.Qwen2Config(hidden_size=64, intermediate_size=160, num_attention_heads=8,
                             num_key_value_heads=2, **SMALL),
              (2, 64, 8, 2, 160, "rmsnorm", "swiglu", "rope", False)),
    "gpt_neox": (hf.GPTNeoXConfig(hidden_size=64, intermediate_size=256, num_attention_heads=4,
                                  **SMALL),
                 (2, 64, 4, 4, 256, "layernorm", "gelu", "rope", False)),
    "opt": (hf.OPTConfig(hidden_size=64, ffn_dim=256, num_attention_heads=4,
                         word_embed_proj_dim=64, **SMALL),
            (2, 64, 4, 4, 256, "layernorm", "gelu", "learned", True)),
    "phi": (hf.PhiConfig(hidden_size=64, intermediate_size=256, num_attention_heads=4, **SMALL),
            (2, 64, 4, 4, 256, "layernorm", "gelu", "rope", False)),
    "phi3": (hf.Phi3Config(hidden_size=64, intermediate_size=160, num_attention_heads=8,
                           num_key_value_heads=2, **SMALL),
             (2, 64, 8, 2, 160, "rmsnorm", "swiglu", "rope", False)),
    "gemma": (hf.GemmaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4,
                             num_key_value_heads=1, head_dim=16, **SMALL),
              (2, 64, 4, 1, 160, "rmsnorm", "swiglu", "rope", True)),
    "falcon": (hf.FalconConfig(hidden_size=64, num_attention_heads=4, **SMALL),
               (2, 64, 4, 1, 256, "layernorm", "gelu", "rope", True)),
    # Eager attention on (B * heads, T, T) scores: BLOOM (ALiBi, no position table: priced as
    # rotary, which costs the same next to nothing) and XGLM (sinusoidal, likewise).
    # Head width 32, not the capture's 16 tokens: the two cannot be confused.
    "bloom": (hf.BloomConfig(vocab_size=512, hidden_size=96, n_layer=2, n_head=3,
                             bos_token_id=None, eos_token_id=None, pad_token_id=None),
              (2, 96, 3, 3, 384, "layernorm", "gelu", "rope", True)),
    "xglm": (hf.XGLMConfig(vocab_size=512, d_model=96, num_layers=2, attention_heads=3,
                           ffn_dim=128, bos_token_id=None, eos_token_id=None,
                           pad_token_id=None),
             (2, 96, 3, 3, 128, "layernorm", "gelu", "rope", True)),
}


def _arch(name):
    """A fresh copy of an architecture's config (tests change them) and its expected shape."""
    config, expected = ARCHITECTURES[name]
    return copy.deepcopy(config), expected


def _meta_model(config):
    config.use_cache = False
    with torch.device("meta"):  # nothing allocated: the planner's route for big models
        return hf.AutoModelForCausalLM.from_config(config)


def _shape(config):
    return (config.n_layers, config.d_model, config.n_heads, config.n_kv_heads, config.d_ff,
            config.norm, config.activation, config.position, config.tie_embeddings)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_architectures_without_a_config_reader_are_read_from_their_graph(name):
    config, expected = _arch(name)
    described = describe_module(_meta_model(config), seq_len=256)
    assert _shape(described.config) == expected
    assert described.config.vocab_size == 512 and described.config.max_seq_len == 256
    assert described.flops_gap <= MAX_GAP and described.param_gap <= MAX_GAP


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_graph_and_config_readers_agree(name):
    if name == "gpt2":
        config = hf.GPT2Config(vocab_size=512, n_embd=64, n_layer=3, n_head=4, n_positions=128)
    else:
        config = hf.LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=8,
                                num_key_value_heads=2, **SMALL)
    from_config = from_hf_dict(config.to_dict()).replace(max_seq_len=128)
    described = describe_module(_meta_model(config), seq_len=128)
    assert described.config == from_config
    # Exact for these two: the description is the model, so parameters agree to the last one.
    assert described.param_gap == 0.0


def test_what_the_planner_prices_differently_is_warned_about():
    config, _ = _arch("qwen2")  # biases on q, k and v only
    with pytest.warns(UserWarning, match="Qwen2ForCausalLM read from its graph: biases on "
                                         "some projections only"):
        assert describe_module(_meta_model(config), seq_len=64).config.bias


def test_a_graph_read_model_keeps_its_dropout():
    # The graph is captured in eval (no random ops); the modules give the dropout to price.
    config, _ = _arch("qwen2")
    assert describe_module(_meta_model(config), seq_len=64).config.dropout == 0.0
    config.attention_dropout = 0.1
    with pytest.warns(UserWarning):  # Qwen2's biases, as above
        described = describe_module(_meta_model(config), seq_len=64).config
    # Attention's own: no residual dropout priced (Qwen2 has none).
    assert (described.attention_p, described.dropout) == (0.1, 0.0)
    # GPT-2's modules: attn_dropout apart from resid_dropout, mlp dropout and the embedding's.
    gpt2 = hf.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                         attn_pdrop=0.0, resid_pdrop=0.2, embd_pdrop=0.1)
    described = describe_module(_meta_model(gpt2), seq_len=64).config
    assert (described.attention_p, described.dropout) == (0.0, 0.2)


@pytest.mark.parametrize("name", ["qwen2", "gpt_neox"])  # GPT-NeoX splits its fused q|k|v
def test_eager_attention_reads_like_sdpa(name):
    config, expected = _arch(name)
    config._attn_implementation = "eager"  # softmax(q k^T) then p @ v, no fused op
    assert _shape(describe_module(_meta_model(config), seq_len=256).config) == expected


@pytest.mark.parametrize("style", [{}, dict(norm="rmsnorm", activation="swiglu",
                                            position="rope", tie_embeddings=False, bias=False,
                                            n_kv_heads=2)])
def test_reference_model_is_read_back_exactly(style):
    config = preset("tiny").replace(**style)
    with torch.device("meta"):
        model = Transformer(config)
    assert describe_module(model, config.max_seq_len).config == config


def test_blocks_that_differ_are_refused_naming_the_block():
    config = preset("tiny")
    with torch.device("meta"):
        model = Transformer(config)
        wider = Transformer(config.replace(d_ff=2 * config.d_ff))
    model.blocks[1].mlp = wider.blocks[1].mlp
    with pytest.raises(ModelSpecError, match="block 1 differs from block 0.*identical blocks"):
        describe_module(model, config.max_seq_len)


def test_mixture_of_experts_is_refused():
    config = hf.Qwen2MoeConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4,
                               num_key_value_heads=2, moe_intermediate_size=32, num_experts=4,
                               num_experts_per_tok=2, shared_expert_intermediate_size=64,
                               **SMALL)
    with pytest.raises(ModelSpecError, match="no mixture of experts"):
        describe_module(_meta_model(config), seq_len=128)


def test_config_json_paths_and_refusals(tmp_path):
    qwen, expected = _arch("qwen2")
    qwen.save_pretrained(tmp_path / "qwen")
    assert _shape(describe_model(str(tmp_path / "qwen/config.json"), seq_len=64)) == expected
    gpt2 = hf.GPT2Config(vocab_size=512, n_embd=64, n_layer=3, n_head=4, n_positions=128)
    gpt2.save_pretrained(tmp_path / "gpt2")  # read from its fields, nothing captured
    assert describe_model(str(tmp_path / "gpt2/config.json")) == from_hf_dict(gpt2.to_dict())
    with pytest.raises(ModelSpecError, match="cannot read"):
        describe_model(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelSpecError, match="no model_type"):
        describe_model(str(tmp_path / "bad.json"))
    with pytest.raises(ModelSpecError, match="'qwen2'.*config.json path, or the model itself"):
        describe_model(qwen)  # a config object alone: say how to get a description


def test_plan_cli_takes_a_config_json(tmp_path):
    config, _ = _arch("phi3")
    config.save_pretrained(tmp_path)
    result = CliRunner().invoke(plan_group, ["--model", str(tmp_path / "config.json"),
                                             "--cluster", "a100-40gb:4x1", "--gbs", "16",
                                             "--seq", "128", "--top", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert len(data["results"]) == 2  # and it says what it priced: the graph's reading
    assert data["model"].startswith("layers=2,hidden=64,heads=8,kv_heads=2,ffn=160,vocab=512,"
                                    "seq=128 (rmsnorm, swiglu, rope")


def test_auto_strategy_plans_an_architecture_it_has_no_config_reader_for():
    from tessera.strategy import AVAILABLE
    from tessera.train.hf_strategy import resolve_strategy

    config, _ = _arch("gpt_neox")
    config.use_cache = True  # as users build them: switched off for the capture only
    model = hf.AutoModelForCausalLM.from_config(config)
    strategy = resolve_strategy("auto", model, 2, 4, 2, "fp32", seq_len=64)
    assert strategy.world_size == 2 and strategy.global_batch_size == 16
    strategy.require_available(AVAILABLE)
    # Sequence parallelism is not planned for GPT-NeoX (auto.SP_PLANNED); tensor parallelism
    # may be (a policy since 2026-11-29): whichever tp the planner picks, it is runnable.
    assert strategy.sp == 1
    assert model.config.use_cache is True and model.training


def test_auto_holds_tensor_and_sequence_parallelism_off_without_a_policy(monkeypatch):
    import tessera.train.auto as auto

    with torch.device("meta"):
        gpt2 = hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=64, n_layer=2, n_head=4,
                                                resid_pdrop=0.0, embd_pdrop=0.0,
                                                attn_pdrop=0.0))
        dropping = hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=64, n_layer=2, n_head=4))
        # (GPT-NeoX was this model until it got a policy, 2026-11-29: Phi-3 has none)
        phi3 = hf.AutoModelForCausalLM.from_config(hf.Phi3Config(
            vocab_size=50432, hidden_size=4096, intermediate_size=16384, num_hidden_layers=4,
            num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
            use_cache=False, pad_token_id=None, bos_token_id=None, eos_token_id=None))
        gemma = hf.AutoModelForCausalLM.from_config(hf.GemmaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False))
    # Megatron sequence parallelism (tp_seq) takes Hugging Face models whose dropout modules
    # the policy places (GPT-2's, dropping by default); the reference model's dropout it runs.
    assert auto.layout_limits(phi3) == {"tp": 1, "sp": 1} and auto.layout_limits(gpt2) == {}
    assert auto.layout_limits(Transformer(preset("tiny", dropout=0.1))) == {}
    # A policy (Gemma's): tensor parallelism may be planned, sequence parallelism is planned
    # only for the classes the suite checks it on.
    assert auto.layout_limits(gemma) == {"sp": 1}
    # GPT-2's default dropout (0.1): sequence parallelism trains it (each sp rank on its own
    # random stream, attention dropout by hashed masks), so auto may plan it, and tp_seq.
    # A dropout module the policy gives no dropout style holds tp_seq off.
    assert auto.layout_limits(dropping) == {}
    dropping.transformer.h[0].mlp.extra = torch.nn.Dropout(0.1)  # a user's own module
    assert auto.layout_limits(dropping) == {"tp_seq": "off"}
    # A vocabulary or MLP width some tp degree of the world cannot cut (GPT-2's 50257
    # tokens): the planner checks heads only, so tp is held at 1 (it picked tp=2, refused).
    with torch.device("meta"):
        odd_vocab = hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=64, n_layer=2, n_head=4,
                                                     vocab_size=50257))
        odd_ffn = hf.LlamaForCausalLM(hf.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=130, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1))
    assert auto.layout_limits(odd_vocab, 2) == {"tp": 1}
    assert auto.layout_limits(odd_ffn, 4) == {"tp": 1}  # 130 splits 2 ways, not 4
    assert auto.layout_limits(odd_ffn, 2) == {}
    assert auto.layout_limits(odd_vocab, 1) == {}
    # On 8 A100s (not this machine's CPU workers, so the pick does not depend on the host) the
    # planner, free to choose, would split this 1.2B model with tensor parallelism, which the
    # runtime cannot apply to Phi-3 (no policy); held to tp=1 it picks another layout.
    monkeypatch.setattr(auto, "local_cluster", lambda n, device="auto": f"a100-40gb:{n}x1")
    config = describe_model(phi3, seq_len=2048)
    assert auto.best_runnable(config, 8, 16, "bf16").tp > 1
    held = auto.plan_strategy(phi3, 8, 16, "bf16", seq_len=2048)
    assert held.tp == 1 and held.sp == 1 and held.world_size == 8


def test_seq_reaches_a_config_json_read_from_its_graph(tmp_path):
    config, _ = _arch("phi3")
    config.save_pretrained(tmp_path)
    # Read at the length asked for, not the config's position count (128): a config naming
    # none could not be described at all when the length was dropped on the way.
    assert from_hf_json(tmp_path / "config.json", seq_len=96).max_seq_len == 96


def test_reading_leaves_the_models_modes_and_handles_ffn_equal_to_hidden():
    config, _ = _arch("gpt_neox")
    config.intermediate_size = 64  # d_ff = hidden: the up and down projections look alike
    model = _meta_model(config)
    model.train()
    model.gpt_neox.layers[0].eval()  # a user's choice the capture must not undo
    described = describe_module(model, seq_len=64).config
    assert described.d_ff == 64 and described.activation == "gelu"
    assert model.training and not model.gpt_neox.layers[0].training


def test_auto_plans_for_the_host_when_training_is_told_to_run_there(monkeypatch):
    import tessera.train.auto as auto
    from tessera.config import load_config
    from tessera.strategy import StrategyError
    from tessera.train.hf_strategy import resolve_strategy

    # A GPU host: auto plans for its card, unless the job is to run on the CPU (use_cpu,
    # train.device=cpu), when planning for the card would pick a layout sized for it.
    monkeypatch.setattr(auto.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(auto.torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB")
    assert auto.local_cluster(4) == "h100-80gb:4x1"
    assert auto.local_cluster(4, "cpu") == "cpu:4x1"
    # A card without a preset is refused for "auto" but never consulted for the CPU.
    monkeypatch.setattr(auto.torch.cuda, "get_device_name", lambda index=0: "Tesla T4")
    with pytest.raises(StrategyError, match="no planner preset for GPU 'Tesla T4'"):
        resolve_strategy("auto", Transformer(preset("tiny")), 2, 4, 2, "fp32")
    planned = resolve_strategy("auto", Transformer(preset("tiny")), 2, 4, 2, "fp32",
                               device="cpu")
    assert planned.world_size == 2 and planned.global_batch_size == 16
    base = ["model.preset=tiny", "train.device=cpu"]
    assert load_config(None, [*base, "strategy=auto,gbs=16"], world_size=2).strategy


@pytest.mark.parametrize("sample, length", [
    ({"input_ids": torch.arange(12)}, 12), ({"input_ids": list(range(7))}, 7),
    (torch.arange(5), 5), (hf.BatchEncoding({"input_ids": [1, 2, 3]}), 3),
    ({"input_ids": torch.tensor(4)}, None), ({"text": "no ids"}, None)])
def test_auto_plans_at_the_training_sets_length(sample, length):
    from tessera.train.hf_strategy import sample_length as _sample_length

    assert _sample_length([sample]) == length


def test_three_d_scores_give_heads_at_any_captured_batch():
    from tessera.parallel.pipeline.capture import capture
    from tessera.planner.graph_spec import describe_graph

    model = _meta_model(_arch("xglm")[0])  # (B * heads, T, T) scores
    for batch in (1, 3):
        assert describe_graph(capture(model.eval(), batch, 16)).config.n_heads == 3
