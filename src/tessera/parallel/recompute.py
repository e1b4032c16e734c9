"""Activation recomputation for a share of the transformer blocks.

A ratio r checkpoints the first r * n of n blocks, rounded to the nearest block with a half
rounded down (:func:`tessera.strategy.blocks_to_recompute`, which the planner prices): their
activations are dropped after the forward pass and recomputed during backward. The earliest
blocks are chosen because in a pipeline they hold activations longest. The block's parameter
names do not change (the forward is wrapped in place), so checkpoints load whatever the ratio.
"""

from __future__ import annotations

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


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
