"""Per-architecture tensor-parallel policies: module-path patterns -> parallel styles.

A policy is an ordered list of (regular expression over the module path, style); the first
pattern that matches a module's full path decides its style. Styles:

    colwise      linear split by output features (1D) / SUMMA linear (2D)
    colwise_kv   key or value projection: split by kv heads, or replicated per head group
                 when there are fewer kv heads than ranks (1D)
    colwise_qkv  fused q|k|v projection (GPT-2 c_attn): each shard holds q, k, v of its heads
    rowwise      linear split by input features, output summed (1D) / SUMMA linear (2D)
    vocab_embed  token embedding split by vocabulary (1D) / 2D blocks (2D)
    vocab_head   output layer, logits stay split by vocabulary
    position     learned position table: replicated (1D) / 2D blocks (2D)
    norm         nn.LayerNorm, or RMSNorm as Llama's (x_hat * w): replicated (1D) /
                 statistics along grid rows (2D)
    layernorm    a LayerNorm of another class (Cohere's): replicated (1D only)
    rmsnorm_1p   Gemma's RMSNorm, x_hat * (1 + w) in fp32: replicated (1D only)
    head_norm    a LayerNorm with a weight per head (Cohere's q/k norms): split by heads
                 (1D only)
    head_rmsnorm_1p  Gemma 3's q/k norms, one (head_dim,) weight for all heads: replicated,
                 its gradient summed over the ranks' heads (1D only)
    head_rmsnorm Qwen 3's q/k norms: the same with x_hat * w (1D only)
    attention    the attention module itself: its head counts become the local ones; (1D)
                 its input gets Megatron's f once for all its column layers (under
                 sequence parallelism: is gathered along the sequence)
    mlp          the MLP module: (1D) its input gets f once (under SP: is gathered)
    seq_dropout  a dropout on the residual stream inside the decoder layers (GPT-2's
                 resid_dropout, its MLP's dropout): kept, except under Megatron sequence
                 parallelism (1D), where each rank drops its sequence chunk's rows of the
                 mask one device draws (seq_dropout.SequenceChunkDropout)
    whole_dropout  a dropout on what every tp rank holds whole (GPT-2's embedding dropout,
                 before its first layer): kept
    probs_dropout  a dropout of attention probabilities (GPT-2's attn_dropout): kept; under
                 1D its rate goes to the per-head masks of tensor/attention.py

Megatron sequence parallelism on a Hugging Face model needs every dropout module that drops
to have one of the three dropout styles (an attention module's dropout rate needs none).

Adding an architecture means adding one entry to ``POLICIES`` (keyed by model class name) and,
if its config names differ, to ``model_dims``. A norm or token embedding whose forward is not
what its style builds is refused when replaced (probe.py): a name alike is not enough.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from tessera.strategy import StrategyError

_B = r"blocks\.\d+"
_H = r"transformer\.h\.\d+"
_L = r"model\.layers\.\d+"

POLICIES: dict[str, list[tuple[str, str]]] = {
    "Transformer": [  # tessera.models.Transformer
        (r"embed", "vocab_embed"),
        (r"pos_embed", "position"),
        (rf"{_B}\.attn\.q_proj", "colwise"),
        (rf"{_B}\.attn\.(k|v)_proj", "colwise_kv"),
        (rf"{_B}\.attn\.o_proj", "rowwise"),
        (rf"{_B}\.mlp\.(up|gate)_proj", "colwise"),
        (rf"{_B}\.mlp\.down_proj", "rowwise"),
        (rf"({_B}\.(attn|mlp)_norm|norm)", "norm"),
        (rf"{_B}\.attn", "attention"),
        (rf"{_B}\.mlp", "mlp"),
        (r"lm_head", "vocab_head"),
    ],
    "GPT2LMHeadModel": [
        (rf"{_H}\.(attn\.resid_dropout|mlp\.dropout)", "seq_dropout"),
        (rf"{_H}\.attn\.attn_dropout", "probs_dropout"),
        (r"transformer\.drop", "whole_dropout"),
        (r"transformer\.wte", "vocab_embed"),
        (r"transformer\.wpe", "position"),
        (rf"{_H}\.attn\.c_attn", "colwise_qkv"),
        (rf"{_H}\.attn\.c_proj", "rowwise"),
        (rf"{_H}\.mlp\.c_fc", "colwise"),
        (rf"{_H}\.mlp\.c_proj", "rowwise"),
        (rf"({_H}\.ln_(1|2)|transformer\.ln_f)", "norm"),
        (rf"{_H}\.attn", "attention"),
        (rf"{_H}\.mlp", "mlp"),
        (r"lm_head", "vocab_head"),
    ],
    "LlamaForCausalLM": [
        (r"model\.embed_tokens", "vocab_embed"),
        (rf"{_L}\.self_attn\.q_proj", "colwise"),
        (rf"{_L}\.self_attn\.(k|v)_proj", "colwise_kv"),
        (rf"{_L}\.self_attn\.o_proj", "rowwise"),
        (rf"{_L}\.mlp\.(gate|up)_proj", "colwise"),
        (rf"{_L}\.mlp\.down_proj", "rowwise"),
        (rf"({_L}\.(input|post_attention)_layernorm|model\.norm)", "norm"),
        (rf"{_L}\.self_attn", "attention"),
        (rf"{_L}\.mlp", "mlp"),
        (r"lm_head", "vocab_head"),
    ],
}


# Hugging Face classes whose modules are Llama's, name for name and role for role (RMSNorm,
# rotary q/k/v/o attention, a gated MLP, embeddings and head): Llama's policy, each checked
# against one device (tests/parallel/tensor/test_tp_layers.py; Granite with its embedding,
# residual, attention and logit multipliers). Helium is one too: its o_proj takes hidden_size
# inputs, so Hugging Face itself needs heads * head_dim == hidden_size (a config with another
# head_dim fails on one device as well). Since 2026-11-29 also Ernie 4.5, and StableLM, whose
# norms are nn.LayerNorms with bias (the norm style builds those) and whose layers may run
# attention and MLP off one norm (use_parallel_residual: listed in PARALLEL_LAYERS below).
LLAMA_LAYOUT = ("MistralForCausalLM", "Qwen2ForCausalLM", "GraniteForCausalLM",
                "SmolLM3ForCausalLM", "ArceeForCausalLM", "HeliumForCausalLM",
                "Ernie4_5ForCausalLM", "StableLmForCausalLM")
for _name in LLAMA_LAYOUT:
    POLICIES[_name] = list(POLICIES["LlamaForCausalLM"])  # each its own, to extend alone


def _llama_with_norm(style: str, norms: str = r"input|post_attention") -> list:
    """Llama's policy with its norms given ``style`` (``norms``: the layer norms' prefixes)."""
    return [(rf"({_L}\.({norms})_layernorm|model\.norm)", style) if s == "norm" else (p, s)
            for p, s in POLICIES["LlamaForCausalLM"]]


# Named as Llama's, computing otherwise (each checked against one device in the same test).
# Gemma 1-3: RMSNorm times (1 + weight), the embedding scaled by sqrt(hidden) (read off the
# module's scalar_embed_scale by vocab_embed); Gemma 2 and 3 have norms before and after the
# MLP too, Gemma 3 q/k norms. Cohere: a LayerNorm (mean subtracted, no bias) that is not an
# nn.LayerNorm, one per layer feeding attention and MLP in parallel, and with use_qk_norm a
# LayerNorm per head on q and k. Until 2026-11-28 they had no entry: built with Llama's,
# Gemma's norms computed x_hat * w (its tp=2 loss 7e-3 from one device) and Cohere's were
# taken for RMSNorms (3e-5 in the loss, 34% in gradients).
_GEMMA2_NORMS = r"input|post_attention|pre_feedforward|post_feedforward"
POLICIES["GemmaForCausalLM"] = _llama_with_norm("rmsnorm_1p")
POLICIES["Gemma2ForCausalLM"] = _llama_with_norm("rmsnorm_1p", _GEMMA2_NORMS)
POLICIES["Gemma3ForCausalLM"] = [(rf"{_L}\.self_attn\.(q|k)_norm", "head_rmsnorm_1p"),
                                 *_llama_with_norm("rmsnorm_1p", _GEMMA2_NORMS)]
# Qwen 3: Llama's, with an RMSNorm (x_hat * w) over each head's features on q and k, one
# (head_dim,) weight for all heads.
POLICIES["Qwen3ForCausalLM"] = [(rf"{_L}\.self_attn\.(q|k)_norm", "head_rmsnorm"),
                                *POLICIES["LlamaForCausalLM"]]
POLICIES["CohereForCausalLM"] = [(rf"{_L}\.self_attn\.(q|k)_norm", "head_norm"),
                                 *_llama_with_norm("layernorm", "input")]
# Parallel layers (1D): decoder layers whose attention and MLP read one input (Cohere:
# ``x + attn(norm(x)) + mlp(norm(x))``). The two blocks share their entry (modules.SharedEntry):
# the input enters tensor parallelism once, one input-gradient all-reduce a layer instead of
# one per block (under tp_seq: one gather, one reduce-scatter, one re-gather instead of two
# each). Exact whatever the layer does: a block handed another tensor enters its own.
PARALLEL_LAYERS: dict[str, str] = {"CohereForCausalLM": _L, "StableLmForCausalLM": _L}
# Phi 1-2: one LayerNorm (with bias) per layer feeding attention and MLP in parallel, biased
# q, k, v, dense and MLP layers, a biased LM head, partial rotary embeddings (per head, so
# each rank's heads rotate alone); the residual dropout acts on each block's output, a row
# layer's (a sequence chunk under tp_seq), the embedding dropout before the first layer.
# Its optional q/k LayerNorms (qk_layernorm=True) have no style: refused by name.
POLICIES["PhiForCausalLM"] = [
    (rf"{_L}\.resid_dropout", "seq_dropout"),
    (r"model\.embed_dropout", "whole_dropout"),
    (r"model\.embed_tokens", "vocab_embed"),
    (rf"{_L}\.self_attn\.q_proj", "colwise"),
    (rf"{_L}\.self_attn\.(k|v)_proj", "colwise_kv"),
    (rf"{_L}\.self_attn\.dense", "rowwise"),
    (rf"{_L}\.mlp\.fc1", "colwise"),
    (rf"{_L}\.mlp\.fc2", "rowwise"),
    (rf"({_L}\.input_layernorm|model\.final_layernorm)", "norm"),
    (rf"{_L}\.self_attn", "attention"),
    (rf"{_L}\.mlp", "mlp"),
    (r"lm_head", "vocab_head"),
]
PARALLEL_LAYERS["PhiForCausalLM"] = _L
# GPT-J: one LayerNorm feeding attention and MLP in parallel (a parallel layer), separate
# q, k, v without bias, rotary embeddings on the first rotary_dim features of each head, a
# biased LM head; its residual dropouts act on the row layers' outputs.
POLICIES["GPTJForCausalLM"] = [
    (rf"{_H}\.(attn\.resid_dropout|mlp\.dropout)", "seq_dropout"),
    (r"transformer\.drop", "whole_dropout"),
    (r"transformer\.wte", "vocab_embed"),
    (rf"{_H}\.attn\.(q|k|v)_proj", "colwise"),
    (rf"{_H}\.attn\.out_proj", "rowwise"),
    (rf"{_H}\.mlp\.fc_in", "colwise"),
    (rf"{_H}\.mlp\.fc_out", "rowwise"),
    (rf"({_H}\.ln_1|transformer\.ln_f)", "norm"),
    (rf"{_H}\.attn", "attention"),
    (rf"{_H}\.mlp", "mlp"),
    (r"lm_head", "vocab_head"),
]
PARALLEL_LAYERS["GPTJForCausalLM"] = _H
# GPT-NeoX (Pythia): its fused query_key_value holds each head's q, k, v together ((heads, 3,
# head_dim) rows), so a contiguous split by output features gives each rank whole heads, as
# plain colwise does (GPT-2's c_attn holds all q, then all k, all v: colwise_qkv permutes).
# Parallel residual (the default) reads two norms, one per block: not a parallel layer in the
# sense of PARALLEL_LAYERS. Its hidden dropout acts on each block's output (a row layer's).
_N = r"gpt_neox\.layers\.\d+"
POLICIES["GPTNeoXForCausalLM"] = [
    (rf"{_N}\.post_(attention|mlp)_dropout", "seq_dropout"),
    (r"gpt_neox\.emb_dropout", "whole_dropout"),
    (r"gpt_neox\.embed_in", "vocab_embed"),
    (rf"{_N}\.attention\.query_key_value", "colwise"),
    (rf"{_N}\.attention\.dense", "rowwise"),
    (rf"{_N}\.mlp\.dense_h_to_4h", "colwise"),
    (rf"{_N}\.mlp\.dense_4h_to_h", "rowwise"),
    (rf"({_N}\.(input|post_attention)_layernorm|gpt_neox\.final_layer_norm)", "norm"),
    (rf"{_N}\.attention", "attention"),
    (rf"{_N}\.mlp", "mlp"),
    (r"lm_head", "vocab_head"),
]
# Styles the 2D builder does not build (refused there by name).
ONE_D_STYLES = ("layernorm", "rmsnorm_1p", "head_norm", "head_rmsnorm", "head_rmsnorm_1p")
# Where a dropout module acts (kept as they are but for seq_dropout under tp_seq)
DROPOUT_STYLES = ("seq_dropout", "whole_dropout", "probs_dropout")


class PolicyError(StrategyError):
    """A model or option mix cannot be tensor-parallelised; the message names the rule."""


@dataclass(frozen=True)
class ModelDims:
    """What the styles need to know about a model."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    d_ff: int
    hf: bool  # a Hugging Face model (its attention modules carry head counts)


def policy_for(model: nn.Module) -> list[tuple[re.Pattern, str]]:
    """The compiled policy of ``model``'s class.

    Raises:
        PolicyError: for an unknown class, naming where to add it.
    """
    name = type(model).__name__
    if name not in POLICIES:
        raise PolicyError(
            f"no tensor-parallel policy for model class {name!r} (known: "
            f"{', '.join(POLICIES)}): train it with tp=1 (data, pipeline and sequence "
            "parallelism need no policy), or register one in your script before the "
            f"Trainer is built: tessera.parallel.tensor.policy.POLICIES[{name!r}] = "
            "[(module-path regex, style), ...] (styles: colwise, colwise_kv, colwise_qkv, "
            "rowwise, vocab_embed, vocab_head, position, norm, layernorm, rmsnorm_1p, "
            "head_norm, head_rmsnorm, head_rmsnorm_1p, attention, mlp, seq_dropout, "
            "whole_dropout, probs_dropout; docs/tensor_parallel.md), and check its losses "
            "against tp=1")
    return [(re.compile(pattern), style) for pattern, style in POLICIES[name]]


def style_of(path: str, policy: list[tuple[re.Pattern, str]]) -> str | None:
    """The style of the module at ``path``, or None when no pattern matches."""
    for pattern, style in policy:
        if pattern.fullmatch(path):
            return style
    return None


def model_dims(model: nn.Module) -> ModelDims:
    """Head counts and sizes from a reference ModelConfig or a Hugging Face config."""
    c = model.config
    if hasattr(c, "d_model") and hasattr(c, "n_kv_heads"):  # tessera ModelConfig
        return ModelDims(c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size,
                         c.d_ff, False)
    d_model = getattr(c, "hidden_size", None) or c.n_embd
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or d_model // heads
    d_ff = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * d_model
    return ModelDims(d_model, heads, kv, head_dim, c.vocab_size, d_ff, True)


def check_divisible(dims: ModelDims, ways: int, kv_ways_ok: bool, what: str) -> None:
    """Refuse shapes the split cannot cut evenly, naming the size and the rule.

    Args:
        ways: how many pieces heads, hidden size and vocabulary are cut into.
        kv_ways_ok: whether fewer kv heads than ``ways`` may be replicated instead (1D).
        what: the strategy text for the message, e.g. "tp=4 (1d)".
    """
    rules = [("n_heads", dims.n_heads), ("d_model", dims.d_model),
             ("vocab_size", dims.vocab_size), ("d_ff", dims.d_ff)]
    for name, value in rules:
        if value % ways:
            raise PolicyError(f"{what}: model {name}={value} is not divisible by {ways}")
    kv = dims.n_kv_heads
    if kv % ways and not (kv_ways_ok and ways % kv == 0):
        need = "divide or be divisible by" if kv_ways_ok else "be divisible by"
        raise PolicyError(f"{what}: model n_kv_heads={kv} must {need} {ways}")
