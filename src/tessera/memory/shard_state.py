"""State dicts of a tensor-parallel model whose shards live in chunks.

Without chunks, a tensor-parallel model's state dict holds DTensor parameters (and, for fused
q|k|v weights, whole unpermuted tensors made by the tp hooks); torch.distributed.checkpoint
and ``full_tensor()`` turn them into the single-device layout. Under chunk memory the local
shards are chunk views or empty placeholders, possibly on another rank (ZeRO) or tier. So
around every ``state_dict`` / ``load_state_dict`` of the model these hooks give each shard a
private fp32 copy of its current value (the owner broadcasts it over the ZeRO group), let
torch and the tp hooks do exactly what they do without chunks, then point the shards back at
their chunks. A load writes the loaded shards into the owners' chunks (parameters and fp32
masters). The layout of what is saved is therefore the tensor-parallel one, unchanged.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tessera.memory.chunk import Kind
from tessera.memory.shards import local_of, point_at

if TYPE_CHECKING:
    from tessera.memory.runtime import ChunkRuntime


class ShardStateDicts:
    """The four state-dict hooks of a chunked tensor-parallel model (see module docstring)."""

    def __init__(self, runtime: "ChunkRuntime") -> None:
        self.runtime = runtime

    def register(self, model: nn.Module) -> None:
        # Root-module hooks run before (pre) and after (post) every submodule's, so the tp
        # hooks on the layers see materialized shards.
        model.register_state_dict_pre_hook(functools.partial(ShardStateDicts._before_save,
                                                             self))
        model.register_state_dict_post_hook(functools.partial(ShardStateDicts._after_save,
                                                              self))
        model.register_load_state_dict_pre_hook(functools.partial(ShardStateDicts._before_load,
                                                                  self))
        model.register_load_state_dict_post_hook(functools.partial(ShardStateDicts._after_load,
                                                                   self))

    def materialize(self) -> None:
        """Give every shard a private fp32 copy of its value (all ZeRO ranks must call)."""
        device = self.runtime.manager.device.device
        for param, value in self.runtime.full_params().items():
            point_at(param, value.to(device))

    def restore(self) -> None:
        """Point the shards back at their chunks (or placeholders)."""
        for chunk in self.runtime.manager.chunks:
            self.runtime.manager.set_views(chunk)

    @torch.no_grad()
    def store(self) -> None:
        """Copy the (loaded) private shard values into this rank's own chunks."""
        m = self.runtime.manager
        for chunk in m.own_chunks():
            for kind in (Kind.PARAM, Kind.MASTER):
                buf = self.runtime.readable(chunk, kind)
                if buf is None:
                    continue
                for slot in chunk.slots:
                    buf[slot.offset: slot.end].copy_(local_of(slot.param).reshape(-1))

    # ------------------------------------------------------------------------- hooks
    def _before_save(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.materialize()

    def _after_save(self, module: nn.Module, state_dict: dict, prefix: str,
                    local_metadata: Any) -> None:
        # The saved entries are detached aliases of the private copies: they keep them.
        self.restore()

    def _before_load(self, module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
        self.materialize()  # keys absent from state_dict keep their current value

    def _after_load(self, module: nn.Module, incompatible: Any) -> None:
        self.store()
        self.restore()
