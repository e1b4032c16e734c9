"""Full (unsharded) model weights in a Hugging Face compatible safetensors layout.

Hugging Face models are written with ``save_pretrained`` (config.json + model.safetensors) and
load with ``from_pretrained``. The reference model is written as ``model.safetensors`` (tied
output head stored once) plus a ``config.json`` of its ModelConfig, and loads with
:func:`load_reference_model`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tessera.models import ModelConfig, Transformer

REFERENCE_WEIGHTS = "model.safetensors"
REFERENCE_CONFIG = "config.json"


def save_full_model(trainer, output_dir: Path) -> Path:
    """Gather the full state dict (all ranks call this) and write it from rank 0."""
    state = get_model_state_dict(trainer.wrapped, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        model = trainer.model
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(output_dir, state_dict=state, safe_serialization=True)
        else:
            _save_reference(model, state, output_dir)
    dist.barrier()
    return output_dir


def _save_reference(model: Transformer, state: dict[str, torch.Tensor], output_dir: Path) -> None:
    from safetensors.torch import save_file

    if model.config.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(output_dir / REFERENCE_WEIGHTS))
    (output_dir / REFERENCE_CONFIG).write_text(json.dumps(
        {"tessera_model": model.config.to_dict()}, indent=2))


def load_reference_model(folder: str | Path) -> Transformer:
    """Rebuild a reference model written by :func:`save_full_model`."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / REFERENCE_CONFIG).read_text())["tessera_model"]
    model = Transformer(ModelConfig.from_mapping(config))
    state = load_file(str(folder / REFERENCE_WEIGHTS))
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if model.config.tie_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"{folder}: weights do not match the config (missing {missing}, "
                         f"unexpected {unexpected})")
    return model
