"""Chunk memory trains through the Trainer like plain AdamW: two multi-process launches.

Tolerance 1e-5 (fp32): chunked runs do the same fp32 arithmetic as torch.optim.AdamW, in a
different order: AdamW runs vectorised over a chunk's flat buffer instead of per tensor, the
clipping norm sums squares over chunks instead of stacking per-tensor norms, and under ZeRO the
gradient mean comes from a reduce-scatter rather than DDP's bucketed all-reduce. Those reorder
sums, which moves results by rounding (about 1e-6 here), not by a skipped or wrong update.

Budgets (tiny model: 8 chunks of 20000 fp32 elements = 640 kB of parameters, about 1 MB of
activations) are chosen so that `auto` must evict parameter chunks and `static` just fits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.memory import TensorState
from tessera.memory.chunk import Kind
from tessera.run import build_datasets, build_model, build_tokenizer
from tessera.testing import run_distributed, tiny_run_config
from tessera.train.trainer import Trainer

FP32 = dict(rtol=0, atol=1e-5)
AUTO = {"placement": "auto", "chunk_size": 20000, "device_budget": 1_500_000}
STATIC = {"placement": "static", "chunk_size": 20000, "device_budget": 2_200_000}
HF = {**AUTO, "device_budget": 2_500_000}  # Llama keeps more activations (rope, swiglu)
CHUNK = "memory=chunk,offload=cpu"


def _trainer(out: Path, strategy: str, steps: int = 10, memory=None, model=None, **train):
    sections = {"memory": memory} if memory else {}
    if model:
        sections["model"] = model
    config = tiny_run_config(out, strategy, train={"max_steps": steps, **train}, **sections)
    train_ds, val_ds = build_datasets(config, build_tokenizer(config))
    return Trainer(build_model(config), config.train, train_ds, val_ds,
                   strategy=config.strategy, memory=config.memory)


def _run(out: Path, strategy: str, steps: int = 10, memory=None, until=None, model=None,
         **train):
    trainer = _trainer(out, strategy, steps, memory, model, **train)
    result = trainer.train(until_step=until)
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    runtime = trainer.plan.memory
    return {"losses": result.losses, "params": params,
            "stats": runtime.stats() if runtime else None,
            "seen": set(runtime.manager.log.seen) if runtime else set()}


def _one_rank(rank, world, root):
    root = Path(root)
    out = {"ref": _run(root / "ref", "dp=1,mbs=4,gbs=8")}
    out["auto"] = _run(root / "auto", f"dp=1,mbs=4,gbs=8,{CHUNK}", memory=AUTO)
    out["static"] = _run(root / "static", f"dp=1,mbs=4,gbs=8,{CHUNK}", memory=STATIC)
    out["first"] = _run(root / "resume", f"dp=1,mbs=4,gbs=8,{CHUNK}", memory=AUTO, until=5)
    out["second"] = _run(root / "resume", f"dp=1,mbs=4,gbs=8,{CHUNK}", memory=AUTO,
                         resume=True)
    out["bf16"] = _run(root / "bf16", f"dp=1,mbs=4,gbs=8,{CHUNK},precision=bf16", memory=AUTO)
    (root / "spill").mkdir()
    disk = {**AUTO, "host_budget": 1_000_000, "disk_dir": str(root / "spill")}
    out["disk"] = _run(root / "disk", f"dp=1,mbs=4,gbs=8,{CHUNK}+disk", steps=4, memory=disk)
    out["overflow"] = _fp16_overflow_is_skipped(root / "fp16")
    llama = {"model": {"preset": "tiny", "hf": "llama"}}
    out["hf_ref"] = _run(root / "hf_ref", "dp=1,mbs=4,gbs=8", steps=4, **llama)
    out["hf"] = _run(root / "hf", f"dp=1,mbs=4,gbs=8,{CHUNK}", steps=4, memory=HF, **llama)
    return out


def _fp16_overflow_is_skipped(out: Path):
    trainer = _trainer(out, f"dp=1,mbs=4,gbs=8,{CHUNK},precision=fp16", memory=AUTO)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    scaler, runtime = trainer.engine.scaler, trainer.plan.memory
    batch = trainer.train_dataset[0]
    trainer.engine.forward_backward([{k: v[None] for k, v in batch.items()}])
    runtime.hooks.flush()
    runtime.manager.chunks[0].payload[Kind.GRAD][0] = float("inf")
    scale = scaler.get_scale()
    scaler.unscale_(trainer.optimizer)
    scaler.step(trainer.optimizer)
    scaler.update()
    after = trainer.model.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return {"unchanged": unchanged, "halved": scaler.get_scale() == scale / 2,
            "skipped": scaler.skipped}


def _two_ranks(rank, world, root):
    root = Path(root)
    out = {"ref": _run(root / "ref", "dp=2,mbs=4,gbs=8")}
    out["auto"] = _run(root / "auto", f"dp=2,mbs=4,gbs=8,{CHUNK}", memory=AUTO)
    # Gradient accumulation (no_sync) and an evaluation pass exercise more transitions.
    out["static"] = _run(root / "static", f"dp=2,mbs=2,gbs=8,{CHUNK}", memory=STATIC,
                         eval_steps=5, eval_batches=1)
    # Save on two ranks (owners broadcast their chunks), resume on two ranks.
    out["first"] = _run(root / "resume", f"dp=2,mbs=4,gbs=8,{CHUNK}", memory=AUTO, until=5)
    out["second"] = _run(root / "resume", f"dp=2,mbs=4,gbs=8,{CHUNK}", memory=AUTO,
                         resume=True)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunk")
    one = run_distributed(_one_rank, 1, args=(str(root / "one"),), timeout=400)[0]
    two = run_distributed(_two_ranks, 2, args=(str(root / "two"),), timeout=400)
    assert two[0]["auto"]["losses"] == two[1]["auto"]["losses"]
    return one, two


def _same(run, ref):
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), **FP32)
    assert run["params"].keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        torch.testing.assert_close(run["params"][name], value, **FP32)


def _within_budget(run, budget):
    assert 0 < run["stats"]["device_peak"] <= budget, run["stats"]


@pytest.mark.parametrize("placement", ["auto", "static"])
def test_one_rank_matches_adamw_within_the_budget(runs, placement):
    one, _ = runs
    run = one[placement]
    _same(run, one["ref"])
    _within_budget(run, AUTO["device_budget"] if placement == "auto" else STATIC["device_budget"])
    if placement == "auto":
        assert run["stats"]["evictions"].get("device", 0) > 0  # the budget forced evictions


@pytest.mark.parametrize("placement", ["auto", "static"])
def test_zero_on_two_ranks_matches_ddp_adamw(runs, placement):
    _, two = runs
    for rank in (0, 1):
        run, ref = two[rank][placement], two[rank]["ref"]
        if placement == "auto":
            _same(run, ref)
            assert run["stats"]["evictions"].get("device", 0) > 0
        else:  # 4 micro-batches of 2 per rank: the same gradient mean, summed in another order
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]),
                                       **FP32)
            for name, value in ref["params"].items():
                torch.testing.assert_close(run["params"][name], value, **FP32)
        _within_budget(run, (AUTO if placement == "auto" else STATIC)["device_budget"])


def test_training_exercises_the_state_machine(runs):
    one, two = runs
    seen = set().union(*(r["seen"] for r in (one["auto"], two[0]["auto"], two[0]["static"])))
    S = TensorState
    expected = {(S.HOLD, S.COMPUTE), (S.COMPUTE, S.HOLD_AFTER_FWD),
                (S.HOLD_AFTER_FWD, S.COMPUTE), (S.COMPUTE, S.HOLD_AFTER_BWD),
                (S.HOLD_AFTER_BWD, S.HOLD), (S.FREE, S.HOLD), (S.HOLD_AFTER_FWD, S.FREE),
                (S.HOLD_AFTER_BWD, S.FREE), (S.HOLD_AFTER_BWD, S.COMPUTE),
                (S.COMPUTE, S.HOLD), (S.HOLD, S.FREE)}
    assert expected <= seen, expected - seen


def test_checkpoint_resume_equals_an_uninterrupted_run(runs):
    one, _ = runs
    losses = one["first"]["losses"] + one["second"]["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one["auto"]["losses"]),
                               rtol=0, atol=1e-6)
    for name, value in one["auto"]["params"].items():
        torch.testing.assert_close(one["second"]["params"][name], value, rtol=0, atol=1e-6)


def test_zero_checkpoint_resume_on_two_ranks(runs):
    _, two = runs
    for rank in (0, 1):
        run = two[rank]
        losses = run["first"]["losses"] + run["second"]["losses"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(run["auto"]["losses"]),
                                   rtol=0, atol=1e-6)
        for name, value in run["auto"]["params"].items():
            torch.testing.assert_close(run["second"]["params"][name], value, rtol=0, atol=1e-6)


def test_bf16_chunks_with_fp32_masters_track_fp32(runs):
    one, _ = runs
    # bf16 compute chunks keep 8 mantissa bits; fp32 masters keep the updates exact.
    torch.testing.assert_close(torch.tensor(one["bf16"]["losses"]),
                               torch.tensor(one["ref"]["losses"]), rtol=0, atol=5e-2)


def test_fp16_overflow_skips_the_step_and_halves_the_scale(runs):
    one, _ = runs
    assert one["overflow"] == {"unchanged": True, "halved": True, "skipped": 1}


def test_disk_tier_spills_and_still_matches(runs):
    one, _ = runs
    run = one["disk"]
    moved = run["stats"]["transfers"]
    assert moved.get("host->disk", 0) > 0 and moved.get("disk->host", 0) > 0, moved
    torch.testing.assert_close(torch.tensor(run["losses"]),
                               torch.tensor(one["ref"]["losses"][:4]), **FP32)


def test_hugging_face_llama_trains_unmodified_under_chunks(runs):
    one, _ = runs
    _same(one["hf"], one["hf_ref"])
    _within_budget(one["hf"], HF["device_budget"])
