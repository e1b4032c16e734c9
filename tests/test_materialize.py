"""Materialising a meta-device model, all of it or a part (models/materialize.py).

The pipeline runs that rely on this (each rank materialising its stages' share) are in
tests/parallel/pipeline/test_pipeline_parity.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.models import Transformer
from tessera.models.config import preset
from tessera.models.hf import build_hf_model, hf_config_from_reference
from tessera.models.materialize import (MaterializeError, has_meta, materialize,
                                        shapes_on_meta)
from tessera.parallel import parallelize
from tessera.strategy import Strategy

ARCHS = ("ref", "gpt2", "llama")


def _on_meta(arch: str) -> nn.Module:
    with torch.device("meta"):
        if arch == "ref":  # rope: its cos/sin tables are non-persistent buffers
            return Transformer(preset("tiny-llama", n_layers=2))
        base = preset("tiny-llama" if arch == "llama" else "tiny", n_layers=2)
        return build_hf_model(arch, **hf_config_from_reference(arch, base))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_weight_gets_the_same_values_whichever_part_is_materialised(arch):
    whole = _on_meta(arch)
    materialize(whole, "cpu", seed=5)
    assert not has_meta(whole)
    part = _on_meta(arch)
    names = [n for n, _ in part.named_parameters()]
    chosen = names[1::2]  # every other weight: the draws of the others are skipped
    got = materialize(part, "cpu", chosen, seed=5)
    assert set(got) == set(chosen) and has_meta(part)
    reference = dict(whole.named_parameters())
    for name, param in part.named_parameters():
        assert param.is_meta == (name not in chosen), name
        if not param.is_meta:
            assert torch.equal(param, reference[name]), name
    for (name, buf), (_, want) in zip(part.named_buffers(), whole.named_buffers()):
        assert torch.equal(buf, want), name  # every buffer, recomputed by the model's init
    other = _on_meta(arch)
    materialize(other, "cpu", seed=6)
    assert not torch.equal(next(other.parameters()), next(whole.parameters()))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_model_initialisation_is_the_models_own(arch):
    model = _on_meta(arch)
    materialize(model, "cpu")
    for name, param in model.named_parameters():
        if name.endswith("embed.weight") or name.endswith(("wte.weight", "embed_tokens.weight")):
            assert 0.015 < param.std().item() < 0.025, name  # normal(0, 0.02) of each model
        if "norm" in name and name.endswith("weight") or ".ln_" in name and name.endswith(
                "weight"):
            assert torch.equal(param, torch.ones_like(param)), name
    if arch == "ref":  # the rope tables are the ones an eager build computes
        eager = Transformer(preset("tiny-llama", n_layers=2))
        assert torch.equal(model.rope_cos, eager.rope_cos)


def test_tied_weights_stay_one_parameter():
    model = _on_meta("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    materialize(model, "cpu", ["lm_head.weight"])  # named by its second name
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not model.lm_head.weight.is_meta


def test_weights_already_on_the_device_keep_their_values():
    model = _on_meta("ref")
    materialize(model, "cpu", ["embed.weight"])
    with torch.no_grad():
        model.embed.weight.fill_(7.0)
    materialize(model, "cpu")  # the rest; the init's writes to embed.weight are skipped
    assert torch.equal(model.embed.weight, torch.full_like(model.embed.weight, 7.0))
    assert not has_meta(model)


class _Unset(nn.Module):
    """A weight no initialisation routine knows about."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.empty(4))


def test_a_weight_the_initialisation_leaves_unset_is_named():
    with torch.device("meta"):
        model = _Unset()
    with pytest.raises(MaterializeError, match=r"\['scale'\]"):
        materialize(model, "cpu")


def test_shapes_on_meta_swaps_and_restores():
    model = _on_meta("gpt2")
    materialize(model, "cpu", ["transformer.wte.weight"])
    wte = model.transformer.wte.weight
    with shapes_on_meta(model):
        assert all(p.is_meta for p in model.parameters())
        assert model.lm_head.weight is model.transformer.wte.weight  # tied stand-in
    assert model.transformer.wte.weight is wte and not wte.is_meta


def test_parallelize_refuses_a_meta_model_without_a_deferred_init():
    model = _on_meta("ref")
    with pytest.raises(ValueError, match="meta device"):
        parallelize(model, Strategy(), mesh=None)  # refused before the mesh is read


@pytest.mark.parametrize("arch", ARCHS)
def test_few_at_a_time_gives_the_whole_models_values_and_copies_no_storage(arch):
    from tessera.models.materialize import DeferredInit, FewAtATime

    whole = _on_meta(arch)
    materialize(whole, "cpu", seed=3)
    model = _on_meta(arch)
    source = FewAtATime(model, DeferredInit(torch.device("cpu"), seed=3))
    # Twice from the same source (Hugging Face marks modules initialised: a fresh copy each).
    for names in (["lm_head.weight"], [n for n, _ in model.named_parameters()][:3]):
        params = [model.get_parameter(n) for n in names]
        got = source.whole(params)
        for name, p in zip(names, params):
            assert torch.equal(got[id(p)], whole.get_parameter(name)), (arch, name)
    assert has_meta(model)  # the model itself is left as it was
    # A model whose weights are real but whose buffers are on meta (loaded with assign=True):
    # the copy the requests start from holds none of the real weights.
    for module in whole.modules():
        for key, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[key] = torch.empty_like(buf, device="meta")
    held = FewAtATime(whole, DeferredInit(torch.device("cpu")))
    assert all(p.is_meta for p in held.template.parameters())
    assert not any(p.is_meta for p in whole.parameters())
