"""ONES's fitness (completion time, slowdown, GPU-time), batch choice and greedy seed."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.cluster.jobs import ACTIVE, JobTable
from tessera.cluster.policies import ONES, ClusterSpec, ClusterView
from tessera.cluster.policies import ones_fitness as fit
from tessera.cluster.simulator import SimConfig, Simulator
from tessera.cluster.traces import JobSpec


def view_of(models, jobs, gpus=8):
    table = JobTable.build(jobs, models, 4)
    table.status[:] = ACTIVE
    owner = np.full(gpus, -1, dtype=np.int64)
    return ClusterView(0.0, ClusterSpec.with_gpus(gpus), models, table,
                       np.arange(len(jobs)), owner, 30.0, True, np.ones(len(jobs)))


def test_completion_fitness_spreads_a_scalable_job_where_gpu_time_does_not(models):
    view = view_of(models, [JobSpec("a", 0, "cifar10", 1, 128)])
    one = np.array([[0, -1, -1, -1, -1, -1, -1, -1]])  # the job on 1 GPU
    four = np.array([[0, 0, 0, 0, -1, -1, -1, -1]])  # on 4 GPUs (scaling below linear)
    ids = view.active
    gpu_time = ONES(objective="gpu_time")
    assert gpu_time.fitness(view, ids, one) < gpu_time.fitness(view, ids, four)
    for objective in ("jct", "slowdown"):
        ones = ONES(objective=objective)
        assert ones.fitness(view, ids, four) < ones.fitness(view, ids, one)


def test_a_queued_job_waits_for_the_first_gpu_to_free_up(models):
    view = view_of(models, [JobSpec("a", 0, "cifar10", 1, 128), JobSpec("b", 0, "ncf", 1, 256)])
    ones, ids = ONES(objective="jct"), view.active
    queued = ones.fitness(view, ids, np.array([[0, -1, -1, -1, -1, -1, -1, -1]]))
    both = ones.fitness(view, ids, np.array([[0, 1, -1, -1, -1, -1, -1, -1]]))
    t1 = ones._one_gpu_time(view, ids)
    # Idle GPUs do not count as free: b starts when a's GPU frees up.
    assert queued[0] == pytest.approx(t1[0] + (t1[0] + t1[1]) + 30.0, rel=1e-9)
    assert both[0] == pytest.approx(t1[0] + t1[1] + 60.0, rel=1e-9) and both[0] < queued[0]


def test_queued_jobs_take_freed_gpus_shortest_first_in_lanes():
    # Job 0 holds both GPUs for 10 s; queued jobs 1..3 need 5, 3 and 4 s on one GPU. Shortest
    # first: job 2 and job 3 start at 10 s (one freed GPU each), job 1 when job 2 ends (13 s).
    pop = np.array([[0, 0]])
    n = np.array([[2, 0, 0, 0]])
    t = np.array([[10.0, np.inf, np.inf, np.inf]])
    t1 = np.array([20.0, 5.0, 3.0, 4.0])
    total = fit.completion_sum(t, n, pop, t1, np.ones(4))
    assert total[0] == pytest.approx(10 + 13 + 14 + 18)
    weighted = fit.completion_sum(t, n, pop, t1, np.array([1.0, 0.5, 1.0, 1.0]))
    assert weighted[0] == pytest.approx(10 + 13 + 14 + 0.5 * 18)


def test_best_batch_is_within_bounds_and_beats_the_fixed_per_gpu_batch(models):
    view = view_of(models, [JobSpec("a", 0, "cifar10", 1, 128), JobSpec("b", 0, "bert", 1, 0)])
    ids = np.array([0, 0, 1, 1])
    n = np.array([1, 8, 1, 8])
    good, b = fit.best_batch(view, ids, n, np.ceil(n / 4))
    app = view.jobs.app[ids]
    assert (b >= models.param("base_batch", app)).all()
    assert (b <= models.param("max_batch", app)).all()
    linear = ONES(batching="linear").batch(view, ids, n)
    frac = view.jobs.fraction(ids)
    assert (good >= models.goodput(app, n, np.ceil(n / 4), linear, frac) - 1e-9).all()


def test_greedy_seed_respects_caps_fixed_jobs_and_the_cluster(models):
    jobs = [JobSpec(f"j{i}", 0, app, 1, 0) for i, app in enumerate(
        ["cifar10", "ncf", "bert", "imagenet", "yolov3"])]
    view = view_of(models, jobs, gpus=16)
    ids = view.active
    ones = ONES()
    t1 = ones._one_gpu_time(view, ids)
    cap = np.array([4, 4, 4, 4, 4])
    fixed = np.array([-1, 3, -1, -1, -1])  # job 1 is frozen on 3 GPUs
    counts = fit.greedy_counts(view, ids, t1, cap, fixed, 1.0 / t1)
    assert counts[1] == 3 and counts.sum() <= 16
    assert (counts >= 1).all() and (counts[[0, 2, 3, 4]] <= 4).all()


def test_ones_variants_finish_a_trace_and_bad_settings_are_refused(models):
    jobs = [JobSpec(f"j{i}", 60.0 * i, app, 2, 0)
            for i, app in enumerate(["cifar10", "ncf", "bert", "cifar10"])]
    for policy in (ONES(), ONES.artifact(), ONES(objective="jct", batching="linear")):
        result = Simulator(jobs, ClusterSpec.with_gpus(8), models, SimConfig()).run(policy)
        assert np.isfinite(result.finish).all()
    with pytest.raises(ValueError, match="objective must be one of"):
        ONES(objective="makespan")
    with pytest.raises(ValueError, match="batching must be linear or goodput"):
        ONES(batching="sqrt")
    with pytest.raises(ValueError, match="cap_growth_epochs must be > 0"):
        ONES(cap_growth_epochs=0)


def test_best_batch_per_distinct_triple_equals_the_full_goodput_grid(models):
    # best_batch prices each distinct (app, GPUs, nodes) once; the result must equal the
    # goodput over every row's own grid (same jobs at several counts, two jobs of one app).
    jobs = [JobSpec("a", 0, "cifar10", 1, 0), JobSpec("b", 0, "cifar10", 1, 0),
            JobSpec("c", 0, "bert", 1, 0)]
    view = view_of(models, jobs, gpus=16)
    view.jobs.progress[:] = [0.0, 0.3, 0.1] * view.jobs.work[:3]
    ids = np.array([0, 1, 2, 0, 1, 2, 0, 0])
    n = np.array([1, 1, 2, 4, 4, 8, 16, 4])
    nodes = np.array([1, 1, 1, 1, 2, 2, 4, 1])
    good, b = fit.best_batch(view, ids, n, nodes)
    app, frac = view.jobs.app[ids], view.jobs.fraction(ids)
    b0, bmax = models.param("base_batch", app), models.param("max_batch", app)
    lo = np.minimum(np.maximum(b0, np.ceil(models.param("min_local", app) * n)), bmax)
    grid = np.round(lo[:, None] * (bmax / lo)[:, None] ** np.linspace(0, 1, fit.BATCH_STEPS))
    full = models.goodput(app[:, None], n[:, None], nodes[:, None], grid, frac[:, None])
    assert np.array_equal(good, full.max(axis=1))
    assert np.array_equal(b, grid[np.arange(len(ids)), full.argmax(axis=1)])
    assert good[1] != good[0]  # same app and count, other progress: not shared by mistake
