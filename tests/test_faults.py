"""Faults inside a run: NaN/inf steps stop or skip by name; a stalled rank gives a named timeout."""

import math

import torch
from torch import nn

from tessera.models import Transformer, preset
from tessera.run import build_datasets, build_tokenizer
from tessera.testing import run_distributed, tiny_run_config
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
