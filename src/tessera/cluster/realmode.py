"""Real mode: a scheduling policy driving real tessera training jobs through an executor.

The loop is the simulator's, on the wall clock: every ``round_s`` seconds (and whenever a job
arrives, finishes or fails) the policy sees the job table and the device owners and returns a
schedule; the schedule is made runnable (:meth:`RealRunner._runnable`), checked (no device
given twice, only active jobs) and handed to the executor, which pauses, checkpoints and
relaunches jobs to match it. Between rounds the executor's polls feed the job table (samples
done, finishes, failures) and the measured step times, from which the job models are refitted
every round (:mod:`tessera.cluster.measured`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tessera.cluster.executor import JobProgress
from tessera.cluster.jobs import ACTIVE, DONE, WAITING, JobTable
from tessera.cluster.measured import Measurements, fit_models
from tessera.cluster.policies.base import Assignment, ClusterSpec, ClusterView, Policy, Schedule
from tessera.cluster.real_executor import RealExecutor
from tessera.cluster.realjobs import RealJob
from tessera.cluster.simulator import SimResult, check_schedule
from tessera.cluster.traces import JobSpec


@dataclass(frozen=True)
class RealConfig:
    """Real-mode settings.

    Attributes:
        round_s: seconds between scheduling rounds.
        poll_s: seconds between polls of the running jobs.
        restart_s: the restart cost the policies are told until a start-up was measured
            (then the median measured start-up: launch to first logged step).
        prior_sample_s: seconds per sample on one device assumed before a job is measured.
        seed: seed of the policies' random choices.
        max_time: stop every job after this many seconds (None: run to completion).
    """

    round_s: float = 10.0
    poll_s: float = 0.5
    restart_s: float = 30.0
    prior_sample_s: float = 0.01
    seed: int = 0
    max_time: float | None = None


@dataclass
class RealResult:
    """What a real-mode run produced.

    Attributes:
        sim: the run in the simulator's result form (JCTs, restarts, resizes, utilisation).
        steps: optimizer steps each job completed.
        failed: per job, whether it was marked failed.
        events: crash, retry and failure messages, in order.
        owners: every applied owner array (device -> job id), one per round.
    """

    sim: SimResult
    steps: list[int]
    failed: list[bool]
    events: list[str] = field(default_factory=list)
    owners: list[np.ndarray] = field(default_factory=list)


def order_jobs(jobs: tuple[RealJob, ...]) -> tuple[RealJob, ...]:
    """Jobs in the job table's order (arrival, then name): their ids in real mode."""
    return tuple(sorted(jobs, key=lambda j: (j.arrival, j.name)))


class RealRunner:
    """Runs one policy over real jobs until all finish or fail.

    Args:
        jobs: the jobs in :func:`order_jobs` order (index = job id).
        cluster: the device slots (nodes x devices per node).
        executor: runs the jobs (local processes or Ray).
        measured: step-time measurements (updated as jobs run).
        config: settings.
        log: called with each event message (crashes, retries, failures, rounds).
    """

    def __init__(self, jobs: tuple[RealJob, ...], cluster: ClusterSpec, executor: RealExecutor,
                 measured: Measurements, config: RealConfig = RealConfig(),
                 log: Callable[[str], None] = lambda _: None) -> None:
        self.jobs, self.cluster, self.executor = jobs, cluster, executor
        self.measured, self.config, self.log = measured, config, log

    def run(self, policy: Policy) -> RealResult:
        """Schedule and run every job; stops all jobs on an error or Ctrl-C."""
        started = time.monotonic()
        try:
            return self._loop(policy, started)
        finally:
            self.executor.stop_all()

    # ----------------------------------------------------------------------------- loop
    def _loop(self, policy: Policy, started: float) -> RealResult:
        cfg = self.config
        models = fit_models(self.jobs, self.measured, cfg.prior_sample_s)
        specs = [JobSpec(j.name, j.arrival, j.name, j.devices, j.gbs) for j in self.jobs]
        table = JobTable.build(specs, models, self.cluster.gpus_per_node)
        policy.reset(self.cluster, models, cfg.seed)
        result = RealResult(SimResult(policy.name, table.names, table.arrival, table.finish,
                                      table.restarts, table.resizes, np.empty(0), np.empty(0),
                                      self.cluster.gpus, 0.0), [0] * len(table),
                            [False] * len(table))
        times, used = [], []
        next_round, changed, last = 0.0, True, 0.0
        expected = self.executor.owner()
        while (table.status != DONE).any():
            now = time.monotonic() - started
            if cfg.max_time is not None and now > cfg.max_time:
                result.events.append(f"stopped at max_time={cfg.max_time:.0f} s")
                break
            changed |= self._collect(table, result, now)
            changed |= self._lost_devices(table, expected)
            arrived = (table.status == WAITING) & (table.arrival <= now)
            table.status[arrived] = ACTIVE
            changed |= bool(arrived.any())
            owner = self.executor.owner()
            self._hold(table, owner, now - last, now)
            if used and int((owner >= 0).sum()) != used[-1]:  # a job ended between rounds
                times.append(now)
                used.append(int((owner >= 0).sum()))
            last = now
            active = np.flatnonzero(table.status == ACTIVE)
            due = changed or (policy.periodic and now >= next_round)
            if active.size and due:
                owner = self._round(policy, table, active, changed, now)
                expected = self.executor.owner()
                result.owners.append(owner)
                times.append(now)
                used.append(int((owner >= 0).sum()))
                next_round, changed = now + cfg.round_s, False
            time.sleep(cfg.poll_s)
        times.append(time.monotonic() - started)
        used.append(int((self.executor.owner() >= 0).sum()))
        result.sim.timeline_t, result.sim.timeline_used = np.array(times), np.array(used)
        result.sim.wall_s = times[-1]
        return result

    def _round(self, policy: Policy, table: JobTable, active: np.ndarray, changed: bool,
               now: float) -> np.ndarray:
        models = fit_models(self.jobs, self.measured, self.config.prior_sample_s)
        owner = self.executor.owner()
        # The restart cost the policies weigh is the measured start-up once there is one.
        restart_s = self.measured.restart_s(self.config.restart_s)
        view = ClusterView(now, self.cluster, models, table, active, owner, restart_s, changed,
                           np.ones(len(table)))
        schedule = self._runnable(policy.schedule(view), owner)
        new_owner = check_schedule(schedule, len(table), active, self.cluster.gpus)
        self.executor.apply(schedule, now)
        self._account(table, owner, now)
        return new_owner

    # -------------------------------------------------------------------------- helpers
    def _runnable(self, schedule: Schedule, owner: np.ndarray) -> Schedule:
        """The schedule trimmed to what a real job can run on.

        A job runs on one node (multi-node launches are not wired up), on the node where the
        policy gave it the most devices, keeping the devices it already holds first, and on
        the largest count that divides its global batch size (:meth:`RealJob.usable_devices`);
        its batch size is its own ``gbs``. Devices trimmed away stay idle until next round.
        """
        gpn = self.cluster.gpus_per_node
        out: Schedule = {}
        for j, a in schedule.items():
            gpus = np.asarray(a.gpus, dtype=np.int64)
            if gpus.size == 0:
                continue
            nodes, counts = np.unique(gpus // gpn, return_counts=True)
            gpus = gpus[gpus // gpn == nodes[np.argmax(counts)]]
            keep, gbs = self.jobs[j].run_shape(len(gpus), a.batch)
            held_first = gpus[np.lexsort((gpus, owner[gpus] != j))]
            out[j] = Assignment(np.sort(held_first[:keep]), gbs)
        return out

    def _account(self, table: JobTable, before: np.ndarray, now: float) -> None:
        """Counters after a schedule was applied, from what the executor really did.

        A job that finished just before its pause is not relaunched, so the executor's
        launch counts, not the schedule, say what restarted.
        """
        after = self.executor.owner()
        launches, resizes = self.executor.counts()
        table.restarts[:], table.resizes[:] = launches, resizes
        # The batch each job really runs at: policies keep it when they keep a job's count.
        table.batch[:] = self.executor.batches()
        for j in np.unique(after[after != before]).tolist():
            if j >= 0 and np.isnan(table.first_start[j]):
                table.first_start[j] = now
        changed = np.unique(np.concatenate([before[before != after], after[before != after]]))
        table.since_change[changed[changed >= 0]] = 0.0

    def _lost_devices(self, table: JobTable, expected: np.ndarray) -> bool:
        """True if an active job stopped holding devices outside a round (it paused by hand,
        or its relaunch after a crash did not start): the policy must place it again."""
        owner = self.executor.owner()
        lost = np.unique(expected[(expected >= 0) & (owner != expected)])
        expected[:] = owner
        return bool((table.status[lost] == ACTIVE).any()) if lost.size else False

    def _hold(self, table: JobTable, owner: np.ndarray, dt: float, now: float) -> None:
        """Devices held now (from the executor) and the attained service they add."""
        n = np.bincount(owner[owner >= 0], minlength=len(table))[: len(table)]
        table.attained += n * dt
        table.n[:] = np.where(table.status == DONE, 0, n)
        table.nodes[:] = np.where(table.n > 0, 1, 0)
        table.last_run_end[table.n > 0] = now

    def _collect(self, table: JobTable, result: RealResult, now: float) -> bool:
        """Fold the executor's reports into the table; True if a job finished or failed."""
        changed = False
        for p in self.executor.poll(now):
            changed |= self._progress(table, result, p, now)
        for event in self.executor.drain_events():
            result.events.append(event)
            self.log(event)
        return changed

    def _progress(self, table: JobTable, result: RealResult, p: JobProgress,
                  now: float) -> bool:
        j = p.job
        table.since_change[j] += max(p.samples - table.samples[j], 0.0)
        table.samples[j] = table.progress[j] = p.samples
        result.steps[j] = p.step
        if table.status[j] == DONE or not (p.finished or p.failed):
            return False
        table.status[j] = DONE
        if p.finished:
            table.finish[j] = now
            self.log(f"{self.jobs[j].name}: finished at {now:.1f} s")
        else:
            result.failed[j] = True
        return True
