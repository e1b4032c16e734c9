"""The body of ``tessera cluster run``: build the executor and runner, print the outcome."""

from __future__ import annotations

import json
from pathlib import Path

import click

from tessera.cluster.launchers import LocalLauncher, RayLauncher
from tessera.cluster.measured import Measurements
from tessera.cluster.policies import POLICIES, ClusterSpec, make_policy
from tessera.cluster.real_executor import RealExecutor, default_threads
from tessera.cluster.realjobs import JobFileError, load_jobs
from tessera.cluster.realmode import RealConfig, RealResult, RealRunner, order_jobs
from tessera.cluster.report import summarize


class JobInputError(click.ClickException):
    """Bad job file or options, refused before any job starts."""

    exit_code = 2


def _launcher(backend: str, devices: int, ray_address: str | None):
    import torch

    gpus = torch.cuda.device_count()
    if gpus and devices > gpus and backend == "local":
        raise JobInputError(f"--devices {devices} but this machine has {gpus} GPU(s)")
    if backend == "local":
        return LocalLauncher(devices_per_node=devices, use_gpus=gpus > 0)
    try:
        return RayLauncher(ray_address, local_devices=devices, use_gpus=gpus > 0)
    except ImportError:
        raise JobInputError("--executor ray needs Ray: pip install 'ray>=2.9'") from None


def run_jobs(jobs_file: Path, devices: int, policy: str | None, round_s: float, out: Path,
             backend: str, ray_address: str | None, restart_s: float, seed: int,
             as_json: bool) -> None:
    """Load, check and run the jobs; print a per-job table (or JSON lines) and a summary."""
    try:
        parsed = load_jobs(jobs_file, devices, tuple(POLICIES))
    except JobFileError as err:
        raise JobInputError(str(err)) from None
    name = policy or parsed.policy or "ones"
    launcher = _launcher(backend, devices, ray_address)
    total = launcher.nodes * launcher.devices_per_node
    if backend == "ray" and ray_address is not None:
        try:  # re-check against the devices the Ray cluster really has
            load_jobs(jobs_file, total, tuple(POLICIES))
        except JobFileError as err:
            raise JobInputError(str(err)) from None
    jobs = order_jobs(parsed.jobs)
    out.mkdir(parents=True, exist_ok=True)
    measured = Measurements.load(out / "throughput.json")
    executor = RealExecutor(jobs, launcher, out, measured,
                            threads_per_device=default_threads(total))
    cluster = ClusterSpec(launcher.nodes, launcher.devices_per_node)
    runner = RealRunner(jobs, cluster, executor, measured,
                        RealConfig(round_s=round_s, restart_s=restart_s, seed=seed),
                        log=lambda msg: click.echo(f"tessera cluster: {msg}", err=True))
    try:
        result = runner.run(make_policy(name))
    finally:
        measured.save(out / "throughput.json")
        if isinstance(launcher, RayLauncher):
            launcher.shutdown()
    _print(result, jobs, jobs_file, total, measured, as_json)
    if any(result.failed):
        raise SystemExit(1)


def _print(result: RealResult, jobs, jobs_file: Path, total: int, measured: Measurements,
           as_json: bool) -> None:
    sim = result.sim
    rows = []
    for j, job in enumerate(jobs):
        status = "failed" if result.failed[j] else ("finished" if sim.finish[j] == sim.finish[j]
                                                    else "unfinished")
        rows.append({"job": job.name, "status": status, "steps": result.steps[j],
                     "jct_s": float(sim.finish[j] - sim.arrival[j]),
                     "restarts": int(sim.restarts[j]), "resizes": int(sim.resizes[j]),
                     "step_s_by_devices": measured.medians(job.name)})
    summary = {"jobs_file": str(jobs_file), "devices": total, **summarize(sim).as_dict()}
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        click.echo(json.dumps(summary))
        return
    from rich.console import Console
    from rich.table import Table

    tab = Table(title=f"{jobs_file.name} on {total} devices, policy {sim.policy}")
    for col in ("job", "status", "steps", "JCT s", "restarts", "resizes", "step s by devices"):
        tab.add_column(col)
    for r in rows:
        times = ", ".join(f"{n}: {s:.3f}" for n, s in r["step_s_by_devices"].items())
        tab.add_row(r["job"], r["status"], str(r["steps"]), f"{r['jct_s']:.1f}",
                    str(r["restarts"]), str(r["resizes"]), times)
    console = Console()
    console.width = max(console.width, 110)
    console.print(tab)
    console.print(f"avg JCT {summary['avg_jct']:.1f} s, makespan {summary['makespan']:.1f} s, "
                  f"device utilisation {summary['utilization']:.0%}")
