"""Faults inside a run: NaN/inf steps stop or skip by name; a stalled rank gives a named
timeout; a full disk tier stops the run by name and a resume after freeing space loses nothing.

The disk fault uses the test-only capacity of the disk tier (TESSERA_FAULT_DISK_CAPACITY, see
docs/training.md): its directory counts as a filesystem of that many bytes, which a test fills
by writing a (sparse) file there, as another process filling the disk would.
"""

import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from tessera.memory.tiers import FAULT_CAPACITY_ENV, DiskFullError
from tessera.models import Transformer, preset
from tessera.run import build_datasets, build_model, build_tokenizer
from tessera.testing import run_distributed, tiny_run_config
from tessera.train.checkpoint import find_latest, verify_checkpoint
from tessera.train.trainer import NonFiniteError, Trainer


class PoisonedAt(nn.Module):
    """The tiny model, with NaN logits on one forward call (counting from 1)."""

    def __init__(self, call: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.call, self.calls = Transformer(preset("tiny")), call, 0

    def forward(self, input_ids):
        self.calls += 1
        logits = self.inner(input_ids)
        return logits * math.nan if self.calls == self.call else logits


def _run(rank, world_size, root, mode):
    config = tiny_run_config(f"{root}/{mode}", "dp=1,mbs=8,gbs=8",
                             train={"max_steps": 5, "nonfinite": mode})
    train_ds, _ = build_datasets(config, build_tokenizer(config))
    trainer = Trainer(PoisonedAt(call=3), config.train, train_ds, strategy=config.strategy)
    try:
        result = trainer.train()
    except NonFiniteError as err:
        return {"error": str(err)}
    finite = all(torch.isfinite(p).all() for p in trainer.model.parameters())
    return {"skipped": trainer.skipped_steps, "losses": result.losses, "finite": finite}


def test_nonfinite_stop_and_skip(tmp_path):
    stopped = run_distributed(_run, world_size=1, args=(str(tmp_path), "stop"))[0]
    assert "step 3: non-finite gradients" in stopped["error"]
    assert "first non-finite gradient: inner." in stopped["error"]
    skipped = run_distributed(_run, world_size=1, args=(str(tmp_path), "skip"))[0]
    assert skipped["skipped"] == [3] and skipped["finite"]
    assert math.isnan(skipped["losses"][2])  # the poisoned step's loss is reported as is
    assert all(math.isfinite(x) for i, x in enumerate(skipped["losses"]) if i != 2)


class StallAt(nn.Module):
    """The tiny model; on rank 1 one forward call sleeps far past the collective timeout."""

    def __init__(self, call: int, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.call, self.calls, self.rank = Transformer(preset("tiny")), call, 0, rank

    def forward(self, input_ids):
        self.calls += 1
        if self.rank == 1 and self.calls == self.call:
            import time

            time.sleep(30)
        return self.inner(input_ids)


def _stalled(rank, world_size, root):
    config = tiny_run_config(f"{root}/stall", "dp=2,mbs=4,gbs=8",
                             train={"max_steps": 5, "collective_timeout_s": 4})
    train_ds, _ = build_datasets(config, build_tokenizer(config))
    trainer = Trainer(StallAt(call=2, rank=rank), config.train, train_ds,
                      strategy=config.strategy)
    trainer.train()


def test_a_stalled_rank_gives_a_named_timeout_not_a_hang(tmp_path):
    import pytest

    from tessera.testing import DistributedTestError

    with pytest.raises(DistributedTestError) as err:
        run_distributed(_stalled, world_size=2, args=(str(tmp_path),), timeout=60,
                        collective_timeout_s=4)
    text = str(err.value)
    assert "rank 0 failed" in text and "CollectiveError: rank 0: forward/backward with the " \
        "data-parallel gradient all-reduce at step 2 failed" in text
    assert "Timed out" in text and "collective_timeout_s=4" in text


# Host budget small enough that chunks spill to disk every step (about 2 MB per step).
DISK_MEMORY = {"placement": "auto", "chunk_size": 20000, "device_budget": 1_500_000,
               "host_budget": 1_500_000}
TIGHT_HOST = 1_000_000  # the loaded AdamW states alone overfill it
DISK_CAPACITY = 8 * 2**20


def _disk_run(root: Path, name: str, host_budget: int = DISK_MEMORY["host_budget"], **train):
    (root / f"{name}_spill").mkdir(exist_ok=True)
    config = tiny_run_config(
        root / name, "dp=1,mbs=4,gbs=8,memory=chunk,offload=cpu+disk",
        memory={**DISK_MEMORY, "host_budget": host_budget,
                "disk_dir": str(root / f"{name}_spill")},
        train={"max_steps": 6, "save_steps": 2, **train})
    train_ds, _ = build_datasets(config, build_tokenizer(config))
    return Trainer(build_model(config), config.train, train_ds, strategy=config.strategy,
                   memory=config.memory)


def _disk_full(rank, world_size, root):
    """Fill the disk tier at step 3; the run stops by name; freed, a resume finishes it."""
    root = Path(root)
    straight = _disk_run(root, "straight").train().losses
    filler = root / "full_spill" / "someone_elses_file"

    def fill_at_step_3(record):
        if record.get("step") == 3:
            with open(filler, "wb") as handle:  # sparse: counts DISK_CAPACITY, writes nothing
                handle.truncate(DISK_CAPACITY)

    trainer = _disk_run(root, "full")
    trainer.callbacks.append(fill_at_step_3)
    error = None  # stays None if the fault did not stop the run (the test then fails)
    try:
        trainer.train()
    except DiskFullError as err:
        error = str(err)
    latest = find_latest(root / "full" / "checkpoints")
    verify_checkpoint(latest)  # the last checkpoint is intact
    filler.unlink()  # space freed
    resumed = _disk_run(root, "full", resume=True).train().losses
    tight = _disk_run(root, "tight", TIGHT_HOST, resume_from=str(latest)).train().losses
    return {"error": error, "latest": latest.name, "straight": straight, "resumed": resumed,
            "tight": tight}


@pytest.fixture(scope="module")
def disk_full(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk_full")
    out = run_distributed(_disk_full, world_size=1, args=(str(root),),
                          env={FAULT_CAPACITY_ENV: str(DISK_CAPACITY)})[0]
    return root, out


def test_a_full_disk_tier_stops_by_name_and_a_resume_loses_nothing(disk_full):
    root, out = disk_full
    assert out["error"] is not None, "the full disk tier did not stop the run"
    assert f"memory.disk_dir {root / 'full_spill'} is full (No space left on device): " \
           f"writing rank0_chunk" in out["error"]
    assert re.search(r"needs \d+ bytes, 0 are free", out["error"]), out["error"]
    assert out["latest"] == "step_00000002"
    # Same world size and config: the resumed steps replay the same operations exactly.
    assert out["resumed"] == pytest.approx(out["straight"][2:], abs=1e-6)


def test_a_resume_whose_optimizer_states_overfill_the_host_budget(disk_full):
    # Regression: clipping used to scale gradient tensors kept from before a later read
    # evicted them to disk, so the scaled values were lost and the update differed.
    _, out = disk_full
    assert out["tight"][0] == pytest.approx(out["straight"][2], abs=1e-6)  # weights: exact
    assert out["tight"] == pytest.approx(out["straight"][2:], abs=1e-6)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_real_enospc_from_the_kernel_is_named_and_leaves_no_torn_file(tmp_path):
    from tessera.memory.tiers import DiskTier

    tier = DiskTier(tmp_path)
    (tmp_path / "rank0_chunk0_param.bin").symlink_to("/dev/full")  # every write: ENOSPC
    with pytest.raises(DiskFullError, match=rf"memory.disk_dir {tmp_path} is full \(No space "
                                            r"left on device\): writing rank0_chunk0_param "
                                            r"needs 4000 bytes"):
        tier.write("rank0_chunk0_param", torch.ones(1000))
    assert not (tmp_path / "rank0_chunk0_param.bin").exists() and not tier.files
