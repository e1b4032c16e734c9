"""Chunks holding tensor-parallel shards: the local tensor of a DTensor parameter.

Under tensor parallelism (parallel/tensor/) every parameter is a DTensor whose local tensor is
this rank's shard, and the layers compute with ``to_local()``. Chunk memory lays out and moves
the *local* tensors: a chunk holds the shards of one tp rank, ZeRO-sharded over the dp ranks
that hold the same shards. The DTensor wrapper stays, so the placements still tell state dicts,
checkpoints and gradient clipping what the whole tensor is.

``to_local()`` returns a fresh view of the wrapper's ``_local_tensor``, so pointing a shard at
a chunk (or at an empty placeholder) must change ``_local_tensor`` itself, in place: the
wrapper and any views taken afterwards then see the chunk.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def is_shard(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor)


def local_of(param: torch.Tensor) -> torch.Tensor:
    """The tensor chunk memory manages for ``param``: its local shard, or itself."""
    return param._local_tensor if isinstance(param, DTensor) else param


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def point_at(param: torch.Tensor, data: torch.Tensor) -> None:
    """Make ``param`` (its local shard under tp) use ``data`` as its storage."""
    local_of(param).data = data


def as_layout(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a local-shaped tensor) in ``param``'s layout: a DTensor under tp."""
    if not isinstance(param, DTensor):
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False)


def to_local_value(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``value``, which may be a DTensor, a whole (single-device)
    tensor, or already local."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(param, DTensor) and tuple(value.shape) == tuple(param.shape):
        from tessera.parallel.tensor.shard import local_chunk

        return local_chunk(value, param.device_mesh, param.placements)
    return value


def has_shards(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())
