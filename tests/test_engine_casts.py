"""The training engine's weight casts under autocast over fp32 weights (pp = 1).

Gradient accumulation runs the micro-batches one after another; the engine keeps autocast's
16-bit weight copies for the whole step, so only the first forward casts. The copies are the
same values each forward would make, so the gradients are bit for bit those of casting per
micro-batch (the comparison is exact).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.models import Transformer
from tessera.models.config import ModelConfig
from tessera.parallel.plan import Parallelized
from tessera.parallel.recompute import apply_recompute
from tessera.strategy import Strategy
from tessera.train.engine import Engine

CONFIG = ModelConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, max_seq_len=16)
MICRO_BATCHES = 3


class _WeightCasts(TorchDispatchMode):
    """Counts fp32 -> bf16 casts of tensors shaped like a 2-D weight of the model."""

    def __init__(self, shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32
                and out.dtype == torch.bfloat16 and tuple(args[0].shape) in self.shapes):
            self.count += 1
        return out


def _step(share: bool, recompute: bool = False) -> tuple[int, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    plan = Parallelized(module=model, model=model, loss_group=None)
    if recompute and apply_recompute(model, 1.0):
        plan.features.append("recompute")
    engine = Engine(plan, Strategy.parse("mbs=2,gbs=6,precision=bf16"), torch.device("cpu"))
    if not share:
        engine._step_casts = contextlib.nullcontext
    gen = torch.Generator().manual_seed(1)
    batches = [{"input_ids": ids, "labels": ids} for ids in
               torch.randint(0, CONFIG.vocab_size, (MICRO_BATCHES, 2, 16), generator=gen)]
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    with _WeightCasts(shapes) as casts:
        engine.forward_backward(batches)
    return casts.count, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_accumulated_micro_batches_cast_each_weight_once_per_step():
    shared, grads = _step(share=True)
    each, reference = _step(share=False)
    assert shared > 0 and each == MICRO_BATCHES * shared
    for name, grad in grads.items():
        assert torch.equal(grad, reference[name]), name


def test_recomputed_layers_keep_casting_per_forward():
    # Recomputation would keep every recomputed layer's copies cached for the rest of the
    # step: the engine shares nothing then (recomputed forwards cast again, as before).
    shared, _ = _step(share=True, recompute=True)
    each, _ = _step(share=False, recompute=True)
    assert shared == each


def test_a_model_checkpointing_itself_casts_per_forward():
    # Hugging Face's own gradient checkpointing recomputes layers the engine cannot see.
    from tessera.models.hf import build_hf_model, hf_config_from_reference
    from tessera.models.config import preset

    torch.manual_seed(0)
    model = build_hf_model("llama", **hf_config_from_reference("llama", preset("tiny-llama")))
    model.activation_checkpointing_enable()
    plan = Parallelized(module=model, model=model, loss_group=None)
    engine = Engine(plan, Strategy.parse("mbs=2,gbs=6,precision=bf16"), torch.device("cpu"))
    assert isinstance(engine._step_casts(), contextlib.nullcontext)
    model.activation_checkpointing_disable()
    assert not isinstance(engine._step_casts(), contextlib.nullcontext)
