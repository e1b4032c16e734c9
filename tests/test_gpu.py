"""CUDA paths: NCCL process groups, device placement, bf16 autocast, pinned transfers.

Skipped on machines without a GPU (see conftest.py); run them where one is present.
"""

import pytest
import torch

from tessera.testing import run_distributed
from tessera.testing import train_tiny as _train


def _cuda_run(rank, world_size, root):
    result, params = _train(f"{root}/cuda", "dp=1,tp=1,pp=1,mbs=8,gbs=8,precision=bf16",
                            steps=8, train={"device": "cuda"})
    return result.losses, next(iter(params.values())).device.type


@pytest.mark.gpu
def test_training_on_one_gpu(tmp_path):
    losses, device = run_distributed(_cuda_run, world_size=1, args=(str(tmp_path),),
                                     backend="nccl")[0]
    assert device == "cuda"
    assert losses[-1] < losses[0]


def _nccl_dp(rank, world_size, root):
    result, _ = _train(f"{root}/nccl", "dp=2,tp=1,pp=1,mbs=4,gbs=8", train={"device": "cuda"})
    return result.losses


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_dp2_over_nccl_matches_across_ranks(tmp_path):
    losses = run_distributed(_nccl_dp, world_size=2, args=(str(tmp_path),), backend="nccl")
    assert losses[0] == losses[1] and len(losses[0]) == 5


def _nccl_pipeline(rank, world_size, root, schedule):
    strategy = f"dp=1,pp={world_size},mbs=2,gbs=8,schedule={schedule}"
    if world_size == 1:
        strategy = "dp=1,pp=1,mbs=2,gbs=8"
    result, _ = _train(f"{root}/{schedule}{world_size}", strategy, train={"device": "cuda"})
    return result.losses


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "scp"])
def test_pp2_over_nccl_equals_one_gpu(tmp_path, schedule):
    """Pipeline messages over NCCL, which matches sends to receives by order, not tag, and
    runs a communicator's operations on one stream (comm.py's channels): every schedule
    completes (a deadlock would hit the timeout) and trains as one GPU does. Tolerance 1e-4
    on losses of about 5: the same fp32 arithmetic per micro-batch, summed in another order."""
    one = run_distributed(_nccl_pipeline, world_size=1, args=(str(tmp_path), schedule),
                          backend="nccl")[0]
    pp = run_distributed(_nccl_pipeline, world_size=2, args=(str(tmp_path), schedule),
                         backend="nccl", timeout=300)
    assert pp[0] == pp[1]
    assert max(abs(a - b) for a, b in zip(one, pp[0])) < 1e-4, (one, pp[0])


CHUNK_MEMORY = {"placement": "auto", "chunk_size": 20000, "device_budget": 1_500_000}


def _nccl_chunk(rank, world_size, root, memory):
    strategy = "dp=2,mbs=4,gbs=8" + (",memory=chunk,offload=cpu" if memory else "")
    result, _ = _train(f"{root}/{'chunk' if memory else 'ddp'}", strategy,
                       train={"device": "cuda"}, **({"memory": CHUNK_MEMORY} if memory else {}))
    return result.losses


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_chunk_memory_with_prefetch_over_nccl_equals_ddp(tmp_path):
    """ZeRO over dp=2 with chunks offloaded to the host under a device budget, so auto
    placement prefetches chunks on a side stream between uses: the all-gather and AdamW
    must read them only after the copy (memory/manager.py place). Tolerance 1e-4 on losses
    of about 5: the same fp32 sums, reduced in another order."""
    ddp = run_distributed(_nccl_chunk, world_size=2, args=(str(tmp_path), False),
                          backend="nccl")[0]
    chunk = run_distributed(_nccl_chunk, world_size=2, args=(str(tmp_path), True),
                            backend="nccl", timeout=300)[0]
    assert max(abs(a - b) for a, b in zip(ddp, chunk)) < 1e-4, (ddp, chunk)


@pytest.mark.gpu
def test_gpu_profile_measures_this_node(tmp_path):
    # tessera profile on CUDA: matmul by shape in bf16/fp16, attention, memory, AdamW on the
    # first device; collectives and the host link over NCCL when there are two or more.
    from tessera.planner import estimate, load_cluster, save_cluster
    from tessera.planner.profile_gpu import match_preset, measure_device, profile_gpu_cluster
    from tessera.planner.hardware import get_device
    from tessera.models.config import preset
    from tessera.strategy import Strategy

    figures = measure_device(0, quick=True)
    props = torch.cuda.get_device_properties(0)
    assert figures.memory_bytes == props.total_memory
    # bf16 only where the hardware has it (compute capability 8.0 and later)
    assert figures.precision == ("bf16" if props.major >= 8 else "fp16")
    name = match_preset(figures.name, figures.memory_bytes)
    if name:  # measured rates below the datasheet's (5% for timer noise)
        spec = get_device(name)
        assert max(r for _, r in figures.table) <= 1.05 * spec.peak(figures.precision)
        assert figures.memory_bandwidth <= 1.05 * spec.memory_bandwidth
        assert figures.attention_rate <= spec.peak(figures.precision)
        assert figures.fp32_rate < max(r for _, r in figures.table)  # tensor cores
    # Fused AdamW reads p, g, m, v and writes p, m, v (28 bytes per fp32 parameter); a
    # synchronised timing cannot come out below that, nor a host link above PCIe 5 x16.
    assert 20 <= figures.adam_bytes <= 200
    assert 1e9 < figures.host_bandwidth < 70e9

    cluster = profile_gpu_cluster(quick=True)
    assert cluster.matmul_precision == figures.precision and cluster.matmul_table
    assert cluster.devices_per_node == torch.cuda.device_count()
    if torch.cuda.device_count() > 1:
        fit = cluster.collectives["all_reduce"][torch.cuda.device_count()]
        assert 1e-7 < fit.latency < 1e-3 and 1e9 < fit.bandwidth < 1e12
    path = str(tmp_path / "gpu.yaml")
    save_cluster(cluster, path)
    again = load_cluster(path)
    est = estimate(preset("tiny"), again, Strategy(dp=1, micro_batch_size=1,
                                                   global_batch_size=1,
                                                   precision=cluster.matmul_precision))
    assert 0 < est.step_time < 1

