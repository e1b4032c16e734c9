"""Command line: ``tessera plan``, ``tessera plan estimate`` and ``tessera profile``.

The main CLI registers :data:`plan_group` and :data:`profile_command`; they are plain click
objects, so they also run on their own (and under ``click.testing.CliRunner``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from tessera.planner.cluster import ClusterError, parse_cluster, save_cluster
from tessera.planner.hardware import HardwareError
from tessera.planner.model_spec import ModelSpecError, describe_model, summary
from tessera.planner.search import PlannerError, search
from tessera.planner.simulator import SimOptions, estimate
from tessera.strategy import Strategy, StrategyError

GIB = 2**30


def _model(text: str, seq: int | None):
    try:
        return describe_model(text, seq_len=seq)
    except (ModelSpecError, ValueError) as err:
        raise click.BadParameter(str(err), param_hint="'--model'") from None


def _cluster(text: str):
    try:
        return parse_cluster(text)
    except (ClusterError, HardwareError) as err:
        raise click.BadParameter(str(err), param_hint="'--cluster'") from None


def _fixed(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        if "=" not in item:
            raise click.BadParameter(f"{item!r} is not key=value", param_hint="'--fix'")
        key, value = (p.strip() for p in item.split("=", 1))
        out[key] = _typed(key, value)
    return out


def _typed(key: str, value: str) -> Any:
    if key in ("dp", "tp", "pp", "sp", "mbs", "micro_batch_size"):
        try:
            return int(value)
        except ValueError:
            raise click.BadParameter(f"{key} must be an integer, got {value!r}",
                                     param_hint="'--fix'") from None
    if key == "offload":
        return () if value in ("", "none") else tuple(value.split("+"))
    return value


_COMMON = [
    click.option("--model", "model_text", required=True,
                 help="Preset (gpt3-175b), layers=..,hidden=..,heads=..[,seq,vocab,ffn,"
                      "kv_heads,style], or a Hugging Face config.json (other architectures "
                      "than GPT-2/Llama/Mistral are read from their captured graph)."),
    click.option("--cluster", "cluster_text", required=True,
                 help="DEVICE:PER_NODExNODES (a100-80gb:8x128) or a cluster YAML file."),
    click.option("--seq", type=int, default=None, help="Training sequence length override."),
    click.option("--tp-overlap", type=float, default=0.0, show_default=True,
                 help="Fraction of tensor-parallel communication hidden (sub-pipelined TP)."),
    click.option("--json", "as_json", is_flag=True, help="Print JSON for programs."),
]


def _common(func):
    for option in reversed(_COMMON):
        func = option(func)
    return func


@click.group("plan", invoke_without_command=True)
@click.option("--model", "model_text", default=None,
              help="Model: preset, shorthand or Hugging Face config.json (see estimate --help).")
@click.option("--cluster", "cluster_text", default=None, help="Cluster shorthand or YAML.")
@click.option("--gbs", type=int, default=None, help="Global batch size (samples per step).")
@click.option("--devices", type=int, default=None, help="Devices to use (default: all).")
@click.option("--top", type=int, default=10, show_default=True, help="Strategies to show.")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]), default=None)
@click.option("--seq", type=int, default=None, help="Training sequence length override.")
@click.option("--fix", "fix_text", default=None, help="Fields to hold fixed: 'tp=1,memory=ddp'.")
@click.option("--available-only", is_flag=True,
              help="Only strategies this build's runtime can run.")
@click.option("--allow-disk", is_flag=True, help="Also consider NVMe offload.")
@click.option("--tp-overlap", type=float, default=0.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for programs.")
@click.pass_context
def plan_group(ctx: click.Context, model_text, cluster_text, gbs, devices, top, precision, seq,
               fix_text, available_only, allow_disk, tp_overlap, as_json) -> None:
    """Find the fastest strategies that fit: tessera plan --model M --cluster C --gbs N."""
    if ctx.invoked_subcommand is not None:
        return
    for name, value in (("--model", model_text), ("--cluster", cluster_text), ("--gbs", gbs)):
        if value is None:
            raise click.UsageError(f"missing option {name} (or use a subcommand: estimate)")
    model, cluster = _model(model_text, seq), _cluster(cluster_text)
    try:
        result = search(model, cluster, gbs, devices=devices, top_k=top, precision=precision,
                        fixed=_fixed(fix_text), available_only=available_only,
                        allow_disk=allow_disk, options=SimOptions(tp_overlap=tp_overlap))
    except (PlannerError, StrategyError, HardwareError) as err:
        raise click.ClickException(str(err)) from None
    if as_json:
        click.echo(json.dumps({**result.to_dict(), "model": summary(model)}, indent=2))
    else:
        click.echo(f"model: {summary(model)}")
        _print_table(result, cluster.name, gbs)
    if result.infeasible is not None:
        if not as_json:
            click.echo(result.infeasible.message(), err=True)
        ctx.exit(1)


def _print_table(result, cluster_name: str, gbs: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tessera plan on {cluster_name}, global batch {gbs} "
                        f"({result.candidates_evaluated} of {result.candidates_total} "
                        f"candidates priced, {result.elapsed_s:.2f} s)")
    for column in ("#", "strategy", "step s", "tokens/s", "TFLOP/s/dev", "MFU", "mem/dev GiB",
                   "largest costs", "runs"):
        table.add_column(column, overflow="fold")
    runs = [e.strategy.is_runnable() for e in result.results]
    for rank, (e, runnable) in enumerate(zip(result.results, runs), 1):
        costs = sorted(e.breakdown.items(), key=lambda kv: -kv[1])[:3]
        table.add_row(str(rank), e.strategy.to_text(), f"{e.step_time:.3f}",
                      f"{e.tokens_per_s:,.0f}", f"{e.tflops_per_device:.1f}", f"{e.mfu:.1%}",
                      f"{e.memory.total / GIB:.1f}",
                      ", ".join(f"{k} {v:.2f}s" for k, v in costs if v > 0),
                      "yes" if runnable else "not yet")
    Console(width=max(120, Console().width)).print(table)
    if not all(runs):
        click.echo("runs 'not yet': priced, but tessera train refuses it in this build (e.g. "
                   "memory=zero1/2/3); --available-only lists only what it runs")


@plan_group.command("estimate")
@_common
@click.option("--strategy", "strategy_text", required=True,
              help="e.g. 'dp=32,tp=8,pp=2,mbs=1,gbs=1536,recompute=full,schedule=1f1b'.")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="Override the strategy's precision.")
def estimate_command(model_text, cluster_text, seq, tp_overlap, as_json, strategy_text,
                     precision) -> None:
    """Price one strategy: step time, throughput, MFU, memory and the breakdown."""
    model, cluster = _model(model_text, seq), _cluster(cluster_text)
    try:
        strategy = Strategy.parse(strategy_text)
        if precision:
            strategy = strategy.replace(precision=precision)
        est = estimate(model, cluster, strategy, SimOptions(tp_overlap=tp_overlap))
    except StrategyError as err:
        raise click.BadParameter(str(err), param_hint="'--strategy'") from None
    except HardwareError as err:
        raise click.ClickException(str(err)) from None
    if as_json:
        click.echo(json.dumps({**est.to_dict(), "model": summary(model)}, indent=2))
        return
    d = est.to_dict()
    click.echo(f"model                    {summary(model)}")
    click.echo(f"strategy                 {d['strategy']}")
    for key in ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu"):
        click.echo(f"{key:<25}{d[key]:.4g}")
    click.echo(f"{'memory_per_device_bytes':<25}{d['memory_per_device_bytes']:.4g} "
               f"({d['memory_per_device_bytes'] / GIB:.1f} GiB of "
               f"{d['memory_capacity_bytes'] / GIB:.1f}; fits: {d['fits']})")
    click.echo("breakdown (s): " + ", ".join(f"{k}={v:.4g}" for k, v in d["breakdown"].items()))
    click.echo("memory (GiB):  " + ", ".join(f"{k}={v / GIB:.2f}" for k, v in
                                           d["memory"].items()))


@click.command("profile")
@click.option("--out", "out_path", default="cluster.yaml", show_default=True,
              help="Cluster YAML to write.")
@click.option("--device", "device_type", type=click.Choice(["auto", "cpu", "cuda"]),
              default="auto", show_default=True,
              help="What to measure: CPU workers over gloo, or the CUDA devices over NCCL "
                   "(auto: CUDA when a device is visible).")
@click.option("--workers", type=int, default=None,
              help="CPU worker processes for collectives (default: the CPU count, at least 2).")
@click.option("--quick", is_flag=True,
              help="Fewer shapes and sizes (about a minute on 2 cores, 2 workers).")
def profile_command(out_path: str, device_type: str, workers: int | None, quick: bool) -> None:
    """Measure this machine (matmul by shape, memory, collectives by group size) and write a
    cluster file the planner reads. On GPUs run it on one node, or under torchrun across
    nodes (`torchrun --no-python --nnodes N --nproc-per-node G tessera profile`) to measure
    the cross-node link too."""
    import torch

    from tessera.planner.profile import profile_cluster
    from tessera.planner.profile_gpu import ProfileError, profile_gpu_cluster, torchrun_layout

    log = lambda msg: click.echo(msg, err=True)  # noqa: E731
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        if workers is not None:
            raise click.UsageError("--workers sets CPU worker processes; a GPU profile runs "
                                   "one process per device")
        try:
            cluster = profile_gpu_cluster(quick=quick, log=log)
        except ProfileError as err:
            raise click.ClickException(str(err)) from None
        if cluster is None:  # a torchrun rank other than 0: rank 0 writes the file
            return
    else:
        if torchrun_layout() is not None:
            raise click.UsageError("the CPU profile spawns its own workers: run it without "
                                   "torchrun (torchrun is for profiling GPUs across nodes)")
        cluster = profile_cluster(workers=workers, quick=quick, log=log)
    save_cluster(cluster, out_path)
    precision = cluster.matmul_precision
    click.echo(f"wrote {out_path}: {cluster.name}, best matmul "
               f"{max(rate for _, rate in cluster.matmul_table) / 1e9:.1f} GFLOP/s "
               f"{precision} per {'worker' if cluster.device.is_host else 'device'}, "
               f"{len(cluster.collectives)} collectives measured")


if __name__ == "__main__":  # pragma: no cover - convenience for running this file directly
    sys.exit(plan_group())
