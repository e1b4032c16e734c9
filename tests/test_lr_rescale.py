"""Warm-up of a changed learning rate after a resume (a resize that changed the batch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.cluster.real_executor import train_command
from tessera.cluster.realjobs import RealJob
from tessera.testing import train_tiny
from tessera.train.optim import PeakRamp


def test_the_peak_ramp_moves_linearly_from_the_old_peak_to_the_new():
    ramp = PeakRamp()
    assert [ramp(s) for s in range(3)] == [1.0, 1.0, 1.0]  # the identity until restarted
    ramp.restart(step=10, old_peak=1e-3, new_peak=2e-3, steps=4)
    assert [ramp(s) for s in (10, 11, 12, 13, 14)] == pytest.approx([0.625, 0.75, 0.875, 1, 1])
    ramp.restart(step=11, old_peak=2e-3, new_peak=4e-3, steps=2)  # during a ramp: from where it is
    assert ramp(11) == pytest.approx(0.75 * 0.5 + (1 - 0.75 * 0.5) / 2)


def _lrs(out: Path) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["lr"] for r in map(json.loads, lines) if "lr" in r and "step" in r}


def test_a_resumed_run_warms_a_changed_learning_rate_up(tmp_path):
    common = dict(train={"warmup_steps": 0, "lr_scheduler_type": "constant",
                         "logging_steps": 1, "learning_rate": 1e-3})
    train_tiny(tmp_path, "dp=1,mbs=4,gbs=4", steps=8, until=4, **common)
    common["train"].update(resume=True, learning_rate=2e-3, lr_rescale_warmup_steps=4)
    result, _ = train_tiny(tmp_path, "dp=1,mbs=4,gbs=8", steps=8, **common)
    lrs = _lrs(tmp_path)
    # Constant schedule: the rate logged at step k is the one step k trained at (the
    # optimizer's); the ramp's first step is a quarter of the way from the old peak.
    assert lrs[4] == pytest.approx(1e-3)  # logged by the first run
    assert [lrs[k] for k in (5, 6, 7, 8)] == pytest.approx([1.25e-3, 1.5e-3, 1.75e-3, 2e-3])
    # The ramp is saved with the checkpoint, so a resume in the middle of it continues it.
    meta = json.loads((Path(result.checkpoint) / "meta.json").read_text())
    assert meta["peak_ramp"] == {"start": 4, "steps": 4, "from_ratio": 0.5}


def test_real_mode_passes_the_jobs_warm_up_with_a_rescaled_rate():
    job = RealJob("a", devices=2, gbs=8, steps=10, mbs=4, max_gbs=16, lr=1e-3,
                  lr_warmup_steps=3)
    cmd = train_command(job, 2, Path("/out/a"), gbs=16)
    assert {"train.learning_rate=0.002", "train.lr_rescale_warmup_steps=3"} <= set(cmd)
