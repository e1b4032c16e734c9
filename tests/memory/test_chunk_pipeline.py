"""Chunk memory under pipeline parallelism (dp x pp, memory=chunk): three launches.

One worker trains the single-device references (memory=ddp, pp=1, fp32; memory=chunk in
bf16). Two workers (pp=2) train with memory=chunk under 1f1b with half of each stage
recomputed and a device budget that forces evictions, gpipe without a budget, scp with full
recomputation, 1f1b spilling to disk (offload=cpu+disk, host budget), 1f1b in bf16, and a
checkpoint resume. Four workers train dp=2 x pp=2 (chunks ZeRO-sharded over each stage's dp
pair) under 1f1b and interleaved (two virtual stages per rank), and sp=2 (ring) x pp=2 in bf16. 3 AdamW steps each, with the
Trainer's gradient clipping, on the tiny reference model (tied embedding = LM head, held by
both stages).

Tolerance 1e-5 (fp32) on losses (about 5) and on each stage's parameters after 3 steps: a
stage runs the same aten ops on the same micro-batches, so what differs is the order of fp32
sums (tied gradient summed over pp, the ZeRO reduce-scatter mean, the norm as per-chunk
partial sums, AdamW vectorised over chunks), a few 1e-6 measured; a missing tied-weight sum,
a gradient reduced twice or a stale chunk moves them by 1e-3 or more (a missing tied sum:
2.3e-2 on the losses).

bf16 (bf16 parameter and gradient chunks, fp32 masters) is compared with the single-device
chunk run in bf16, whose weights are bf16 too: 4 micro-batches of 2 against 2 of 4 round
activations and accumulated bf16 gradients differently (8-bit mantissa, ~4e-3 relative).
Losses within 2e-3 (measured 1.4e-4); fp32 masters within 2e-2 (measured 4.4e-3): AdamW's
first steps move a weight by about lr = 3e-3 whatever its gradient's size, so a rounding
difference on a near-zero gradient can change a weight by a few lr over 3 steps. sp x pp in
bf16 adds the ring's blockwise attention (bf16 blocks, fp32 log-sum-exp merges) against one
device's fused attention: losses measured 9.0e-5, masters 1.0e-2, within the same bounds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.testing import run_distributed, tiny_trainer
from tessera.train.checkpoint import find_latest
from tessera.train.trainer import Trainer

FP32 = dict(rtol=0, atol=1e-5)
BF16_LOSS, BF16_PARAMS = dict(rtol=0, atol=2e-3), dict(rtol=0, atol=2e-2)
STEPS = 3
AUTO = {"placement": "auto", "chunk_size": 10000}
# A little above one stage piece's chunks plus its activations, below all model data of a
# stage: chunks are evicted on the first stage (its head's per-block segments and its tail
# take turns; 750_000 stopped forcing evictions once the head was recomputed block by block).
BUDGET = {**AUTO, "device_budget": 650_000}
PP2 = {  # name: (strategy, memory)
    "1f1b_budget": ("pp=2,mbs=2,gbs=8,schedule=1f1b,recompute=0.5,"
                    "memory=chunk,offload=cpu", BUDGET),
    "gpipe": ("pp=2,mbs=2,gbs=8,schedule=gpipe,memory=chunk,offload=cpu", AUTO),
    "scp_recompute": ("pp=2,mbs=2,gbs=8,schedule=scp,recompute=full,memory=chunk,offload=cpu",
                      {**AUTO, "device_budget": 1_000_000}),
}
DP2_PP2 = {
    "dp2_1f1b": ("dp=2,pp=2,mbs=2,gbs=8,schedule=1f1b,memory=chunk,offload=cpu", AUTO),
    "dp2_interleaved": ("dp=2,pp=2,mbs=2,gbs=8,schedule=interleaved,memory=chunk,offload=cpu",
                        AUTO),
}
DISK_STRATEGY = "pp=2,mbs=2,gbs=8,schedule=1f1b,recompute=0.5,memory=chunk,offload=cpu+disk"
BF16 = "memory=chunk,offload=cpu,precision=bf16"
SP2_BF16 = f"sp=2,pp=2,mbs=2,gbs=8,schedule=1f1b,sp_mode=ring,{BF16}"
RESUME_STRATEGY = "pp=2,mbs=2,gbs=8,schedule=1f1b,memory=chunk,offload=cpu"


def _trainer(out: Path, strategy: str, memory=None, **train) -> Trainer:
    sections = {"memory": memory} if memory else {}
    return tiny_trainer(out, strategy, STEPS, train=train, **sections)


def _run(out: Path, strategy: str, memory=None) -> dict:
    trainer = _trainer(out, strategy, memory)
    losses = trainer.train().losses
    runtime = trainer.plan.memory
    # plan.module is this rank's StageModule: its state dict holds this stage's weights.
    params = {k: v.detach().clone() for k, v in trainer.plan.module.state_dict().items()}
    return {"losses": losses, "params": params,
            "stats": runtime.stats() if runtime else None}


def _reference(rank, world, root):
    root = Path(root)
    return {"fp32": _run(root / "fp32", "dp=1,mbs=4,gbs=8"),
            "bf16": _run(root / "bf16", f"dp=1,mbs=4,gbs=8,{BF16}", AUTO)}


def _two_ranks(rank, world, root):
    root = Path(root)
    out = {name: _run(root / name, text, memory) for name, (text, memory) in PP2.items()}
    disk = {**BUDGET, "device_budget": 800_000, "host_budget": 500_000,
            "disk_dir": str(root / "spill")}
    (root / "spill").mkdir(exist_ok=True)
    out["disk"] = _run(root / "disk", DISK_STRATEGY, disk)
    out["bf16"] = _run(root / "bf16", f"pp=2,mbs=2,gbs=8,schedule=1f1b,{BF16}", AUTO)
    # Resume: 2 steps, save, then 1 more from the checkpoint = 3 uninterrupted steps.
    first = _trainer(root / "resume", RESUME_STRATEGY, AUTO)
    out["first"] = first.train(until_step=2).losses
    out["saved"] = find_latest(root / "resume" / "checkpoints") is not None
    second = _trainer(root / "resume", RESUME_STRATEGY, AUTO, resume=True)
    out["second"] = second.train().losses
    out["resumed_params"] = {k: v.detach().clone()
                             for k, v in second.plan.module.state_dict().items()}
    out["uninterrupted"] = _run(root / "straight", RESUME_STRATEGY, AUTO)
    return out


def _four_ranks(rank, world, root):
    root = Path(root)
    out = {name: _run(root / name, text, memory) for name, (text, memory) in DP2_PP2.items()}
    out["sp2_bf16"] = _run(root / "sp2_bf16", SP2_BF16, AUTO)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunk_pp")
    one = run_distributed(_reference, 1, args=(str(root / "one"),), timeout=300)[0]
    two = run_distributed(_two_ranks, 2, args=(str(root / "two"),), timeout=600)
    four = run_distributed(_four_ranks, 4, args=(str(root / "four"),), timeout=600)
    return one, two, four


def _same_as_one_device(run: dict, ref: dict) -> None:
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), **FP32)
    assert run["params"] and run["params"].keys() <= ref["params"].keys()
    for name, value in run["params"].items():
        torch.testing.assert_close(value, ref["params"][name], **FP32)


def _covers_the_model(per_rank: list[dict], ref: dict) -> None:
    """The stages' state dicts together are the single-device state dict."""
    keys = set().union(*(run["params"].keys() for run in per_rank))
    assert keys == set(ref["params"].keys())


def _every_rank_equals_one_device(per_rank: list[dict], ref: dict) -> None:
    for run in per_rank:
        _same_as_one_device(run, ref)
    _covers_the_model(per_rank, ref)


@pytest.mark.parametrize("name", sorted(PP2) + ["disk"])
def test_pp2_chunk_runs_equal_one_device(runs, name):
    one, two, _ = runs
    _every_rank_equals_one_device([r[name] for r in two], one["fp32"])


def test_pp2_chunk_budgets_evict_and_spill(runs):
    _, two, _ = runs
    stats = [r["1f1b_budget"]["stats"] for r in two]
    assert all(0 < s["device_peak"] <= BUDGET["device_budget"] for s in stats), stats
    assert sum(s["evictions"].get("device", 0) for s in stats) > 0, stats
    for rank_out in two:
        moved = rank_out["disk"]["stats"]["transfers"]
        assert moved.get("host->disk", 0) > 0 and moved.get("disk->host", 0) > 0, moved


@pytest.mark.parametrize("name", sorted(DP2_PP2))
def test_dp2_pp2_chunk_runs_equal_one_device(runs, name):
    one, _, four = runs
    _every_rank_equals_one_device([r[name] for r in four], one["fp32"])


@pytest.mark.parametrize("launch, name", [(1, "bf16"), (2, "sp2_bf16")])
def test_pp2_chunk_bf16_tracks_one_device_chunk_bf16(runs, launch, name):
    ranks, ref = runs[launch], runs[0]["bf16"]
    for rank_out in ranks:
        run = rank_out[name]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]),
                                   **BF16_LOSS)
        for key, value in run["params"].items():  # fp32 masters
            torch.testing.assert_close(value, ref["params"][key], **BF16_PARAMS)
    _covers_the_model([r[name] for r in ranks], ref)


def test_pp2_chunk_checkpoint_resume_equals_uninterrupted(runs):
    _, two, _ = runs
    for rank_out in two:
        assert rank_out["saved"]
        straight = rank_out["uninterrupted"]
        torch.testing.assert_close(torch.tensor(rank_out["first"] + rank_out["second"]),
                                   torch.tensor(straight["losses"]), rtol=0, atol=1e-6)
        for key, value in straight["params"].items():
            torch.testing.assert_close(rank_out["resumed_params"][key], value, rtol=0,
                                       atol=1e-6)
