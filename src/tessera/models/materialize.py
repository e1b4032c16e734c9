"""Give a model built on the meta device storage and its initial values, all of it or a part.

A model larger than one device's memory is built under ``torch.device("meta")``; under
pipeline parallelism each rank then materialises only the weights its stages hold
(``parallel/pipeline``). Two things must hold for that to train like one device: the ranks
sharing a weight (an embedding tied to the LM head on the first and last stage) must agree on
it, and the pipeline must start from the very weights a single-device run of the same model
starts from. Both follow if a weight's initial values depend on nothing but its name. So every
random fill the model's own initialisation makes (``normal_``, ``uniform_``, ...) is drawn from
a generator seeded by the model seed, the weight's first name in the model and how many fills
that weight has had; weights left on meta take no draws and shift no one else's.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DeferredInit", "FewAtATime", "MaterializeError", "has_meta", "materialize",
           "materialize_unit", "parameter_aliases", "shapes_on_meta"]

aten = torch.ops.aten
# In-place random fills nn.init and Hugging Face's initialisers use (each takes a generator).
_RANDOM_FILLS = {aten.normal_, aten.uniform_, aten.bernoulli_, aten.random_, aten.exponential_,
                 aten.log_normal_, aten.cauchy_, aten.geometric_}


class MaterializeError(RuntimeError):
    """The model's initialisation left a tensor it was to set unset."""


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in _tensors(model))


def materialize(model: nn.Module, device: torch.device | str,
                names: Iterable[str] | None = None, seed: int = 0) -> list[str]:
    """Give ``model``'s meta parameters (those with a name in ``names``; all by default) and
    all its meta buffers storage on ``device``, then run the model's own initialisation.

    Parameters tied to each other stay one parameter. The initialisation is the model's
    ``reset_parameters()`` (tessera's reference model), Hugging Face's ``init_weights()``, or
    else every submodule's ``reset_parameters()``; its random fills are seeded per weight (see
    the module docstring), so a weight gets the same values whichever part is materialised.
    Parameters not named stay on meta; tensors already off meta keep their values (the
    initialisation's writes to them are skipped). Returns the materialised parameters' first
    names.

    Raises:
        MaterializeError: if the initialisation left a floating-point tensor it should have
            set unset (it is filled with NaN first to tell), naming it.
    """
    device = torch.device(device)
    wanted = None if names is None else set(names)
    first_names = parameter_aliases(model)
    new_params, _ = _swap(model, ("_parameters",), device, lambda p: p.is_meta and (
        wanted is None or bool(wanted & set(first_names[id(p)]))))
    new_buffers, _ = _swap(model, ("_buffers",), device, lambda b: b.is_meta)
    fresh = {id(t) for t in (*new_params.values(), *new_buffers.values())}
    owners, kept = {}, set()  # storages: fresh ones by name; the ones whose values stay
    for name, tensor in _named_tensors(model):
        if id(tensor) in fresh:
            if tensor.is_floating_point():
                tensor.data.fill_(float("nan"))
            owners[tensor.untyped_storage().data_ptr()] = name
        elif not tensor.is_meta:
            kept.add(tensor.untyped_storage().data_ptr())
    with torch.no_grad(), _SeededFills(owners, kept, seed):
        _run_initialisation(model)
    unset = [name for name, t in _named_tensors(model) if id(t) in fresh
             and t.is_floating_point() and bool(torch.isnan(t).any())]
    if unset:
        raise MaterializeError(
            f"the model's initialisation ({type(model).__name__}) left {unset[:5]} unset "
            "after moving them off the meta device; give the model a reset_parameters() (or "
            "Hugging Face _init_weights) that sets every weight and buffer, or build it on "
            "the device")
    return [first_names[pid][0] for pid in new_params]


def _tensors(model: nn.Module):
    yield from model.parameters()
    yield from model.buffers()


def _named_tensors(model: nn.Module):
    yield from model.named_parameters()
    yield from model.named_buffers()


def parameter_aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name of every parameter, by tensor identity, in module order: tied weights have
    several; the first is the one ``named_parameters`` gives."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def _swap(model: nn.Module, slots: tuple[str, ...], device: torch.device | str, wanted
          ) -> tuple[dict[int, torch.Tensor], list[tuple[dict, str, torch.Tensor]]]:
    """Swap each ``wanted`` tensor in every module's ``slots`` for an empty one of its shape
    and dtype on ``device``; a tensor held by several modules (tied) gets one replacement.
    Returns {old id: new} and the (table, key, old tensor) entries swapped."""
    new: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    for module in model.modules():
        for slot in slots:
            table = getattr(module, slot)
            for key, old in table.items():
                if old is None or not (id(old) in new or wanted(old)):
                    continue
                if id(old) not in new:
                    empty = torch.empty_like(old, device=device)
                    new[id(old)] = (nn.Parameter(empty, requires_grad=old.requires_grad)
                                    if isinstance(old, nn.Parameter) else empty)
                swapped.append((table, key, old))
                table[key] = new[id(old)]
    return new, swapped


def _run_initialisation(model: nn.Module) -> None:
    if callable(getattr(type(model), "reset_parameters", None)):
        model.reset_parameters()
    elif callable(getattr(model, "init_weights", None)) and hasattr(model, "_init_weights"):
        model.init_weights()  # Hugging Face: _init_weights over every module, then ties
    else:
        for module in model.modules():
            if module is not model and callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()


class _SeededFills(TorchDispatchMode):
    """Hands each in-place random fill of a named tensor a generator seeded by
    (seed, name, how many fills that tensor has had); skips writes into ``kept`` storages."""

    def __init__(self, owners: dict[int, str], kept: set[int], seed: int) -> None:
        super().__init__()
        self.owners, self.kept, self.seed, self.fills = owners, kept, seed, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is None or target.is_meta:
            return func(*args, **kwargs)
        storage = target.untyped_storage().data_ptr()
        if storage in self.kept and _writes_first_argument(func):
            return target
        if func.overloadpacket in _RANDOM_FILLS:
            name = self.owners.get(storage)
            if name is not None:
                kwargs["generator"] = self._generator(name, args[0].device)
        return func(*args, **kwargs)

    def _generator(self, name: str, device: torch.device) -> torch.Generator:
        count = self.fills[name]
        self.fills[name] += 1
        digest = hashlib.sha256(f"{self.seed}:{name}:{count}".encode()).digest()
        generator = torch.Generator(device=device)
        generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        return generator


def _writes_first_argument(func) -> bool:
    arguments = func._schema.arguments
    alias = arguments[0].alias_info if arguments else None
    return alias is not None and alias.is_write


@dataclass
class DeferredInit:
    """How a model built on the meta device gets its weights once a layout knows which it
    keeps: :func:`materialize` on ``device`` with ``seed``, then ``load`` (e.g. pretrained
    weights from a folder; it must skip what is still on meta)."""

    device: torch.device
    seed: int = 0
    load: Callable[[nn.Module], None] | None = None

    def __call__(self, model: nn.Module, names: Iterable[str] | None = None) -> list[str]:
        done = materialize(model, self.device, names, self.seed)
        if self.load is not None:
            self.load(model)
        return done


@contextlib.contextmanager
def shapes_on_meta(model: nn.Module) -> Iterator[None]:
    """Every parameter and buffer of ``model`` swapped for a meta stand-in of its shape and
    dtype (tied ones stay tied), the originals back afterwards.

    For capturing a model some of whose weights are materialised and some not: torch.export
    traces shapes only, and cannot mix devices.
    """
    _, swapped = _swap(model, ("_parameters", "_buffers"), "meta", lambda t: not t.is_meta)
    try:
        yield
    finally:
        for table, key, tensor in swapped:
            table[key] = tensor


# The module lists that hold transformer blocks (GPT-2's ``h``, Llama's ``layers``, tessera's
# ``blocks``); the pipeline's capture reads block indices with the same names.
BLOCK_LISTS = "h|layers|blocks"
_BLOCK_PATH = re.compile(rf"^(.*?(?:^|\.)(?:{BLOCK_LISTS})\.\d+)(?:\.|$)")


def materialize_unit(path: str) -> str:
    """What a layout materialising a few weights at a time takes at once for the module at
    ``path``: its transformer block (``model.layers.3`` for ``model.layers.3.mlp.up_proj``),
    else the module itself. One request per block keeps the number of requests, each of which
    runs the model's initialisation, proportional to the depth, not to the module count."""
    match = _BLOCK_PATH.match(path)
    return match.group(1) if match else path


class FewAtATime:
    """Whole values of a meta model's weights, a few at a time, for a layout that keeps only a
    piece of each (tensor parallelism keeps a shard).

    Each request materialises the weights asked for, with ``deferred``, on a fresh copy of the
    model made with every tensor on meta (so copies cost no storage): the initialisation runs
    over the original structure, and a weight's values depend only on its name (module
    docstring), so each comes out as materialising the whole model would make it, pretrained
    values loaded included. A fresh copy each time, because initialisations remember what they
    did (Hugging Face marks each module initialised). The model itself is not changed.
    """

    def __init__(self, model: nn.Module, deferred: DeferredInit) -> None:
        with shapes_on_meta(model):  # a weight already materialised is not copied either
            self.template = copy.deepcopy(model)
        self.deferred = deferred
        self.names = parameter_aliases(model)  # id(model's parameter) -> its names

    def whole(self, params: Iterable[nn.Parameter]) -> dict[int, torch.Tensor]:
        """{id(parameter): its whole initial value} for those of ``params`` still on meta.
        The values' storage is freed when the caller drops them."""
        wanted = {id(p): self.names[id(p)][0] for p in params if p.is_meta}
        if not wanted:
            return {}
        work = copy.deepcopy(self.template)
        self.deferred(work, list(wanted.values()))
        return {key: work.get_parameter(name).detach() for key, name in wanted.items()}
