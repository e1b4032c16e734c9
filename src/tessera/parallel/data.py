"""Data parallelism with DDP semantics, on the mesh's dp group."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tessera.mesh import Mesh


def wrap_data_parallel(model: nn.Module, mesh: Mesh) -> nn.Module:
    """DDP over the ``dp`` axis; the model itself when dp == 1 (no communication needed)."""
    if mesh.size("dp") == 1:
        return model
    device_ids = None
    param = next(model.parameters())
    if param.device.type == "cuda":
        device_ids = [param.device.index]
    # Not static_graph: it conflicts with no_sync during gradient accumulation. Non-reentrant
    # activation checkpointing works with plain DDP.
    return DistributedDataParallel(model, device_ids=device_ids, process_group=mesh.group("dp"))
