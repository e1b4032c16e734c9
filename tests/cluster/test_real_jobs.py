"""Real mode without training: job files, strategies, the device ledger, measured models."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.cluster.measured import Measurements, fit_job, fit_models
from tessera.cluster.policies import POLICIES
from tessera.cluster.real_executor import DeviceLedger, train_command
from tessera.cluster.realjobs import JobFileError, RealJob, load_jobs
from tessera.cluster.simulator import SchedulingError

GOOD = """
policy: tiresias
defaults:
  overrides: [model.preset=tiny]
jobs:
  - {name: a, devices: 2, gbs: 8, mbs: 2, steps: 10}
  - {name: b, devices: 1, gbs: 4, steps: 5, arrival: 3, overrides: [train.seed=1]}
"""


def write(tmp_path, text):
    path = tmp_path / "jobs.yaml"
    path.write_text(text)
    return path


def test_a_good_file_is_read_with_defaults_merged(tmp_path):
    parsed = load_jobs(write(tmp_path, GOOD), 3, tuple(POLICIES))
    assert parsed.policy == "tiresias"
    a, b = parsed.jobs
    assert (a.name, a.devices, a.gbs, a.mbs, a.steps, a.epoch_steps) == ("a", 2, 8, 2, 10, 2)
    assert b.overrides == ("model.preset=tiny", "train.seed=1") and b.arrival == 3.0
    assert b.mbs == 4  # default gbs / devices


@pytest.mark.parametrize("entry, fragment", [
    ("- {name: a, gbs: 8, steps: 10}", "job 1 ('a'): missing field(s) devices"),
    ("- {name: a, devices: 4, gbs: 8, steps: 10}", "job 1 ('a'): devices=4 exceeds the "
     "cluster's 3 device(s)"),
    ("- {name: a, devices: 2, gbs: 6, mbs: 2, steps: 10}", "job 1 ('a'): at devices=2"),
    ("- {name: a, devices: 1, gbs: 8, steps: 10, overrides: [train.max_steps=3]}",
     "override train.max_steps is set by the scheduler"),
    ("- {name: a, devices: 1, gbs: 8, steps: 0}", "steps must be >= 1"),
    ("- {name: a, devices: 1, gbs: 8, steps: 2, gpus: 1}", "unknown key(s) gpus"),
    ("- {name: a, devices: 1, gbs: 8, steps: 2, max_gbs: 4}", "max_gbs=4 must be >= gbs=8"),
    ("- {name: a, devices: 1, gbs: 8, steps: 2, max_gbs: 16, lr: -1}",
     "lr must be a positive number"),
    ("- {name: a, devices: 1, gbs: 8, steps: 2, max_gbs: 16, overrides: [train.bogus=1]}",
     "cannot read the learning rate to scale with gbs"),
    ("- {name: a, devices: 1, gbs: 8, steps: 2}\n  - {name: a, devices: 1, gbs: 8, steps: 2}",
     "job 2 ('a'): duplicate job name"),
])
def test_bad_entries_are_refused_naming_file_and_entry(tmp_path, entry, fragment):
    path = write(tmp_path, f"jobs:\n  {entry}\n")
    with pytest.raises(JobFileError) as err:
        load_jobs(path, 3, tuple(POLICIES))
    assert str(err.value).startswith(f"{path}: ") and fragment in str(err.value)


def test_unknown_policy_and_empty_file_are_refused(tmp_path):
    path = write(tmp_path, "policy: lottery\njobs:\n  - {name: a, devices: 1, gbs: 1, steps: 1}\n")
    with pytest.raises(JobFileError, match=r"jobs.yaml: policy: unknown policy 'lottery'"):
        load_jobs(path, 2, tuple(POLICIES))
    with pytest.raises(JobFileError, match="non-empty 'jobs' list"):
        load_jobs(write(tmp_path, "jobs: []\n"), 2, tuple(POLICIES))


def test_device_counts_become_strategies_with_the_same_global_batch():
    job = RealJob("a", devices=2, gbs=8, steps=10, mbs=4)
    assert [job.usable_devices(n) for n in range(0, 10)] == [0, 1, 2, 2, 4, 4, 4, 4, 8, 8]
    assert job.strategy(1).to_text() == "dp=1,tp=1,pp=1,mbs=4,gbs=8"  # accumulation 2
    assert job.strategy(4).to_text() == "dp=4,tp=1,pp=1,mbs=2,gbs=8"  # mbs lowered to fit
    with pytest.raises(ValueError, match="3 devices do not divide gbs=8"):
        job.strategy(3)
    cmd = train_command(job, 2, "/out/a")
    assert cmd[3:4] == ["train"] and cmd[-3:] == ["--nproc", "2", "--resume"]
    assert {"strategy=dp=2,tp=1,pp=1,mbs=4,gbs=8", "train.max_steps=10",
            "train.output_dir=/out/a"} <= set(cmd)


def test_the_ledger_never_gives_a_device_twice():
    ledger = DeviceLedger(3)
    ledger.acquire(0, [0, 1])
    with pytest.raises(SchedulingError, match=r"device 1 assigned twice \(jobs 0 and 1\)"):
        ledger.acquire(1, [1, 2])
    assert ledger.held(1) == []  # a refused request takes nothing
    with pytest.raises(SchedulingError, match="listed twice"):
        ledger.acquire(1, [2, 2])
    with pytest.raises(SchedulingError, match=r"in \[0, 3\)"):
        ledger.acquire(1, [3])
    ledger.release(0)
    ledger.acquire(1, [0, 1, 2])
    assert ledger.held(1) == [0, 1, 2]


def test_measured_step_times_fit_the_job_model(tmp_path):
    job = RealJob("a", devices=2, gbs=8, steps=100, mbs=2, epoch_steps=10)
    measured = Measurements()
    for n, t in ((1, 1.0), (2, 0.6), (4, 0.45)):
        for noise in (0.98, 1.0, 1.02):
            measured.add("a", n, t * noise)
    models = fit_models((job,), measured, prior_sample_s=0.01)
    pred = models.step_time(np.zeros(3, dtype=int), [1, 2, 4], [1, 1, 1], 8)
    np.testing.assert_allclose(pred, [1.0, 0.6, 0.45], rtol=0.05)
    assert models.param("target_progress", 0) == 800 and models.param("epoch_samples", 0) == 80
    assert models.efficiency(0, 8, 0.5) == pytest.approx(1.0, abs=1e-6)
    prior = fit_job(job, {}, prior_sample_s=0.01)  # unmeasured: ideal scaling
    assert prior.compute_b == pytest.approx(0.01)
    assert measured.restart_s(30.0) == 30.0  # nothing measured yet: the default
    for s in (12.0, 20.0, 14.0):
        measured.add_startup(s)
    assert measured.restart_s(30.0) == 14.0
    measured.save(tmp_path / "t.json")
    loaded = Measurements.load(tmp_path / "t.json")
    assert loaded.medians("a") == measured.medians("a") and loaded.restart_s(30.0) == 14.0


def test_the_documented_example_job_file_is_valid():
    from pathlib import Path

    path = Path(__file__).with_name("data") / "jobs_tiny.yaml"
    parsed = load_jobs(path, 3, tuple(POLICIES))
    assert [j.name for j in parsed.jobs] == ["long", "mid", "short"] and parsed.policy == "ones"
    with pytest.raises(JobFileError, match="'long'.*exceeds the cluster's 1 device"):
        load_jobs(path, 1, tuple(POLICIES))
