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
