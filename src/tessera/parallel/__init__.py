"""Apply a Strategy to a single-device model, in one ordered function.

Order (ARCHITECTURE.md): tensor parallel (1d | 2d) -> sequence parallel -> pipeline split and
recomputation -> memory manager (chunks / ZeRO / offload) -> data parallel. Each later
parallelism adds its step here; a Strategy asking for one that is not built yet is refused by
:meth:`tessera.strategy.Strategy.require_available` before anything is changed.
"""

from __future__ import annotations

from torch import nn

from tessera.mesh import Mesh
from tessera.parallel.data import wrap_data_parallel
from tessera.parallel.plan import Parallelized
from tessera.parallel.recompute import apply_recompute
from tessera.strategy import Strategy

__all__ = ["Parallelized", "parallelize"]


def parallelize(model: nn.Module, strategy: Strategy, mesh: Mesh) -> Parallelized:
    """Lay ``model`` out under ``strategy`` on ``mesh``.

    The model's parameters must already be on the mesh's device. The returned ``module`` may
    wrap ``model`` (e.g. DistributedDataParallel); ``model`` keeps its parameter names, so
    checkpoints stay in the single-device layout.
    """
    strategy.require_available()
    plan = Parallelized(module=model, model=model, loss_group=mesh.group("dp"))
    if apply_recompute(model, strategy.stage_recompute(mesh.rank("pp"))):
        plan.features.append("recompute")
    plan.module = wrap_data_parallel(plan.module, mesh)
    if plan.module is not model:
        plan.features.append("data_parallel")
    return plan
