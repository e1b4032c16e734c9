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
    # 169 fp32 parameters fit the first 1 MiB bucket: one message for the whole step (with a
    # had-a-gradient flag for each of the 6 tensors), the first step (counting) and the next
    # (launched inside the backward) alike.
    assert out["step"] == ([out["params"] + 6], True)
    assert out["step again"] == ([out["params"] + 6], True)
    assert out["outside"] == ([64, 8, 64, 8, 8, 1][::-1], True)  # as gradients complete
    assert out["no_sync"] == ([], True)


def _unused(rank, world_size):
    from tessera.parallel.tensor.data_parallel import ShardGradSync

    group = dist.new_group([0, 1])
    model = _model()
    spare = nn.Linear(2, 2)  # never used by the forward
    holder = nn.ModuleDict({"model": model, "spare": spare})
    sync = ShardGradSync(holder, group)
    x = torch.full((2, 8), float(rank + 1))
    for _ in range(2):  # the counting step, then one that launches inside the backward
        holder.zero_grad(set_to_none=True)
        with sync.step((2, 8)):
            model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    mine = [g.clone() for g in torch.autograd.grad(model(x).sum(), list(model.parameters()))]
    return {"spare": [p.grad for p in spare.parameters()], "grads": grads, "mine": mine}


def test_an_unused_parameter_keeps_no_gradient_and_the_rest_are_averaged():
    out = run_distributed(_unused, world_size=2)
    assert out[0]["spare"] == [None, None] and out[1]["spare"] == [None, None]
    for got0, got1, mine0, mine1 in zip(out[0]["grads"], out[1]["grads"], out[0]["mine"],
                                        out[1]["mine"]):
        torch.testing.assert_close(got0, got1, rtol=0, atol=0)  # the same average on both
        # fp32 sum of two then halved: within one rounding of the exact mean
        torch.testing.assert_close(got0, (mine0 + mine1) / 2, rtol=1e-6, atol=1e-7)


def _failing_collective(rank, world_size):
    from tessera.parallel.tensor.data_parallel import ShardGradSync

    group = dist.new_group([0])
    model = _model()
    sync = ShardGradSync(model, group)
    all_reduce = dist.all_reduce

    class _Broken:
        def wait(self):
            raise RuntimeError("collective timed out")

    dist.all_reduce = lambda *args, **kwargs: _Broken()
    try:
        with sync.step((2, 8)):
            model(torch.ones(2, 8)).sum().backward()
        raised = None
    except RuntimeError as err:
        raised = str(err)
    finally:
        dist.all_reduce = all_reduce
    armed = sync.buckets._key is not None
    model.zero_grad(set_to_none=True)
    model(torch.ones(2, 8)).sum().backward()  # outside a step: averaged per parameter
    return {"raised": raised, "armed": armed, "grads": all(p.grad is not None
                                                            for p in model.parameters())}


def test_a_failed_collective_leaves_nothing_armed():
    out = run_distributed(_failing_collective, world_size=1)[0]
    assert out == {"raised": "collective timed out", "armed": False, "grads": True}


def _optimizer_paths(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tessera.train.optim import build_optimizer

    mesh = init_device_mesh("cpu", (1,))
    model = _model()
    sharded = nn.Module()
    sharded.weight = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))
    out = {}
    for name, module in (("plain", model), ("dtensor", sharded)):
        optimizer = build_optimizer(module, 1e-3, 0.0, (0.9, 0.999), 1e-8,
                                    torch.device("cpu"))
        state = optimizer.state_dict()
        for group in state["param_groups"]:
            group["foreach"] = not group["foreach"]  # as another run's checkpoint says
        optimizer.load_state_dict(state)
        out[name] = [group["foreach"] for group in optimizer.param_groups]
    return out


def test_dtensor_parameters_step_through_foreach_and_keep_it_after_a_load():
    out = run_distributed(_optimizer_paths, world_size=1)[0]
    # DTensors: the foreach path (one dispatch per op over the list); plain tensors: torch's
    # default; a loaded state dict's choice does not stick.
    assert out == {"plain": [None, None], "dtensor": [True, True]}
