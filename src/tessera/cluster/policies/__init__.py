"""Scheduling policies behind one interface (:class:`Policy`), and a registry by name."""

from __future__ import annotations

from tessera.cluster.policies.base import (
    Assignment, ClusterSpec, ClusterView, Policy, Schedule, gang_fill)
from tessera.cluster.policies.fifo import FIFO
from tessera.cluster.policies.ones import ONES
from tessera.cluster.policies.optimus import Optimus
from tessera.cluster.policies.pollux import PolluxLike
from tessera.cluster.policies.srtf import SRTF
from tessera.cluster.policies.tiresias import Tiresias

POLICIES = {"fifo": FIFO, "srtf": SRTF, "tiresias": Tiresias, "optimus": Optimus,
            "pollux": PolluxLike, "ones": ONES}


def make_policy(name: str) -> Policy:
    """A fresh policy by name (one of :data:`POLICIES`).

    Raises:
        ValueError: unknown name.
    """
    try:
        return POLICIES[name.strip().lower()]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None


__all__ = ["Assignment", "ClusterSpec", "ClusterView", "Policy", "Schedule", "gang_fill",
           "FIFO", "ONES", "Optimus", "PolluxLike", "SRTF", "Tiresias", "POLICIES",
           "make_policy"]
