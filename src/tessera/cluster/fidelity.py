"""Validation of the fitted job models against the profiles they were fitted from.

Step time: every measured configuration (placements and multi-node scalability rows) is
predicted and compared. Epochs to target: every validation run that reaches the target is
predicted with the batches it used (:func:`predict_epochs`); the noise-scale level is calibrated
on the larger-batch runs, so the honest figure is the leave-one-out one, where the run being
predicted is left out of the calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.cluster.job_model import (
    JobModels, calibrate_phi_shift, first_reach, fit_efficiency, predict_epochs)
from tessera.cluster.profiles import HIGHER_IS_BETTER, AppProfile


@dataclass(frozen=True)
class FitReport:
    """How well one application's model reproduces its profile.

    Attributes:
        app: application name.
        step_time_mape: mean |predicted - measured| / measured step time.
        step_time_max_err: the largest such relative error.
        step_samples: number of step-time measurements.
        epochs_mape: in-sample mean relative error of epochs to target over the runs.
        epochs_loo_mape: the same with each run left out of the noise-scale calibration.
        epochs_pairs: (max batch, measured epochs, predicted epochs, leave-one-out prediction).
    """

    app: str
    step_time_mape: float
    step_time_max_err: float
    step_samples: int
    epochs_mape: float
    epochs_loo_mape: float
    epochs_pairs: tuple[tuple[int, int, int | None, int | None], ...]


def _rel(pred: int | None, measured: int) -> float:
    return 1.0 if pred is None else abs(pred - measured) / measured


def fit_report(models: JobModels, profile: AppProfile) -> FitReport:
    """Step-time and epochs-to-target prediction errors of one application's model.

    Args:
        models: the fitted models (containing ``profile.name``).
        profile: the measurements the model was fitted from.

    Returns:
        The errors; a run the model never brings to the target counts as 100% error.
    """
    app = models.index(profile.name)
    m = models.models[app]
    s = profile.steps
    pred = models.step_time(np.full(len(s.gpus), app), s.gpus, s.nodes, s.local_bsz * s.gpus)
    rel = np.abs(pred - s.step_time) / s.step_time
    higher = HIGHER_IS_BETTER[profile.name]
    b0, es, tp = m.base_batch, m.epoch_samples, m.target_progress
    raw = fit_efficiency(profile, calibrate=False)["phi_coef"]
    pairs = []
    for i, run in enumerate(profile.runs):
        measured = first_reach(run.metric, m.target_metric, higher)
        if measured is None:
            continue
        inside = predict_epochs(b0, es, tp, m.phi_coef, run)
        loo = inside
        others = [r for j, r in enumerate(profile.runs) if j not in (0, i)]
        if i > 0 and others:
            shift = calibrate_phi_shift(b0, es, tp, raw, others, m.target_metric, higher)
            loo = predict_epochs(b0, es, tp, (raw[0] + shift, raw[1], raw[2]), run)
        pairs.append((run.max_batch, measured, inside, loo))
    return FitReport(
        app=profile.name, step_time_mape=float(rel.mean()), step_time_max_err=float(rel.max()),
        step_samples=len(rel),
        epochs_mape=float(np.mean([_rel(p, e) for _, e, p, _ in pairs])) if pairs else 0.0,
        epochs_loo_mape=float(np.mean([_rel(q, e) for _, e, _, q in pairs])) if pairs else 0.0,
        epochs_pairs=tuple(pairs))
