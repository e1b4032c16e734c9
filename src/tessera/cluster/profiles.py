"""Reading the six applications' measured profiles (Pollux simulator traces).

Layout of one application's folder (``<root>/<app>/``):

* ``placements.csv``: ``placement,local_bsz,step_time,sync_time``. ``placement`` is a string of
  digits, one per node, each the GPUs used on that node ("24" = 6 GPUs over 2 nodes).
* ``scalability.csv``: ``num_nodes,num_replicas,local_bsz,step_time,sync_time`` (larger runs).
* ``validation-<B>.csv``: ``progress,iteration,metric,grad_sqr,grad_var``, one row per epoch of a
  run whose batch size may grow up to ``B``. ``progress`` counts base-batch iterations
  (samples / base batch), ``grad_sqr``/``grad_var`` are gradient statistics at the base batch.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessera.cluster.traces import TraceError

APPS = ("bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3")
# Accuracy-like metrics rise as training goes on; error rates (WER) and losses fall.
HIGHER_IS_BETTER = {"bert": True, "cifar10": True, "deepspeech2": False, "imagenet": True,
                    "ncf": True, "yolov3": False}
PROFILE_DIR_ENV = "TESSERA_CLUSTER_PROFILES"


@dataclass(frozen=True)
class StepSamples:
    """Measured step times, one entry per profiled configuration."""

    gpus: np.ndarray  # (R,) replicas
    nodes: np.ndarray  # (R,) nodes spanned
    local_bsz: np.ndarray  # (R,)
    step_time: np.ndarray  # (R,) seconds per optimizer step
    sync_time: np.ndarray  # (R,) seconds of gradient synchronisation within the step


@dataclass(frozen=True)
class ValidationRun:
    """One training run's per-epoch record."""

    max_batch: int
    progress: np.ndarray  # (E,) base-batch iterations done at the end of each epoch
    iteration: np.ndarray  # (E,) optimizer steps done at the end of each epoch
    metric: np.ndarray  # (E,)
    grad_sqr: np.ndarray  # (E,)
    grad_var: np.ndarray  # (E,)


@dataclass(frozen=True)
class AppProfile:
    """All measurements of one application."""

    name: str
    steps: StepSamples
    runs: tuple[ValidationRun, ...]  # sorted by max_batch; runs[0] is the base batch size

    @property
    def base_batch(self) -> int:
        """The smallest profiled batch size (the run that never grows its batch)."""
        return self.runs[0].max_batch


def default_profile_dir() -> Path:
    """Where the Pollux application traces live: $TESSERA_CLUSTER_PROFILES, else the copy
    shipped with tessera (``tessera/cluster/data/pollux``; sources and licenses in
    ``data/SOURCES.md`` there).
    """
    env = os.environ.get(PROFILE_DIR_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parent / "data" / "pollux" / "traces"


def _read_rows(path: Path, columns: tuple[str, ...]) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            missing = [c for c in columns if c not in (reader.fieldnames or [])]
            if missing:
                raise TraceError(path, 1, f"missing columns {missing}")
            rows = list(reader)
    except OSError as exc:
        raise TraceError(path, None, f"cannot read profile: {exc.strerror}") from exc
    for i, row in enumerate(rows, start=2):
        if any(row.get(c) in (None, "") for c in columns):
            raise TraceError(path, i, "row has empty or missing fields")
    return rows


def load_profile(root: str | Path, app: str) -> AppProfile:
    """Read one application's profile folder.

    Args:
        root: the folder holding one sub-folder per application.
        app: application name.

    Returns:
        The parsed profile.

    Raises:
        TraceError: a file is missing or malformed.
    """
    folder = Path(root) / app
    gpus, nodes, bsz, step, sync = [], [], [], [], []
    for row in _read_rows(folder / "placements.csv",
                          ("placement", "local_bsz", "step_time", "sync_time")):
        digits = [int(c) for c in row["placement"]]
        gpus.append(sum(digits))
        nodes.append(sum(1 for d in digits if d > 0))
        bsz.append(float(row["local_bsz"]))
        step.append(float(row["step_time"]))
        sync.append(float(row["sync_time"]))
    for row in _read_rows(folder / "scalability.csv",
                          ("num_nodes", "num_replicas", "local_bsz", "step_time", "sync_time")):
        gpus.append(int(row["num_replicas"]))
        nodes.append(int(row["num_nodes"]))
        bsz.append(float(row["local_bsz"]))
        step.append(float(row["step_time"]))
        sync.append(float(row["sync_time"]))
    steps = StepSamples(*(np.asarray(a, dtype=float) for a in (gpus, nodes, bsz, step, sync)))
    runs = []
    for path in folder.glob("validation-*.csv"):
        names = ("progress", "iteration", "metric", "grad_sqr", "grad_var")
        rows = _read_rows(path, names)
        cols = {c: np.array([float(r[c]) for r in rows]) for c in names}
        runs.append(ValidationRun(int(path.stem.split("-")[-1]), **cols))
    if not runs:
        raise TraceError(folder, None, "no validation-<batch>.csv files")
    runs.sort(key=lambda r: r.max_batch)
    return AppProfile(app, steps, tuple(runs))
