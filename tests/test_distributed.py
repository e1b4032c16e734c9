"""Mesh layout and the multi-process test helper (one 8-rank launch for all mesh checks)."""

import time

import pytest
import torch
import torch.distributed as dist

from tessera.mesh import Mesh
from tessera.strategy import Strategy, StrategyError
from tessera.testing import DistributedTestError, run_distributed

MESH_CASES = [
    "dp=8,tp=1,pp=1,mbs=1,gbs=8",
    "dp=2,tp=2,pp=2,mbs=1,gbs=2",
    "dp=2,tp=4,tp_mode=2d,pp=1,mbs=1,gbs=2",
    "dp=1,tp=2,pp=2,sp=2,mbs=1,gbs=1",
]


def _expected_groups(strategy: Strategy, rank: int) -> dict[str, list[int]]:
    rows, cols = strategy.tp_grid
    grid = torch.arange(strategy.world_size).view(strategy.pp, strategy.dp, strategy.sp,
                                                  rows, cols)
    pp, dp, sp, r, c = (int(i) for i in (grid == rank).nonzero()[0])
    groups = {"pp": grid[:, dp, sp, r, c], "dp": grid[pp, :, sp, r, c],
              "sp": grid[pp, dp, :, r, c], "tp": grid[pp, dp, sp].flatten()}
    if strategy.tp_mode == "2d":
        # Along an axis means varying that coordinate: the tp_row group is one grid column.
        groups |= {"tp_row": grid[pp, dp, sp, :, c], "tp_col": grid[pp, dp, sp, r, :]}
    return {axis: sorted(v.tolist()) for axis, v in groups.items()}


def _check_meshes(rank, world_size):
    checked = 0
    for text in MESH_CASES:
        strategy = Strategy.parse(text)
        mesh = Mesh(strategy, "cpu")
        for axis, expected in _expected_groups(strategy, rank).items():
            members = [None] * mesh.size(axis)
            dist.all_gather_object(members, rank, group=mesh.group(axis))
            assert sorted(members) == expected, (text, axis, members, expected)
            assert mesh.rank(axis) == expected.index(rank)
            checked += 1
        for axis in mesh.axis_names:  # every group along the axis, ordered by coordinate
            everyone = [None] * world_size
            dist.all_gather_object(everyone, (mesh.rank(axis),
                                              _expected_groups(strategy, rank)[axis]))
            groups = mesh.groups_along(axis)
            assert sorted(sorted(g) for g in groups) == sorted(
                list(g) for g in {tuple(g) for _, g in everyone}), (text, axis)
            for member, (coordinate, _) in enumerate(everyone):
                (group,) = [g for g in groups if member in g]
                assert group[coordinate] == member, (text, axis, member)
    try:
        Mesh(Strategy(dp=4, micro_batch_size=1, global_batch_size=4), "cpu")
    except StrategyError as err:
        assert "must equal the world size 8" in str(err)
    else:
        raise AssertionError("a 4-rank strategy on 8 ranks was accepted")
    return checked


@pytest.mark.slow
def test_mesh_axes_and_groups_on_8_ranks():
    counts = run_distributed(_check_meshes, world_size=8, timeout=240)
    assert all(c == counts[0] > 0 for c in counts)


def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(60)
    return rank


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return float(t)


def test_helper_returns_results_and_surfaces_failures():
    assert run_distributed(_sum_ranks, world_size=2) == [1.0, 1.0]
    with pytest.raises(DistributedTestError, match="(?s)rank 1 failed.*boom from rank one"):
        run_distributed(_fail_on_rank_1, world_size=2)
    with pytest.raises(DistributedTestError, match=r"timed out after 8s waiting for ranks \[1\]"):
        run_distributed(_hang_on_rank_1, world_size=2, timeout=8)
