"""save_model under dp x pp: rank 0 gathers every stage's share; the other pipelines'
ranks send nothing (train/export.py)."""

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tessera.testing import run_distributed, tiny_trainer
from tessera.train.export import REFERENCE_WEIGHTS, save_full_model


def _export(rank, world, root, strategy):
    trainer = tiny_trainer(f"{root}/run{world}", strategy, 1)  # weights as initialised
    save_full_model(trainer, Path(root) / f"weights{world}")


@pytest.mark.slow
def test_dp2_pp2_export_equals_one_device(tmp_path):
    run_distributed(_export, 4, args=(str(tmp_path), "dp=2,pp=2,mbs=2,gbs=8"))
    run_distributed(_export, 1, args=(str(tmp_path), "dp=1,mbs=2,gbs=8"))
    split = load_file(tmp_path / "weights4" / REFERENCE_WEIGHTS)
    whole = load_file(tmp_path / "weights1" / REFERENCE_WEIGHTS)
    assert sorted(split) == sorted(whole)
    assert all(split[k].equal(whole[k]) for k in whole)  # same seed, no step: bit for bit
