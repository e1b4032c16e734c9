"""Checkpoints through torch.distributed.checkpoint, written atomically.

Layout under ``<output_dir>/checkpoints``::

    step_00000010/          a complete checkpoint (DCP shards + .metadata)
        meta.json           model config, strategy, step, data position: written last
        rng/rank_0.pt       per-rank RNG state
    .step_00000020.partial  a save in progress (never read)
    latest                  name of the newest complete checkpoint

A save goes to the ``.partial`` folder; only when every rank has written its shards and rank 0
has written ``meta.json`` is the folder renamed into place (an atomic rename) and ``latest``
replaced (write, fsync, rename). A crash or Ctrl-C mid-save leaves the previous checkpoint and
``latest`` untouched.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

META = "meta.json"
LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names its path and the reason."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    meta: dict[str, Any], keep: int = 3) -> Path:
    """Save model and optimizer state (all ranks call this); returns the checkpoint folder."""
    rank = dist.get_rank()
    final = root / step_dirname(step)
    partial = root / f".{step_dirname(step)}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
    (partial / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), partial / "rng" / f"rank_{rank}.pt")
    dist.barrier()
    if rank == 0:
        _write_json_durably(partial / META, {**meta, "step": step})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        _write_text_durably(root / LATEST, final.name)
        _prune(root, keep)
    dist.barrier()
    return final


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / META).is_file():
            return candidate
    complete = sorted(p for p in root.glob("step_*") if (p / META).is_file())
    return complete[-1] if complete else None


def read_meta(path: Path) -> dict[str, Any]:
    """The meta.json of a checkpoint folder."""
    meta_file = Path(path) / META
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {META})")
    try:
        return json.loads(meta_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{meta_file} is corrupted: {err}") from None


def check_compatible(meta: dict[str, Any], model_meta: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint of another model, naming the fields that differ."""
    saved = meta.get("model", {})
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs run {v!r}"
             for k, v in model_meta.items() if saved.get(k) != v]
    if diffs:
        raise CheckpointError(f"checkpoint {path} is from another model ({'; '.join(diffs)})")


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer
                    ) -> dict[str, Any]:
    """Load model and optimizer state in place (all ranks); returns the checkpoint's meta."""
    meta = read_meta(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=StateDictOptions(strict=True))
    rng_file = path / "rng" / f"rank_{dist.get_rank()}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than were saved
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return meta


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_text_durably(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _write_json_durably(path: Path, data: dict[str, Any]) -> None:
    _write_text_durably(path, json.dumps(data, indent=2, sort_keys=True))


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    complete = sorted(p for p in root.glob("step_*") if (p / META).is_file())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
