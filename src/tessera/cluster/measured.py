"""Job models fitted from measured tessera jobs (real mode's throughput profiles).

A running tessera job appends ``tokens_per_s`` to ``metrics.jsonl`` at every logging step.
Real mode turns each record into a step time ``T(n) = gbs * seq_len / tokens_per_s`` at the
device count ``n`` the job ran on, keeps the last :data:`KEEP` per count (the ONES artifact
also uses the mean of its last 5 measurements), and fits the simulator's throughput model
(:mod:`tessera.cluster.job_model`) to their medians:

* compute: ``T_c(local) = b * local`` with ``b = T(1) / gbs`` — the one-device step time split
  evenly over the samples (with one global batch size per job, the fixed part ``a`` and the
  per-sample part cannot be told apart, so ``a = 0``: ideal compute scaling);
  without a one-device measurement, ``T(1)`` is ``n * T(n)`` of the smallest measured ``n``.
* network: ``T_net(n) = T(n) - T(1) / n`` for ``n > 1``, a least-squares line in ``n - 2``
  (the model's ``alpha + beta (n - 2)``), one node so intra = inter; overlap exponent 1
  (additive), since nothing measured separates compute from communication.
* before any measurement: ideal scaling with ``prior_sample_s`` seconds per sample.

Step times measured at another batch (a job may run between its ``gbs`` and ``max_gbs``, see
:mod:`tessera.cluster.realjobs`) are scaled to the job's ``gbs`` per sample before they are kept.
Statistical efficiency is 1 (no gradient statistics are measured), so a job's work is
``steps * gbs`` samples at any batch, and a policy sees no statistical cost in a larger batch:
``max_gbs`` is the user's bound on how far that may go.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict, deque
from pathlib import Path

import numpy as np

from tessera.cluster.job_model import AppModel, JobModels, _lstsq_line
from tessera.cluster.realjobs import RealJob

KEEP = 5
# log(phi / B0) = 20: a noise scale so large that eff(B) = 1 for every batch.
FLAT_EFFICIENCY = (20.0, 0.0, 0.0)


class Measurements:
    """Measured step seconds per job and device count (the last :data:`KEEP` of each)."""

    def __init__(self) -> None:
        self._steps: dict[str, dict[int, deque]] = defaultdict(dict)
        self._startups: deque = deque(maxlen=4 * KEEP)

    def add_startup(self, seconds: float) -> None:
        """Record one launch's start-up: from the launch to its first logged step."""
        if seconds > 0 and math.isfinite(seconds):
            self._startups.append(float(seconds))

    def restart_s(self, default: float) -> float:
        """Median measured start-up (the cost of a restart), or ``default`` before any."""
        return float(np.median(self._startups)) if self._startups else default

    def add(self, job: str, devices: int, step_s: float) -> None:
        """Record one logging window's mean step time of ``job`` on ``devices`` devices."""
        if step_s > 0 and math.isfinite(step_s):
            self._steps[job].setdefault(devices, deque(maxlen=KEEP)).append(float(step_s))

    def medians(self, job: str) -> dict[int, float]:
        """Median step seconds of ``job`` per device count measured."""
        return {n: float(np.median(v)) for n, v in sorted(self._steps.get(job, {}).items())}

    def save(self, path: Path) -> None:
        """Write every kept measurement as JSON (read back by :meth:`load`)."""
        steps = {job: {str(n): list(v) for n, v in per.items()}
                 for job, per in self._steps.items()}
        data = {"step_s": steps, "startup_s": list(self._startups)}
        path.write_text(json.dumps(data, indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: Path) -> "Measurements":
        """Measurements saved by :meth:`save` (empty if ``path`` does not exist)."""
        out = cls()
        if path.is_file():
            data = json.loads(path.read_text())
            for job, per in data.get("step_s", {}).items():
                for n, values in per.items():
                    for v in values:
                        out.add(job, int(n), v)
            for v in data.get("startup_s", []):
                out.add_startup(v)
        return out


def step_seconds(record: dict, gbs: int, seq_len: int) -> float | None:
    """Mean optimizer-step seconds of one metrics record (None if it has no throughput)."""
    tps = record.get("tokens_per_s")
    if not isinstance(tps, (int, float)) or tps <= 0:
        return None
    return gbs * seq_len / float(tps)


def fit_job(job: RealJob, medians: dict[int, float], prior_sample_s: float) -> AppModel:
    """The job model of one real job from its median step seconds per device count."""
    if medians:
        n_min = min(medians)
        t1 = medians.get(1, n_min * medians[n_min])
    else:
        t1 = prior_sample_s * job.gbs
    multi = np.array([n for n in medians if n > 1], dtype=float)
    sync = np.array([medians[int(n)] - t1 / n for n in multi])
    alpha, beta = _lstsq_line(multi - 2, np.maximum(sync, 0.0)) if multi.size else (1e-6, 0.0)
    epochs = math.ceil(job.steps / job.epoch_steps)
    return AppModel(name=job.name, compute_a=0.0, compute_b=t1 / job.gbs, intra_a=alpha,
                    intra_b=beta, inter_a=alpha, inter_b=beta, gamma=1.0, min_local=1.0,
                    max_local=float(job.max_gbs), base_batch=job.gbs, max_batch=job.max_gbs,
                    epoch_samples=float(job.epoch_steps * job.gbs), target_metric=0.0,
                    target_epochs=epochs, target_progress=float(job.steps * job.gbs),
                    phi_coef=FLAT_EFFICIENCY)


def fit_models(jobs: tuple[RealJob, ...], measured: Measurements,
               prior_sample_s: float) -> JobModels:
    """One application model per real job (the job's name is its application)."""
    return JobModels([fit_job(j, measured.medians(j.name), prior_sample_s) for j in jobs])
