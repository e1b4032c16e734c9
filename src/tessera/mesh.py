"""Named device mesh over torch's DeviceMesh, built from a Strategy.

Axes, outermost first: ``pp``, ``dp``, ``sp``, ``tp``. With ``tp_mode="2d"`` the tensor axis is a
q x q grid with axes ``tp_row`` and ``tp_col`` (and ``tp`` names the flattened grid). Ranks are
laid out row-major over the axes, so the innermost axis (tensor parallelism, which communicates
most) gets neighbouring ranks, i.e. the same node.

Process groups are handed out by name and passed explicitly to the code that communicates: no
module-level globals.

A group "along" an axis links the ranks whose coordinates differ only on that axis.

Worked example: ``pp=2, dp=2, tp=2`` on 8 ranks gives the rank grid ``arange(8).view(2, 2, 1, 2)``;
rank 5 sits at (pp=1, dp=0, sp=0, tp=1), its tp group is {4, 5} and its dp group is {5, 7}.

With ``dp=2, tp=4, tp_mode=2d`` the grid is ``arange(8).view(1, 2, 1, 2, 2)``: ranks 4..7 form
the 2 x 2 tensor grid [[4, 5], [6, 7]]. Rank 5 is at row 0, column 1; its ``tp_row`` group
(row index varies) is the grid column {5, 7}, its ``tp_col`` group (column index varies) is
the grid row {4, 5}, and its ``tp`` group is all four.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessera.strategy import Strategy, StrategyError

AXES_1D = ("pp", "dp", "sp", "tp")
AXES_2D = ("pp", "dp", "sp", "tp_row", "tp_col")


def default_device_type() -> str:
    """"cuda" when a GPU is present (NCCL), else "cpu" (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device_type: str) -> str:
    """The collective backend for a device type: nccl for CUDA, gloo otherwise."""
    return "nccl" if device_type == "cuda" else "gloo"


class Mesh:
    """The job's devices as named axes, with one process group per axis.

    Args:
        strategy: the parallel layout; its world size must equal the process group's.
        device_type: "cpu" or "cuda" (default: what is available).

    Raises:
        StrategyError: if the strategy's world size differs from the running world.
    """

    def __init__(self, strategy: Strategy, device_type: str | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs torch.distributed initialised (tessera.launch does it)")
        world = dist.get_world_size()
        strategy.check_world_size(world)  # the layout alone: step sizes are the run's
        self.strategy = strategy
        self.device_type = device_type or default_device_type()
        q_rows, q_cols = strategy.tp_grid
        if strategy.tp_mode == "2d":
            names, shape = AXES_2D, (strategy.pp, strategy.dp, strategy.sp, q_rows, q_cols)
        else:
            names, shape = AXES_1D, (strategy.pp, strategy.dp, strategy.sp, strategy.tp)
        self.device_mesh: DeviceMesh = init_device_mesh(
            self.device_type, shape, mesh_dim_names=names)
        self.axis_names = names
        self._flat_tp: DeviceMesh | None = None
        self._flat: dict[str, DeviceMesh] = {}
        self._cpu_group: dist.ProcessGroup | None = None
        if strategy.tp_mode == "2d":
            # The whole grid as one group, for collectives over all tp ranks (e.g. loss).
            self._flat_tp = self.device_mesh["tp_row", "tp_col"]._flatten("tp")

    def submesh(self, *axes: str) -> DeviceMesh:
        """The DeviceMesh over the named axes (for DTensor / FSDP2)."""
        self._check_axes(axes)
        if axes == ("tp",) and self._flat_tp is not None:
            return self._flat_tp
        return self.device_mesh[axes[0]] if len(axes) == 1 else self.device_mesh[axes]

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank along ``axis``."""
        return self.submesh(axis).get_group()

    def flat_group(self, *axes: str) -> dist.ProcessGroup:
        """One process group over several axes, e.g. ("dp", "sp"): all ranks holding the same
        weights under sequence parallelism. The flattened group is built once (a collective:
        every rank must call this) and cached."""
        self._check_axes(axes)
        if len(axes) == 1:
            return self.group(axes[0])
        name = "_".join(axes)
        if name not in self._flat:
            self._flat[name] = self.device_mesh[axes]._flatten(name)
        return self._flat[name].get_group()

    def cpu_group(self) -> dist.ProcessGroup:
        """Every rank on gloo, for CPU tensors and objects when the mesh runs NCCL (the world
        group itself on CPU). Built on first use: a collective, every rank calls it. Every
        rank is a member: torch's new_group under a device-bound NCCL world makes
        non-members join a communicator split the members never start (a hang)."""
        if self._cpu_group is None:
            self._cpu_group = (dist.group.WORLD if dist.get_backend() == "gloo" else
                               dist.new_group(list(range(dist.get_world_size())),
                                              backend="gloo"))
        return self._cpu_group

    def groups_along(self, axis: str) -> list[list[int]]:
        """Global ranks of every group along ``axis`` (one of the mesh's named axes), each
        ordered by its coordinate on ``axis``; the same list on every rank."""
        self._check_axes((axis,))
        if axis not in self.axis_names:
            raise StrategyError(f"groups_along takes one of the mesh's own axes "
                                f"{self.axis_names}, got {axis!r}")
        grid = self.device_mesh.mesh.movedim(self.axis_names.index(axis), -1)
        return grid.reshape(-1, grid.shape[-1]).tolist()

    def size(self, axis: str) -> int:
        """Number of ranks along ``axis``."""
        return self.submesh(axis).size()

    def rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return self.submesh(axis).get_local_rank()

    def coordinates(self) -> dict[str, int]:
        """This rank's coordinate on every axis."""
        return {axis: self.rank(axis) for axis in self.axis_names}

    def _check_axes(self, axes: tuple[str, ...]) -> None:
        valid = set(self.axis_names) | ({"tp"} if self.strategy.tp_mode == "2d" else set())
        for axis in axes:
            if axis not in valid:
                raise StrategyError(f"mesh has no axis {axis!r}; axes: {', '.join(sorted(valid))}")

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self.size(a)}" for a in self.axis_names)
        return f"Mesh({sizes}, device_type={self.device_type})"
