"""A model's identity for checkpoint compatibility: class, parameter shapes and the config
fields that change what it computes (``checkpoint.check_compatible`` compares two)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from torch import nn


def describe_model(model: nn.Module) -> dict[str, Any]:
    """Identity of a model for checkpoint compatibility: class, size, shapes, config."""
    shapes = sorted((name, tuple(p.shape)) for name, p in model.named_parameters())
    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]
    info: dict[str, Any] = {"class": type(model).__name__,
                            "num_params": sum(p.numel() for p in model.parameters()),
                            "parameter_shapes_sha256": digest}
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict") and type(config).__module__.startswith("tessera"):
        info.update({k: v for k, v in config.to_dict().items() if k not in ("init_std",)})
    elif hasattr(config, "to_dict") and type(config).__module__.startswith("transformers"):
        # A Hugging Face config: what shapes the computation (a model of other heads,
        # rope_theta or eps has the same parameter shapes), not names, token ids, output
        # switches or the initialisation; under JSON's types, as meta.json reads back.
        info.update(_functional(json.loads(json.dumps(config.to_dict(), default=str))))
    return info


def _functional(fields: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face config's fields less HF_CONFIG_IGNORED and private ones, also inside
    sub-configs (a multimodal model's ``text_config``)."""
    return {k: _functional(v) if isinstance(v, dict) else v for k, v in fields.items()
            if not k.startswith("_") and k not in HF_CONFIG_IGNORED}


# Hugging Face config keys that do not change what a trained model computes.
HF_CONFIG_IGNORED = frozenset({
    "transformers_version", "dtype", "torch_dtype", "use_cache", "architectures",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id",
    "problem_type", "pad_token_id", "bos_token_id", "eos_token_id", "initializer_range",
    "chunk_size_feed_forward", "name_or_path", "tokenizer_class", "prefix",
    "attn_implementation"})
