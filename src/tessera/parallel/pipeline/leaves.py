"""Opaque leaf modules: the way to pipeline a model torch.export cannot capture whole.

A module whose forward cannot be traced (a Python ``if`` on a tensor value, ``.item()``, an
untraceable library call) is captured as one opaque node instead of its operations, and runs
eagerly, its own forward as written, inside the stage that holds it. ``train.
pipeline_leaf_modules: ["blocks.*.moe"]`` names such modules (names or ``fnmatch``
patterns over ``model.named_modules()``); the rest of the model is captured as usual, and the
stages are cut by the partitioner or at ``pipeline_split_points`` between whole leaves.

Built on torch's ``leaf_function`` (an ``invoke_leaf_function`` node whose inputs are the
module's parameters and buffers, reparametrised into it at run time, so gradients reach the
model's own parameters). Tracing cannot run the module, so it sees a stand-in output: **a
leaf must return one tensor shaped like its first tensor argument** (a transformer block, an
MLP or mixture-of-experts layer); a leaf returning anything else is refused at its first
run, naming it. A leaf is priced as the matmuls of the weights it holds (2 FLOPs per weight
per token forward, twice that backward), and the activations it keeps inside are not seen
by the memory estimate. The rules and limits: docs/pipeline.md.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import inspect
import traceback
import weakref
from collections.abc import Iterator

import torch
from torch import fx, nn
from torch._dynamo.decorators import leaf_function
from torch.utils._pytree import tree_map_only

from tessera.parallel.pipeline.cost import BWD_MATMUL, NodeCost, value_bytes
from tessera.strategy import StrategyError

_MARK = "_tessera_pipeline_leaves"  # resolved leaf module names, set on the model


def mark_leaves(model: nn.Module, patterns: list[str] | None) -> list[str]:
    """Resolve ``patterns`` to module names and mark them as opaque leaves of ``model`` for
    every later capture; returns the names (outermost matches only, in model order).

    Raises:
        StrategyError: a pattern that matches no module, or that names the model itself.
    """
    names = resolve_leaves(model, patterns or [])
    for name in names:
        _refuse_aliased_weights(name, model.get_submodule(name))
    model.__dict__[_MARK] = tuple(names)  # not a parameter, buffer or submodule
    if names:
        # A leaf's module that reads a weight it does not hold (a plain reference to another
        # module's parameter) would send that weight no gradient, silently: torch's check
        # turns it into an error naming the tensor.
        torch._dynamo.config.leaf_function_check_escaped_gradients = True
    return names


def _refuse_aliased_weights(name: str, module: nn.Module) -> None:
    """A weight held under two names in one leaf is swapped in under one only when it runs
    (torch's reparametrisation): refuse it rather than fail in backward."""
    every = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    unique = {n for n, _ in module.named_parameters()}
    twice = [n for n in every if n not in unique]
    if twice:
        raise StrategyError(f"pipeline leaf module {name!r} holds a weight under two names "
                            f"({', '.join(twice)} is tied to another of its parameters); "
                            "mark its submodules as leaves instead")


def marked_leaves(model: nn.Module) -> tuple[str, ...]:
    """The leaf module names ``mark_leaves`` set on ``model`` (none: empty)."""
    return model.__dict__.get(_MARK, ())


def resolve_leaves(model: nn.Module, patterns: list[str]) -> list[str]:
    """Module names matching ``patterns``; a match inside another match is dropped."""
    named = [name for name, _ in model.named_modules() if name]
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern in ("", "*"):
            raise StrategyError(f"pipeline_leaf_modules: {pattern!r} names the whole model; a "
                                "leaf is a submodule (e.g. 'blocks.*')")
        hits = [n for n in named if n == pattern or fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            tops = [n for n in named if "." not in n]
            raise StrategyError(f"pipeline_leaf_modules: {pattern!r} matches no module of "
                                f"{type(model).__name__}; its top-level modules are "
                                f"{', '.join(tops)}")
        chosen.update(hits)
    return [n for n in named if n in chosen
            and not any(n.startswith(outer + ".") for outer in chosen)]


@contextlib.contextmanager
def opaque_leaves(model: nn.Module) -> Iterator[None]:
    """While open, the marked leaves of ``model`` trace as one opaque node each."""
    modules = [model.get_submodule(name) for name in marked_leaves(model)]
    stored = set(_module_store())
    saved = []  # a forward set on the instance before (a patch, a hook library's wrapper)
    for module in modules:
        saved.append(module.__dict__.get("forward"))
        module.forward = _opaque_forward(module)  # shadows the class's
    try:
        yield
    finally:
        for module, previous in zip(modules, saved):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        _release_with(model, set(_module_store()) - stored)


def _opaque_forward(module: nn.Module):
    def opaque(*args, **kwargs):
        # The modes the capture saw, per submodule: the graph of an evaluation runs the leaf
        # in eval mode although the user's modules stay in training mode under pipeline
        # stages, and a submodule frozen in eval mode stays so.
        modes = tuple(m.training for m in module.modules())
        return _run_leaf(module, args, kwargs, modes)

    return opaque


@leaf_function
def _run_leaf(module: nn.Module, args: tuple, kwargs: dict, modes: tuple[bool, ...]
              ) -> torch.Tensor:
    # At run time ``module.forward`` is the original again (opaque_leaves put it back); not
    # ``module(...)``: the module's hooks ran around the opaque call when it was traced, and
    # are in the graph. The leaf function hands its tensor arguments over as autograd
    # leaves, whose casts autocast caches and shares (three projections of one input would
    # then sum their gradients in 16 bits); views of them are not leaves, so the module
    # runs as in the whole model.
    args, kwargs = tree_map_only(torch.Tensor, _view_of_leaf, (args, kwargs))
    with _as_captured(module, modes):
        out = module.forward(*args, **kwargs)
    like = _first_tensor(args, kwargs)
    if not isinstance(out, torch.Tensor) or out.shape != like.shape:
        got = (f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
               else type(out).__name__)
        raise TypeError(f"pipeline leaf module {type(module).__name__} returned {got}; a "
                        f"leaf must return one tensor shaped like its first tensor argument "
                        f"{tuple(like.shape)} (pipeline/leaves.py): mark a module that does")
    # The capture saw the argument's dtype; a 16-bit output under autocast is widened to it,
    # exactly (its readers would promote it alike), so the graph gets the dtype it traced.
    return out.to(like.dtype) if out.is_floating_point() and like.is_floating_point() else out


@contextlib.contextmanager
def _as_captured(module: nn.Module, modes: tuple[bool, ...]) -> Iterator[None]:
    """The submodules in the modes the capture saw, and Hugging Face's own gradient
    checkpointing off (its recomputation inside a leaf's local autograd graph fails in
    backward; the pipeline's recomputation covers the leaf); put back after."""
    modules = list(module.modules())
    before = [(m.training, getattr(m, "gradient_checkpointing", None)) for m in modules]
    try:
        for m, mode in zip(modules, modes):
            m.training = mode
            if getattr(m, "gradient_checkpointing", False) is True:
                m.gradient_checkpointing = False
        yield
    finally:
        for m, (mode, checkpointing) in zip(modules, before):
            m.training = mode
            if checkpointing is not None:
                m.gradient_checkpointing = checkpointing


@_run_leaf.register_fake
def _run_leaf_fake(module: nn.Module, args: tuple, kwargs: dict, modes: tuple[bool, ...]
                   ) -> torch.Tensor:
    return torch.empty_like(_first_tensor(args, kwargs))


def _module_store() -> dict:
    """torch's store of the modules leaf calls run (a private table), by key."""
    # The module, not the op of the same name that torch._higher_order_ops exports.
    hop = importlib.import_module("torch._higher_order_ops.invoke_leaf_function")
    return getattr(hop, "_makefx_module_storage", {})


def _release_with(model: nn.Module, keys: set[int]) -> None:
    """Drop torch's references to a capture's leaf modules when ``model`` is collected
    (torch never clears its store, which would keep every captured model alive)."""
    def forget(store=_module_store(), keys=frozenset(keys)):
        for key in keys:
            store.pop(key, None)

    if keys:
        weakref.finalize(model, forget)


def _view_of_leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view_as(tensor) if tensor.requires_grad and tensor.is_leaf else tensor


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError("a pipeline leaf module needs a tensor argument")


def is_leaf_call(node: fx.Node) -> bool:
    """Whether ``node`` is an opaque leaf module's call."""
    return getattr(node.target, "__name__", "") == "invoke_leaf_function"


def leaf_cost(node: fx.Node, weights: int) -> NodeCost:
    """Cost of a leaf call holding ``weights`` parameter elements: its weights' matmuls, 2
    FLOPs per weight per token forward and twice that backward, the tokens read from its
    first activation (..., hidden). What it keeps inside is unknown: its output is counted."""
    tokens = 1
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if (arg.op != "placeholder" and isinstance(val, torch.Tensor)
                and val.is_floating_point() and val.dim() >= 2):
            tokens = val.shape[:-1].numel()
            break
    flops = 2.0 * weights * tokens
    out = value_bytes(node.meta.get("val"))
    return NodeCost(flops, BWD_MATMUL * flops, out, out)


def suggest_leaves(model: nn.Module, err: BaseException) -> list[str] | None:
    """Leaf patterns that would hide the operation ``err`` was raised at: the instances of
    the innermost module class whose forward is on the traceback (None: the failure is in
    the model's own forward, which no leaf can hide). A module holding most of the model's
    weights (a backbone) is not suggested: it does not return its input's shape."""
    by_code: dict[tuple[str, str, int, int], list[str]] = {}
    total = sum(p.numel() for p in model.parameters())
    for name, module in model.named_modules():
        forward = inspect.unwrap(type(module).forward)  # under decorators' wrappers
        code = getattr(forward, "__code__", None)
        if name and code is not None and can_be_leaf(model, name, total):
            lines = [line for _, _, line in code.co_lines() if line is not None]
            key = (code.co_filename, code.co_name, min(lines, default=0),
                   max(lines, default=0))
            by_code.setdefault(key, []).append(name)
    for frame in reversed(_frames(err)):  # innermost first
        for (filename, func, first, last), names in by_code.items():
            if (frame.filename == filename and frame.name == func
                    and frame.lineno is not None and first <= frame.lineno <= last):
                return leaf_patterns(names)
    return None


def can_be_leaf(model: nn.Module, name: str, total: int | None = None) -> bool:
    """Whether to suggest submodule ``name`` as a leaf: not one holding most of the
    model's weights (a backbone, which does not return its input's shape). ``total``: the
    model's parameter count, when the caller has it."""
    if total is None:
        total = sum(p.numel() for p in model.parameters())
    held = sum(p.numel() for p in model.get_submodule(name).parameters())
    return 2 * held <= total


def _frames(err: BaseException | None) -> list[traceback.FrameSummary]:
    """The frames of ``err`` and of the exceptions it was raised from, outermost first (an
    exception's cause was raised deeper than the exception)."""
    seen, frames = set(), []
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        frames = frames + traceback.extract_tb(err.__traceback__)
        err = err.__cause__ or err.__context__
    return frames


def leaf_patterns(names: list[str]) -> list[str]:
    """``blocks.0.moe``, ``blocks.1.moe`` -> ``blocks.*.moe`` (indices become ``*``); a
    name that would become all wildcards (a ``Sequential``'s ``0``) stays as it is."""
    out = []
    for name in names:
        parts = ["*" if part.isdigit() else part for part in name.split(".")]
        pattern = name if set(parts) == {"*"} else ".".join(parts)
        if pattern not in out:
            out.append(pattern)
    return out
