"""Training through the Trainer under tensor parallelism, against dp=1, in two launches.

Launch 1 (8 ranks): dp=2 x tp=4 1D, and dp=2 x tp=4 2D with gradient accumulation, each 5
steps of a 10-step schedule; the 2D run leaves its checkpoint; dp=2 x tp=4 1D in bf16 and in
fp16 (likewise); dp=2 x tp=4 1D with Megatron sequence parallelism (tp_seq=on), with
memory=ddp and memory=chunk. Launch 2 (1 rank): the dp=1 runs they must equal, and a dp=1
resume of the 2D checkpoint. Reference model only (importing transformers in 8 processes
costs more than the runs) on a corpus of three standard-library
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
# Autocast, against one device in the same precision: the column/row-parallel products run in
# the low dtype forward and backward as autocast's own linear does, but each rank rounds its
# partial product (and the all-reduce sums them) where one device rounds the whole. One bf16
# rounding of a loss of about 5 is 5 x 2^-9 = 1e-2; over the mean of 256 tokens the rounding
# largely cancels: a tenth of that for bf16 (as in test_sp_compositions.py), and 2^-3 less
# for fp16's 3 more mantissa bits.
MIXED = {"bf16": dict(rtol=0, atol=1e-3), "fp16": dict(rtol=0, atol=1.25e-4)}


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
    for precision in MIXED:
        out[precision] = _train(root / precision, f"dp=2,tp=4,mbs=4,gbs=8,precision={precision}",
                                steps=10, until=5)[0]
    # Megatron sequence parallelism: norms, dropout and residuals on 1/4 of the sequence,
    # column layers keeping their input's shard (gathered again in backward); with every
    # block recomputed (the shard recomputed too); with chunk memory (the replicated norm
    # weights' gradients summed over tp before they reach the chunks, then ZeRO-reduced over
    # dp); in bf16.
    for name, extra in (("1d_seq", ""), ("1d_seq_recompute", ",recompute=full"),
                        ("1d_seq_chunk", ",memory=chunk"), ("1d_seq_bf16", ",precision=bf16")):
        out[name], out[f"{name}_features"] = _train(
            root / name, f"dp=2,tp=4,tp_seq=on,mbs=4,gbs=8{extra}", steps=10, until=5)
    return out


def _single_runs(rank, world_size, root):
    root = Path(root)
    out = {"straight": _train(root / "straight", "dp=1,mbs=4,gbs=8", steps=10)[0]}
    # The 2D checkpoint holds the unsharded layout (model and Adam states): a single device
    # resumes it. (GPT-2's permuted fused q|k|v is checked in test_tp_layers.py.)
    out["resumed"] = _train(root / "resumed", "dp=1,mbs=4,gbs=8", steps=10,
                            train={"resume": True})[0]
    for precision in MIXED:
        out[f"{precision}_single"] = _train(root / f"{precision}_single",
                                            f"dp=1,mbs=4,gbs=8,precision={precision}",
                                            steps=10, until=5)[0]
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
@pytest.mark.parametrize("name", ["1d_seq", "1d_seq_recompute", "1d_seq_chunk", "1d_seq_bf16"])
def test_dp2_tp4_megatron_sequence_parallel_equals_dp1(runs, name):
    assert "tp_sequence_parallel" in runs[f"{name}_features"]
    assert ("recompute" in runs[f"{name}_features"]) == name.endswith("recompute")
    if name.endswith("bf16"):
        _close(runs[name].losses, runs["bf16_single"].losses, **MIXED["bf16"])
        return
    _close(runs[name].losses, runs["straight"].losses[:5], **FP32_PARITY)


@pytest.mark.slow
def test_2d_checkpoint_resumes_on_one_device(runs):
    assert runs["resumed"].step == 10 and len(runs["resumed"].losses) == 5
    _close(runs["resumed"].losses, runs["straight"].losses[5:], **FP32_PARITY)


@pytest.mark.slow
@pytest.mark.parametrize("precision", sorted(MIXED))
def test_dp2_tp4_1d_mixed_precision_equals_dp1(runs, precision):
    # Before 2026-11-23 the 1D layers' backward multiplied autocast's bf16/fp16 gradient by
    # the saved fp32 weight and crashed on the dtype mismatch.
    single = runs[f"{precision}_single"].losses
    _close(runs[precision].losses, single, **MIXED[precision])
    # Autocast was on: the run differs from fp32 (by far less than a bf16 rounding of it).
    assert runs[precision].losses != runs["straight"].losses[:5]
    _close(runs[precision].losses, runs["straight"].losses[:5], rtol=0, atol=1e-2)
