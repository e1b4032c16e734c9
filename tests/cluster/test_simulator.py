"""Simulator invariants: determinism, no GPU assigned twice, schedule checks, placement."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.cluster.placement import place
from tessera.cluster.policies import POLICIES, ClusterSpec, Policy, make_policy
from tessera.cluster.policies.base import Assignment
from tessera.cluster.simulator import SchedulingError, SimConfig, Simulator
from tessera.cluster.traces import JobSpec, load_trace


def small_trace(rng, n=24):
    apps = ("cifar10", "ncf", "yolov3", "deepspeech2", "bert")
    return [JobSpec(f"j{i}", float(rng.integers(0, 3000)), apps[i % 5],
                    int(rng.choice([1, 2, 4, 8])), 0) for i in range(n)]


class Checked(Policy):
    """Wraps a policy and asserts each raw schedule it returns gives every GPU at most once."""

    def __init__(self, inner: Policy) -> None:
        self.inner, self.name, self.periodic = inner, inner.name, inner.periodic
        self.rounds = 0

    def reset(self, cluster, models, seed):
        self.inner.reset(cluster, models, seed)

    def schedule(self, view):
        out = self.inner.schedule(view)
        gpus = np.concatenate([a.gpus for a in out.values()]) if out else np.empty(0, int)
        assert len(np.unique(gpus)) == len(gpus), "a GPU was assigned twice"
        assert set(out) <= set(view.active.tolist())
        self.rounds += 1
        return out


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_gpu_assigned_twice(models, name):
    jobs = small_trace(np.random.default_rng(1))
    policy = Checked(make_policy(name))
    r = Simulator(jobs, ClusterSpec.with_gpus(16), models, SimConfig(seed=1)).run(policy)
    assert policy.rounds > 0 and np.all(~np.isnan(r.finish))
    assert r.timeline_used.max() <= 16


@pytest.mark.parametrize("name", ["ones", "pollux", "tiresias"])
def test_deterministic_under_a_seed(models, pollux_workload, name):
    jobs = load_trace(pollux_workload, max_gpus=64, apps=models.names)[:40]
    sim = Simulator(jobs, ClusterSpec.with_gpus(32), models, SimConfig(seed=7))
    a, b = sim.run(make_policy(name)), sim.run(make_policy(name))
    np.testing.assert_array_equal(a.finish, b.finish)
    np.testing.assert_array_equal(a.restarts, b.restarts)


def test_different_seeds_change_ones_decisions(models, pollux_workload):
    jobs = load_trace(pollux_workload, max_gpus=64, apps=models.names)[:40]
    cluster = ClusterSpec.with_gpus(32)
    runs = [Simulator(jobs, cluster, models, SimConfig(seed=s)).run(make_policy("ones"))
            for s in (1, 2)]
    assert not np.array_equal(runs[0].finish, runs[1].finish)


class DoubleBooker(Policy):
    name = "double"

    def schedule(self, view):
        return {int(j): Assignment(np.array([0]), 1) for j in view.active}


def test_simulator_refuses_a_gpu_given_twice(models):
    jobs = [JobSpec("a", 0, "ncf", 1, 256), JobSpec("b", 0, "ncf", 1, 256)]
    sim = Simulator(jobs, ClusterSpec.with_gpus(4), models)
    with pytest.raises(SchedulingError, match="GPU 0 assigned twice"):
        sim.run(DoubleBooker())


def test_restart_cost_delays_completion(models):
    jobs = [JobSpec("a", 0, "ncf", 1, 256)]
    cluster = ClusterSpec.with_gpus(4)
    fast = Simulator(jobs, cluster, models, SimConfig(restart_s=0)).run(make_policy("fifo"))
    slow = Simulator(jobs, cluster, models, SimConfig(restart_s=300)).run(make_policy("fifo"))
    assert slow.jct[0] == pytest.approx(fast.jct[0] + 300, rel=1e-6)


def test_placement_keeps_gpus_and_packs_nodes():
    owner = np.full(16, -1)
    owner[[0, 1, 4]] = 7
    out = place({7: 2, 8: 4, 9: 2}, owner, 4)
    assert set(out[7]) <= {0, 1, 4} and len(out[7]) == 2
    assert len(np.unique(out[8] // 4)) == 1  # 4 GPUs on one node
    every = np.concatenate(list(out.values()))
    assert len(np.unique(every)) == len(every)
    with pytest.raises(ValueError):
        place({1: 17}, np.full(16, -1), 4)
