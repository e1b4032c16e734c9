"""Policy behaviours on small hand-made traces where the right answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.cluster.policies import ONES, POLICIES, ClusterSpec, Tiresias, make_policy
from tessera.cluster.simulator import SimConfig, Simulator
from tessera.cluster.traces import JobSpec


def run(models, jobs, policy, gpus=8, **cfg):
    config = SimConfig(record_schedules=True, **cfg)
    return Simulator(jobs, ClusterSpec.with_gpus(gpus), models, config).run(policy)


def held(result, job):
    """GPUs held by ``job`` in each recorded round."""
    return np.array([(s == job).sum() for s in result.schedules])


def test_fifo_starts_in_arrival_order_without_preemption(models):
    jobs = [JobSpec("long", 0, "cifar10", 8, 1024), JobSpec("small", 60, "ncf", 1, 256)]
    r = run(models, jobs, make_policy("fifo"))
    long_gpus, small_gpus = held(r, 0), held(r, 1)
    assert set(long_gpus[long_gpus > 0]) == {8}  # never resized or preempted
    first_small = np.argmax(small_gpus > 0)
    assert r.finish[0] <= r.timeline_t[first_small]  # small waited for long to finish


def test_srtf_short_job_preempts_long_one(models):
    jobs = [JobSpec("long", 0, "imagenet", 8, 1600), JobSpec("short", 120, "ncf", 8, 2048)]
    r = run(models, jobs, make_policy("srtf"))
    assert r.finish[1] < r.finish[0]
    assert r.restarts[0] == 2  # started, preempted, resumed


def test_tiresias_demotes_by_attained_service(models):
    # With a tiny threshold the first job is demoted after one round and the newcomer, with
    # no attained service, takes the whole cluster.
    jobs = [JobSpec("old", 0, "imagenet", 8, 1600), JobSpec("new", 600, "imagenet", 8, 1600)]
    r = run(models, jobs, Tiresias(thresholds_gpu_h=(0.5,)), max_time=3000)
    idx = int(np.searchsorted(r.timeline_t, 660))
    assert held(r, 1)[idx] == 8 and held(r, 0)[idx] == 0
    high = run(models, jobs, Tiresias(thresholds_gpu_h=(1e6,)), max_time=3000)
    assert held(high, 1)[idx] == 0  # one queue: FIFO, the old job keeps running


def test_optimus_grows_a_lone_scalable_job(models):
    r = run(models, [JobSpec("a", 0, "cifar10", 2, 2048)], make_policy("optimus"), gpus=16)
    assert held(r, 0).max() > 2


def test_pollux_grows_batch_and_gpus_for_a_lone_job(models):
    r = run(models, [JobSpec("a", 0, "cifar10", 1, 128)], make_policy("pollux"), gpus=16)
    assert held(r, 0).max() > 1


def test_ones_artifact_starts_jobs_on_one_gpu_and_grows_them(models):
    r = run(models, [JobSpec("a", 0, "cifar10", 4, 512)], ONES.artifact(), gpus=16)
    counts = held(r, 0)
    assert counts[0] == 1 and counts.max() > 1
    assert counts.max() <= 16  # cap_factor 4 x requested 4


def test_ones_resizes_at_most_once_per_epoch(models):
    jobs = [JobSpec(f"j{i}", 90 * i, "cifar10", 2, 256) for i in range(6)]
    r = run(models, jobs, ONES(max_epoch_s=None), gpus=8)
    epochs_total = models.models[models.index("cifar10")].target_progress / 50048
    # every change after the first start needs an epoch of progress since the previous one
    assert np.all(r.restarts - 1 <= np.ceil(epochs_total) + 1)
    assert np.all(r.resizes <= r.restarts)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_finishes_every_job(models, name):
    jobs = [JobSpec(f"j{i}", 200 * i, app, g, b) for i, (app, g, b) in enumerate(
        [("ncf", 1, 256), ("cifar10", 2, 256), ("ncf", 4, 1024), ("cifar10", 1, 128),
         ("yolov3", 2, 16)])]
    r = run(models, jobs, make_policy(name))
    assert np.all(~np.isnan(r.finish)) and np.all(r.jct > 0)
