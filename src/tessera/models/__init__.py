"""Models: the reference transformer, its presets, and Hugging Face adapters."""

from tessera.models.config import PRESETS, ModelConfig, ModelConfigError, preset
from tessera.models.transformer import Transformer

__all__ = ["PRESETS", "ModelConfig", "ModelConfigError", "Transformer", "preset"]
