"""Full (unsharded) model weights in a Hugging Face compatible safetensors layout.

Hugging Face models are written with ``save_pretrained`` (config.json + model.safetensors) and
load with ``from_pretrained``. The reference model is written as ``model.safetensors`` (tied
output head stored once) plus a ``config.json`` of its ModelConfig, and loads with
:func:`load_reference_model`. Any other module is written as ``model.safetensors`` alone (a
tied tensor once), for ``train.init_from`` / :func:`load_safetensors_weights`.

Import (``train.init_from``): :func:`load_safetensors_weights` fills a single-device model from
such a folder (``model.safetensors``, or the shards a ``model.safetensors.index.json`` names)
before any parallelism is applied, so a run under any strategy starts from the same weights.
:func:`check_importable` reads only the files' headers, so the launcher refuses a missing
folder or mismatched names and shapes before workers start.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tessera.models import ModelConfig, Transformer

REFERENCE_WEIGHTS = "model.safetensors"
REFERENCE_CONFIG = "config.json"
WEIGHTS_INDEX = "model.safetensors.index.json"  # sharded Hugging Face checkpoints


class WeightsImportError(ValueError):
    """A safetensors folder cannot initialise this model; the message names the problem."""


def save_full_model(trainer, output_dir: Path) -> Path:
    """Gather the full state dict (all ranks call this) and write it from rank 0.

    Under pipeline parallelism each stage's ranks hold only their stages' weights: rank 0
    gathers them from the other ranks of its pp group.
    """
    pipeline = trainer.plan.pipeline
    # cpu_offload keeps the gathered values on rank 0 only: stages' shares live elsewhere.
    state = get_model_state_dict(trainer.wrapped, options=StateDictOptions(
        full_state_dict=True, cpu_offload=pipeline is None))
    if pipeline is not None:
        state = _gather_stages({k: v.cpu() for k, v in state.items()}, pipeline.pp_group,
                               trainer.mesh.cpu_group())
    if dist.get_rank() == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        model = trainer.model
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(output_dir, state_dict=_without_tied_head(model, state),
                                  safe_serialization=True)
        elif isinstance(model, Transformer):
            _save_reference(model, state, output_dir)
        else:
            _save_module(model, state, output_dir)
    dist.barrier()
    return output_dir


def _gather_stages(state: dict[str, torch.Tensor], pp_group, cpu_group
                   ) -> dict[str, torch.Tensor]:
    """Every stage's share of the state dict on global rank 0 (a weight two stages share is
    equal on both); other ranks keep their own.

    The shares travel over ``cpu_group`` (every rank, gloo; all call this): under NCCL,
    gather_object over the pp group would pickle every share into device buffers on rank 0.
    Ranks outside rank 0's pp group send nothing."""
    mine = state if 0 in dist.get_process_group_ranks(pp_group) else {}
    shares = [None] * dist.get_world_size(cpu_group) if dist.get_rank() == 0 else None
    dist.gather_object(mine, shares, dst=0, group=cpu_group)
    if dist.get_rank() != 0:
        return state
    whole: dict[str, torch.Tensor] = {}
    for share in shares:
        whole.update(share)
    return whole


def _save_reference(model: Transformer, state: dict[str, torch.Tensor], output_dir: Path) -> None:
    from safetensors.torch import save_file

    if model.config.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(output_dir / REFERENCE_WEIGHTS))
    (output_dir / REFERENCE_CONFIG).write_text(json.dumps(
        {"tessera_model": model.config.to_dict()}, indent=2))


def _without_tied_head(model: nn.Module, state: dict[str, torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
    """The state without the output embedding's key when the model ties it to the input
    embedding, as ``save_pretrained`` writes a tie of one tensor; gathered under tp or pp the
    two names hold separate (equal) tensors, which it would write twice."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not getattr(text, "tie_word_embeddings", False) or head is None:
        return state
    key = next((f"{name}.weight" for name, module in model.named_modules()
                if module is head), None)
    embed = model.get_input_embeddings()
    embed_key = next((f"{name}.weight" for name, module in model.named_modules()
                      if module is embed), None)
    if key is None or embed_key not in state or key == embed_key:
        return state
    return {name: value for name, value in state.items() if name != key}


def _save_module(model: nn.Module, state: dict[str, torch.Tensor], output_dir: Path) -> None:
    """Any other module: its weights as ``model.safetensors``, a tensor tied under several
    names stored once (under its first name), which ``train.init_from`` reads back."""
    from safetensors.torch import save_file

    params = dict(model.named_parameters(remove_duplicate=False))
    kept, seen = {}, set()
    for name, value in state.items():
        param = params.get(name)  # None for a buffer
        if param is not None:
            if id(param) in seen:
                continue  # a tie: the first name in the state dict holds it
            seen.add(id(param))
        kept[name] = value.contiguous()
    save_file(kept, str(output_dir / REFERENCE_WEIGHTS))


def load_reference_model(folder: str | Path) -> Transformer:
    """Rebuild a reference model written by :func:`save_full_model`."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / REFERENCE_CONFIG).read_text())["tessera_model"]
    model = Transformer(ModelConfig.from_mapping(config))
    state = load_file(str(folder / REFERENCE_WEIGHTS))
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if model.config.tie_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"{folder}: weights do not match the config (missing {missing}, "
                         f"unexpected {unexpected})")
    return model


def check_importable(folder: str | Path, model: nn.Module) -> dict[str, Path]:
    """Check that a safetensors folder holds exactly this model's tensors, by name and shape.

    Reads headers only (works on a model on the meta device). A tensor tied to another one
    (e.g. an output head sharing the embedding) may be absent: exports store it once.

    Returns:
        tensor name -> the file that holds it.

    Raises:
        WeightsImportError: naming the folder, and the missing, unexpected or misshapen tensors.
    """
    folder = Path(folder)
    files = _weight_files(folder)
    shapes = _saved_shapes(folder, files)
    expected = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    present = set(shapes)
    missing = sorted(n for n in set(expected) - present if not _tied_names(model, n) & present)
    unexpected = sorted(present - set(expected))
    misshapen = [f"{n} (file {list(shapes[n])}, model {list(expected[n])})"
                 for n in sorted(present & set(expected)) if shapes[n] != expected[n]]
    problems = [f"{label}: {_first(names)}" for label, names in (
        ("missing tensors", missing), ("tensors this model does not have", unexpected),
        ("shape mismatches", misshapen)) if names]
    if problems:
        raise WeightsImportError(f"train.init_from {folder} does not fit the model "
                                 f"{type(model).__name__}: {'; '.join(problems)}")
    return files


def load_safetensors_weights(model: nn.Module, folder: str | Path) -> None:
    """Fill ``model`` (single-device, before parallelisation) from a safetensors folder.

    Tensors still on the meta device (another pipeline rank's share of a model materialised
    per stage) are neither read nor filled.

    Raises:
        WeightsImportError: see :func:`check_importable`.
    """
    from safetensors import safe_open

    files = check_importable(folder, model)
    targets = model.state_dict(keep_vars=True)
    state: dict[str, torch.Tensor] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as reader:
            state.update({name: reader.get_tensor(name) for name in reader.keys()
                          if name in targets and not targets[name].is_meta})
    # Absent names are tied to present ones (checked above): loading those fills both.
    model.load_state_dict(state, strict=False)


def _weight_files(folder: Path) -> dict[str, Path]:
    if not folder.is_dir():
        raise WeightsImportError(f"train.init_from {folder} is not a folder")
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise WeightsImportError(f"{index} is not a safetensors index ({err!r})") from None
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / REFERENCE_WEIGHTS
    if not single.is_file():
        raise WeightsImportError(
            f"train.init_from {folder} has neither {REFERENCE_WEIGHTS} nor {WEIGHTS_INDEX} "
            f"(the layout save_model and save_pretrained write)")
    return {name: single for name in _read_header(folder, single)}


def _saved_shapes(folder: Path, files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        if not path.is_file():
            raise WeightsImportError(f"train.init_from {folder}: {path.name}, named in "
                                     f"{WEIGHTS_INDEX}, is missing")
        shapes.update(_read_header(folder, path))
    return shapes


def _read_header(folder: Path, path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except (SafetensorError, OSError) as err:
        raise WeightsImportError(f"train.init_from {folder}: {path.name} is not a readable "
                                 f"safetensors file ({err})") from None


def _tied_names(model: nn.Module, name: str) -> set[str]:
    """Other names of the parameter called ``name`` (tied weights), or an empty set."""
    groups: dict[int, set[str]] = {}
    for other, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), set()).add(other)
    return next((names - {name} for names in groups.values() if name in names), set())


def _first(names: list[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
