"""Shared fixtures: small run configs over a slice of the standard library's sources."""

from __future__ import annotations

import pytest

from tessera.config import RunConfig, config_from_dict


def tiny_run_config(output_dir, strategy: str = "dp=1,tp=1,pp=1,mbs=4,gbs=8",
                    **sections) -> RunConfig:
    """A tiny-model run that takes well under a second per step on one CPU core."""
    raw = {
        "model": {"preset": "tiny"},
        "strategy": strategy,
        "data": {"corpus": "stdlib", "seq_len": 32, "max_bytes": 200_000},
        "train": {"output_dir": str(output_dir), "max_steps": 5, "learning_rate": 3e-3,
                  "warmup_steps": 2, "logging_steps": 1, "progress": "off", "seed": 7},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    return config_from_dict(raw)


@pytest.fixture
def make_config(tmp_path):
    def make(strategy: str = "dp=1,tp=1,pp=1,mbs=4,gbs=8", **sections) -> RunConfig:
        return tiny_run_config(tmp_path / "run", strategy, **sections)
    return make


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` on machines without CUDA (the marker is in pyproject.toml)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
