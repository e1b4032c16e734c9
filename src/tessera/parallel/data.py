"""Data parallelism with DDP semantics, on the mesh's dp group."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tessera.mesh import Mesh


def wrap_data_parallel(model: nn.Module, mesh: Mesh) -> nn.Module:
    """DDP over the ``dp`` axis (dp x sp under sequence parallelism: sp ranks hold the same
    weights and see different tokens); the model itself when that is one rank."""
    if mesh.size("dp") * mesh.size("sp") == 1:
        return model
    group = mesh.group("dp") if mesh.size("sp") == 1 else mesh.flat_group("dp", "sp")
    device_ids = None
    param = next(model.parameters())
    if param.device.type == "cuda":
        device_ids = [param.device.index]
    # Not static_graph: it conflicts with no_sync during gradient accumulation. Non-reentrant
    # activation checkpointing works with plain DDP.
    return DistributedDataParallel(model, device_ids=device_ids, process_group=group)
