"""The simulator's job table: one numpy array per job attribute, indexed by job id.

Job ids are positions in arrival order. Keeping attributes as arrays (not objects) lets the
simulator and the policies evaluate all jobs at once, which is what makes a 10,000-job trace on
1,024 GPUs fast enough.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.cluster.job_model import JobModels
from tessera.cluster.traces import JobSpec, TraceError

WAITING, ACTIVE, DONE = 0, 1, 2


def _packed_nodes(gpus, gpus_per_node: int) -> np.ndarray:
    return np.ceil(np.asarray(gpus) / gpus_per_node)


@dataclass
class JobTable:
    """Static description and dynamic state of every job (arrays of length ``len(names)``)."""

    names: list[str]
    arrival: np.ndarray
    app: np.ndarray  # index into JobModels.names
    req_gpus: np.ndarray
    req_batch: np.ndarray  # global batch the user chose for req_gpus
    local0: np.ndarray  # per-GPU batch kept fixed by linear-scaling policies (ONES)
    work: np.ndarray  # progress (base-batch samples) needed to finish
    epoch_samples: np.ndarray
    # dynamic state
    status: np.ndarray
    progress: np.ndarray
    samples: np.ndarray  # samples processed (epochs = samples / epoch_samples)
    n: np.ndarray  # GPUs held now
    nodes: np.ndarray  # nodes spanned now
    batch: np.ndarray  # global batch now
    restart_left: np.ndarray  # seconds of restart still to pay
    warm_left: np.ndarray  # samples of learning-rate warm-up still to run
    warm_factor: np.ndarray  # progress rate factor during warm-up
    since_change: np.ndarray  # samples processed since the allocation last changed
    attained: np.ndarray  # GPU-seconds held (Tiresias' 2D attained service)
    first_start: np.ndarray
    finish: np.ndarray
    restarts: np.ndarray  # allocation changes that cost a restart (starts included)
    resizes: np.ndarray  # changes of GPU count while running
    last_run_end: np.ndarray

    @classmethod
    def build(cls, jobs: list[JobSpec], models: JobModels, gpus_per_node: int,
              source: str = "<trace>") -> "JobTable":
        """Turn trace jobs into a table, deriving each job's work from its application.

        Jobs with a measured ``duration`` (Philly) get the work that takes that long at their
        requested GPUs and batch; other jobs need their application's target progress.

        Raises:
            TraceError: a job names an application without a model.
        """
        jobs = sorted(jobs, key=lambda j: (j.arrival, j.name))
        n = len(jobs)
        try:
            app = np.array([models.index(j.app) for j in jobs], dtype=np.int64)
        except ValueError:
            bad = next(j for j in jobs if j.app not in models.names)
            raise TraceError(source, None, f"job {bad.name}: no model for application "
                             f"{bad.app!r}") from None
        req = np.array([j.gpus for j in jobs], dtype=np.int64)
        b0, bmax = models.param("base_batch", app), models.param("max_batch", app)
        given = np.array([j.batch_size for j in jobs], dtype=float)
        batch = np.where(given > 0, given, np.clip(b0 * req, b0, bmax))
        local0 = np.clip(batch / req, models.param("min_local", app),
                         models.param("max_local", app))
        work = models.param("target_progress", app).astype(float)
        dur = np.array([j.duration if j.duration is not None else np.nan for j in jobs])
        timed = ~np.isnan(dur)
        if timed.any():
            fr = np.linspace(0.0, 1.0, 11)[:, None]
            nodes = _packed_nodes(req[timed], gpus_per_node)
            rate = models.goodput(app[timed], req[timed], nodes, batch[timed], fr).mean(axis=0)
            work[timed] = dur[timed] * rate
        zeros = lambda dtype=float: np.zeros(n, dtype=dtype)  # noqa: E731
        return cls(
            names=[j.name for j in jobs], arrival=np.array([j.arrival for j in jobs], float),
            app=app, req_gpus=req, req_batch=batch.round().astype(np.int64), local0=local0,
            work=work, epoch_samples=models.param("epoch_samples", app).astype(float),
            status=zeros(np.int8), progress=zeros(), samples=zeros(), n=zeros(np.int64),
            nodes=zeros(np.int64), batch=batch.round().astype(np.int64), restart_left=zeros(),
            warm_left=zeros(), warm_factor=np.ones(n), since_change=zeros(), attained=zeros(),
            first_start=np.full(n, np.nan), finish=np.full(n, np.nan),
            restarts=zeros(np.int64), resizes=zeros(np.int64), last_run_end=zeros())

    def __len__(self) -> int:
        return len(self.names)

    def epochs(self, ids) -> np.ndarray:
        """Epochs of data processed so far."""
        return self.samples[ids] / self.epoch_samples[ids]

    def fraction(self, ids) -> np.ndarray:
        """Training fraction done, in [0, 1]."""
        return np.clip(self.progress[ids] / self.work[ids], 0.0, 1.0)
