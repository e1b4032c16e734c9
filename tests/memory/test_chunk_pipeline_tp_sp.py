"""Chunk memory in tensor- and sequence-parallel pipeline stages (memory=chunk, pp=2): two
launches.

One worker trains the single-device references (memory=ddp, pp=1) of the tiny reference
model and of Hugging Face GPT-2 and Llama. Eight workers train, with memory=chunk and the
Trainer's gradient clipping, 3 AdamW steps of:

- dp=2 x tp=2 (1d) x pp=2, 1f1b, half of each stage recomputed, under a device budget that
  forces evictions (chunks hold each rank's tp shards, ZeRO-sharded over dp); also with
  sub-pipelined tensor parallelism (tp_overlap=subpipe);
- tp=4 as a 2 x 2 SUMMA grid x pp=2, gpipe (the 2d layers are custom ops in the graph);
- dp=2 x sp=2 (ring) x pp=2, 1f1b (chunks ZeRO-sharded over dp x sp);
- Hugging Face GPT-2 at dp=2 x tp=2 x pp=2, scp with full recomputation (fused q|k|v shards
  stored permuted, the embedding tied to the LM head across stages), with Megatron sequence
  parallelism (tp_seq=on);
- Hugging Face Llama at dp=2 x sp=2 (ulysses, grouped key/value heads) x pp=2, gpipe;
- tp=2 (1d) x sp=2 (ring, zigzag) x pp=2, 1f1b (chunks hold each tp rank's shards,
  ZeRO-sharded over the sp ranks);
- a checkpoint the first strategy's run saves after 2 steps, resumed for the third.

Each rank's stage state dict (tp shards gathered whole, in the single-device layout) must
equal the single-device one. A stage runs the same aten ops on the same micro-batches, so
what differs is the order of fp32 sums (tp partial products and norm statistics, the ZeRO
reduce-scatter mean, the tied gradient summed over pp, the norm's per-chunk partial sums).
Losses (about 5) within 1e-5: measured <= 9.5e-7. Weights within 3e-5: AdamW divides each
gradient by its own running magnitude, so rounding on a near-zero gradient becomes a larger
weight difference; measured <= 8.9e-6 (Llama), 7.7e-6 (GPT-2), 2.4e-6 to 6.1e-6 elsewhere.
A tp replica counted twice in the gradient norm moves losses by 1.6e-3 to 2.5e-3 and weights
by 1.5e-3 to 2.8e-3 (measured by breaking it); a tied-weight sum left out or a stale chunk,
by more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from tessera.testing import run_distributed, tiny_trainer
from tessera.train.checkpoint import step_dirname
from tessera.train.trainer import Trainer

TOL, WEIGHT_TOL = dict(rtol=0, atol=1e-5), dict(rtol=0, atol=3e-5)
STEPS = 3
AUTO = {"placement": "auto", "chunk_size": 10000}
GPT2 = {"preset": "tiny", "hf": "gpt2"}
LLAMA = {"preset": "tiny-llama", "hf": "llama"}
TP1D = "dp=2,tp=2,pp=2,mbs=2,gbs=8,schedule=1f1b,recompute=0.5,memory=chunk,offload=cpu"
CASES = {  # name: (model section or None for the reference model, strategy, memory)
    # Below a stage's chunks and activations together: chunks are evicted (6 of 8 ranks).
    "dp2_tp2_pp2_budget": (None, TP1D, {**AUTO, "device_budget": 420_000}),
    # The same, sub-pipelined: each weight still accumulates once per micro-batch.
    "dp2_tp2_pp2_subpipe": (None, TP1D + ",tp_overlap=subpipe",
                            {**AUTO, "device_budget": 420_000}),
    "tp4_2d_pp2": (None, "tp=4,tp_mode=2d,pp=2,mbs=2,gbs=8,schedule=gpipe,memory=chunk,"
                         "offload=cpu", AUTO),
    "dp2_sp2_pp2": (None, "dp=2,sp=2,pp=2,mbs=2,gbs=8,schedule=1f1b,memory=chunk,offload=cpu",
                    AUTO),
    # ... with Megatron sequence parallelism in the stages (tensor/ops_seq.py)
    "gpt2_dp2_tp2_pp2_seq": (GPT2, "dp=2,tp=2,pp=2,mbs=2,gbs=8,schedule=scp,recompute=full,"
                                   "tp_seq=on,memory=chunk,offload=cpu", AUTO),
    "llama_dp2_sp2_pp2": (LLAMA, "dp=2,sp=2,pp=2,mbs=2,gbs=8,schedule=gpipe,sp_mode=ulysses,"
                                 "memory=chunk,offload=cpu", AUTO),
    "tp2_sp2_pp2": (None, "tp=2,sp=2,pp=2,mbs=2,gbs=8,schedule=1f1b,sp_mode=ring,"
                          "memory=chunk,offload=cpu", AUTO),
}
RESUMED = "dp2_tp2_pp2_budget"  # its run saves after step 2, resumed for step 3


def _trainer(out: Path, strategy: str, model=None, memory=None, **train) -> Trainer:
    sections = {"memory": memory} if memory else {}
    if model:
        sections["model"] = model
    return tiny_trainer(out, strategy, STEPS, train=train, **sections)


def _whole_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's stage state dict with tp shards gathered (every tp rank of the stage
    gathers the same keys in the same order)."""
    state = trainer.plan.module.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in state.items()}


def _run(out: Path, model, strategy: str, memory=None, **train) -> dict:
    trainer = _trainer(out, strategy, model, memory, **train)
    losses = trainer.train().losses
    runtime = trainer.plan.memory
    return {"losses": losses, "params": _whole_state(trainer),
            "features": list(trainer.plan.features),
            "stats": runtime.stats() if runtime else None}


def _reference(rank, world, root):
    root = Path(root)
    return {"ref": _run(root / "ref", None, "dp=1,mbs=4,gbs=8"),
            "gpt2": _run(root / "gpt2", GPT2, "dp=1,mbs=4,gbs=8"),
            "llama": _run(root / "llama", LLAMA, "dp=1,mbs=4,gbs=8")}


def _eight_ranks(rank, world, root):
    root = Path(root)
    out = {name: _run(root / name, model, text, memory, save_steps=2 if name == RESUMED else 0)
           for name, (model, text, memory) in CASES.items()}
    # Resume: step 3 from the checkpoint of step 2 = the uninterrupted run's step 3.
    _, text, memory = CASES[RESUMED]
    resumed = _trainer(root / "resumed", text, memory=memory,
                       resume_from=str(root / RESUMED / "checkpoints" / step_dirname(2)))
    out["resumed"] = resumed.train().losses
    out["resumed_params"] = _whole_state(resumed)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunk_pp_tp_sp")
    one = run_distributed(_reference, 1, args=(str(root / "one"),), timeout=300)[0]
    eight = run_distributed(_eight_ranks, 8, args=(str(root / "eight"),), timeout=900)
    return one, eight


def _same_params(got: dict, want: dict) -> None:
    assert got and got.keys() <= want.keys()
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], **WEIGHT_TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunk_memory_in_tp_and_sp_stages_equals_one_device(runs, name):
    one, eight = runs
    model = CASES[name][0]
    ref = one[model["hf"] if model else "ref"]
    for rank, out in enumerate(eight):
        run = out[name]
        assert "chunk_memory" in run["features"] and "pipeline" in run["features"], run
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]),
                                   **TOL)
        _same_params(run["params"], ref["params"])
    # The stages' state dicts together are the single-device state dict.
    keys = set().union(*(out[name]["params"].keys() for out in eight))
    assert keys == set(ref["params"].keys())


def test_the_budget_forces_evictions_in_tp_stages(runs):
    _, eight = runs
    stats = [out["dp2_tp2_pp2_budget"]["stats"] for out in eight]
    assert all(0 < s["device_peak"] <= 420_000 for s in stats), stats
    assert sum(s["evictions"].get("device", 0) for s in stats) > 0, stats


def test_tp_pp_chunk_checkpoint_resumes_exactly(runs):
    one, eight = runs
    for out in eight:
        assert len(out["resumed"]) == 1  # step 3 only
        torch.testing.assert_close(torch.tensor(out["resumed"]),
                                   torch.tensor(one["ref"]["losses"][2:]), **TOL)
        _same_params(out["resumed_params"], one["ref"]["params"])
