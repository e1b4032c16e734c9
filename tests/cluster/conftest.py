"""Shared fixtures: the fitted job models (fitted once per session) and tiny traces."""

from __future__ import annotations

import pytest

from tessera.cluster.job_model import JobModels
from tessera.cluster.profiles import default_profile_dir


@pytest.fixture(scope="session")
def profile_dir():
    path = default_profile_dir()
    if not (path / "cifar10" / "placements.csv").exists():
        pytest.skip(f"application profiles not found at {path}")
    return path


@pytest.fixture(scope="session")
def models(profile_dir) -> JobModels:
    return JobModels.fit(profile_dir)


@pytest.fixture(scope="session")
def pollux_workload(profile_dir):
    return profile_dir.parent / "workloads" / "workload-1.csv"
