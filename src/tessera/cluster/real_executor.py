"""Real mode's executor: runs ``tessera train`` jobs on device slots as schedules dictate.

Resizing is pause -> checkpoint -> restart: the executor writes ``PAUSE`` into the job's
output directory, the Trainer checkpoints at its next logging step and exits, and the job is
relaunched with ``tessera train ... --nproc n --resume`` under the Strategy for its new device
count and global batch (:meth:`RealJob.strategy`). The resumed run continues from the
checkpoint's ``samples_consumed`` in the same data order and LR schedule position; when the
batch changed it runs ``train.max_steps`` = its step + the steps the remaining samples need at
the new batch, with the learning rate scaled linearly (``lr * gbs' / gbs``). Devices are released
only once a job's processes have exited and handed to others only through a
:class:`DeviceLedger`, which refuses to give a device to two jobs.

A job that exits with an error is relaunched from its last checkpoint up to its ``retries``
times, then marked failed; the other jobs never notice.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from tessera.cluster.executor import JobProgress
from tessera.cluster.launchers import Handle, Launcher
from tessera.cluster.measured import Measurements, step_seconds
from tessera.cluster.policies.base import Schedule
from tessera.cluster.realjobs import RealJob
from tessera.cluster.simulator import SchedulingError

PAUSE_FILE = "PAUSE"  # the Trainer's pause request (tessera.train.trainer.PAUSE_FILE)


class DeviceLedger:
    """Which job holds each device; a device is never given to two jobs (checked)."""

    def __init__(self, devices: int) -> None:
        self.owner = np.full(devices, -1, dtype=np.int64)

    def acquire(self, job: int, devices) -> None:
        """Give ``devices`` to ``job``.

        Raises:
            SchedulingError: a device is out of range or already held (naming both jobs).
        """
        devices = np.asarray(devices, dtype=np.int64)
        if devices.size and (devices.min() < 0 or devices.max() >= self.owner.size):
            raise SchedulingError(f"device ids must be in [0, {self.owner.size})")
        if len(np.unique(devices)) != devices.size:
            raise SchedulingError(f"job {job}: a device is listed twice in {devices.tolist()}")
        busy = devices[self.owner[devices] >= 0]
        if busy.size:
            d = int(busy[0])
            raise SchedulingError(f"device {d} assigned twice (jobs {int(self.owner[d])} and "
                                  f"{job})")
        self.owner[devices] = job

    def release(self, job: int) -> None:
        """Free every device ``job`` holds."""
        self.owner[self.owner == job] = -1

    def held(self, job: int) -> list[int]:
        """Devices ``job`` holds, sorted."""
        return np.flatnonzero(self.owner == job).tolist()


@dataclass
class _Run:
    """Live state of one job in the executor."""

    job: RealJob
    out: Path
    handle: Handle | None = None
    devices: int = 0
    launches: int = 0  # starts and restarts (each costs start-up and a checkpoint load)
    resizes: int = 0  # launches on a different device count than the previous one
    crashes: int = 0
    bytes_read: int = 0
    first_record: bool = True  # the next record is a launch's first (includes start-up)
    launched_at: float = 0.0  # wall-clock time of the latest launch
    step: int = 0
    gbs: int = 0  # global batch of the current (or last) launch
    base_step: int = 0  # step at which the current launch started
    base_samples: int = 0  # samples trained before it
    max_steps: int = 0  # train.max_steps of the current launch
    seq_len: int = 0
    finished: bool = False
    failed: bool = False
    error: str = ""
    events: list[str] = field(default_factory=list)


class RealExecutor:
    """Runs real tessera jobs on the devices of a :class:`~tessera.cluster.launchers.Launcher`.

    Implements :class:`tessera.cluster.executor.Executor`. A schedule is complete: a running
    job it leaves out is preempted (paused with a checkpoint); a job whose devices change is
    paused and relaunched on the new ones.

    Args:
        jobs: the jobs, indexed by job id.
        launcher: where processes run (local processes or a Ray cluster).
        out_dir: each job writes to ``out_dir/<name>`` (its ``train.output_dir``).
        measured: step-time measurements, updated from the jobs' metrics.
        pause_timeout: seconds to wait for a paused job to exit before stopping it (it then
            resumes from its previous checkpoint and repeats the steps after it).
        threads_per_device: ``OMP_NUM_THREADS`` of each CPU worker.
        command: builds a job's command line from (job, devices, output dir, gbs, max_steps);
            default :func:`train_command` (tests pass a stand-in trainer).
    """

    def __init__(self, jobs: tuple[RealJob, ...], launcher: Launcher, out_dir: Path,
                 measured: Measurements, pause_timeout: float = 300.0,
                 threads_per_device: int = 1,
                 command: Callable[[RealJob, int, Path, int, int], list[str]] | None = None
                 ) -> None:
        self.launcher, self.measured = launcher, measured
        self.command = command or train_command
        self.pause_timeout, self.threads = pause_timeout, threads_per_device
        self.ledger = DeviceLedger(launcher.nodes * launcher.devices_per_node)
        self.runs = [_Run(j, Path(out_dir) / j.name, gbs=j.gbs) for j in jobs]
        self._changed: set[int] = set()

    # ----------------------------------------------------------------------- Executor
    def apply(self, schedule: Schedule, time_s: float) -> None:
        """Pause jobs that lose or change devices or batch, then (re)start jobs on their new
        devices at their new batch (each assignment's batch must suit its job:
        :meth:`RealJob.run_shape`)."""
        want = {j: sorted(int(g) for g in a.gpus) for j, a in schedule.items()}
        batch = {j: int(a.batch) for j, a in schedule.items()}
        self._pause([j for j, run in enumerate(self.runs)
                     if run.handle is not None and (self.ledger.held(j) != want.get(j, [])
                                                    or batch.get(j, run.gbs) != run.gbs)])
        for j, devices in want.items():
            run = self.runs[j]
            if run.handle is None and not (run.finished or run.failed) and devices:
                self._launch(j, devices, batch[j])

    def poll(self, time_s: float) -> list[JobProgress]:
        """Read new metrics, detect exits; crashed jobs are relaunched or marked failed.

        Returns the progress of every job that runs or changed state (finished, failed,
        paused) since the previous poll, including changes made by :meth:`apply`.
        """
        for j, run in enumerate(self.runs):
            if run.handle is not None:
                self._read_metrics(run)
                code = run.handle.poll()
                if code is not None:
                    self._exited(j, code)
        report = [j for j, r in enumerate(self.runs) if r.handle is not None or j in self._changed]
        self._changed.clear()
        return [self._progress(j) for j in report]

    # ---------------------------------------------------------------------------- queries
    def owner(self) -> np.ndarray:
        """Job id holding each device (-1 free): the ground truth for the next round."""
        return self.ledger.owner.copy()

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(launches, resizes) per job so far."""
        return (np.array([r.launches for r in self.runs]),
                np.array([r.resizes for r in self.runs]))

    def batches(self) -> np.ndarray:
        """Global batch each job runs (or last ran) at."""
        return np.array([r.gbs for r in self.runs])

    def drain_events(self) -> list[str]:
        """Messages about crashes, retries and failures since the last call."""
        events = [f"{r.job.name}: {e}" for r in self.runs for e in r.events]
        for r in self.runs:
            r.events.clear()
        return events

    def stop_all(self) -> None:
        """Stop every job now (their last checkpoints stay usable)."""
        for j, run in enumerate(self.runs):
            if run.handle is not None:
                run.handle.stop()
                run.handle = None
                self.ledger.release(j)

    # ---------------------------------------------------------------------------- private
    def _launch(self, j: int, devices: list[int], gbs: int) -> None:
        run = self.runs[j]
        run.base_step, run.base_samples = self._resume_point(run)
        run.step, run.gbs = run.base_step, gbs
        # The steps the remaining samples need at this batch (the last may overshoot a little).
        left = run.job.steps * run.job.gbs - run.base_samples
        run.max_steps = run.step + max(1, -(-left // gbs))
        node = devices[0] // self.launcher.devices_per_node
        self.ledger.acquire(j, devices)
        run.out.mkdir(parents=True, exist_ok=True)
        # A stale pause request would stop the new launch after its first step.
        (run.out / PAUSE_FILE).unlink(missing_ok=True)
        local = [d % self.launcher.devices_per_node for d in devices]
        env = {"OMP_NUM_THREADS": str(self.threads)}
        try:
            argv = self.command(run.job, len(devices), run.out, gbs, run.max_steps)
            run.handle = self.launcher.start(argv, env, run.out / "launch.log", local, node)
        except OSError as err:  # cannot even start (missing executable, no resources)
            self.ledger.release(j)
            run.failed, run.error = True, f"could not start: {err}"
            run.events.append(f"failed: {run.error}")
            self._changed.add(j)
            return
        run.resizes += int(run.launches > 0 and run.devices != len(devices))
        run.launches += 1
        run.devices, run.first_record, run.launched_at = len(devices), True, time.time()

    def _pause(self, jobs: list[int]) -> None:
        """Ask ``jobs`` to checkpoint and exit, all at once, and wait until they have."""
        for j in jobs:
            (self.runs[j].out / PAUSE_FILE).touch()
        deadline = time.monotonic() + self.pause_timeout
        waiting = list(jobs)
        while waiting:
            waiting = [j for j in waiting if self.runs[j].handle.poll() is None]
            if waiting and time.monotonic() > deadline:
                for j in waiting:
                    self.runs[j].events.append(f"did not pause within {self.pause_timeout:.0f}"
                                               " s; stopped")
                    self.runs[j].handle.stop()
                break
            time.sleep(0.2)
        for j in jobs:
            code = self.runs[j].handle.poll()
            self._exited(j, 0 if code is None else code, paused=True)

    def _exited(self, j: int, code: int, paused: bool = False) -> None:
        run = self.runs[j]
        run.handle = None
        self._changed.add(j)
        devices = self.ledger.held(j)
        self.ledger.release(j)
        (run.out / PAUSE_FILE).unlink(missing_ok=True)
        self._read_metrics(run)
        if code == 0 and run.step >= run.max_steps:
            run.finished = True
        elif code != 0 and not paused:
            run.crashes += 1
            why = f"exit code {code}: {_last_error(run.out / 'launch.log')}"
            if run.crashes > run.job.retries:
                run.failed, run.error = True, why
                run.events.append(f"failed after {run.crashes} crash(es); {why}")
            else:
                run.events.append(f"crashed ({why}); retry {run.crashes}/{run.job.retries} "
                                  "from its last checkpoint")
                self._launch(j, devices, run.gbs)  # the devices it just gave back
        # code 0 before the last step: paused (by us or by hand); it waits for a schedule.

    def _read_metrics(self, run: _Run) -> None:
        path = run.out / "metrics.jsonl"
        if not path.is_file():
            return
        with open(path, "rb") as f:
            f.seek(run.bytes_read)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
        run.bytes_read += len(complete)
        for line in complete.decode().splitlines():
            record = json.loads(line)
            if "loss" not in record:
                continue
            run.step = int(record["step"])
            if run.first_record:  # its window includes process start-up and compilation
                run.first_record = False
                if isinstance(record.get("time"), (int, float)):
                    self.measured.add_startup(record["time"] - run.launched_at)
                continue
            seconds = step_seconds(record, run.gbs, self._seq_len(run))
            if seconds is not None:  # kept per sample of the job's own gbs (one batch model)
                self.measured.add(run.job.name, run.devices, seconds * run.job.gbs / run.gbs)

    def _seq_len(self, run: _Run) -> int:
        if not run.seq_len:
            import yaml

            config = yaml.safe_load((run.out / "config.yaml").read_text())
            run.seq_len = int(config["data"]["seq_len"])
        return run.seq_len

    def _progress(self, j: int) -> JobProgress:
        run = self.runs[j]
        medians = self.measured.medians(run.job.name)
        step_s = medians.get(run.devices)
        samples = float(self._samples(run))
        return JobProgress(job=j, samples=samples, progress=samples,
                           throughput=run.job.gbs / step_s if step_s else 0.0, step=run.step,
                           finished=run.finished, failed=run.failed, error=run.error)


    def _resume_point(self, run: _Run) -> tuple[int, int]:
        """(step, samples consumed) the next launch resumes at: its newest complete checkpoint
        (a pause that timed out resumes from an earlier one), else where it stands."""
        from tessera.train.checkpoint import list_complete, read_meta

        done = list_complete(run.out / "checkpoints") if (run.out / "checkpoints").is_dir() else []
        if done:
            meta = read_meta(done[-1])
            if "samples_consumed" in meta:
                return int(meta["step"]), int(meta["samples_consumed"])
        return run.step, self._samples(run)

    @staticmethod
    def _samples(run: _Run) -> int:
        """Samples trained so far (batches may have changed between launches)."""
        return run.base_samples + (run.step - run.base_step) * run.gbs


def train_command(job: RealJob, devices: int, out: Path, gbs: int | None = None,
                  max_steps: int | None = None) -> list[str]:
    """The ``tessera train ... --nproc n --resume`` command line of ``job`` on ``devices`` at
    global batch ``gbs`` (default the job's), training to step ``max_steps`` (default its
    ``steps``). A batch other than the job's also sets the linearly scaled learning rate (the
    trainer warms a changed rate up over the job's ``lr_warmup_steps``)."""
    gbs = gbs or job.gbs
    lr = ([f"train.learning_rate={job.lr * gbs / job.gbs:.6g}",
           f"train.lr_rescale_warmup_steps={job.lr_warmup_steps}"] if job.lr is not None else [])
    return [sys.executable, "-m", "tessera.cli", "train", *([job.config] if job.config else []),
            *job.overrides, *lr, f"strategy={job.strategy(devices, gbs).to_text()}",
            f"train.max_steps={max_steps or job.steps}", f"train.output_dir={out}", "--nproc",
            str(devices), "--resume"]


def _last_error(log: Path) -> str:
    """The last meaningful line of a job's log (the error torchrun reported)."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["no output"])[-1][:300]


def default_threads(devices: int) -> int:
    """CPU threads per device slot: the machine's cores shared evenly."""
    return max(1, (os.cpu_count() or 1) // max(1, devices))
