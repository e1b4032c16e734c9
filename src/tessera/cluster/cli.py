"""``tessera cluster ...`` commands (a click group the main CLI registers)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from tessera.cluster.job_model import JobModels
from tessera.cluster.policies import POLICIES, ClusterSpec, make_policy
from tessera.cluster.profiles import default_profile_dir
from tessera.cluster.report import summarize, table, write_plots
from tessera.cluster.simulator import SimConfig, Simulator
from tessera.cluster.traces import TraceError, assign_philly_apps, load_trace

cluster_group = click.Group("cluster", help="Elastic cluster scheduling: simulate policies on "
                            "job traces, or run real training jobs under one.")


def _policies(text: str) -> list[str]:
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if not names or bad:
        raise click.BadParameter(f"unknown policy {', '.join(bad) or '(none)'}; choose from "
                                 f"{', '.join(POLICIES)}", param_hint="--policies")
    return names


@cluster_group.command("simulate")
@click.option("--workload", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Trace CSV: a Pollux workload file or the Philly-derived trace.")
@click.option("--policies", default="ones,tiresias,optimus,fifo", show_default=True,
              help=f"Comma-separated policies from: {', '.join(POLICIES)}.")
@click.option("--gpus", default=64, show_default=True, type=click.IntRange(1),
              help="Cluster GPUs (a multiple of --gpus-per-node).")
@click.option("--gpus-per-node", default=4, show_default=True, type=click.IntRange(1))
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of every random "
              "choice; equal seeds give equal results.")
@click.option("--limit", type=click.IntRange(1), default=None,
              help="Use only this many jobs (a contiguous slice in arrival order).")
@click.option("--start", type=click.IntRange(0), default=0, help="First job of the slice.")
@click.option("--round-s", default=60.0, show_default=True, type=click.FloatRange(1.0))
@click.option("--restart-s", default=30.0, show_default=True, type=click.FloatRange(0.0))
@click.option("--profiles", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder of application profiles (default: $TESSERA_CLUSTER_PROFILES or "
              "the copy shipped in the package, tessera/cluster/data/pollux/traces).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead of a table.")
@click.option("--plots", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write jct_cdf.png and utilization.png here (needs matplotlib).")
def simulate(workload: Path, policies: str, gpus: int, gpus_per_node: int, seed: int,
             limit: int | None, start: int, round_s: float, restart_s: float,
             profiles: Path | None, as_json: bool, plots: Path | None) -> None:
    """Simulate each policy on the workload and compare job completion times."""
    names = _policies(policies)
    try:
        cluster = ClusterSpec.with_gpus(gpus, gpus_per_node)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--gpus") from None
    try:
        models = JobModels.fit(profiles or default_profile_dir())
        jobs = load_trace(workload, max_gpus=gpus, apps=models.names, limit=limit, start=start)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None
    jobs = assign_philly_apps(jobs, seed)
    if not jobs:
        raise click.ClickException(f"{workload}: no jobs")
    config = SimConfig(round_s=round_s, restart_s=restart_s, seed=seed)
    results = [Simulator(jobs, cluster, models, config).run(make_policy(n)) for n in names]
    summaries = [summarize(r) for r in results]
    if as_json:
        for s in summaries:
            click.echo(json.dumps({"workload": str(workload), "gpus": gpus, "seed": seed,
                                   **s.as_dict()}))
    else:
        from rich.console import Console

        # Piped output defaults to 80 columns, which would elide the columns; the table is
        # about 110 wide.
        console = Console()
        console.width = max(console.width, 120)
        console.print(table(summaries, f"{workload.name} on {gpus} GPUs (seed {seed})"))
    if plots is not None:
        try:
            for path in write_plots(results, plots):
                click.echo(f"wrote {path}", err=True)
        except ImportError:
            raise click.ClickException("--plots needs matplotlib: pip install "
                                       "'matplotlib>=3.7'") from None


@cluster_group.command("run")
@click.argument("jobs_file", metavar="JOBS.yaml", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--devices", required=True, type=click.IntRange(1),
              help="Device slots: GPUs where present, else CPU worker processes.")
@click.option("--policy", default=None, help=f"One of {', '.join(POLICIES)} [default: the job "
              "file's policy, else ones].")
@click.option("--round-seconds", default=10.0, show_default=True, type=click.FloatRange(0.5),
              help="Seconds between scheduling rounds.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              default=Path("runs/cluster"), show_default=True,
              help="Each job writes to OUT/<name>; OUT/throughput.json keeps measured profiles.")
@click.option("--executor", "backend", type=click.Choice(["local", "ray"]), default="local",
              show_default=True, help="local processes, or tasks on a Ray cluster.")
@click.option("--ray-address", default=None, help="An existing Ray cluster (default: start a "
              "local instance with --devices CPUs).")
@click.option("--restart-s", default=30.0, show_default=True, type=click.FloatRange(0.0),
              help="Restart cost the policies assume until a start-up is measured.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead of a table.")
def run(jobs_file: Path, devices: int, policy: str | None, round_seconds: float, out: Path,
        backend: str, ray_address: str | None, restart_s: float, seed: int,
        as_json: bool) -> None:
    """Run the real tessera training jobs of JOBS.yaml on --devices slots under a policy."""
    from tessera.cluster.real_cli import run_jobs

    if policy is not None and policy.lower() not in POLICIES:
        raise click.BadParameter(f"unknown policy {policy!r}; choose from "
                                 f"{', '.join(POLICIES)}", param_hint="--policy")
    run_jobs(jobs_file, devices, policy, round_seconds, out, backend, ray_address, restart_s,
             seed, as_json)
