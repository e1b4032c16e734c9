"""Training through the Trainer under tensor parallelism, against dp=1, in two launches.

Launch 1 (8 ranks): dp=2 x tp=4 1D, and dp=2 x tp=4 2D with gradient accumulation, each 5
steps of a 10-step schedule; the 2D run leaves its checkpoint. Launch 2 (1 rank): the dp=1
run they must equal, and a dp=1 resume of the 2D checkpoint. Reference model only (importing
transformers in 8 processes costs more than the runs) on a corpus of three standard-library
files (40 kB used), so that data loading stays cheap.

Tolerance: fp32 on CPU; tensor parallelism and the dp average sum in another order than one
process, so per-step losses agree to rounding (1e-5 absolute on losses of about 5, as in
tests/test_training.py). A wrong gradient changes the second step's loss by far more.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
from pathlib import Path

import pytest
import torch

from tessera.run import build_datasets, build_model, build_tokenizer
from tessera.testing import run_distributed, tiny_run_config
from tessera.train.trainer import Trainer


FP32_PARITY = dict(rtol=0, atol=1e-5)


def _train(out: Path, strategy: str, steps: int = 5, until: int | None = None, **sections):
    train = {"max_steps": steps, **sections.pop("train", {})}
    corpus = str(out.parent / "corpus")  # a few files: listing the whole stdlib costs seconds
    config = tiny_run_config(out, strategy, train=train,
                             data={"corpus": corpus, "max_bytes": 40_000}, **sections)
    tokenizer = build_tokenizer(config)
    train_ds, val_ds = build_datasets(config, tokenizer)
    trainer = Trainer(build_model(config), config.train, train_ds, val_ds,
                      strategy=config.strategy)
    result = trainer.train(until_step=until)
    return result, trainer.plan.features


def _parallel_runs(rank, world_size, root):
    root = Path(root)
    out = {}
    # 10-step schedules stopped at step 5: the 2D one leaves a checkpoint to resume.
    out["1d"], out["1d_features"] = _train(root / "1d", "dp=2,tp=4,mbs=4,gbs=8", steps=10,
                                           until=5)
    out["2d"], out["2d_features"] = _train(root / "resumed", "dp=2,tp=4,tp_mode=2d,mbs=2,gbs=8",
                                           steps=10, until=5)
    return out


def _single_runs(rank, world_size, root):
    root = Path(root)
    out = {"straight": _train(root / "straight", "dp=1,mbs=4,gbs=8", steps=10)[0]}
    # The 2D checkpoint holds the unsharded layout (model and Adam states): a single device
    # resumes it. (GPT-2's permuted fused q|k|v is checked in test_tp_layers.py.)
    out["resumed"] = _train(root / "resumed", "dp=1,mbs=4,gbs=8", steps=10,
                            train={"resume": True})[0]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_training")
    (root / "corpus").mkdir()
    for module in (os, pathlib, argparse):  # any text will do; these are always present
        shutil.copy(module.__file__, root / "corpus")
    parallel = run_distributed(_parallel_runs, world_size=8, args=(str(root),), timeout=400)
    assert all(p["2d"].losses == parallel[0]["2d"].losses for p in parallel)
    single = run_distributed(_single_runs, world_size=1, args=(str(root),), timeout=300)[0]
    return {**parallel[0], **single}


def _close(a, b, **tol):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **tol)


@pytest.mark.slow
def test_dp2_tp4_2d_equals_dp1_for_5_steps(runs):
    # mbs=2 against dp=1's mbs=4: gradient accumulation (no_sync) is exercised too.
    assert runs["2d_features"][0] == "tensor_parallel_2d"
    assert len(runs["2d"].losses) == 5
    _close(runs["2d"].losses, runs["straight"].losses[:5], **FP32_PARITY)


@pytest.mark.slow
def test_dp2_tp4_1d_equals_dp1(runs):
    assert runs["1d_features"][0] == "tensor_parallel_1d"
    _close(runs["1d"].losses, runs["straight"].losses[:5], **FP32_PARITY)


@pytest.mark.slow
def test_2d_checkpoint_resumes_on_one_device(runs):
    assert runs["resumed"].step == 10 and len(runs["resumed"].losses) == 5
    _close(runs["resumed"].losses, runs["straight"].losses[5:], **FP32_PARITY)
