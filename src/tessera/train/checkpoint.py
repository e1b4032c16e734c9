"""Checkpoints through torch.distributed.checkpoint, written atomically.

Layout under ``<output_dir>/checkpoints``::

    step_00000010/          a complete checkpoint (DCP shards + .metadata)
        meta.json           model config, strategy, step, data position, and the size and
                            sha256 of every other file: written last
        rng/rank_0.pt       per-rank RNG state
    .step_00000020.partial  a save in progress (never read)
    .step_00000010.replaced a step saved again: the old folder, set aside until the new one
                            is in place
    latest                  name of the newest complete checkpoint

A save goes to the ``.partial`` folder; only when every rank has written its shards and rank 0
has written ``meta.json`` is the folder renamed into place (an atomic rename) and ``latest``
replaced (write, fsync, rename). A crash or Ctrl-C mid-save leaves the previous checkpoint and
``latest`` untouched. Loading verifies every file against the manifest in ``meta.json``, so a
truncated or corrupted checkpoint is named, with the previous complete one offered instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from tessera.models.materialize import parameter_aliases

META = "meta.json"
# Pipeline stages (a model with ``flat_optimizer_state = True``) hold different parameters in
# their optimizer's "group 0": index keys ("param_groups.0.lr") would collide across stages
# (DCP keeps one rank's copy of an equal key), so they save optimizer state flattened, keyed
# by parameter name, which loads at any pp. Loading follows what the checkpoint holds.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_INDEXED = StateDictOptions()
LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names its path and the reason."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    meta: dict[str, Any], keep: int = 3) -> Path:
    """Save model and optimizer state (all ranks call this); returns the checkpoint folder.

    Raises:
        CheckpointError: on every rank, naming the rank and the error, when any rank's part
            of the save fails (a full disk, a permission); the previous checkpoint and
            ``latest`` are left as they were.
    """
    rank = dist.get_rank()
    final = root / step_dirname(step)
    partial = root / f".{step_dirname(step)}.partial"

    def prepare() -> None:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    def write_shards() -> None:
        flat = getattr(model, "flat_optimizer_state", False)
        never_stepped = not optimizer.state
        model_sd, optim_sd = _state_dicts(model, optimizer, _FLAT if flat else _INDEXED)
        if never_stepped:
            _forget_state_init_step(optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
        (partial / "rng").mkdir(exist_ok=True)
        _save_durably(_rng_state(), partial / "rng" / f"rank_{rank}.pt")

    def publish() -> None:
        _write_json_durably(partial / META, {**meta, "step": step, "files": _manifest(partial)})
        # A step saved again (a run resumed from an earlier step): the old folder is renamed
        # aside in one step, so that no crash leaves a half-deleted checkpoint under its
        # name; ``latest`` naming it then finds nothing and falls back to the newest complete.
        replaced = root / f".{final.name}.replaced"
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        try:
            os.replace(partial, final)
        except OSError:
            if replaced.exists():  # the old one back under its name
                os.replace(replaced, final)
            raise
        _fsync_folder(root)
        shutil.rmtree(replaced, ignore_errors=True)
        write_text_durably(root / LATEST, final.name)
        _prune(root, keep, final)

    _agreed(step, partial, prepare, on_rank0_only=True)
    _agreed(step, partial, write_shards)
    _agreed(step, partial, publish, on_rank0_only=True)
    return final


def _agreed(step: int, partial: Path, part: Callable[[], None],
            on_rank0_only: bool = False) -> None:
    """Run one part of a save and raise on every rank if it failed on any.

    A rank that failed alone used to leave the others waiting in the next barrier until the
    collective timeout; now every rank raises the same CheckpointError at once. The unfinished
    ``.partial`` folder is removed (the next save would remove it too)."""
    rank = dist.get_rank()
    error: BaseException | None = None
    if rank == 0 or not on_rank0_only:
        try:
            part()
        except Exception as err:  # any failure: the other ranks must not wait for this one
            error = err
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, f"rank {rank}: {error}" if error else None)
    failed = [p for p in problems if p]
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()  # the folder is gone on every rank's return
    message = (f"saving the checkpoint of step {step} failed ({'; '.join(failed)}); no "
               f"complete checkpoint in {partial.parent} was changed")
    raise CheckpointError(message) from error


def _forget_state_init_step(optimizer: torch.optim.Optimizer) -> None:
    """Undo the step count of the state that get_state_dict just created.

    An optimizer that has not stepped yet (every step so far skipped, as fp16 does while its
    loss scale comes down) has no state; get_state_dict creates it by one step at lr 0 with
    zero gradients. For AdamW that leaves zero moments, as a fresh state, but a step count of
    1, which shifts bias correction for the rest of the run (a resume then differs from the
    uninterrupted run). The saved state dict holds the same tensors, so both are reset.
    """
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0


def list_complete(root: Path) -> list[Path]:
    """Complete checkpoints under ``root`` (those with a meta.json), oldest first."""
    # Only names a save writes: a copy named step_..._backup is neither listed nor pruned.
    return sorted(p for p in Path(root).glob("step_*")
                  if re.fullmatch(r"step_\d+", p.name) and (p / META).is_file())


def verify_checkpoint(path: Path, hashes: bool = True) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest; returns its meta.

    Args:
        path: the checkpoint folder.
        hashes: also compare sha256 digests (reads every byte); sizes alone catch truncation.

    Raises:
        CheckpointError: naming the missing, truncated or altered file, and the previous
            complete checkpoint to resume from instead (if there is one).
    """
    path = Path(path)
    meta = read_meta(path)
    for name, expected in sorted(meta.get("files", {}).items()):
        problem = _file_problem(path / name, expected, hashes)
        if problem:
            raise CheckpointError(f"checkpoint {path} is corrupted: {name} {problem}. "
                                  f"{_previous_offer(path)}")
    return meta


def _file_problem(file: Path, expected: dict[str, Any], hashes: bool) -> str | None:
    if not file.is_file():
        return "is missing"
    size = file.stat().st_size
    if size != expected["bytes"]:
        return f"has {size} bytes, expected {expected['bytes']} (truncated or rewritten)"
    if hashes and _sha256(file) != expected["sha256"]:
        return "does not match its sha256"
    return None


def _previous_offer(path: Path) -> str:
    earlier = [p for p in list_complete(path.parent) if p.name < path.name]
    if not earlier:
        return "No earlier complete checkpoint exists; start without --resume."
    return (f"The previous complete checkpoint is {earlier[-1]}: resume from it with "
            f"train.resume_from={earlier[-1]}")


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    return {str(f.relative_to(folder)): {"bytes": f.stat().st_size, "sha256": _sha256(f)}
            for f in sorted(folder.rglob("*")) if f.is_file() and f.name != META}


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / META).is_file():
            return candidate
    complete = list_complete(root)
    return complete[-1] if complete else None


def read_meta(path: Path) -> dict[str, Any]:
    """The meta.json of a checkpoint folder."""
    meta_file = Path(path) / META
    if not Path(path).exists():
        raise CheckpointError(f"checkpoint {path} does not exist (checkpoints are folders "
                              f"named like {step_dirname(3)} in <output_dir>/checkpoints)")
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {META})")
    try:
        return json.loads(meta_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{meta_file} is corrupted: {err}") from None


def check_compatible(meta: dict[str, Any], model_meta: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint of another model, naming the fields that differ. Fields the
    checkpoint does not record (a Hugging Face config field added by a newer transformers,
    or any before 2026-11-28, when those were first recorded) are not compared."""
    diffs = _differences(meta.get("model", {}), model_meta)
    if diffs:
        raise CheckpointError(f"checkpoint {path} is from another model ({'; '.join(diffs)})")


def _differences(saved: dict[str, Any], run: dict[str, Any], prefix: str = "") -> list[str]:
    """Fields both record that differ, sub-configs (dicts) field by field."""
    out = []
    for key, value in run.items():
        if key not in saved:
            continue
        if isinstance(value, dict) and isinstance(saved[key], dict):
            out += _differences(saved[key], value, f"{prefix}{key}.")
        elif saved[key] != value:
            out.append(f"{prefix}{key}: checkpoint {saved[key]!r} vs run {value!r}")
    return out


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer
                    ) -> dict[str, Any]:
    """Load model and optimizer state in place (all ranks); returns the checkpoint's meta.

    Rank 0 verifies the files first and every rank raises the same CheckpointError if one
    is damaged, so no rank is left waiting in a collective.
    """
    problem = [None]
    if dist.get_rank() == 0:
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            problem[0] = str(err)
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise CheckpointError(problem[0])
    meta = read_meta(path)
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    flat = _saved_flat(saved)
    model_sd, optim_sd = _state_dicts(model, optimizer, _FLAT if flat else _INDEXED)
    renamed = _saved_alias_keys(model, optim_sd, saved) if flat else {}
    state = {"model": model_sd,
             "optim": {renamed.get(key, key): value for key, value in optim_sd.items()}}
    dcp.load(state, checkpoint_id=str(path))
    back = {saved: key for key, saved in renamed.items()}
    state["optim"] = {back.get(key, key): value for key, value in state["optim"].items()}
    if model_sd:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=True, flatten_optimizer_state_dict=flat))
    rng_file = path / "rng" / f"rank_{dist.get_rank()}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than were saved
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return meta


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer,
                 options: StateDictOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and optimizer's state dicts; empty for a rank with no state of its own (a
    pipeline stage holding nothing but rows of a weight another stage holds, rows.py), which
    still joins the collective save and load."""
    if not model.state_dict():
        return {}, {}
    return get_state_dict(model, optimizer, options=options)


def _saved_alias_keys(model: nn.Module, optim_sd: dict[str, Any], saved: set[str]
                      ) -> dict[str, str]:
    """Flat optimizer keys this run names by a tied weight's first name where the
    checkpoint holds them under another of its names -> that key. Pipeline stages named
    a tied weight by its sorted-first name until 2026-11-28 (GPT-2's ``lm_head.weight``,
    not ``transformer.wte.weight``), so their checkpoints load under either layout.
    ``saved``: the checkpoint's keys."""
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    renamed: dict[str, str] = {}
    tied = [names for names in parameter_aliases(module).values() if len(names) > 1]
    for names in tied:
        for key in optim_sd:
            part = next((p for p in ("state.", "param_groups.")
                         if key.startswith(f"{p}{names[0]}.")), None)
            if part is None or f"optim.{key}" in saved:
                continue
            rest = key[len(part) + len(names[0]):]
            alias = next((f"{part}{a}{rest}" for a in names[1:]
                          if f"optim.{part}{a}{rest}" in saved), None)
            if alias is not None:
                renamed[key] = alias
    return renamed


def _saved_flat(keys: set[str]) -> bool:
    """Whether a checkpoint (its ``keys``) keys optimizer hyperparameters by parameter name
    (see _FLAT)."""
    prefix = "optim.param_groups."
    return any(k.startswith(prefix) and not k[len(prefix):].split(".")[0].isdigit()
               for k in keys)


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def write_text_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` all or nothing: a temporary file, fsynced, renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_folder(path.parent)


def _save_durably(obj: Any, path: Path) -> None:
    """torch.save, fsynced: the manifest records this file, so it must be on disk first."""
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_folder(folder: Path) -> None:
    """Make renames inside ``folder`` durable (a rename is an entry in the folder, which is
    only on disk once the folder is synced). Platforms without folder fsync skip it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json_durably(path: Path, data: dict[str, Any]) -> None:
    write_text_durably(path, json.dumps(data, indent=2, sort_keys=True))


def _prune(root: Path, keep: int, saved: Path) -> None:
    """Keep ``saved`` (just written) and the newest others of its run, ``keep`` in all, and
    remove the ``.partial`` (and ``.replaced``) folders of saves that never finished.

    Checkpoints numbered above ``saved`` are an abandoned continuation (the run resumed from
    an earlier step): they go first. Pruning by number alone deleted the checkpoint just
    written, and a later resume took the abandoned one (until 2026-11-28)."""
    for pattern in (".step_*.partial", ".step_*.replaced"):  # saves cut short by a crash
        for leftover in root.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)
    if keep <= 0:
        return
    step = _step_of(saved)
    others = [c for c in list_complete(root) if c.name != saved.name]
    # Abandoned ones first (step above), then the run's own oldest first.
    order = sorted(others, key=lambda c: (_step_of(c) < step, _step_of(c)))
    for old in order[:max(0, len(others) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def _step_of(folder: Path) -> int:
    return int(folder.name.removeprefix("step_"))
