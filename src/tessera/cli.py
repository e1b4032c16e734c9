"""The ``tessera`` command line: train, strategy, model, plan, profile, cluster, memory."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table

from tessera.config import ConfigError, load_config
from tessera.data.corpus import DataError
from tessera.models.config import PRESETS, ModelConfigError, preset
from tessera.strategy import Strategy, StrategyError
from tessera.train.checkpoint import CheckpointError

# Errors that mean "your input is wrong": reported in one line, exit code 2, no traceback.
USER_ERRORS = (ConfigError, DataError, StrategyError, ModelConfigError, CheckpointError)


class InputError(click.ClickException):
    """Bad input, refused before any work starts."""

    exit_code = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tessera")
def main() -> None:
    """tessera: train transformers too big or too long for your hardware."""


@main.command(context_settings={"ignore_unknown_options": False})
@click.argument("args", nargs=-1, metavar="[CONFIG.yaml] [KEY=VALUE]...")
@click.option("--nproc", type=int, default=None,
              help="Workers on this node [default: the strategy's world size / nnodes].")
@click.option("--nnodes", type=int, default=1, show_default=True, help="Nodes in the job.")
@click.option("--node-rank", type=int, default=0, show_default=True, help="This node's rank (rdzv-backend static; c10d numbers nodes as they join).")
@click.option("--rdzv-endpoint", default=None, help="HOST:PORT of the multi-node rendezvous.")
@click.option("--rdzv-backend", default="c10d", show_default=True,
              help="torchrun rendezvous backend for multi-node jobs.")
@click.option("--max-restarts", type=int, default=0, show_default=True,
              help="Restart all workers this many times after a failure.")
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in output_dir.")
def train(args: tuple[str, ...], nproc: int | None, nnodes: int, node_rank: int,
          rdzv_endpoint: str | None, rdzv_backend: str, max_restarts: int, resume: bool) -> None:
    """Train a model as CONFIG.yaml says, with KEY=VALUE overrides.

    \b
    Examples:
      tessera train configs/demo.yaml --nproc 2
      tessera train configs/demo.yaml train.max_steps=50 "strategy=dp=2,mbs=4,gbs=32"
    """
    from tessera.launch import LaunchOptions, prepare_run, run_workers

    config_path, overrides = _split_args(args)
    if resume:
        overrides.append("train.resume=true")
    try:
        config = load_config(config_path, overrides,
                             world_size=None if nproc is None else nproc * nnodes)
        if nproc is None:
            nproc = max(1, config.strategy.world_size // nnodes)
        options = LaunchOptions(nproc, nnodes, node_rank, rdzv_endpoint, rdzv_backend,
                                max_restarts)
        resolved = prepare_run(config, options)
    except (*USER_ERRORS, ValueError) as err:
        raise InputError(str(err)) from None
    click.echo(f"tessera: {config.strategy} on {options.world_size} worker(s); "
               f"output in {config.train.output_dir}")
    code = run_workers(resolved, options)
    if code != 0:
        click.echo(f"tessera: training failed (exit code {code}); the report above names the "
                   "failing rank and its traceback", err=True)
        sys.exit(code)


def _split_args(args: tuple[str, ...]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


@main.group()
def strategy() -> None:
    """Inspect and validate strategies."""


@strategy.command("check")
@click.argument("text")
@click.option("--world-size", type=int, default=None, help="Devices the job will have.")
@click.option("--model", "model_name", default=None, help="Model preset to check against.")
@click.option("--seq-len", type=int, default=None, help="Sequence length to check against.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def strategy_check(text: str, world_size: int | None, model_name: str | None,
                   seq_len: int | None, as_json: bool) -> None:
    """Validate strategy TEXT and print its fields.

    Example: tessera strategy check "dp=2,tp=1,pp=1,mbs=2,gbs=16" --world-size 2
    """
    try:
        parsed = Strategy.parse(text)
        model = preset(model_name) if model_name else None
        parsed.validate_for(world_size=world_size, model=model, seq_len=seq_len)
    except USER_ERRORS as err:
        raise InputError(str(err)) from None
    info = {**parsed.to_dict(), "text": parsed.to_text(), "world_size": parsed.world_size,
            "grad_accum_steps": parsed.grad_accum_steps}
    try:
        parsed.require_available()
        info["runnable"] = "yes"
    except StrategyError as err:
        info["runnable"] = f"not yet: {err}"
    if as_json:
        click.echo(json.dumps(info))
        return
    table = Table(title=f"strategy {parsed}", show_header=False)
    for key, value in info.items():
        table.add_row(key, str(value))
    Console().print(table)


@main.group()
def model() -> None:
    """Inspect model presets."""


@model.command("list")
def model_list() -> None:
    """List the model presets with their sizes."""
    table = Table("preset", "layers", "d_model", "heads", "kv", "style", "params")
    for name in PRESETS:
        c = preset(name)
        style = "llama" if c.activation == "swiglu" else "gpt2"
        table.add_row(name, str(c.n_layers), str(c.d_model), str(c.n_heads),
                      str(c.n_kv_heads), style, f"{c.num_params() / 1e6:,.1f}M")
    Console().print(table)


def _register_subsystem_commands() -> None:
    """plan, profile, cluster and memory live with their subsystems."""
    from tessera.cluster.cli import cluster_group
    from tessera.memory.cli import memory_group
    from tessera.planner.cli import plan_group, profile_command

    for command in (plan_group, profile_command, cluster_group, memory_group):
        main.add_command(command)


_register_subsystem_commands()

if __name__ == "__main__":
    main()
