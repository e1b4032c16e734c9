"""Policies and rules that need no processes: unknown models, shapes, strategy rules."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from tessera.models import Transformer
from tessera.models.config import preset
from tessera.models.hf import build_hf_model, hf_config_from_reference
from tessera.parallel.tensor.policy import (POLICIES, PolicyError, check_divisible, model_dims,
                                            policy_for, style_of)
from tessera.parallel.tensor.shard import fused_perm
from tessera.strategy import Strategy, StrategyError


class MyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


def test_unknown_architecture_names_what_to_add():
    with pytest.raises(PolicyError, match=r"no tensor-parallel policy for model class 'MyNet'"
                                          r".*POLICIES\['MyNet'\]"):
        policy_for(MyNet())


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_every_parameterised_module_of_hf_models_has_a_style(arch):
    ref = preset("tiny" if arch == "gpt2" else "tiny-llama")
    model = build_hf_model(arch, **hf_config_from_reference(arch, ref))
    policy = policy_for(model)
    owners = {name.rpartition(".")[0] for name, _ in model.named_parameters()}
    assert all(style_of(owner, policy) for owner in owners), owners
    dims = model_dims(model)
    assert (dims.d_model, dims.n_heads, dims.n_kv_heads, dims.vocab_size) == (
        ref.d_model, ref.n_heads, ref.n_kv_heads, ref.vocab_size)


def test_reference_policy_styles():
    policy = policy_for(Transformer(preset("tiny-llama")))
    assert style_of("blocks.1.attn.k_proj", policy) == "colwise_kv"
    assert style_of("blocks.0.mlp.down_proj", policy) == "rowwise"
    assert style_of("blocks.0.attn", policy) == "attention"
    assert style_of("lm_head", policy) == "vocab_head"
    assert style_of("blocks.0", policy) is None
    # Llama's layout under other classes, derived from it for other norms, Phi's, NeoX's and
    # GPT-J's (each checked against one device in test_tp_layers.py), and nothing else; the
    # parallel layers are those of classes with a policy.
    from tessera.parallel.tensor.policy import LLAMA_LAYOUT, PARALLEL_LAYERS

    derived = {"GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
               "CohereForCausalLM", "Qwen3ForCausalLM"}
    assert set(POLICIES) == {"Transformer", "GPT2LMHeadModel", "LlamaForCausalLM",
                             "PhiForCausalLM", "GPTNeoXForCausalLM", "GPTJForCausalLM",
                             *LLAMA_LAYOUT, *derived}
    assert set(PARALLEL_LAYERS) == {"CohereForCausalLM", "PhiForCausalLM", "GPTJForCausalLM",
                                    "StableLmForCausalLM"}
    assert all(POLICIES[name] == POLICIES["LlamaForCausalLM"]
               and POLICIES[name] is not POLICIES["LlamaForCausalLM"] for name in LLAMA_LAYOUT)
    gemma3 = [(re.compile(p), s) for p, s in POLICIES["Gemma3ForCausalLM"]]
    assert style_of("model.layers.3.pre_feedforward_layernorm", gemma3) == "rmsnorm_1p"
    assert style_of("model.layers.0.self_attn.k_norm", gemma3) == "head_rmsnorm_1p"
    assert style_of("model.norm", gemma3) == "rmsnorm_1p"
    cohere = [(re.compile(p), s) for p, s in POLICIES["CohereForCausalLM"]]
    assert style_of("model.layers.1.input_layernorm", cohere) == "layernorm"
    assert style_of("model.layers.1.self_attn.q_norm", cohere) == "head_norm"
    phi = [(re.compile(p), s) for p, s in POLICIES["PhiForCausalLM"]]
    assert style_of("model.layers.1.self_attn.dense", phi) == "rowwise"
    assert style_of("model.final_layernorm", phi) == "norm"
    assert style_of("model.layers.0.resid_dropout", phi) == "seq_dropout"


def _tiny_hf(model_type: str, **extra):
    import transformers

    config = transformers.AutoConfig.for_model(
        model_type, use_cache=False, pad_token_id=None, head_dim=16,
        **{**hf_config_from_reference("llama", preset("tiny-llama")), **extra})
    return transformers.AutoModelForCausalLM.from_config(config)


def test_a_norm_or_embedding_computing_otherwise_than_its_style_is_refused():
    from tessera.parallel.tensor.probe import check_embedding, check_norm

    gemma = _tiny_hf("gemma")
    norm = gemma.model.layers[0].input_layernorm  # x_hat * (1 + w), w starts at 0
    with pytest.raises(PolicyError, match="GemmaRMSNorm under style 'norm' computes another "
                                          "norm .* rmsnorm_1p"):
        check_norm(norm, "norm", norm.eps, rms=True)
    check_norm(norm, "rmsnorm_1p", norm.eps, rms=True, unit_offset=True)
    embed = gemma.model.embed_tokens  # scaled by sqrt(hidden)
    with pytest.raises(PolicyError, match="GemmaTextScaledWordEmbedding under style "
                                          "'vocab_embed' computes another token embedding"):
        check_embedding(embed, "vocab_embed", None)
    check_embedding(embed, "vocab_embed", embed.scalar_embed_scale)
    cohere = _tiny_hf("cohere", use_qk_norm=True)
    layer = cohere.model.layers[0]
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
    with pytest.raises(PolicyError, match="CohereLayerNorm under style 'norm'"):
        check_norm(layer.input_layernorm, "norm", 1e-5, rms=True)  # not an nn.LayerNorm
    check_norm(layer.input_layernorm, "layernorm", layer.input_layernorm.variance_epsilon,
               rms=False)
    q_norm = layer.self_attn.q_norm  # weight (heads, head_dim)
    check_norm(q_norm, "head_norm", q_norm.variance_epsilon, rms=False)
    llama = build_hf_model("llama", **hf_config_from_reference("llama", preset("tiny-llama")))
    check_norm(llama.model.norm, "norm", llama.model.norm.variance_epsilon, rms=True)
    with torch.device("meta"):  # no weights to run: not probed
        check_norm(_tiny_hf("gemma").model.norm, "norm", 1e-6, rms=True)


def test_shapes_not_divisible_are_refused():
    dims = model_dims(Transformer(preset("tiny", vocab_size=250)))
    with pytest.raises(PolicyError, match="vocab_size=250 is not divisible by 4"):
        check_divisible(dims, 4, kv_ways_ok=True, what="tp=4")
    gqa = model_dims(Transformer(preset("tiny-llama")))  # 2 kv heads
    check_divisible(gqa, 4, kv_ways_ok=True, what="tp=4")  # 1D replicates kv heads
    with pytest.raises(PolicyError, match="n_kv_heads=2 must be divisible by 4"):
        check_divisible(gqa, 4, kv_ways_ok=False, what="tp=16 (2d)")


def test_strategy_refuses_2d_kv_heads_not_split_by_the_grid():
    with pytest.raises(StrategyError, match="n_kv_heads=1 is not divisible by 2"):
        Strategy(tp=4, tp_mode="2d").validate_for(model=preset("tiny", n_kv_heads=1))
    Strategy(tp=4, tp_mode="2d").validate_for(model=preset("tiny-llama"))


def test_fused_perm_puts_each_shards_q_k_v_together():
    perm = fused_perm(12, 3, 2)
    assert perm.tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert torch.equal(torch.argsort(perm)[perm], torch.arange(12))
