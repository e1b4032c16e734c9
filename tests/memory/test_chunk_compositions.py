"""Chunk memory composed with tensor, sequence parallelism and recomputation: two launches.

One launch of 1 worker trains the single-device AdamW reference and a chunked run with every
block recomputed; one launch of 4 workers trains, with memory=chunk, 1D tensor parallelism
(tp=2) x dp=2, 2D tensor parallelism (2x2 grid), and sequence parallelism (ring, sp=2) x dp=2.
Budgets are small enough that `auto` evicts parameter chunks in every run.

Tolerance 1e-5 (fp32), as in test_memory_training.py: the runs do the same fp32 arithmetic in
another order (tp partial sums, the ring's online softmax, ZeRO's reduce-scatter instead of
one device's sums, AdamW vectorised over chunks), which moves results by rounding (a few 1e-6
here); a missing gradient reduction or a stale shard moves them by 1e-3 or more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.memory import TensorState
from tessera.parallel.plan import default_forward_loss
from tessera.run import build_datasets, build_model, build_tokenizer
from tessera.testing import run_distributed, tiny_run_config
from tessera.train.checkpoint import find_latest
from tessera.train.trainer import Trainer

FP32 = dict(rtol=0, atol=1e-5)
STEPS = 3
CHUNK = "memory=chunk,offload=cpu"
# Per-run budgets (bytes): a little above the peak non-model memory plus the chunks in use,
# below what keeping every chunk on the device would need, so chunks are evicted.
RECOMPUTE = {"placement": "auto", "chunk_size": 20000, "device_budget": 650_000}
TP_1D = {"placement": "auto", "chunk_size": 10000, "device_budget": 930_000}
TP_2D = {"placement": "auto", "chunk_size": 5000, "device_budget": 440_000}
SP = {"placement": "auto", "chunk_size": 10000, "device_budget": 1_300_000}


def _trainer(out: Path, strategy: str, memory=None, steps: int = STEPS, **train) -> Trainer:
    sections = {"memory": memory} if memory else {}
    config = tiny_run_config(out, strategy, train={"max_steps": steps, **train}, **sections)
    train_ds, val_ds = build_datasets(config, build_tokenizer(config))
    return Trainer(build_model(config), config.train, train_ds, val_ds,
                   strategy=config.strategy, memory=config.memory)


def _whole(state_dict: dict) -> dict[str, torch.Tensor]:
    """A state dict in the single-device layout (DTensors gathered; all ranks call)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in state_dict.items()}


def _run(out: Path, strategy: str, memory=None, **train) -> tuple[Trainer, dict]:
    trainer = _trainer(out, strategy, memory, **train)
    losses = trainer.train().losses
    runtime = trainer.plan.memory
    moments = runtime.manager.tracer.moments if runtime else []
    return trainer, {"losses": losses, "params": _whole(trainer.model.state_dict()),
                     "stats": runtime.stats() if runtime else None,
                     "seen": set(runtime.manager.log.seen) if runtime else set(),
                     "recomputed": sum(m.label.startswith("rfw") for m in moments)}


def _reference(rank, world, root):
    root = Path(root)
    _, ref = _run(root / "ref", "dp=1,mbs=4,gbs=8")
    _, recompute = _run(root / "recompute", f"dp=1,mbs=4,gbs=8,{CHUNK},recompute=full",
                        RECOMPUTE)
    return {"ref": ref, "recompute": recompute}


def _one_device_loss(params: dict[str, torch.Tensor], batch) -> float:
    """The loss of a single-device model loaded with ``params``, on ``batch``."""
    config = tiny_run_config("unused", "dp=1,mbs=4,gbs=8")
    model = build_model(config)
    model.load_state_dict(params)
    with torch.no_grad():
        return default_forward_loss(model, batch).item()


def _tp_checks(trainer: Trainer, root: Path) -> dict:
    """Checkpoint layout, loading at one device, load_state_dict and resume of tp x chunk."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    params = _whole(trainer.model.state_dict())
    with torch.no_grad():
        here = trainer.plan.forward_loss(trainer.plan.module, batch).item()
    out = {"loss_here": here, "loss_one_device": _one_device_loss(params, batch)}
    # Loading a single-device state dict lands in the chunks (every rank's shard).
    changed = {k: v + 0.5 for k, v in params.items()}
    trainer.model.load_state_dict(changed)
    back = _whole(trainer.model.state_dict())
    out["load_error"] = max((back[k] - v).abs().max().item() for k, v in changed.items())
    # Resume: 2 steps, save, 1 more step from the checkpoint = 3 uninterrupted steps.
    first = _trainer(root / "resume", f"dp=2,tp=2,mbs=4,gbs=8,{CHUNK}", TP_1D)
    out["first"] = first.train(until_step=2).losses
    assert find_latest(root / "resume" / "checkpoints") is not None
    second = _trainer(root / "resume", f"dp=2,tp=2,mbs=4,gbs=8,{CHUNK}", TP_1D, resume=True)
    out["second"] = second.train().losses
    out["second_params"] = _whole(second.model.state_dict())
    return out


def _four_ranks(rank, world, root):
    root = Path(root)
    trainer, tp1d = _run(root / "tp1d", f"dp=2,tp=2,mbs=4,gbs=8,{CHUNK}", TP_1D)
    out = {"tp1d": tp1d, "tp1d_checks": _tp_checks(trainer, root / "tp1d_checks")}
    _, out["tp2d"] = _run(root / "tp2d", f"dp=1,tp=4,tp_mode=2d,mbs=4,gbs=8,{CHUNK}", TP_2D)
    _, out["sp"] = _run(root / "sp", f"dp=2,sp=2,mbs=4,gbs=8,{CHUNK}", SP)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compose")
    one = run_distributed(_reference, 1, args=(str(root / "one"),), timeout=400)[0]
    four = run_distributed(_four_ranks, 4, args=(str(root / "four"),), timeout=600)
    return one, four


def _same(run, ref):
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), **FP32)
    assert run["params"].keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        torch.testing.assert_close(run["params"][name], value, **FP32)


def _evicted_within_budget(run, memory):
    stats = run["stats"]
    assert 0 < stats["device_peak"] <= memory["device_budget"], stats
    assert stats["evictions"].get("device", 0) > 0, stats  # the budget forced evictions


def test_recomputed_blocks_under_chunk_memory_match_adamw(runs):
    one, _ = runs
    _same(one["recompute"], one["ref"])
    _evicted_within_budget(one["recompute"], RECOMPUTE)
    # The warm-up traced each recomputed forward as a moment of its own (2 blocks x 8 modules
    # with parameters, per micro-batch), and the state machine accepted them.
    assert one["recompute"]["recomputed"] >= 16, one["recompute"]["recomputed"]
    S = TensorState
    assert (S.HOLD_AFTER_FWD, S.COMPUTE) in one["recompute"]["seen"]


@pytest.mark.parametrize("name, memory", [("tp1d", TP_1D), ("tp2d", TP_2D), ("sp", SP)])
def test_chunks_of_parallel_runs_match_single_device_adamw(runs, name, memory):
    one, four = runs
    for rank in range(4):  # the gathered (single-device layout) parameters, on every rank
        _same(four[rank][name], one["ref"])
        _evicted_within_budget(four[rank][name], memory)


def test_tp_chunk_checkpoints_keep_the_single_device_layout(runs):
    _, four = runs
    for rank in range(4):
        checks = four[rank]["tp1d_checks"]
        # The same weights on one device give the same loss (fp32 rounding of the tp sums).
        assert abs(checks["loss_here"] - checks["loss_one_device"]) < 1e-5, checks
        assert checks["load_error"] == 0.0
        losses = checks["first"] + checks["second"]
        torch.testing.assert_close(torch.tensor(losses),
                                   torch.tensor(four[rank]["tp1d"]["losses"]), rtol=0, atol=1e-6)
        for key, value in four[rank]["tp1d"]["params"].items():
            torch.testing.assert_close(checks["second_params"][key], value, rtol=0, atol=1e-6)
