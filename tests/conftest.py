"""Test-suite hooks. Tiny runs for tests live in tessera.testing, importable from any folder."""

from __future__ import annotations

import pytest
from hypothesis import settings

from tessera.testing import use_fork_server

# Workers of run_distributed fork from a server that imported torch and tessera once: the
# suite starts hundreds of workers, each of which would otherwise import them (4-5 s of CPU).
use_fork_server()

# Property tests explore the same examples on every run: CI stays reproducible.
settings.register_profile("tessera", derandomize=True)
settings.load_profile("tessera")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` on machines without CUDA (the marker is in pyproject.toml)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def own_process_group(monkeypatch):
    """A Trainer built here starts a one-rank process group: released after the test, so
    later tests do not read its world size (and its port, set here, is dropped too)."""
    from tessera.testing import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    yield
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
