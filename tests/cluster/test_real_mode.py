"""Real mode's scheduling loop, executor and backends, driving a stand-in trainer.

``fake_train.py`` keeps the contract of ``tessera train`` (metrics.jsonl, PAUSE, resume from its
checkpoint, exit codes) in milliseconds, so these tests exercise resizing, crashes, retries
and failures under real policies without the cost of real training (see
``test_real_training.py`` for that).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tessera.cluster.launchers import LocalLauncher
from tessera.cluster.measured import Measurements
from tessera.cluster.policies import Assignment, ClusterSpec, Policy, make_policy
from tessera.cluster.real_executor import RealExecutor
from tessera.cluster.realjobs import RealJob
from tessera.cluster.realmode import RealConfig, RealRunner, order_jobs
from tessera.cluster.real_executor import train_command
from tessera.cluster.simulator import SchedulingError

FAKE = str(Path(__file__).with_name("fake_train.py"))
FAST = RealConfig(round_s=0.5, poll_s=0.05, restart_s=1.0, max_time=60)


def fake_command(job: RealJob, devices: int, out: Path, gbs: int, max_steps: int) -> list[str]:
    real = train_command(job, devices, out, gbs, max_steps)
    return [sys.executable, FAKE, *real[real.index("train") + 1:]]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run(tmp_path, jobs, policy="optimus", devices=3, launcher=None):
    jobs = order_jobs(tuple(jobs))
    measured = Measurements()
    launcher = RecordingLauncher(launcher or LocalLauncher(devices))
    executor = RealExecutor(jobs, launcher, tmp_path, measured,
                            pause_timeout=30, command=fake_command)
    runner = RealRunner(jobs, ClusterSpec(1, devices), executor, measured, FAST)
    policy = make_policy(policy) if isinstance(policy, str) else policy
    result = runner.run(policy)
    launcher.assert_no_device_twice()
    return result, measured


class RecordingLauncher:
    """Wraps a launcher; records when each process held which devices (start to exit)."""

    def __init__(self, inner) -> None:
        self.inner, self.spans = inner, []
        self.nodes, self.devices_per_node = inner.nodes, inner.devices_per_node

    def start(self, argv, env, log, devices, node=0):
        handle = self.inner.start(argv, env, log, devices, node)
        span = {"devices": set(devices), "start": time.monotonic(), "end": None}
        self.spans.append(span)

        class Recorded:
            def poll(self):
                code = handle.poll()
                if code is not None and span["end"] is None:
                    span["end"] = time.monotonic()
                return code

            def stop(self):
                handle.stop()
                span["end"] = span["end"] or time.monotonic()

        return Recorded()

    def assert_no_device_twice(self):
        """No two processes ever ran on one device at the same time."""
        assert self.spans and all(s["end"] is not None for s in self.spans)
        for i, a in enumerate(self.spans):
            for b in self.spans[i + 1:]:
                if a["devices"] & b["devices"]:
                    assert a["end"] <= b["start"] or b["end"] <= a["start"], (a, b)


@pytest.mark.parametrize("policy", ["optimus", "ones"])
def test_policies_resize_jobs_and_no_step_is_repeated_or_skipped(tmp_path, policy):
    # b (unmeasured: ideal scaling at the prior) gains more from another device than a does,
    # so both policies shrink a a round or two after b arrives. a is long enough (120 steps,
    # over 3 s) that the resize lands before a ends: with 60 steps ONES's resize of a raced
    # a's last steps and, under load, sometimes came after it.
    jobs = [RealJob("a", 1, 8, 120, 2, epoch_steps=5),
            RealJob("b", 1, 8, 150, 2, arrival=1.0, epoch_steps=5)]
    result, measured = run(tmp_path, jobs, policy)
    assert result.steps == [120, 150] and not any(result.failed)
    assert np.isfinite(result.sim.finish).all()
    assert result.sim.resizes.sum() >= 1  # at least one job ran on two device counts
    for name, steps in (("a", 120), ("b", 150)):
        logged = records(tmp_path / name)
        assert [r["step"] for r in logged] == list(range(1, steps + 1))
    dps = {r["dp"] for r in records(tmp_path / "a")} | {r["dp"] for r in records(tmp_path / "b")}
    assert len(dps) > 1  # a relaunch really changed the data-parallel size
    assert measured.medians("a")  # step times were measured from the metrics
    assert 0 < measured.restart_s(-1.0) < 30  # and start-ups, from launch to first step


def test_a_crash_is_retried_and_an_incurable_job_fails_alone(tmp_path):
    jobs = [RealJob("flaky", 1, 4, 20, 4, overrides=("fake.crash_at=5",)),
            RealJob("doomed", 1, 4, 20, 4, retries=1,
                    overrides=("fake.crash_at=3", "fake.crash_always=1")),
            RealJob("fine", 1, 4, 20, 4)]
    result, _ = run(tmp_path, jobs, "fifo")
    names = [j.name for j in order_jobs(tuple(jobs))]
    by = dict(zip(names, zip(result.steps, result.failed)))
    assert by["flaky"] == (20, False) and by["fine"] == (20, False)
    assert by["doomed"][1] is True
    text = "\n".join(result.events)
    assert "flaky: crashed (exit code 3: RuntimeError: injected crash); retry 1/2" in text
    assert "doomed: failed after 2 crash(es)" in text
    # The crashed step (logged, not checkpointed) is trained again after the retry.
    flaky = [r["step"] for r in records(tmp_path / "flaky")]
    assert flaky == [1, 2, 3, 4, 5, *range(5, 21)]


class GrowBatch(Policy):
    """One device at batch 4 for the first second, then two devices at batch 16."""

    name = "grow"

    def schedule(self, view):
        if view.time < 1.0:
            return {0: Assignment(np.array([0]), 4)}
        return {0: Assignment(np.array([0, 1]), 16)}


def test_a_resize_changes_the_batch_and_trains_the_same_samples(tmp_path):
    # 40 steps at gbs 4 = 160 samples; after the switch to gbs 16 the job runs only as many
    # steps as the remaining samples need, with the learning rate scaled 4x.
    job = RealJob("a", 1, 4, 40, 2, max_gbs=16, lr=1e-3, overrides=("fake.step_s=0.1",))
    result, _ = run(tmp_path, [job], GrowBatch(), devices=2)
    logged = records(tmp_path / "a")
    steps = [r["step"] for r in logged]
    assert steps == list(range(1, len(steps) + 1)) and not result.failed[0]
    gbs = [r["gbs"] for r in logged]
    k = gbs.index(16)  # steps trained at gbs 4 before the switch
    assert 0 < k < 40 and set(gbs[:k]) == {4} and set(gbs[k:]) == {16}
    assert len(steps) == k + -(-(160 - 4 * k) // 16)  # the remaining samples, rounded up
    assert {r["lr"] for r in logged[:k]} == {1e-3} and {r["lr"] for r in logged[k:]} == {4e-3}
    assert {r["dp"] for r in logged[k:]} == {2} and result.steps == [len(steps)]


def test_ones_chooses_a_batch_once_and_keeps_it_while_the_count_holds(tmp_path):
    # Measured jobs have efficiency 1, so ONES takes the largest batch allowed on both devices;
    # later rounds keep the count and must keep the running batch too (no relaunch).
    job = RealJob("a", 1, 4, 120, 2, max_gbs=16, lr=1e-3, epoch_steps=5)
    result, _ = run(tmp_path, [job], "ones", devices=2)
    logged = records(tmp_path / "a")
    assert {(r["gbs"], r["dp"], r["lr"]) for r in logged} == {(16, 2, 4e-3)}
    assert [r["step"] for r in logged] == list(range(1, 31)) and result.steps == [30]
    assert result.sim.restarts.tolist() == [1]  # one launch, never relaunched


def test_run_shape_fits_the_policy_batch_to_the_devices():
    job = RealJob("a", 1, 8, 10, 2, max_gbs=32)
    assert job.run_shape(3, 32) == (3, 30)  # a multiple of the device count
    assert job.run_shape(3, 8) == (2, 8)  # gbs itself cannot split 3 ways: 2 devices
    assert job.run_shape(4, 100) == (4, 32) and job.run_shape(2, 1) == (2, 8)  # clamped
    assert RealJob("b", 1, 8, 10, 2).run_shape(3, 32) == (2, 8)  # max_gbs = gbs: fixed batch


class DoubleBooker(Policy):
    name = "double"

    def schedule(self, view):
        return {int(j): Assignment(np.array([0]), 4) for j in view.active}


def test_a_schedule_giving_a_device_twice_is_refused_and_jobs_are_stopped(tmp_path):
    jobs = [RealJob("a", 1, 4, 1000, 4), RealJob("b", 1, 4, 1000, 4)]
    launcher = RecordingLauncher(LocalLauncher(2))
    with pytest.raises(SchedulingError, match=r"GPU 0 assigned twice \(jobs 0 and 1\)"):
        run(tmp_path, jobs, DoubleBooker(), devices=2, launcher=launcher)
    assert launcher.spans == []  # refused before anything started


def test_ray_backend_runs_jobs_on_a_local_instance(tmp_path):
    pytest.importorskip("ray")
    from tessera.cluster.launchers import RayLauncher

    launcher = RayLauncher(None, local_devices=2)
    try:
        assert (launcher.nodes, launcher.devices_per_node) == (1, 2)
        jobs = [RealJob("a", 1, 4, 30, 4), RealJob("b", 1, 4, 15, 4, arrival=0.5)]
        result, _ = run(tmp_path, jobs, "optimus", devices=2, launcher=launcher)
    finally:
        launcher.shutdown()
    assert result.steps == [30, 15] and not any(result.failed)
    assert [r["step"] for r in records(tmp_path / "a")] == list(range(1, 31))
