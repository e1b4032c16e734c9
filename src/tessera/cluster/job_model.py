"""Job models fitted from the measured application profiles.

Throughput (samples/s) of a job on ``n`` GPUs spread over ``m`` nodes at global batch ``B``::

    local  = B / n,  split into k = ceil(local / max_local) accumulation micro-steps of l = local/k
    T_c    = a + b * l                                        # compute of one micro-step
    T_net  = 0 if n == 1 else alpha + beta * (n - 2)          # (alpha, beta): in / across nodes
    T_step = (k - 1) * T_c + (T_c**g + T_net**g) ** (1 / g)   # g in [1, 10]: overlap of the two
    throughput = B / T_step

Statistical efficiency (useful work per sample at batch ``B`` relative to the base batch ``B0``)
follows the gradient-noise-scale law: with noise scale ``phi`` (in samples)
``eff(B) = (phi + B0) / (phi + B)``. ``phi`` grows as training goes on; ``log(phi / B0)`` is fitted
as a quadratic in the training fraction from the base-batch run's gradient statistics.

A job's work is the *progress* it needs: base-batch samples to reach the application's target
metric. Progress accrues at ``throughput * eff`` per second (goodput).

Learning rate: when a job's batch grows from ``B1`` to ``B2`` the learning rate is scaled linearly
(``lr ∝ B``, capped at the largest profiled batch, which bounds the batch) and warmed up linearly
over one epoch. Because progress per step scales with the learning rate, that epoch makes progress
at ``(B1 + B2) / (2 * B2)`` of the full rate; shrinking takes effect at once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from tessera.cluster.profiles import APPS, HIGHER_IS_BETTER, AppProfile, load_profile

# The target metric is the worst best-metric over the profiled batch sizes, loosened by this
# fraction so that one lucky epoch does not decide the target.
TARGET_SLACK = 0.01
GAMMAS = np.round(np.arange(1.0, 10.0001, 0.05), 2)
# Offsets of log(phi) tried when calibrating the noise scale against the larger-batch runs.
PHI_SHIFTS = np.round(np.arange(0.0, 8.0001, 0.25), 2)


@dataclass(frozen=True)
class AppModel:
    """Fitted parameters of one application (see the module docstring for the formulas)."""

    name: str
    compute_a: float
    compute_b: float
    intra_a: float
    intra_b: float
    inter_a: float
    inter_b: float
    gamma: float
    min_local: float
    max_local: float
    base_batch: int
    max_batch: int
    epoch_samples: float
    target_metric: float
    target_epochs: int
    target_progress: float  # base-batch samples to reach the target
    phi_coef: tuple[float, float, float]  # log(phi/B0) = c0 + c1 f + c2 f^2


def _lstsq_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    if len(x) == 0:
        return 0.0, 0.0
    if len(np.unique(x)) < 2:
        return float(np.mean(y)), 0.0
    b, a = np.polyfit(x, y, 1)
    return max(float(a), 1e-6), max(float(b), 0.0)


def _net_time(n, m, intra_a, intra_b, inter_a, inter_b):
    net = np.where(m > 1, inter_a + inter_b * (n - 2), intra_a + intra_b * (n - 2))
    return np.where(n > 1, np.maximum(net, 1e-6), 0.0)


def _step_time(n, m, local, a, b, ia, ib, xa, xb, gamma, max_local):
    k = np.maximum(np.ceil(local / max_local - 1e-9), 1.0)
    tc = a + b * (local / k)
    tn = _net_time(n, m, ia, ib, xa, xb)
    return (k - 1.0) * tc + (tc ** gamma + tn ** gamma) ** (1.0 / gamma)


def _fit_throughput(p: AppProfile) -> dict[str, float]:
    s = p.steps
    one = s.gpus == 1
    a, b = _lstsq_line(s.local_bsz[one], s.step_time[one])
    intra = (s.gpus > 1) & (s.nodes == 1)
    inter = s.nodes > 1
    ia, ib = _lstsq_line(s.gpus[intra] - 2, s.sync_time[intra])
    xa, xb = _lstsq_line(s.gpus[inter] - 2, s.sync_time[inter])
    multi = s.gpus > 1
    max_local = float(s.local_bsz.max())
    best, best_err = 1.0, np.inf
    for g in GAMMAS:  # one-dimensional, so an exhaustive grid is exact enough and deterministic
        pred = _step_time(s.gpus[multi], s.nodes[multi], s.local_bsz[multi], a, b, ia, ib, xa,
                          xb, g, max_local)
        err = float(np.mean(np.abs(np.log(pred / s.step_time[multi]))))
        if err < best_err:
            best, best_err = float(g), err
    return dict(compute_a=a, compute_b=b, intra_a=ia, intra_b=ib, inter_a=xa, inter_b=xb,
                gamma=best, min_local=float(s.local_bsz.min()), max_local=max_local)


def first_reach(metric: np.ndarray, target: float, higher: bool) -> int | None:
    """1-based first epoch whose metric reaches ``target`` (None if none does)."""
    hit = metric >= target if higher else metric <= target
    idx = np.flatnonzero(hit)
    return int(idx[0]) + 1 if len(idx) else None


def predict_epochs(b0: float, epoch_samples: float, target_progress: float,
                   phi_coef, run) -> int:
    """Epochs the efficiency model needs to reach the target with the batches ``run`` used.

    Each epoch of the run used an average batch of ``epoch_samples / steps in that epoch``; the
    model credits that epoch with ``epoch_samples * eff(batch, fraction)`` progress, the
    fraction being the run's own measured progress (so the sum is vectorised).

    Returns:
        The first epoch at which the credited progress reaches ``target_progress``.
    """
    steps = np.maximum(np.diff(np.concatenate([[0.0], run.iteration])), 1.0)
    batch = epoch_samples / steps
    frac = np.clip(np.concatenate([[0.0], run.progress[:-1]]) * b0 / target_progress, 0, 1)
    c = phi_coef
    phi = b0 * np.exp(np.clip(c[0] + c[1] * frac + c[2] * frac * frac, -20, 20))
    eff = np.minimum((phi + b0) / (phi + batch), 1.0)
    done = np.cumsum(epoch_samples * eff)
    hit = np.flatnonzero(done >= target_progress * (1 - 1e-2))  # epoch-size rounding
    if len(hit):
        return int(hit[0]) + 1
    # Past the recorded epochs, continue at the last epoch's batch and efficiency.
    extra = (target_progress - done[-1]) / (epoch_samples * eff[-1])
    return len(done) + int(np.ceil(extra - 1e-9))


def _epoch_errors(b0, epoch_samples, target_progress, coef, runs, target, higher):
    errs = []
    for run in runs:
        measured = first_reach(run.metric, target, higher)
        if measured is None:
            continue
        pred = predict_epochs(b0, epoch_samples, target_progress, coef, run)
        errs.append(1.0 if pred is None else abs(pred - measured) / measured)
    return float(np.mean(errs)) if errs else 0.0


def calibrate_phi_shift(b0, epoch_samples, target_progress, coef, runs, target, higher) -> float:
    """The log(phi) offset that best predicts epochs-to-target of ``runs`` (grid search).

    The gradient statistics give the noise scale's shape over training; its level is calibrated
    on the larger-batch runs because the raw estimate is noisy and biased low.
    """
    best, best_err = 0.0, np.inf
    for shift in PHI_SHIFTS:
        c = (coef[0] + shift, coef[1], coef[2])
        err = _epoch_errors(b0, epoch_samples, target_progress, c, runs, target, higher)
        if err < best_err - 1e-12:
            best, best_err = float(shift), err
    return best


def fit_efficiency(p: AppProfile, calibrate: bool = True) -> dict[str, object]:
    """Target, work, epoch size and noise-scale coefficients of one application.

    Args:
        p: the application's profile.
        calibrate: shift the noise-scale level to fit the larger-batch runs' epochs to target.

    Returns:
        The efficiency-related :class:`AppModel` fields, by name.
    """
    higher = HIGHER_IS_BETTER[p.name]
    bests = [r.metric.max() if higher else r.metric.min() for r in p.runs]
    worst = min(bests) if higher else max(bests)
    target = worst * (1 - TARGET_SLACK) if higher else worst * (1 + TARGET_SLACK)
    base = p.runs[0]
    b0 = p.base_batch
    epoch_samples = float(np.median(np.diff(np.concatenate([[0.0], base.progress])))) * b0
    epochs = first_reach(base.metric, target, higher) or len(base.metric)
    target_progress = float(base.progress[epochs - 1]) * b0
    frac = base.progress * b0 / target_progress
    ok = (base.grad_sqr > 0) & (base.grad_var > 0)
    log_phi = np.log(base.grad_var[ok] / base.grad_sqr[ok])
    deg = min(2, int(ok.sum()) - 1)
    coef = np.zeros(3)
    if deg >= 0:
        coef[: deg + 1] = np.polyfit(frac[ok], log_phi, deg)[::-1]
    if calibrate and len(p.runs) > 1:
        coef[0] += calibrate_phi_shift(b0, epoch_samples, target_progress, coef, p.runs[1:],
                                       target, higher)
    return dict(base_batch=b0, max_batch=p.runs[-1].max_batch, epoch_samples=epoch_samples,
                target_metric=float(target), target_epochs=epochs,
                target_progress=target_progress, phi_coef=tuple(float(c) for c in coef))


def fit_app(profile: AppProfile, calibrate: bool = True) -> AppModel:
    """Fit one application's throughput and efficiency model from its profile.

    Args:
        profile: the measurements.
        calibrate: calibrate the noise-scale level on the larger-batch runs (see
            :func:`calibrate_phi_shift`); False uses the raw gradient statistics.
    """
    return AppModel(name=profile.name, **_fit_throughput(profile),
                    **fit_efficiency(profile, calibrate))


class JobModels:
    """The fitted models of all applications, evaluated vectorised over arrays of jobs.

    Every method takes ``app`` as an integer array of application indices (see :attr:`names`)
    and broadcasts it against the other array arguments.
    """

    def __init__(self, models: list[AppModel]) -> None:
        self.models = tuple(models)
        self.names = tuple(m.name for m in models)
        for f in fields(AppModel):
            if f.name not in ("name", "phi_coef"):
                setattr(self, "_" + f.name, np.array([getattr(m, f.name) for m in models],
                                                     dtype=float))
        self._phi = np.array([m.phi_coef for m in models])  # (A, 3)

    @classmethod
    def fit(cls, root: str | Path, apps: tuple[str, ...] = APPS) -> "JobModels":
        """Read and fit every application under ``root`` (see :func:`load_profile`)."""
        return cls([fit_app(load_profile(root, a)) for a in apps])

    def index(self, name: str) -> int:
        """Index of an application name."""
        return self.names.index(name)

    def param(self, name: str, app) -> np.ndarray:
        """A fitted parameter (an :class:`AppModel` field) per job."""
        return getattr(self, "_" + name)[np.asarray(app)]

    def step_time(self, app, gpus, nodes, batch) -> np.ndarray:
        """Seconds per optimizer step."""
        app = np.asarray(app)
        gpus = np.maximum(np.asarray(gpus, dtype=float), 1.0)
        p = {k: getattr(self, "_" + k)[app] for k in (
            "compute_a", "compute_b", "intra_a", "intra_b", "inter_a", "inter_b", "gamma",
            "max_local")}
        return _step_time(gpus, np.asarray(nodes, dtype=float), np.asarray(batch) / gpus,
                          p["compute_a"], p["compute_b"], p["intra_a"], p["intra_b"],
                          p["inter_a"], p["inter_b"], p["gamma"], p["max_local"])

    def throughput(self, app, gpus, nodes, batch) -> np.ndarray:
        """Samples per second; 0 where ``gpus`` is 0."""
        gpus = np.asarray(gpus)
        thr = np.asarray(batch, dtype=float) / self.step_time(app, gpus, nodes, batch)
        return np.where(gpus > 0, thr, 0.0)

    def efficiency(self, app, batch, frac) -> np.ndarray:
        """Statistical efficiency of ``batch`` at training fraction ``frac`` (in (0, 1])."""
        app = np.asarray(app)
        f = np.clip(np.asarray(frac, dtype=float), 0.0, 1.0)
        c = self._phi[app]
        b0 = self._base_batch[app]
        phi = b0 * np.exp(np.clip(c[..., 0] + c[..., 1] * f + c[..., 2] * f * f, -20, 20))
        return np.minimum((phi + b0) / (phi + np.asarray(batch, dtype=float)), 1.0)

    def goodput(self, app, gpus, nodes, batch, frac) -> np.ndarray:
        """Progress (base-batch samples) per second."""
        return self.throughput(app, gpus, nodes, batch) * self.efficiency(app, batch, frac)
