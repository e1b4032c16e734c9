"""Hugging Face causal-LM models built from configs (no downloads), unmodified.

tessera trains these through the same Trainer as its reference model: the trainer reads
``output.logits`` when a model returns an output object. They are built with
``use_cache=False`` so that `torch.export` can capture them later (pipeline partitioning).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tessera.models.config import ModelConfig, ModelConfigError

HF_ARCHITECTURES = ("gpt2", "llama")


def hf_config_from_reference(arch: str, config: ModelConfig) -> dict[str, Any]:
    """Hugging Face config keyword arguments matching a reference ModelConfig's shape."""
    if arch == "gpt2":
        return dict(vocab_size=config.vocab_size, n_positions=config.max_seq_len,
                    n_embd=config.d_model, n_layer=config.n_layers, n_head=config.n_heads,
                    n_inner=config.d_ff, resid_pdrop=config.dropout,
                    embd_pdrop=config.dropout, attn_pdrop=config.attention_p,
                    layer_norm_epsilon=config.norm_eps, bos_token_id=None, eos_token_id=None)
    if arch == "llama":
        return dict(vocab_size=config.vocab_size, hidden_size=config.d_model,
                    intermediate_size=config.d_ff, num_hidden_layers=config.n_layers,
                    num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
                    max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps,
                    rope_theta=config.rope_theta, tie_word_embeddings=config.tie_embeddings,
                    attention_dropout=config.attention_p, bos_token_id=None, eos_token_id=None)
    raise ModelConfigError(f"unknown Hugging Face architecture {arch!r}; known: "
                           f"{', '.join(HF_ARCHITECTURES)}")


def build_hf_model(arch: str, **config_kwargs: Any) -> nn.Module:
    """A randomly initialised Hugging Face causal LM from config keyword arguments.

    Args:
        arch: "gpt2" or "llama".
        **config_kwargs: fields of ``GPT2Config`` / ``LlamaConfig``.

    Raises:
        ModelConfigError: for an unknown architecture or when transformers is missing.
    """
    try:
        import transformers
    except ImportError as err:  # transformers is the optional "hf" extra
        raise ModelConfigError(
            "Hugging Face models need the 'transformers' package: pip install 'tessera[hf]'"
        ) from err
    classes = {"gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
               "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}
    if arch not in classes:
        raise ModelConfigError(f"unknown Hugging Face architecture {arch!r}; known: "
                               f"{', '.join(HF_ARCHITECTURES)}")
    config_cls, model_cls = classes[arch]
    config = config_cls(use_cache=False, **config_kwargs)
    return model_cls(config)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of any causal LM: 6 * params + attention (PaLM, appendix B).

    Reads layer count and hidden size from a Hugging Face config when the model has one.
    """
    params = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    layers = _first_attr(config, ("n_layers", "num_hidden_layers", "n_layer"))
    hidden = _first_attr(config, ("d_model", "hidden_size", "n_embd"))
    return 6.0 * params + 12.0 * layers * hidden * seq_len


def _first_attr(obj: Any, names: tuple[str, ...]) -> int:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int):
            return value
    return 0
