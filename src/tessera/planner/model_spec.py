"""Model description for the planner: a :class:`ModelConfig` from whatever the user has.

Accepted: a ModelConfig, a preset name (``gpt3-175b``), the command-line shorthand
``layers=96,hidden=12288,heads=96,seq=2048,vocab=51200[,ffn=..,kv_heads=..,style=gpt2|llama]``,
a Hugging Face ``GPT2Config``/``LlamaConfig`` object, a dict of either kind of fields, a
Hugging Face ``config.json`` path, a model (``nn.Module``) or a graph captured from one
(``ProxyGraph``). Models and configs of other architectures are described from their captured
graph (graph_spec.py). The planner trains at ``max_seq_len``, so ``seq`` sets the sequence
length it prices.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from tessera.models.config import PRESETS, ModelConfig, ModelConfigError, preset

STYLES = ("gpt2", "llama")
HF_TYPES = ("gpt2", "llama", "mistral")  # model_types read from the config alone
_SHORT_KEYS = {"layers": "n_layers", "hidden": "d_model", "heads": "n_heads",
               "seq": "max_seq_len", "vocab": "vocab_size", "ffn": "d_ff",
               "kv_heads": "n_kv_heads"}
_REQUIRED = ("layers", "hidden", "heads")
_STYLE_FIELDS = {
    "gpt2": dict(norm="layernorm", activation="gelu", position="learned", tie_embeddings=True,
                 bias=True),
    "llama": dict(norm="rmsnorm", activation="swiglu", position="rope", tie_embeddings=False,
                  bias=False),
}


class ModelSpecError(ModelConfigError):
    """A model description cannot be understood; the message names the key."""


def describe_model(source: Any, seq_len: int | None = None) -> ModelConfig:
    """Turn any supported model description into a validated ModelConfig.

    Args:
        source: ModelConfig, preset name, shorthand text, HF config object, mapping or
            ``config.json`` path, ``nn.Module`` or captured ``ProxyGraph``.
        seq_len: training sequence length; overrides the description's ``max_seq_len``.

    Raises:
        ModelSpecError: for an unknown preset, a malformed shorthand, a bad field or a graph
            the planner cannot price, naming it.
    """
    from tessera.parallel.pipeline.capture import ProxyGraph

    if isinstance(source, ProxyGraph):
        from tessera.planner.graph_spec import describe_graph

        return describe_graph(source, seq_len).config
    if isinstance(source, nn.Module):
        return describe_module_or_config(source, seq_len)
    config = _describe(source, seq_len)
    if seq_len is not None:
        config = config.replace(max_seq_len=int(seq_len))
    return config


def _describe(source: Any, seq_len: int | None = None) -> ModelConfig:
    if isinstance(source, ModelConfig):
        return source
    if isinstance(source, str):
        text = source.strip()
        if "=" in text:
            return parse_model_shorthand(text)
        if text in PRESETS:
            return preset(text)
        if text.endswith(".json"):
            return from_hf_json(Path(text), seq_len)
        raise ModelSpecError(f"unknown model {text!r}: not a preset ({', '.join(PRESETS)}), "
                             "not shorthand like 'layers=24,hidden=2048,heads=16' and not a "
                             "Hugging Face config.json")
    if isinstance(source, Mapping):
        return from_hf_dict(source) if _looks_hf(source) else _from_config_mapping(source)
    if hasattr(source, "to_dict") and hasattr(source, "model_type"):
        return from_hf_dict(source.to_dict())
    raise ModelSpecError(f"cannot describe a model from {type(source).__name__}")


def _from_config_mapping(values: Mapping[str, Any]) -> ModelConfig:
    try:
        return ModelConfig.from_mapping(values)
    except (ModelConfigError, TypeError) as err:
        raise ModelSpecError(str(err)) from None


def parse_model_shorthand(text: str) -> ModelConfig:
    """Parse ``layers=..,hidden=..,heads=..[,seq=..,vocab=..,ffn=..,kv_heads=..,style=..]``.

    Raises:
        ModelSpecError: naming the unknown, repeated, missing or non-integer key.
    """
    values: dict[str, str] = {}
    for item in text.split(","):
        if "=" not in item:
            raise ModelSpecError(f"model shorthand item {item.strip()!r} is not key=value")
        key, raw = (part.strip() for part in item.split("=", 1))
        if key not in _SHORT_KEYS and key != "style":
            raise ModelSpecError(f"unknown model key {key!r}; known: "
                                 f"{', '.join([*_SHORT_KEYS, 'style'])}")
        if key in values:
            raise ModelSpecError(f"model key {key!r} given twice")
        values[key] = raw
    missing = [k for k in _REQUIRED if k not in values]
    if missing:
        raise ModelSpecError(f"model shorthand needs {', '.join(missing)}")
    style = values.pop("style", "gpt2")
    if style not in STYLES:
        raise ModelSpecError(f"model key 'style' must be one of {', '.join(STYLES)}, got {style!r}")
    fields: dict[str, Any] = dict(_STYLE_FIELDS[style])
    fields.update(vocab_size=51200 if style == "gpt2" else 32000, max_seq_len=2048)
    for key, raw in values.items():
        try:
            fields[_SHORT_KEYS[key]] = int(raw)
        except ValueError:
            raise ModelSpecError(f"model key {key!r} must be an integer, got {raw!r}") from None
    try:
        return ModelConfig(**fields)
    except ModelConfigError as err:
        raise ModelSpecError(f"model shorthand {text!r}: {err}") from None


def _looks_hf(values: Mapping[str, Any]) -> bool:
    return "model_type" in values or "n_embd" in values or "hidden_size" in values


def from_hf_dict(values: Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig with the shape of a Hugging Face GPT-2 or Llama config (as a dict).

    Raises:
        ModelSpecError: for an unsupported ``model_type`` or a missing field, naming it.
    """
    kind = values.get("model_type") or ("gpt2" if "n_embd" in values else "llama")
    get = _getter(values, kind)
    if kind == "gpt2":
        return _from_config_mapping(dict(
            **{**_STYLE_FIELDS["gpt2"],
               "tie_embeddings": bool(values.get("tie_word_embeddings", True))},
            vocab_size=get("vocab_size"), n_layers=get("n_layer"),
            d_model=get("n_embd"), n_heads=get("n_head"), d_ff=values.get("n_inner") or 0,
            max_seq_len=get("n_positions"),
            # GPT2Config's defaults (0.1) where the dict leaves them out, as transformers does
            dropout=max(float(values.get(key, 0.1)) for key in ("resid_pdrop", "embd_pdrop")),
            attention_dropout=float(values.get("attn_pdrop", 0.1))))
    if kind in ("llama", "mistral"):
        return _from_config_mapping(dict(
            **{**_STYLE_FIELDS["llama"],
               "tie_embeddings": bool(values.get("tie_word_embeddings", False))},
            vocab_size=get("vocab_size"), n_layers=get("num_hidden_layers"),
            d_model=get("hidden_size"), n_heads=get("num_attention_heads"),
            n_kv_heads=values.get("num_key_value_heads") or 0,
            d_ff=get("intermediate_size"), max_seq_len=get("max_position_embeddings"),
            # Llama drops nothing but the attention probabilities
            dropout=0.0, attention_dropout=float(values.get("attention_dropout") or 0.0)))
    raise ModelSpecError(f"Hugging Face model_type {kind!r} is not read from its config alone "
                         f"(only {', '.join(HF_TYPES)}); pass its config.json path, or the "
                         "model itself, to describe it from its captured graph")


def _getter(values: Mapping[str, Any], kind: str):
    def get(key: str) -> Any:
        if values.get(key) is None:
            raise ModelSpecError(f"Hugging Face {kind} config lacks {key!r}")
        return values[key]
    return get


def from_hf_json(path: Path, seq_len: int | None = None) -> ModelConfig:
    """Describe the model of a Hugging Face ``config.json``: GPT-2 / Llama / Mistral from its
    fields, any other causal LM by building it on the meta device (transformers' Auto classes,
    nothing allocated) and reading its captured graph.

    Raises:
        ModelSpecError: for a missing or unreadable file, or a model the planner cannot price.
    """
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelSpecError(f"cannot read Hugging Face config {str(path)!r}: {err}") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ModelSpecError(f"{str(path)!r} is not a Hugging Face config (no model_type)")
    if values["model_type"] in HF_TYPES:
        return from_hf_dict(values)
    return describe_module_or_config(_meta_hf_model(values), seq_len)


def _meta_hf_model(values: dict[str, Any]) -> nn.Module:
    import torch

    try:
        import transformers
    except ImportError:
        raise ModelSpecError(f"describing a {values['model_type']!r} model needs transformers "
                             "(pip install 'tessera[hf]')") from None
    try:
        config = transformers.AutoConfig.for_model(**{**values, "use_cache": False})
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError) as err:
        raise ModelSpecError(f"transformers cannot build a causal LM of model_type "
                             f"{values['model_type']!r}: {err}") from None


def describe_module_or_config(model: nn.Module, seq_len: int | None) -> ModelConfig:
    """A model's description: its ``.config`` when that is a ModelConfig or a config the
    planner reads (GPT-2, Llama, Mistral), else its captured graph (graph_spec.py), priced at
    ``seq_len`` (default: the config's position count).

    Raises:
        ModelSpecError: when neither describes it, naming why.
    """
    from tessera.planner.graph_spec import describe_module

    config = getattr(model, "config", None)
    if isinstance(config, ModelConfig) or getattr(config, "model_type", None) in HF_TYPES:
        return describe_model(config, seq_len)
    seq = seq_len or _position_count(config)
    if seq is None:
        raise ModelSpecError(f"{type(model).__name__}: give the sequence length to plan for "
                             "(its config names no position count)")
    return describe_module(model, seq).config


def _position_count(config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def summary(config: ModelConfig) -> str:
    """One line naming what the planner prices, e.g. for a model read from its graph."""
    return (f"layers={config.n_layers},hidden={config.d_model},heads={config.n_heads},"
            f"kv_heads={config.n_kv_heads},ffn={config.d_ff},vocab={config.vocab_size},"
            f"seq={config.max_seq_len} ({config.norm}, {config.activation}, {config.position} "
            f"positions, {'tied' if config.tie_embeddings else 'untied'} embeddings; "
            f"{config.num_params() / 1e6:,.1f}M parameters)")
