"""Real mode with real ``tessera train`` jobs (tiny model, a few steps, CPU workers)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tessera.cluster.launchers import LocalLauncher
from tessera.cluster.measured import Measurements
from tessera.cluster.policies import Assignment
from tessera.cluster.real_executor import RealExecutor
from tessera.cluster.realjobs import RealJob
from tessera.train.checkpoint import list_complete, read_meta

TINY = ("model.preset=tiny", "data.seq_len=32", "data.max_bytes=200000",
        "train.progress=lines", "train.logging_steps=1", "train.warmup_steps=2")


# Long enough that a pause requested after step 3 lands before the job ends on an idle machine.
STEPS = 60


def losses(out: Path) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if '"loss"' in x]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)), "step repeated/skipped"
    return {r["step"]: r["loss"] for r in steps}


def wait(executor: RealExecutor, until, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out"
        executor.poll(0.0)
        time.sleep(0.2)


@pytest.mark.slow
def test_a_resized_job_continues_exactly_from_its_checkpoint(tmp_path):
    # Job 0 starts on 2 devices and is shrunk to 1 mid-run; job 1 is the same job run on 1
    # device throughout, as the reference. Same gbs, so the same samples in the same order.
    jobs = (RealJob("resized", 2, 8, STEPS, 2, overrides=TINY),
            RealJob("straight", 1, 8, STEPS, 2, overrides=TINY))
    executor = RealExecutor(jobs, LocalLauncher(3), tmp_path, Measurements(),
                            threads_per_device=1)
    batch = lambda g: Assignment(np.array(g), 8)  # noqa: E731
    executor.apply({0: batch([0, 1]), 1: batch([2])}, 0.0)
    wait(executor, lambda: executor.runs[0].step >= 3)
    executor.apply({0: batch([0]), 1: batch([2])}, 0.0)  # pause -> checkpoint -> dp=1
    paused_at = read_meta(list_complete(tmp_path / "resized" / "checkpoints")[-1])
    wait(executor, lambda: all(r.finished for r in executor.runs))

    k = paused_at["step"]
    assert 3 <= k < STEPS and paused_at["strategy"] == "dp=2,tp=1,pp=1,mbs=2,gbs=8"
    final = read_meta(list_complete(tmp_path / "resized" / "checkpoints")[-1])
    assert final["step"] == STEPS and final["strategy"] == "dp=1,tp=1,pp=1,mbs=2,gbs=8"
    resized, straight = losses(tmp_path / "resized"), losses(tmp_path / "straight")
    assert len(resized) == len(straight) == STEPS
    # dp=2 and dp=1 see the same samples; only the order of float sums differs (mean of two
    # half-batch means vs one mean; 4 vs 2 accumulation steps), so the losses agree to ~1e-5.
    # A repeated or skipped batch after the resume would move the loss by ~1e-2.
    for step in range(1, STEPS + 1):
        assert resized[step] == pytest.approx(straight[step], abs=2e-4), step
    log = (tmp_path / "resized" / "launch.log").read_text()
    assert log.index("dp=2,tp=1,pp=1,mbs=2,gbs=8 on 2 worker") < log.index(
        "dp=1,tp=1,pp=1,mbs=2,gbs=8 on 1 worker")
    assert executor.runs[0].resizes == 1 and executor.runs[0].launches == 2


@pytest.mark.slow
def test_a_resize_with_a_new_batch_resumes_at_its_samples_with_the_scaled_rate(tmp_path):
    # 2 devices at gbs 4, then 1 device at gbs 8 (the policy's choice, up to max_gbs): the job
    # trains 200 x 4 = 800 samples in all, resuming the stream at the checkpoint's samples.
    # (200 steps, not fewer: on an idle machine a short job finished before its pause landed.)
    job = RealJob("grow", 2, 4, 200, 2, max_gbs=8, lr=1e-3,
                  overrides=(*TINY, "train.lr_scheduler_type=constant"))
    executor = RealExecutor((job,), LocalLauncher(2), tmp_path, Measurements(),
                            threads_per_device=1)
    ckpts = tmp_path / "grow" / "checkpoints"
    executor.apply({0: Assignment(np.array([0, 1]), 4)}, 0.0)
    wait(executor, lambda: executor.runs[0].step >= 3)
    executor.apply({0: Assignment(np.array([0]), 8)}, 0.0)  # pause -> checkpoint -> relaunch
    paused = read_meta(list_complete(ckpts)[-1])
    wait(executor, lambda: executor.runs[0].finished)

    k = paused["step"]
    assert 3 <= k < 200 and paused["strategy"] == "dp=2,tp=1,pp=1,mbs=2,gbs=4"
    assert paused["samples_consumed"] == 4 * k
    n = k + -(-(800 - 4 * k) // 8)  # the remaining samples at gbs 8, rounded up
    final = read_meta(list_complete(ckpts)[-1])
    assert final["step"] == n and final["strategy"] == "dp=1,tp=1,pp=1,mbs=2,gbs=8"
    assert final["samples_consumed"] == 4 * k + 8 * (n - k)  # none skipped or repeated
    assert sorted(losses(tmp_path / "grow")) == list(range(1, n + 1))
    records = [json.loads(x) for x in (tmp_path / "grow" / "metrics.jsonl").read_text()
               .splitlines() if '"loss"' in x]
    lr = {r["step"]: r["lr"] for r in records}
    # Linear scaling: the rate doubles with the batch (constant schedule after 2 warm-up steps).
    assert lr[k] == pytest.approx(1e-3) and lr[k + 1] == pytest.approx(2e-3)
    assert executor.runs[0].resizes == 1 and executor.runs[0].launches == 2


def tessera(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessera.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_cli_refuses_bad_job_files_before_starting(tmp_path):
    from click.testing import CliRunner

    from tessera.cluster.cli import cluster_group

    path = tmp_path / "jobs.yaml"
    path.write_text("jobs:\n  - {name: big, devices: 5, gbs: 8, steps: 3}\n")
    runner = CliRunner()
    result = runner.invoke(cluster_group, ["run", str(path), "--devices", "2", "--out",
                                           str(tmp_path / "out")])
    assert result.exit_code == 2
    assert f"{path}: job 1 ('big'): devices=5 exceeds the cluster's 2 device(s)" in result.output
    assert not (tmp_path / "out").exists()  # nothing was started
    result = runner.invoke(cluster_group, ["run", str(path), "--devices", "2", "--policy",
                                           "lottery"])
    assert result.exit_code == 2 and "unknown policy 'lottery'" in result.output


@pytest.mark.slow
def test_cli_runs_two_real_jobs_to_completion(tmp_path):
    path = tmp_path / "jobs.yaml"
    path.write_text(f"defaults:\n  overrides: {list(TINY)}\njobs:\n"
                    "  - {name: a, devices: 1, gbs: 4, mbs: 2, steps: 6}\n"
                    "  - {name: b, devices: 1, gbs: 4, mbs: 2, steps: 4}\n")
    result = tessera("cluster", "run", str(path), "--devices", "2", "--policy", "tiresias",
                     "--round-seconds", "2", "--out", str(tmp_path / "out"), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    jobs = {r["job"]: r for r in rows if "job" in r}
    assert {n: (r["status"], r["steps"]) for n, r in jobs.items()} == {
        "a": ("finished", 6), "b": ("finished", 4)}
    assert rows[-1]["finished"] == 2 and rows[-1]["devices"] == 2
    assert all(r["step_s_by_devices"] for r in jobs.values())  # measured from metrics.jsonl
    assert len(losses(tmp_path / "out" / "a")) == 6
    saved = json.loads((tmp_path / "out" / "throughput.json").read_text())
    assert set(saved["step_s"]) == {"a", "b"} and len(saved["startup_s"]) == 2
