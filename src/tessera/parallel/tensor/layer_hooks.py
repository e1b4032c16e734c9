"""Hooks the 1D builder puts around a model's layers once its modules are replaced.

- :func:`share_block_entries`: a parallel layer's attention and MLP enter their one input
  into tensor parallelism once (policy.PARALLEL_LAYERS).
- :func:`check_block_inputs`: every column layer that leaves its input-gradient sum to its
  block has a block doing it.
- :func:`scatter_at_first_layer`: Megatron sequence parallelism on a Hugging Face model
  splits the sequence at its first decoder layer and gathers it after the last.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from torch import nn

from tessera.parallel.tensor.modules import (ColumnLinear, LayerOutputGather, Norm1D,
                                             SequenceScatter, SharedEntry)
from tessera.parallel.tensor.policy import PARALLEL_LAYERS, PolicyError

if TYPE_CHECKING:
    from tessera.parallel.tensor.apply import _Builder1D


def scatter_at_first_layer(model: nn.Module, builder: "_Builder1D") -> None:
    """A Hugging Face model keeps its embeddings whole (its masks and positions follow their
    length): the decoder layer holding the first attention cuts them to this rank's chunk,
    the one holding the last gathers its output whole again, and the norms outside the
    layers (the final one) run on the whole sequence, as plain 1D tp runs them."""
    paths = {id(m): path for path, m in model.named_modules()}
    layers = [paths.get(id(a), "").rpartition(".")[0] for a in builder.attentions]
    if not layers or not all(layers):
        raise PolicyError(f"tp_seq=on: {type(model).__name__} has no decoder layer around an "
                          "attention module to split the sequence at")
    scatter, gather = SequenceScatter(builder.group), LayerOutputGather(builder.group)
    model.get_submodule(layers[0]).register_forward_pre_hook(scatter, with_kwargs=True)
    model.get_submodule(layers[-1]).register_forward_hook(gather)
    builder.sequence_hooks += [scatter, gather]
    for path, module in model.named_modules():
        if isinstance(module, Norm1D) and not any(path.startswith(f"{layer}.")
                                                  for layer in layers):
            module.seq_parallel = False


def share_block_entries(model: nn.Module, builder: "_Builder1D") -> None:
    """Parallel layers (policy.PARALLEL_LAYERS): their attention and MLP share one
    :class:`SharedEntry`, so the one input both read enters tensor parallelism once."""
    pattern = PARALLEL_LAYERS.get(type(model).__name__)
    # A class whose config can turn them off (StableLM's use_parallel_residual): sequential
    # layers would share nothing, and holding the first block's entry costs memory.
    if pattern is None or getattr(model.config, "use_parallel_residual", True) is False:
        return
    for path, layer in list(model.named_modules()):
        if not re.fullmatch(pattern, path):
            continue
        hooks = [builder.block_inputs[id(m)] for m in layer.children()
                 if id(m) in builder.block_inputs]
        if len(hooks) != 2:
            raise PolicyError(f"{path or 'the model'} of {type(model).__name__} is listed in "
                              "PARALLEL_LAYERS (tessera/parallel/tensor/policy.py) as a layer "
                              f"whose attention and MLP read one input, but it holds "
                              f"{len(hooks)} modules of style 'attention' or 'mlp'")
        shared = SharedEntry()
        for hook in hooks:
            hook.shared = shared
        layer.register_forward_hook(shared.clear, always_call=True)


def check_block_inputs(model: nn.Module, builder: "_Builder1D") -> None:
    """Refuse a column layer that skips its input-gradient sum with no block to do it.

    Column layers inside attention / MLP run in mode "gathered" and rely on the enclosing
    block's :class:`BlockInput`; a policy whose column pattern matches a module outside any
    "attention" / "mlp" module would silently lose the sum over ranks.
    """
    hooked = [path for path, m in model.named_modules() if id(m) in builder.block_inputs]
    for path, module in model.named_modules():
        if isinstance(module, ColumnLinear) and module.mode == "gathered" and not any(
                path.startswith(block + ".") for block in hooked):
            raise PolicyError(
                f"{path} of {type(model).__name__} is column-parallel but not inside a module "
                "of style 'attention' or 'mlp', whose pre-hook sums its input gradient: add "
                "its enclosing block to POLICIES in tessera/parallel/tensor/policy.py")
