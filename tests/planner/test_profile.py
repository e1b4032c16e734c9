"""Profile smoke tests: 2 gloo workers, the cluster file is readable and used; the 2D
tensor-parallel overhead on 4 workers."""

import pytest
import torch

from tessera.models.config import preset
from tessera.planner import estimate, load_cluster, save_cluster
from tessera.planner.compute import matmul_rate
from tessera.planner.profile import gpu_not_measured_note, profile_cluster
from tessera.planner.profile_tp import _per_layer, measure_tp_overheads
from tessera.strategy import Strategy


@pytest.mark.slow
def test_profile_two_workers_round_trip(tmp_path):
    cluster = profile_cluster(workers=2, quick=True)
    assert cluster.num_devices == 2 and cluster.matmul_table
    assert 2 in cluster.collectives["all_reduce"]
    # Every collective the simulator prices from fits, including the runtime-shaped ones.
    assert all(2 in cluster.collectives[op] for op in ("ring_step", "broadcast", "all_to_all"))
    assert 0 <= cluster.device.ring_overlap <= 1
    fit = cluster.collectives["all_reduce"][2]
    assert fit.latency > 0 and fit.bandwidth > 1e6
    path = tmp_path / "local.yaml"
    save_cluster(cluster, str(path))
    again = load_cluster(str(path))
    assert again.matmul_table == cluster.matmul_table
    # The contention and fixed-overhead measurements are written and read back. The
    # collective fits are measured under load, so no separate sync penalty is written.
    assert not again.sync_penalty
    assert set(again.straggler) == {2} and again.straggler == cluster.straggler
    assert 0 < again.compute_share() <= 1
    assert again.device.overheads == cluster.device.overheads
    assert again.device.overheads["layer_fwd"] + again.device.overheads["layer_bwd"] > 0
    # The runtimes' own costs beyond a plain step: each measured (>= 0 by construction), and
    # the chunk runtime (hooks and copies per micro-batch, reduction and optimizer per step)
    # is never free.
    chunk = [again.device.overheads[k] for k in ("chunk_layer", "chunk_step_layer")]
    assert min(chunk) >= 0 and sum(chunk) > 0
    assert again.device.overheads["recompute_layer"] >= 0
    # A 1D tensor-parallel layer's own Python and dispatch beyond a plain layer's (tp=2 with
    # no-op collectives against the unwrapped model; ~1.5-2 ms per layer and micro-batch
    # here, where a plain layer's fixed cost is ~0.4 ms), and its clipping and AdamW over
    # DTensors per step: both written and read back, each a clamped difference of
    # fastest-of-12 timings (>= 0).
    tp = [again.device.overheads[k] for k in ("tp_layer", "tp_optim_layer")]
    assert min(tp) >= 0 and sum(tp) > 0
    # Two workers cannot plan tp=4: no 2D figure is measured for them.
    assert "tp2d_layer" not in again.device.overheads
    # The Trainer's own work beyond a bare loop (collation, plan clipping, LR schedule) is
    # measured once per step and once per micro-batch. Each is a difference of median step
    # times of a tiny model and either may clamp at 0 when the machine is busy; together
    # they are a one-micro-batch step through the Trainer less the bare loop, never free.
    trainer = again.device.overheads
    assert trainer["trainer_step"] + trainer["trainer_micro_batch"] > 0
    assert again.device.overheads["trainer_micro_batch"] >= 0
    # Element-wise seconds per element of real layers, for both activation styles: each is a
    # least-squares fit of (measured layer - modelled matmuls and attention), every shape's
    # residual clamped at 0, so it is positive unless the core model overshoots every layer.
    # No bandwidth floor is asserted: the calibration layers are small (100 KB to 1 MB per
    # tensor, cache-resident), so they may stream faster than the measured DRAM bandwidth, and
    # a difference of two timings moves with machine noise (CI once saw 0.31x of 4 bytes per
    # element at that bandwidth).
    for key in ("elem_fwd_gelu", "elem_bwd_gelu", "elem_fwd_swiglu", "elem_bwd_swiglu"):
        assert 0 < again.device.overheads[key] < 1e-6, key
    # Explicit block attention: a per-call cost and a per-score-element cost are measured.
    for phase in ("fwd", "bwd"):
        overheads = again.device.overheads
        assert overheads[f"attn_{phase}_call"] + overheads[f"attn_{phase}_elem"] > 0
    rate = matmul_rate(again, 512, 512, 512, "fp32")
    assert 1e8 < rate <= again.device.peak("fp32") * 1.01
    est = estimate(preset("tiny"), again, Strategy(dp=2, micro_batch_size=2,
                                                   global_batch_size=4))
    assert 0 < est.step_time < 10


def test_2d_tensor_parallel_overhead_is_measured_on_a_grid_timed_in_turn():
    # Four workers on a 2 x 2 grid, each rank timed alone with the collectives no-ops (a
    # real collective left in the path would fail the launch after 120 s, not hang). Every
    # 2D linear is three SUMMA products, each a Python loop over the grid (~2.5 ms per layer
    # and micro-batch here, against ~0.4 ms for a plain layer), so the layer is never free.
    figures = measure_tp_overheads(rounds=3, layouts=("tp2d",))
    assert set(figures) == {"tp2d_layer", "tp2d_optim_layer"}
    assert figures["tp2d_layer"] > 0 and figures["tp2d_optim_layer"] >= 0
    with pytest.raises(ValueError, match="unknown tensor-parallel layouts"):
        measure_tp_overheads(layouts=("3d",))


def test_per_layer_figure_is_the_slowest_rank_over_the_plain_model():
    def rank(tp_deep: float, plain_deep: float) -> dict:
        return {("tp2d", 1, "passes"): 1.0, ("tp2d", 5, "passes"): tp_deep,
                ("plain", 1, "passes"): 0.5, ("plain", 5, "passes"): plain_deep}

    # Slopes over 4 layers: rank 0 (1.8 - 1.0) / 4 - (0.9 - 0.5) / 4 = 0.1; rank 1 0.2.
    assert _per_layer([rank(1.8, 0.9), rank(2.2, 0.9)], "tp2d", "passes") == pytest.approx(0.2)
    # A tp layer measured cheaper than a plain one is clamped at 0, never negative.
    assert _per_layer([rank(1.1, 0.9)], "tp2d", "passes") == 0.0


def test_profile_says_it_does_not_measure_gpus(monkeypatch):
    # A GPU user must not take the CPU cluster file for a profile of the GPUs.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    note = gpu_not_measured_note()
    assert "8 CUDA device(s)" in note and "--device cuda" in note
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_not_measured_note() is None
