"""NaN or inf in a step: the run stops naming step and parameter, or skips the update."""

import math

import torch
from torch import nn

from tessera.models import Transformer, preset
from tessera.run import build_datasets, build_tokenizer
from tessera.testing import run_distributed
from tessera.train.trainer import NonFiniteError, Trainer

from conftest import tiny_run_config


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
