"""ShardGradSync's paths on one rank (a group of one: the average is the identity, so the
gradients must equal autograd's): the Engine's step averages in buckets (one all-reduce per
bucket, not one per parameter), a backward outside it one parameter at a time, no_sync none.
Averaging across ranks is checked by the dp x tp parity runs (test_tp_training.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _one_rank(rank, world_size):
    from tessera.parallel.tensor.data_parallel import ShardGradSync

    group = dist.new_group([0])
    model = _model()
    sync = ShardGradSync(model, group)
    calls = []
    all_reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted
    out = {}
    try:
        for name, context in (("step", lambda: sync.step((2, 8))),
                              ("step again", lambda: sync.step((2, 8))),
                              ("outside", None), ("no_sync", sync.no_sync)):
            model.zero_grad(set_to_none=True)
            calls.clear()
            x = torch.randn(2, 8)
            with context() if context else torch.enable_grad():
                model(x).sum().backward()
            want = torch.autograd.grad(model(x).sum(), list(model.parameters()))
            out[name] = (list(calls), all(torch.equal(p.grad, w)
                                          for p, w in zip(model.parameters(), want)))
    finally:
        dist.all_reduce = all_reduce
    out["params"] = sum(p.numel() for p in model.parameters())
    return out


def test_the_step_averages_in_buckets_and_other_backwards_per_parameter():
    out = run_distributed(_one_rank, world_size=1)[0]
    # 169 fp32 parameters fit the first 1 MiB bucket: one message for the whole step, the
    # first step (counting) and the next (launched inside the backward) alike.
    assert out["step"] == ([out["params"]], True)
    assert out["step again"] == ([out["params"]], True)
    assert out["outside"] == ([64, 8, 64, 8, 8, 1][::-1], True)  # as gradients complete
    assert out["no_sync"] == ([], True)
