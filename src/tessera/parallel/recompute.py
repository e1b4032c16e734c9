"""Activation recomputation for a share of the transformer blocks.

A ratio r checkpoints the first r * n of n blocks, rounded to the nearest block with a half
rounded down (:func:`tessera.strategy.blocks_to_recompute`, which the planner prices): their
activations are dropped after the forward pass and recomputed during backward. The earliest
blocks are chosen because in a pipeline they hold activations longest. The block's parameter
names do not change (the forward is wrapped in place), so checkpoints load whatever the ratio.

Code inside a checkpointed block can ask :func:`in_checkpointed_block`: the block's forward and
its recomputation then run alike (they must save tensors of the same shapes), and what a
layer would keep small and rebuild in backward (Megatron sequence parallelism's column layers
keep their input's shard and gather it again, tensor/modules.BlockInput) it can keep whole:
the checkpoint keeps nothing of the forward, and the recomputation hands the backward its
tensors at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from tessera.strategy import blocks_to_recompute


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks of a reference or Hugging Face causal LM: the list at
    .blocks, .transformer.h or .model.layers, else the longest nn.ModuleList whose modules
    are all of one class (GPT-NeoX's .gpt_neox.layers, OPT's .model.decoder.layers, ...).

    Raises:
        ValueError: naming the model class when no block list is found.
    """
    for path in ("blocks", "transformer.h", "model.layers"):
        module = model
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, nn.ModuleList):
            return module
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)
             and len({type(block) for block in m}) == 1]
    if lists:
        return max(lists, key=len)  # the first of the longest
    raise ValueError(f"cannot find the transformer blocks of {type(model).__name__}: "
                     "expected an nn.ModuleList at .blocks, .transformer.h or .model.layers, "
                     "or any nn.ModuleList of modules of one class")


def apply_recompute(model: nn.Module, ratio: float) -> int:
    """Checkpoint the first :func:`blocks_to_recompute` blocks; returns how many."""
    if ratio <= 0:
        return 0
    blocks = find_blocks(model)
    count = blocks_to_recompute(ratio, len(blocks))
    for block in list(blocks)[:count]:
        if getattr(block, "_tessera_recompute", False):
            continue
        block.forward = functools.partial(_checkpointed, block.forward)
        block._tessera_recompute = True
    return count


_IN_CHECKPOINTED_BLOCK = contextvars.ContextVar("tessera_in_checkpointed_block", default=False)


def in_checkpointed_block() -> bool:
    """Whether the caller runs inside a checkpointed block: its forward, or its recomputation
    in backward."""
    return _IN_CHECKPOINTED_BLOCK.get()


@contextlib.contextmanager
def _checkpointed_block():
    token = _IN_CHECKPOINTED_BLOCK.set(True)
    try:
        yield
    finally:
        _IN_CHECKPOINTED_BLOCK.reset(token)


def _block_contexts():
    """The checkpoint's (forward, recomputation) contexts: both inside the block."""
    return _checkpointed_block(), _checkpointed_block()


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_block_contexts, **kwargs)
