"""``tessera memory ...`` commands (the group is registered by the main CLI)."""

from __future__ import annotations

import json
import tempfile

import click


@click.group("memory")
def memory_group() -> None:
    """Chunk-based heterogeneous memory (memory=chunk) tools."""


@memory_group.command("timeline")
@click.option("--out", default="docs/memory_timeline.png", show_default=True,
              help="PNG to write.")
@click.option("--placement", type=click.Choice(["auto", "static"]), default="auto",
              show_default=True)
@click.option("--device-budget", default="1500000", show_default=True,
              help="Device budget in bytes (or e.g. 2MiB).")
@click.option("--preset", default="tiny", show_default=True, help="Model preset.")
@click.option("--steps", default=3, show_default=True,
              help="Iterations to run; the last one is drawn (the first is the warm-up).")
@click.option("--json-out", default=None, help="Also write the moments as JSON here.")
def timeline(out: str, placement: str, device_budget: str, preset: str, steps: int,
             json_out: str | None) -> None:
    """Train a few steps under chunk memory and draw one iteration's memory per moment."""
    from tessera.config import config_from_dict
    from tessera.memory.timeline import draw_timeline, timeline_rows
    from tessera.run import build_datasets, build_model, build_tokenizer
    from tessera.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        config = config_from_dict({
            "model": {"preset": preset},
            "strategy": "dp=1,mbs=4,gbs=8,memory=chunk,offload=cpu",
            "data": {"corpus": "stdlib", "seq_len": 32, "max_bytes": 200_000},
            "train": {"output_dir": tmp, "max_steps": steps, "progress": "off",
                      "warmup_steps": 1},
            "memory": {"placement": placement, "device_budget": device_budget,
                       "chunk_size": 20000}})
        train_ds, _ = build_datasets(config, build_tokenizer(config))
        trainer = Trainer(build_model(config), config.train, train_ds, None,
                          strategy=config.strategy, memory=config.memory)
        trainer.train()
        runtime = trainer.plan.memory
    moments = runtime.manager.tracer.last
    budget = runtime.manager.device.budget
    title = (f"{preset} model, placement={placement}, budget {budget} B: "
             f"peak accounted {runtime.manager.device.peak} B")
    path = draw_timeline(moments, budget, out, title)
    if json_out:
        with open(json_out, "w") as handle:
            json.dump({"budget": budget, "moments": timeline_rows(moments),
                       "stats": runtime.stats()}, handle, indent=1)
    click.echo(f"wrote {path} ({len(moments)} moments, peak accounted "
               f"{runtime.manager.device.peak} of {budget} bytes)")
