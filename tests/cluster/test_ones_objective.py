"""ONES's alternative fitness (objective="jct") against the artifact's GPU-time fitness."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.cluster.policies import ONES, ClusterSpec, ClusterView
from tessera.cluster.jobs import ACTIVE, JobTable
from tessera.cluster.simulator import SimConfig, Simulator
from tessera.cluster.traces import JobSpec


def view_of(models, jobs, gpus=8):
    table = JobTable.build(jobs, models, 4)
    table.status[:] = ACTIVE
    owner = np.full(gpus, -1, dtype=np.int64)
    return ClusterView(0.0, ClusterSpec.with_gpus(gpus), models, table,
                       np.arange(len(jobs)), owner, 30.0, True, np.ones(len(jobs)))


def test_jct_fitness_prefers_spreading_a_scalable_job_where_gpu_time_does_not(models):
    view = view_of(models, [JobSpec("a", 0, "cifar10", 1, 128)])
    one = np.array([[0, -1, -1, -1, -1, -1, -1, -1]])  # the job on 1 GPU
    four = np.array([[0, 0, 0, 0, -1, -1, -1, -1]])  # on 4 GPUs (scaling below linear)
    gpu_time, jct = ONES(), ONES(objective="jct")
    assert gpu_time.fitness(view, view.active, one) < gpu_time.fitness(view, view.active, four)
    assert jct.fitness(view, view.active, four) < jct.fitness(view, view.active, one)


def test_jct_fitness_charges_a_queued_job_its_wait_and_run(models):
    view = view_of(models, [JobSpec("a", 0, "cifar10", 1, 128), JobSpec("b", 0, "ncf", 1, 256)])
    ones = ONES(objective="jct")
    ids = view.active
    both = ones.fitness(view, ids, np.array([[0, 1, -1, -1, -1, -1, -1, -1]]))
    queued = ones.fitness(view, ids, np.array([[0, -1, -1, -1, -1, -1, -1, -1]]))
    t = view.predicted_time(ids, 1, ones.batch(view, ids, 1))
    assert queued[0] == pytest.approx(t[0] + t[0] + t[1] + 30.0, rel=1e-9)  # b waits for a
    assert both[0] < queued[0]


def test_ones_jct_finishes_a_trace_and_bad_objectives_are_refused(models):
    jobs = [JobSpec(f"j{i}", 60.0 * i, app, 2, 0)
            for i, app in enumerate(["cifar10", "ncf", "bert", "cifar10"])]
    result = Simulator(jobs, ClusterSpec.with_gpus(8), models, SimConfig()).run(
        ONES(objective="jct", max_epoch_s=300.0))
    assert np.isfinite(result.finish).all()
    with pytest.raises(ValueError, match="objective must be gpu_time or jct"):
        ONES(objective="makespan")
