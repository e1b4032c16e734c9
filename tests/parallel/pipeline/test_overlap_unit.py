"""OverlappedAverage's rules on one rank (a group of one: the average is the identity, so the
written-back gradients must equal autograd's): counting, launching inside the backward, the
refusal of a gradient that arrives after its bucket, and forgetting a failed step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tessera.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _backward(model: nn.Module, times: int) -> None:
    for i in range(times):
        model(torch.full((2, 8), float(i + 1))).sum().backward()


def _one_rank(rank, world_size):
    from tessera.parallel.pipeline.overlap import OverlappedAverage

    group = dist.new_group([0])
    model = _model()
    # fp32, in reverse order: (bias 4 + weight 32 + bias 32) B, then (weight 256 + bias 32) B
    # (adding the 256 B weight would pass 300), then the first weight: 3 buckets
    average = OverlappedAverage(list(model.parameters()), group, bucket_bytes=(300, 300))
    out = {"buckets": len(average.buckets)}

    average.arm("two")  # the first step with this key: counts, launches nothing early
    _backward(model, 2)
    out["launched_recording"] = average._launched
    want = [p.grad.clone() for p in model.parameters()]
    average.finish()
    out["recorded_equal"] = all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))

    model.zero_grad(set_to_none=True)
    average.arm("two")  # counts known: every bucket launches inside the second backward
    _backward(model, 2)
    out["launched_before_finish"] = average._launched
    want = [p.grad.clone() for p in model.parameters()]
    average.finish()
    out["overlapped_equal"] = all(torch.equal(p.grad, w)
                                  for p, w in zip(model.parameters(), want))

    model.zero_grad(set_to_none=True)
    average.arm("two")  # a third accumulation arrives after its bucket was averaged
    try:
        _backward(model, 3)
        out["late"] = None
    except RuntimeError as err:
        out["late"] = str(err)
        average.disarm()

    model.zero_grad(set_to_none=True)
    _backward(model, 1)  # without arm: finish averages everything after the fact
    want = [p.grad.clone() for p in model.parameters()]
    average.finish()
    out["unarmed_equal"] = all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
    average.close()
    return out


@pytest.fixture(scope="module")
def result():
    return run_distributed(_one_rank, world_size=1, timeout=120)[0]


def test_buckets_follow_the_size_limit(result):
    assert result["buckets"] == 3


def test_a_recording_step_launches_nothing_early_and_keeps_the_gradients(result):
    assert result["launched_recording"] == 0
    assert result["recorded_equal"]


def test_known_counts_launch_every_bucket_inside_the_backward(result):
    assert result["launched_before_finish"] == result["buckets"]
    assert result["overlapped_equal"]


def test_a_gradient_after_its_bucket_is_refused_by_name(result):
    assert result["late"] is not None
    assert "arrived after its data-parallel bucket was averaged" in result["late"]
    assert "GradSync.overlap = False" in result["late"]


def test_after_a_failed_step_an_unarmed_finish_averages_everything(result):
    assert result["unarmed_equal"]
