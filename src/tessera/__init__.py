"""tessera: train large transformers across devices and beyond device memory.

The main names are importable from the package root; they load on first use so that
``import tessera`` stays cheap for tools that need only part of it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Strategy": "tessera.strategy",
    "StrategyError": "tessera.strategy",
    "Mesh": "tessera.mesh",
    "ModelConfig": "tessera.models.config",
    "Transformer": "tessera.models.transformer",
    "Trainer": "tessera.train.hf_api",
    "TrainingArguments": "tessera.train.hf_api",
    "HfArgumentParser": "tessera.train.hf_parser",  # needs transformers
    "TrainResult": "tessera.train.trainer",
    "RunConfig": "tessera.config",
    "load_config": "tessera.config",
    "parallelize": "tessera.parallel",
    "run_training": "tessera.run",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tessera' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
