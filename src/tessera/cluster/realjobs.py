"""Real-mode job files (``JOBS.yaml``) and how a device count becomes a job's Strategy.

A job file lists real tessera training jobs for ``tessera cluster run``::

    policy: ones                 # optional; --policy wins
    defaults:                    # optional; merged into every job
      config: configs/demo.yaml  # a tessera train config (optional)
      overrides: [model.preset=tiny, data.seq_len=32]
    jobs:
      - name: small-a            # required, unique
        devices: 2               # required: devices asked for (>= 1, <= the cluster)
        gbs: 8                   # required: global batch size (samples per optimizer step)
        max_gbs: 32              # largest gbs the policy may choose when it resizes (default gbs)
        lr: 1e-3                 # learning rate at gbs (default: the config's); scaled with gbs
        lr_warmup_steps: 5       # steps over which a rescaled learning rate is reached (default 0)
        steps: 40                # required: optimizer steps to train (train.max_steps)
        mbs: 2                   # micro-batch size per device (default gbs / devices)
        arrival: 0               # seconds after the run starts (default 0)
        epoch_steps: 10          # steps per "epoch" for ONES's resize bounds (default steps/5)
        retries: 2               # relaunches after a crash before the job is marked failed
        overrides: [train.learning_rate=1e-3]

The scheduler owns ``strategy``, ``train.max_steps``, ``train.output_dir`` and
``train.resume``: a job that sets them is refused.

Batch size and devices. A policy's batch choice is applied between ``gbs`` (the batch the job
asks for, and the one its ``steps`` count) and ``max_gbs`` (default ``gbs``: the batch never
changes). On ``n`` devices a job wanting batch ``B`` runs ``gbs' =`` ``B`` clamped to
``[gbs, max_gbs]`` and rounded down to a multiple of ``n`` (to ``gbs`` if that is below it),
then ``dp = n'``, the largest ``n' <= n`` that divides ``gbs'``, with ``mbs' =`` the largest
divisor of ``gbs' / n'`` not above its ``mbs``; gradient accumulation makes up the rest
(``gbs' = mbs' * dp * accum``). Devices a policy grants beyond ``n'`` are handed back before the
schedule is applied. The job trains ``steps * gbs`` samples in all, whatever batches it runs
at; the learning rate follows the linear scaling rule, ``lr * gbs' / gbs``, reached at once or
linearly over ``lr_warmup_steps`` steps after the relaunch. The training
runtime resumes a checkpoint at its ``samples_consumed`` with the new batch size and applies
the new learning rate (see docs/scheduler.md, "Real mode").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tessera.strategy import Strategy, StrategyError

OWNED_KEYS = ("strategy", "train.max_steps", "train.output_dir", "train.resume",
              "train.resume_from")
JOB_KEYS = {"name", "devices", "gbs", "steps", "mbs", "arrival", "epoch_steps", "retries",
            "overrides", "config", "max_gbs", "lr", "lr_warmup_steps"}


class JobFileError(ValueError):
    """A job file is unusable; the message names the file and the entry."""

    def __init__(self, path: str | Path, entry: str | None, message: str) -> None:
        where = f"{path}: {entry}: " if entry else f"{path}: "
        super().__init__(where + message)


@dataclass(frozen=True)
class RealJob:
    """One real training job of a job file (see the module docstring for the fields)."""

    name: str
    devices: int
    gbs: int
    steps: int
    mbs: int
    arrival: float = 0.0
    epoch_steps: int = 1
    retries: int = 2
    config: str | None = None
    overrides: tuple[str, ...] = field(default_factory=tuple)
    max_gbs: int = 0  # 0: gbs (set in __post_init__)
    lr: float | None = None  # learning rate at gbs; None: the config's
    lr_warmup_steps: int = 0  # steps to reach a rescaled learning rate after a relaunch

    def __post_init__(self) -> None:
        if self.max_gbs == 0:
            object.__setattr__(self, "max_gbs", self.gbs)

    def usable_devices(self, n: int, gbs: int | None = None) -> int:
        """The largest device count ``<= n`` that divides ``gbs`` (default the job's; 0 for
        ``n <= 0``)."""
        gbs = gbs or self.gbs
        return next((k for k in range(min(n, gbs), 0, -1) if gbs % k == 0), 0)

    def run_shape(self, n: int, batch: int) -> tuple[int, int]:
        """(devices, global batch) the job runs with when granted ``n`` devices and asked for
        ``batch`` (see the module docstring)."""
        b = min(max(int(batch), self.gbs), self.max_gbs)
        if n >= 1 and b // n * n >= self.gbs:
            b = b // n * n
        elif b != self.gbs and b % n:
            b = self.gbs
        return self.usable_devices(n, b), b

    def strategy(self, n: int, gbs: int | None = None) -> Strategy:
        """The Strategy this job runs with on ``n`` devices at global batch ``gbs`` (default
        the job's; ``n`` must divide it).

        Raises:
            ValueError: ``n`` does not divide ``gbs``.
        """
        gbs = gbs or self.gbs
        if n < 1 or gbs % n:
            raise ValueError(f"job {self.name}: {n} devices do not divide gbs={gbs}")
        per_rank = gbs // n
        mbs = max(k for k in range(1, min(self.mbs, per_rank) + 1) if per_rank % k == 0)
        return Strategy(dp=n, micro_batch_size=mbs, global_batch_size=gbs)


@dataclass(frozen=True)
class JobFile:
    """A parsed job file: the jobs and the policy it names (if any)."""

    path: Path
    jobs: tuple[RealJob, ...]
    policy: str | None = None


def load_jobs(path: str | Path, devices: int, policies: tuple[str, ...]) -> JobFile:
    """Read and check a job file against a cluster of ``devices`` devices.

    Args:
        path: the YAML file.
        devices: devices in the cluster.
        policies: known policy names.

    Raises:
        JobFileError: unreadable file, unknown policy or key, a missing or bad field, more
            devices than the cluster, a duplicate name; the message names file and entry.
    """
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise JobFileError(path, None, f"cannot read: {err}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("jobs"), list) or not raw["jobs"]:
        raise JobFileError(path, None, "must be a mapping with a non-empty 'jobs' list")
    unknown = sorted(set(raw) - {"jobs", "defaults", "policy"})
    if unknown:
        raise JobFileError(path, None, f"unknown key(s) {', '.join(unknown)}")
    policy = raw.get("policy")
    if policy is not None and str(policy).lower() not in policies:
        raise JobFileError(path, "policy", f"unknown policy {policy!r}; choose from "
                           f"{', '.join(policies)}")
    defaults = raw.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise JobFileError(path, "defaults", "must be a mapping")
    jobs = [_parse_job(path, i, entry, defaults, devices) for i, entry in enumerate(raw["jobs"])]
    seen: set[str] = set()
    for i, job in enumerate(jobs):
        if job.name in seen:
            raise JobFileError(path, _label(i, job.name), "duplicate job name")
        seen.add(job.name)
    return JobFile(path, tuple(jobs), None if policy is None else str(policy).lower())


def _label(index: int, name: Any = None) -> str:
    return f"job {index + 1}" + (f" ({name!r})" if name else "")


def _parse_job(path: Path, index: int, entry: Any, defaults: dict, devices: int) -> RealJob:
    if not isinstance(entry, dict):
        raise JobFileError(path, _label(index), "must be a mapping")
    label = _label(index, entry.get("name"))
    merged = {**defaults, **entry}
    merged["overrides"] = [*defaults.get("overrides", []), *entry.get("overrides", [])]
    if merged.get("config") is not None:  # relative to the job file, like an include
        merged["config"] = str(path.parent / str(merged["config"]))
    unknown = sorted(set(merged) - JOB_KEYS)
    if unknown:
        raise JobFileError(path, label, f"unknown key(s) {', '.join(unknown)}")
    missing = [k for k in ("name", "devices", "gbs", "steps") if k not in merged]
    if missing:
        raise JobFileError(path, label, f"missing field(s) {', '.join(missing)}")
    asked = merged["devices"]
    if isinstance(asked, int) and asked > devices:  # before the strategy rules, which it breaks
        raise JobFileError(path, label, f"devices={asked} exceeds the cluster's {devices} "
                           "device(s)")
    try:
        return _build(merged)
    except (TypeError, ValueError) as err:
        raise JobFileError(path, label, str(err)) from None


def _build(m: dict) -> RealJob:
    ints = {k: _int(k, m[k]) for k in ("devices", "gbs", "steps")}
    for key, value in ints.items():
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")
    mbs = _int("mbs", m.get("mbs", max(1, ints["gbs"] // ints["devices"])))
    arrival = float(m.get("arrival", 0.0))
    if arrival < 0:
        raise ValueError(f"arrival must be >= 0, got {arrival}")
    overrides = tuple(str(o) for o in m["overrides"])
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in OWNED_KEYS:
            raise ValueError(f"override {key} is set by the scheduler; remove it")
    job = RealJob(name=str(m["name"]), mbs=mbs, arrival=arrival,
                  epoch_steps=_int("epoch_steps", m.get("epoch_steps",
                                                        max(1, ints["steps"] // 5))),
                  retries=_int("retries", m.get("retries", 2)), config=m.get("config"),
                  overrides=overrides, max_gbs=_int("max_gbs", m.get("max_gbs", ints["gbs"])),
                  lr=_lr(m, ints["gbs"]),
                  lr_warmup_steps=_int("lr_warmup_steps", m.get("lr_warmup_steps", 0)), **ints)
    if job.mbs < 1 or job.epoch_steps < 1 or job.retries < 0 or job.lr_warmup_steps < 0:
        raise ValueError("mbs and epoch_steps must be >= 1, retries and lr_warmup_steps >= 0")
    if job.max_gbs < job.gbs:
        raise ValueError(f"max_gbs={job.max_gbs} must be >= gbs={job.gbs}")
    try:  # the strategy it asks for must be valid as written
        Strategy(dp=job.devices, micro_batch_size=job.mbs,
                 global_batch_size=job.gbs).validate_for(world_size=job.devices)
    except StrategyError as err:
        raise ValueError(f"at devices={job.devices}: {err}") from None
    if job.config is not None and not Path(job.config).is_file():
        raise ValueError(f"config {job.config} does not exist")
    return job


def _lr(m: dict, gbs: int) -> float | None:
    """The learning rate at ``gbs``: the entry's ``lr``, else (only needed when the batch may
    change) the one its config and overrides give."""
    if m.get("lr") is not None:
        if isinstance(m["lr"], bool) or not isinstance(m["lr"], (int, float)) or m["lr"] <= 0:
            raise ValueError(f"lr must be a positive number, got {m['lr']!r}")
        return float(m["lr"])
    if m.get("max_gbs", gbs) == gbs:
        return None
    from tessera.config import ConfigError, load_config

    try:
        return float(load_config(m.get("config"), m["overrides"]).train.learning_rate)
    except ConfigError as err:
        raise ValueError(f"cannot read the learning rate to scale with gbs: {err}") from None


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value
