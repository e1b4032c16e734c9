"""Micro-batch loss weights: the step's loss is the mean over its labels (loss_weights.py).

The multi-rank cases (dp=2, pp=2, and average_tokens_across_devices=False) ride the launches
of tests/test_training.py; these run in this process.
"""

import pytest
import torch

from tessera.models import Transformer, preset
from tessera.parallel.loss_weights import equal_weights, label_count, token_weights
from tessera.parallel.plan import Parallelized, lm_loss
from tessera.strategy import Strategy
from tessera.train.engine import Engine

CPU = torch.device("cpu")


def _model():
    torch.manual_seed(0)
    return Transformer(preset("tiny", vocab_size=64))


def _batches(ignored_tails):
    """One micro-batch of 2 x 16 tokens per entry, with that many labels ignored at the end."""
    torch.manual_seed(1)
    out = []
    for cut in ignored_tails:
        ids = torch.randint(0, 64, (2, 16))
        labels = torch.randint(0, 64, (2, 16))
        if cut:
            labels[:, 16 - cut:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_weights_follow_the_label_counts():
    batches = _batches([0, 12, 16])
    weights = token_weights(batches, CPU, None, 1)
    assert [int(label_count(b)) for b in batches] == [32, 8, 0]
    torch.testing.assert_close(torch.stack([weights[i] for i in range(3)]),
                               torch.tensor([0.8, 0.2, 0.0]))
    assert [float(equal_weights(4)[i]) for i in range(4)] == [0.25] * 4


def test_accumulated_micro_batches_train_as_the_whole_batch():
    """Gradients of weighted micro-batches equal those of one batch holding them all;
    the mean of their means (equal weights) does not."""
    batches = _batches([0, 13, 5])
    whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    one = _model()
    lm_loss(one(whole["input_ids"]), whole["labels"]).backward()
    model = _model()
    engine = Engine(Parallelized(model, model, None), Strategy(), CPU)
    result = engine.forward_backward(batches, token_weights(batches, CPU, None, 1))
    with torch.no_grad():
        want_loss = lm_loss(one(whole["input_ids"]), whole["labels"])
    # fp32 sums in another order (three partial sums, then their weighted sum): rounding only.
    torch.testing.assert_close(result.loss, want_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(_grads(model), _grads(one)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    model.zero_grad()
    engine.forward_backward(batches)  # equal weights
    differs = max(float((g - w).abs().max()) for g, w in zip(_grads(model), _grads(one)))
    assert differs > 1e-4, differs


def test_a_micro_batch_of_ignored_labels_adds_nothing_and_no_nan():
    batches = _batches([3, 16])
    model = _model()
    engine = Engine(Parallelized(model, model, None), Strategy(), CPU)
    result = engine.forward_backward(batches, token_weights(batches, CPU, None, 1))
    assert torch.isfinite(result.loss)
    assert all(torch.isfinite(g).all() for g in _grads(model))
    # Before: F.cross_entropy over no labels is 0/0, and a NaN stopped the step.
    assert float(lm_loss(torch.zeros(1, 4, 8), torch.full((1, 4), -100))) == 0.0


def test_weights_for_other_micro_batches_are_refused():
    batches = _batches([0, 0])
    model = _model()
    engine = Engine(Parallelized(model, model, None), Strategy(), CPU)
    with pytest.raises(ValueError, match="3 loss weights for 2 micro-batches"):
        engine.forward_backward(batches, equal_weights(3))
    with pytest.raises(ValueError, match="at least one micro-batch"):
        token_weights([], CPU, None, 1)


def test_padding_a_micro_batch_on_changes_neither_loss_nor_gradients():
    from tessera.parallel.plan import pad_batch

    batch = _batches([3])[0]
    model = _model()
    lm_loss(model(batch["input_ids"]), batch["labels"]).backward()
    want = _grads(model)
    model.zero_grad()
    padded = pad_batch(batch, 24)
    assert padded["input_ids"].shape == (2, 24) and (padded["labels"][:, 16:] == -100).all()
    got = lm_loss(model(padded["input_ids"]), padded["labels"])
    got.backward()  # causal attention: real tokens never see the padding after them
    for g, w in zip(_grads(model), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"batch keys \['pixel_values'\] have no padding"):
        pad_batch({**batch, "pixel_values": batch["labels"]}, 24)
