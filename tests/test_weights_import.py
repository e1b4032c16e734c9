"""Importing safetensors weights (train.init_from): bad folders are named before training starts.

The parity of an export imported under another strategy is checked in test_reshard.py.
"""

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tessera.launch import LaunchOptions, prepare_run
from tessera.testing import tiny_run_config
from tessera.train.export import WeightsImportError, load_safetensors_weights


class Tied(nn.Module):
    """An embedding and an output head sharing one weight, as exports store it once."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_weight_stored_once_loads_into_both_names(tmp_path):
    weight = torch.arange(15.0).reshape(5, 3)
    save_file({"embed.weight": weight}, str(tmp_path / "model.safetensors"))
    model = Tied()
    load_safetensors_weights(model, tmp_path)
    assert torch.equal(model.head.weight, weight) and torch.equal(model.embed.weight, weight)


def test_sharded_folders_follow_their_index(tmp_path):
    save_file({"weight": torch.ones(2, 4)}, str(tmp_path / "part-1.safetensors"))
    save_file({"bias": torch.full((2,), 3.0)}, str(tmp_path / "part-2.safetensors"))
    index = {"weight_map": {"weight": "part-1.safetensors", "bias": "part-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = nn.Linear(4, 2)
    load_safetensors_weights(model, tmp_path)
    assert model.weight.sum() == 8 and model.bias.sum() == 6
    (tmp_path / "part-2.safetensors").unlink()
    with pytest.raises(WeightsImportError, match="part-2.safetensors, named in model.safetensors"
                                                 ".index.json, is missing"):
        load_safetensors_weights(model, tmp_path)


@pytest.mark.parametrize("tensors, message", [
    (None, "is not a folder"),
    ({}, "has neither model.safetensors nor model.safetensors.index.json"),
    ({"weight": torch.ones(2, 4)}, r"missing tensors: bias$"),
    ({"weight": torch.ones(2, 4), "bias": torch.ones(2), "extra": torch.ones(1)},
     "tensors this model does not have: extra"),
    ({"weight": torch.ones(3, 4), "bias": torch.ones(2)},
     r"shape mismatches: weight \(file \[3, 4\], model \[2, 4\]\)"),
])
def test_bad_folders_are_named(tmp_path, tensors, message):
    folder = tmp_path / "weights"
    if tensors is not None:
        folder.mkdir()
        if tensors:
            save_file(tensors, str(folder / "model.safetensors"))
    model = nn.Linear(4, 2)
    before = model.weight.detach().clone()
    with pytest.raises(WeightsImportError, match=message):
        load_safetensors_weights(model, folder)
    assert torch.equal(model.weight, before)  # nothing loaded from a folder that does not fit


def test_a_corrupted_file_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(WeightsImportError, match="model.safetensors is not a readable "
                                                 "safetensors file"):
        load_safetensors_weights(nn.Linear(4, 2), tmp_path)


def test_the_launcher_refuses_a_mismatched_import_before_workers_start(tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    save_file({"wrong.name": torch.ones(1)}, str(folder / "model.safetensors"))
    config = tiny_run_config(tmp_path / "run", train={"init_from": str(folder)})
    with pytest.raises(WeightsImportError, match=r"does not fit the model Transformer: missing "
                                                 r"tensors: .* and \d+ more; tensors this model "
                                                 r"does not have: wrong.name"):
        prepare_run(config, LaunchOptions(nproc=1))
