"""Job-arrival traces: the Pollux workload CSVs and the Philly-derived trace.

Two formats are read, told apart by their header row:

* Pollux workloads (``workloads*/workload-N.csv``)::

      name,time,application,num_replicas,batch_size

  ``time`` is seconds since the start of the trace, ``application`` one of the six profiled
  applications, ``num_replicas`` the GPUs the user asked for and ``batch_size`` the global batch
  they chose for that GPU count.

* Philly-derived (``traces/philly.csv``)::

      timestamp,duration,num_gpus,gpu_time,cluster

  ``timestamp`` is a wall-clock submit time and ``duration`` the job's measured run time at
  ``num_gpus`` GPUs. Jobs carry no application, so :func:`assign_philly_apps` maps each to one of
  the profiled applications by its GPU-time (see docs/scheduler.md).

Every row is checked; a bad row raises :class:`TraceError` naming the file and the line.
"""

from __future__ import annotations

import csv
import datetime as _dt
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

POLLUX_COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")
PHILLY_COLUMNS = ("timestamp", "duration", "num_gpus", "gpu_time")


class TraceError(ValueError):
    """A trace file or one of its rows is malformed.

    Attributes:
        path: the trace file.
        line: 1-based line number in the file (the header is line 1), or None for a file-level
            problem.
    """

    def __init__(self, path: str | Path, line: int | None, message: str) -> None:
        self.path = str(path)
        self.line = line
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class JobSpec:
    """One job as the trace describes it.

    Attributes:
        name: unique job name.
        arrival: submit time in seconds since the trace start (>= 0).
        app: profiled application name, or None until one is assigned (Philly rows).
        gpus: GPUs the user requested.
        batch_size: global batch size the user chose for ``gpus`` GPUs (0 = the application's
            base batch size times ``gpus``).
        duration: measured run time in seconds at ``gpus`` GPUs (Philly rows), else None.
    """

    name: str
    arrival: float
    app: str | None
    gpus: int
    batch_size: int = 0
    duration: float | None = None


def load_trace(path: str | Path, max_gpus: int | None = None, apps: tuple[str, ...] | None = None,
               limit: int | None = None, start: int = 0) -> list[JobSpec]:
    """Read a trace file in either format, sorted by arrival.

    Args:
        path: a Pollux workload CSV or a Philly-derived CSV.
        max_gpus: cluster size; a row asking for more GPUs is refused.
        apps: known application names; a Pollux row naming another is refused.
        limit: keep only this many jobs (Philly: a contiguous slice in submit order).
        start: index of the first job of the slice (Philly only).

    Returns:
        The jobs, sorted by arrival time, arrivals shifted so the first is at 0 for Philly.

    Raises:
        TraceError: unreadable file, unknown header or a malformed row (names file and line).
    """
    path = Path(path)
    try:
        handle = path.open(newline="")
    except OSError as exc:
        raise TraceError(path, None, f"cannot read trace: {exc.strerror}") from exc
    with handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise TraceError(path, None, "empty file, expected a header row")
        header = [h.strip() for h in header]
        if all(c in header for c in POLLUX_COLUMNS):
            jobs = _read_pollux(path, header, reader, max_gpus, apps)
        elif all(c in header for c in PHILLY_COLUMNS):
            jobs = _read_philly(path, header, reader, max_gpus)
        else:
            raise TraceError(path, 1, f"unknown header {header}; expected the columns "
                             f"{list(POLLUX_COLUMNS)} or {list(PHILLY_COLUMNS)}")
    jobs.sort(key=lambda j: (j.arrival, j.name))
    if limit is not None or start:
        jobs = jobs[start:start + limit if limit is not None else None]
        if jobs:
            t0 = jobs[0].arrival
            jobs = [replace(j, arrival=j.arrival - t0) for j in jobs]
    return jobs


def _fields(path: Path, line: int, header: list[str], row: list[str],
            needed: tuple[str, ...]) -> dict[str, str]:
    if len(row) < len(header):
        missing = header[len(row):]
        raise TraceError(path, line, f"row has {len(row)} fields, header has {len(header)} "
                         f"(missing {', '.join(missing)})")
    values = dict(zip(header, (v.strip() for v in row)))
    for col in needed:
        if values.get(col, "") == "":
            raise TraceError(path, line, f"column '{col}' is empty")
    return values


def _number(path: Path, line: int, col: str, text: str, kind: type = float) -> float:
    try:
        value = kind(float(text)) if kind is int else float(text)
    except ValueError:
        raise TraceError(path, line, f"column '{col}' is not a number: {text!r}") from None
    if kind is int and float(text) != value:
        raise TraceError(path, line, f"column '{col}' must be a whole number, got {text!r}")
    if not np.isfinite(value) or value < 0:
        raise TraceError(path, line, f"column '{col}' must be >= 0, got {text!r}")
    return value


def _check_gpus(path: Path, line: int, gpus: int, max_gpus: int | None) -> None:
    if gpus < 1:
        raise TraceError(path, line, f"a job needs at least 1 GPU, got {gpus}")
    if max_gpus is not None and gpus > max_gpus:
        raise TraceError(path, line, f"job asks for {gpus} GPUs but the cluster has {max_gpus}")


def _read_pollux(path: Path, header: list[str], reader, max_gpus: int | None,
                 apps: tuple[str, ...] | None) -> list[JobSpec]:
    jobs, names = [], set()
    for line, row in enumerate(reader, start=2):
        if not row or all(not v.strip() for v in row):
            continue
        v = _fields(path, line, header, row, POLLUX_COLUMNS)
        if v["name"] in names:
            raise TraceError(path, line, f"duplicate job name {v['name']!r}")
        if apps is not None and v["application"] not in apps:
            raise TraceError(path, line, f"unknown application {v['application']!r}; "
                             f"known: {', '.join(apps)}")
        gpus = int(_number(path, line, "num_replicas", v["num_replicas"], int))
        _check_gpus(path, line, gpus, max_gpus)
        batch = int(_number(path, line, "batch_size", v["batch_size"], int))
        if batch < 1:
            raise TraceError(path, line, f"batch_size must be >= 1, got {batch}")
        names.add(v["name"])
        jobs.append(JobSpec(v["name"], _number(path, line, "time", v["time"]),
                            v["application"], gpus, batch))
    return jobs


def _read_philly(path: Path, header: list[str], reader, max_gpus: int | None) -> list[JobSpec]:
    rows = []
    for line, row in enumerate(reader, start=2):
        if not row or all(not v.strip() for v in row):
            continue
        v = _fields(path, line, header, row, PHILLY_COLUMNS)
        try:
            stamp = _dt.datetime.fromisoformat(v["timestamp"]).timestamp()
        except ValueError:
            raise TraceError(path, line, f"bad timestamp {v['timestamp']!r}") from None
        duration = _number(path, line, "duration", v["duration"])
        if duration <= 0:
            raise TraceError(path, line, f"duration must be > 0, got {v['duration']!r}")
        gpus = int(_number(path, line, "num_gpus", v["num_gpus"], int))
        _check_gpus(path, line, gpus, max_gpus)
        rows.append((stamp, line, gpus, duration))
    if not rows:
        return []
    t0 = min(r[0] for r in rows)
    return [JobSpec(f"philly-{line}", stamp - t0, None, gpus, 0, duration)
            for stamp, line, gpus, duration in rows]


def assign_philly_apps(jobs: list[JobSpec], seed: int = 0) -> list[JobSpec]:
    """Give each application-less job a profiled application chosen by its GPU-time.

    Short jobs behave like small models and long jobs like large ones, so the GPU-time bucket
    picks the candidates and a seeded draw picks among them (deterministic for a seed).

    Args:
        jobs: jobs from :func:`load_trace`; those with an ``app`` keep it.
        seed: seed of the draw.

    Returns:
        The jobs with ``app`` set.
    """
    rng = np.random.default_rng(seed)
    buckets = ((3600.0, ("cifar10", "ncf")), (36000.0, ("deepspeech2", "yolov3")),
               (360000.0, ("bert", "imagenet", "yolov3")), (float("inf"), ("imagenet",)))
    out = []
    for job in jobs:
        pick = rng.random()
        if job.app is None:
            gpu_time = (job.duration or 0.0) * job.gpus
            choices = next(c for limit, c in buckets if gpu_time < limit)
            job = replace(job, app=choices[int(pick * len(choices))])
        out.append(job)
    return out
