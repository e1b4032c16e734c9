"""Megatron sequence parallelism's custom ops (tensor/ops_seq.py) on one process.

A one-rank stand-in group makes every gather and reduce-scatter an identity that counts its
calls, so the ops must give exactly what plain autograd gives for ``F.linear``, and the
count shows how often a block's column layers gather their kept shard again in backward.
Real multi-rank runs of the ops (pipeline stages under tp_seq=on, against one device) are
in tests/parallel/pipeline/test_tp_pipeline.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.parallel.tensor import ops, ops_seq
from tessera.parallel.tensor.ops_seq import (tp_seq_gather, tp_seq_gather_whole, tp_seq_linear,
                                             tp_seq_reduce_scatter, tp_seq_scatter)

NAME = "tp:test_ops_seq"


class CountingGroup:
    """One rank: a gather or reduce-scatter returns its input, counted by kind."""

    size, rank = 1, 0

    def __init__(self) -> None:
        self.calls = {"all_gather": 0, "reduce_scatter": 0}

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        self.calls["all_gather"] += 1
        return x.clone()

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        self.calls["reduce_scatter"] += 1
        return x.clone()


@pytest.fixture
def group():
    ops._GROUPS[NAME] = CountingGroup()
    yield ops._GROUPS[NAME]
    del ops._GROUPS[NAME]
    ops_seq._REGATHERED.clear()


def _block(x, weights, biases, block: str):
    """A block input gathered once, read by three column layers (Llama's q, k, v)."""
    full = tp_seq_gather(x, NAME, block)
    return sum(tp_seq_linear(full, x, w, b, NAME, block).sum() for w, b in zip(weights, biases))


def _inputs(dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 8, dtype=dtype, requires_grad=True)  # (B, T, C)
    weights = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]  # (O/tp, C)
    biases = [torch.randn(4, requires_grad=True), None, torch.randn(4, requires_grad=True)]
    return x, weights, biases


def _plain(x, weights, biases):
    return sum(F.linear(x, w, b).sum() for w, b in zip(weights, biases))


def _grads(x, weights, biases):
    return [t.grad for t in (x, *weights, *biases) if t is not None]


@pytest.mark.parametrize("block", ["block0", ""])
def test_columns_equal_linear_and_share_one_regather_per_block(group, block):
    x, weights, biases = _inputs()
    _block(x, weights, biases, block).backward()
    got = _grads(x, weights, biases)
    x2, weights2, biases2 = _inputs()
    _plain(x2, weights2, biases2).backward()
    for ours, theirs in zip(got, _grads(x2, weights2, biases2)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # Forward: one gather. Backward: the three columns gather the kept shard again, once
    # for the block when they name it (else once each); the block input's reduce-scatter.
    regathers = 1 if block else 3
    assert group.calls == {"all_gather": 1 + regathers, "reduce_scatter": 1}


def test_a_new_forward_of_the_block_never_reuses_an_old_gather(group):
    # A backward asked for the weights' gradients only (torch.autograd.grad) never runs the
    # gather's backward, which drops the block's entry. The next micro-batch's shard may
    # then sit in the same memory with an unchanged version (here: written through .data);
    # its forward drops the entry, so its backward gathers its own values.
    x, weights, biases = _inputs()
    torch.autograd.grad(_block(x, weights, biases, "block0"), weights)
    assert "block0" in ops_seq._REGATHERED  # left by that backward
    x.data.mul_(2.0)  # same storage and version, new values
    got = torch.autograd.grad(_block(x, weights, biases, "block0"), weights)
    x2, weights2, biases2 = _inputs()
    want = torch.autograd.grad(_plain(x2.detach() * 2.0, weights2, biases2), weights2)
    for ours, theirs in zip(got, want):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_frozen_inputs_keep_nothing_and_frozen_weights_gather_nothing(group):
    # An input that needs no gradient: the columns gather each for itself, keeping nothing
    # after the backward (the block input's backward, which would drop it, never runs).
    x, weights, biases = _inputs()
    x.requires_grad_(False)
    _block(x, weights, biases, "block0").backward()
    assert "block0" not in ops_seq._REGATHERED
    assert group.calls["all_gather"] == 1 + 3
    # Frozen weights: only the input's gradient, which needs no gathered input.
    x, weights, biases = _inputs()
    for w in weights:
        w.requires_grad_(False)
    before = group.calls["all_gather"]
    _block(x, weights, biases, "block0").backward()
    assert group.calls["all_gather"] == before + 1  # the forward's only
    x2, weights2, biases2 = _inputs()
    _plain(x2, weights2, biases2).backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)


def test_under_autocast_the_product_and_its_backward_run_in_the_low_dtype(group):
    x, weights, biases = _inputs()
    x2, weights2, biases2 = _inputs()
    with torch.autocast("cpu", torch.bfloat16):
        full = tp_seq_gather(x, NAME, "block0")
        ours = tp_seq_linear(full, x, weights[0], biases[0], NAME, "block0")
        theirs = F.linear(x2, weights2[0], biases2[0])
    assert ours.dtype == theirs.dtype == torch.bfloat16
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    grad = torch.randn_like(ours)
    ours.backward(grad)
    theirs.backward(grad)
    # Gradients in the inputs' dtypes (fp32), from bf16 products as autocast's linear takes
    # them; summed in another order than aten's fused backward, so within bf16 rounding.
    for a, b in ((x, x2), (weights[0], weights2[0]), (biases[0], biases2[0])):
        assert a.grad.dtype == torch.float32
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("op", [tp_seq_scatter, tp_seq_gather_whole, tp_seq_reduce_scatter])
def test_a_one_sample_batch_passes_through_as_a_new_tensor(group, op):
    # With B = 1 a rank's rows of the sequence are contiguous already: a view of them would
    # be an alias of the op's input, which custom ops may not return (mbs=1 failed so).
    x = torch.randn(1, 6, 8, requires_grad=True)
    y = op(x, NAME)
    assert y.data_ptr() != x.data_ptr()
    torch.testing.assert_close(y, x, rtol=0, atol=0)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, torch.ones_like(x), rtol=0, atol=0)
