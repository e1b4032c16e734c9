"""A deterministic, trace-driven simulator of a GPU cluster under a scheduling policy.

Time advances in scheduling rounds of ``round_s`` seconds. At each round the simulator admits
the jobs that arrived, asks the policy for a schedule, checks it (no GPU held by two jobs, only
active jobs, batch >= 1) and applies it: a job whose GPUs change pays ``restart_s`` seconds
without progress, and a job whose batch grows warms its learning rate up over one epoch (see
:mod:`tessera.cluster.job_model`). Between rounds every running job progresses at its goodput;
a job finishes at the exact moment its progress reaches its work, and its GPUs idle until the
next round. When no job is active the clock jumps to the next arrival.

Everything random (the optional prediction noise, the policies' own generators) is seeded, so
a run is a pure function of (trace, cluster, policy, config).
"""

from __future__ import annotations

import time as _time
from dataclasses import dataclass, field

import numpy as np

from tessera.cluster.job_model import JobModels
from tessera.cluster.jobs import ACTIVE, DONE, JobTable
from tessera.cluster.placement import nodes_spanned
from tessera.cluster.policies.base import ClusterSpec, ClusterView, Policy, Schedule
from tessera.cluster.traces import JobSpec


class SchedulingError(RuntimeError):
    """A policy returned an impossible schedule (e.g. one GPU given to two jobs)."""


@dataclass(frozen=True)
class SimConfig:
    """Simulation settings.

    Attributes:
        round_s: seconds between scheduling rounds.
        restart_s: seconds lost by a job each time its GPUs change (checkpoint, relaunch).
        seed: seed of every random choice (policies and prediction noise).
        prediction_noise: sigma of the log-normal error on predicted remaining work that the
            policies see (0 = the policies know the model's exact remaining work).
        max_time: stop after this many simulated seconds (None = run to completion).
        record_schedules: keep every applied schedule (for tests; costs memory).
    """

    round_s: float = 60.0
    restart_s: float = 30.0
    seed: int = 0
    prediction_noise: float = 0.0
    max_time: float | None = None
    record_schedules: bool = False


@dataclass
class SimResult:
    """What one simulation produced.

    Attributes:
        policy: policy name.
        names, arrival, finish: per job (finish is NaN for a job unfinished at ``max_time``).
        restarts, resizes: per job allocation changes / GPU-count changes while running.
        timeline_t, timeline_used: GPUs allocated from each round start on.
        gpus: cluster size.
        wall_s: wall-clock seconds the simulation took.
        schedules: the owner array of every round, aligned with ``timeline_t`` (if recorded).
    """

    policy: str
    names: list[str]
    arrival: np.ndarray
    finish: np.ndarray
    restarts: np.ndarray
    resizes: np.ndarray
    timeline_t: np.ndarray
    timeline_used: np.ndarray
    gpus: int
    wall_s: float
    schedules: list[np.ndarray] = field(default_factory=list)

    @property
    def jct(self) -> np.ndarray:
        """Job completion times (finish - arrival) of the finished jobs."""
        done = ~np.isnan(self.finish)
        return self.finish[done] - self.arrival[done]


class Simulator:
    """Runs one policy over one trace on one cluster.

    Args:
        jobs: the trace's jobs.
        cluster: the cluster.
        models: fitted job models.
        config: simulation settings.
    """

    def __init__(self, jobs: list[JobSpec], cluster: ClusterSpec, models: JobModels,
                 config: SimConfig = SimConfig()) -> None:
        self.specs = jobs
        self.cluster = cluster
        self.models = models
        self.config = config

    def run(self, policy: Policy) -> SimResult:
        """Simulate until every job finishes (or ``max_time``) and return the result."""
        started = _time.perf_counter()
        cfg, gpn = self.config, self.cluster.gpus_per_node
        jobs = JobTable.build(self.specs, self.models, gpn)
        rng = np.random.default_rng(cfg.seed)
        noise = np.exp(rng.normal(0.0, cfg.prediction_noise, len(jobs)))
        policy.reset(self.cluster, self.models, cfg.seed)
        owner = np.full(self.cluster.gpus, -1, dtype=np.int64)
        times, used, schedules = [], [], []
        t = float(np.floor(jobs.arrival.min() / cfg.round_s) * cfg.round_s) if len(jobs) else 0.0
        nxt, done_count, changed = 0, 0, True
        while done_count < len(jobs):
            if cfg.max_time is not None and t >= cfg.max_time:
                break
            while nxt < len(jobs) and jobs.arrival[nxt] <= t:
                jobs.status[nxt] = ACTIVE
                nxt, changed = nxt + 1, True
            active = np.flatnonzero(jobs.status == ACTIVE)
            if active.size == 0:
                t = float(np.ceil(jobs.arrival[nxt] / cfg.round_s) * cfg.round_s)
                continue
            if changed or policy.periodic:
                view = ClusterView(t, self.cluster, self.models, jobs, active, owner,
                                   cfg.restart_s, changed, noise)
                owner = self._apply(jobs, owner, policy.schedule(view), active, t)
            if cfg.record_schedules:
                schedules.append(owner.copy())
            times.append(t)
            used.append(int((owner >= 0).sum()))
            finished = self._advance(jobs, owner, t, t + cfg.round_s)
            if finished.size:
                owner[np.isin(owner, finished)] = -1
                done_count += finished.size
            changed = bool(finished.size)
            t += cfg.round_s
        times.append(t)
        used.append(int((owner >= 0).sum()))
        return SimResult(policy.name, jobs.names, jobs.arrival, jobs.finish, jobs.restarts,
                         jobs.resizes, np.array(times), np.array(used), self.cluster.gpus,
                         _time.perf_counter() - started, schedules)

    # ------------------------------------------------------------------ applying a schedule
    def _check(self, schedule: Schedule, jobs: JobTable, active: np.ndarray) -> np.ndarray:
        return check_schedule(schedule, len(jobs), active, self.cluster.gpus)

    def _apply(self, jobs: JobTable, owner: np.ndarray, schedule: Schedule,
               active: np.ndarray, t: float) -> np.ndarray:
        new_owner = self._check(schedule, jobs, active)
        gpn = self.cluster.gpus_per_node
        moved = owner != new_owner
        touched = np.unique(np.concatenate([owner[moved], new_owner[moved]]))
        touched = touched[touched >= 0]
        batch_changed = [j for j, a in schedule.items()
                         if a.batch != jobs.batch[j] and j not in set(touched.tolist())]
        for j in [*touched.tolist(), *batch_changed]:
            gpus = schedule[j].gpus if j in schedule else np.empty(0, dtype=np.int64)
            self._change(jobs, j, len(gpus), nodes_spanned(gpus, gpn) if len(gpus) else 0,
                         schedule[j].batch if j in schedule else int(jobs.batch[j]), t)
        return new_owner

    def _change(self, jobs: JobTable, j: int, n: int, nodes: int, batch: int,
                t: float) -> None:
        old_n, old_b = int(jobs.n[j]), int(jobs.batch[j])
        if n > 0:
            jobs.restart_left[j] = self.config.restart_s
            jobs.restarts[j] += 1
            if old_n > 0 and old_n != n:
                jobs.resizes[j] += 1
            if np.isnan(jobs.first_start[j]):
                jobs.first_start[j] = t
            if batch > old_b and jobs.samples[j] > 0:
                # Linear LR scaling with a one-epoch linear warm-up: progress per step
                # follows the learning rate, which averages (old + new) / 2 over the epoch.
                jobs.warm_left[j] = jobs.epoch_samples[j]
                jobs.warm_factor[j] = (old_b + batch) / (2.0 * batch)
            elif batch < old_b:
                jobs.warm_left[j] = 0.0
        jobs.n[j], jobs.nodes[j], jobs.batch[j] = n, nodes, batch
        jobs.since_change[j] = 0.0

    # -------------------------------------------------------------------- advancing time
    def _advance(self, jobs: JobTable, owner: np.ndarray, t0: float, t1: float) -> np.ndarray:
        run = np.flatnonzero((jobs.status == ACTIVE) & (jobs.n > 0))
        if run.size == 0:
            return run
        dt = t1 - t0
        app, n, batch = jobs.app[run], jobs.n[run], jobs.batch[run]
        thr = self.models.throughput(app, n, jobs.nodes[run], batch)
        eff = self.models.efficiency(app, batch, jobs.fraction(run))
        warm = np.where(jobs.warm_left[run] > 0, jobs.warm_factor[run], 1.0)
        rate = thr * eff * warm
        wait = np.minimum(jobs.restart_left[run], dt)
        busy = dt - wait
        need = jobs.work[run] - jobs.progress[run]
        ends = busy * rate >= need
        busy = np.where(ends, need / np.maximum(rate, 1e-30), busy)
        jobs.restart_left[run] -= wait
        jobs.progress[run] += busy * rate
        jobs.samples[run] += busy * thr
        jobs.since_change[run] += busy * thr
        jobs.warm_left[run] = np.maximum(jobs.warm_left[run] - busy * thr, 0.0)
        held = np.where(ends, wait + busy, dt)
        jobs.attained[run] += held * n
        fin = run[ends]
        jobs.finish[fin] = t0 + held[ends]
        jobs.status[fin] = DONE
        jobs.n[fin] = 0
        jobs.last_run_end[run] = t0 + held
        return fin


def check_schedule(schedule: Schedule, num_jobs: int, active: np.ndarray,
                   total: int) -> np.ndarray:
    """The owner array (job id per GPU, -1 free) of a schedule, after checking it.

    Raises:
        SchedulingError: a job that is not active, a GPU id out of range, a batch below 1,
            or a GPU given to two jobs (naming the GPU and both jobs).
    """
    new_owner = np.full(total, -1, dtype=np.int64)
    if not schedule:
        return new_owner
    ids = np.fromiter(schedule.keys(), dtype=np.int64, count=len(schedule))
    is_active = np.zeros(num_jobs, dtype=bool)
    is_active[active] = True
    bad = (ids < 0) | (ids >= num_jobs)
    bad[~bad] = ~is_active[ids[~bad]]
    if bad.any():
        raise SchedulingError(f"schedule names job {int(ids[bad][0])}, which is not active")
    parts = [np.asarray(a.gpus, dtype=np.int64) for a in schedule.values()]
    gpus = np.concatenate(parts)
    who = np.repeat(ids, [len(p) for p in parts])
    if gpus.size and (gpus.min() < 0 or gpus.max() >= total):
        raise SchedulingError(f"GPU ids must be in [0, {total})")
    batch = np.fromiter((a.batch for a in schedule.values()), dtype=np.int64,
                        count=len(schedule))
    if (batch < 1).any():
        raise SchedulingError(f"job {int(ids[batch < 1][0])}: batch must be >= 1")
    uses = np.bincount(gpus, minlength=total)
    if uses.max(initial=0) > 1:
        g = int(np.argmax(uses > 1))
        a, b = who[gpus == g][:2]
        raise SchedulingError(f"GPU {g} assigned twice (jobs {int(a)} and {int(b)})")
    new_owner[gpus] = who
    return new_owner
