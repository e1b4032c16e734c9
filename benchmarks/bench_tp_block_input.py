"""1D tensor parallelism: one input-gradient all-reduce per block against one per column layer.

Prints JSON lines, one per (model, tp): {"name", "value", "unit", "compared_against", ...}.

- tp1d_block_f_step_ratio_{gpt,llama}_tp{2,4}: median step time (forward, backward, AdamW;
  slowest rank) with Megatron's f applied once per attention / MLP block input (what tessera
  does) over the same model with f in every column layer (q, k, v, up; + gate for Llama),
  which is what tessera did before 2026-11-22. Lower is better; < 1.0 means the saving shows.

Both variants live in the same workers: the second is the first's twin (same seed) with the
blocks' pre-hooks removed and its column layers switched to mode "replicated", so it runs the
same code but for where the input gradient is summed. Steps alternate between the two, so load
from other programs on a shared machine falls on both alike. Model: the planner-validation
model (4 layers, d_model 128, 4 heads, vocab 256, seq 128), micro-batch 8, dp=1; "llama" is the
same with rmsnorm, swiglu and rope.

    python benchmarks/bench_tp_block_input.py [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from tessera.mesh import Mesh
from tessera.models import Transformer
from tessera.models.config import ModelConfig
from tessera.parallel.plan import Parallelized
from tessera.parallel.tensor import apply_tensor_parallel
from tessera.parallel.tensor.comm import TPGroup
from tessera.parallel.tensor.modules import BlockInput, ColumnLinear
from tessera.strategy import Strategy
from tessera.testing import run_distributed

MODEL = dict(n_layers=4, d_model=128, n_heads=4, vocab_size=256, max_seq_len=128)
LLAMA = dict(norm="rmsnorm", activation="swiglu", position="rope")
MBS = 8


def _plan(config: ModelConfig, strategy: Strategy, mesh: Mesh, per_layer: bool):
    torch.manual_seed(0)
    model = Transformer(config)
    plan = Parallelized(module=model, model=model, loss_group=None)
    apply_tensor_parallel(plan, strategy, mesh)
    if per_layer:  # the former placement: each column layer all-reduces its own dx
        for module in model.modules():
            for key, hook in list(module._forward_pre_hooks.items()):
                if isinstance(hook, BlockInput):
                    del module._forward_pre_hooks[key]
                    module._forward_pre_hooks_with_kwargs.pop(key, None)
            if isinstance(module, ColumnLinear) and module.mode == "gathered":
                module.mode = "replicated"
    return plan, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _count_backward_all_reduces(plan, batch) -> int:
    calls = []
    original = TPGroup.all_reduce

    def counting(self, tensor, *args, **kwargs):
        calls.append(1)
        return original(self, tensor, *args, **kwargs)

    loss = plan.forward_loss(plan.module, batch)
    TPGroup.all_reduce = counting
    try:
        loss.backward()
    finally:
        TPGroup.all_reduce = original
    plan.model.zero_grad(set_to_none=True)
    return len(calls)


def _step(plan, optimizer, batch) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    loss = plan.forward_loss(plan.module, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
    return float(elapsed), loss.item()


def _worker(rank, world, llama: bool, steps: int):
    config = ModelConfig(**MODEL, **(LLAMA if llama else {}))
    strategy = Strategy(tp=world, micro_batch_size=MBS, global_batch_size=MBS)
    mesh = Mesh(strategy, "cpu")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (MBS, config.max_seq_len + 1), generator=gen)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    variants = {"block": _plan(config, strategy, mesh, False),
                "per_layer": _plan(config, strategy, mesh, True)}
    out = {name: {"all_reduces": _count_backward_all_reduces(plan, batch), "times": [],
                  "losses": []} for name, (plan, _) in variants.items()}
    for i in range(steps + 3):  # 3 warm-up steps each
        for name, (plan, optimizer) in variants.items():
            elapsed, loss = _step(plan, optimizer, batch)
            out[name]["losses"].append(loss)
            if i >= 3:
                out[name]["times"].append(elapsed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    args = parser.parse_args()
    for llama in (False, True):
        for tp in (2, 4):
            load = os.getloadavg()[0]
            res = run_distributed(_worker, world_size=tp, args=(llama, args.steps),
                                  timeout=900)[0]
            block, per_layer = res["block"], res["per_layer"]
            med = {k: statistics.median(v["times"]) for k, v in res.items()}
            loss_diff = max(abs(a - b) for a, b in zip(block["losses"], per_layer["losses"]))
            name = "llama" if llama else "gpt"
            print(json.dumps({
                "name": f"tp1d_block_f_step_ratio_{name}_tp{tp}",
                "value": round(med["block"] / med["per_layer"], 3), "unit": "ratio",
                "compared_against": "f in every column layer (former tessera)",
                "block_median_ms": round(1e3 * med["block"], 1),
                "per_layer_median_ms": round(1e3 * med["per_layer"], 1),
                "backward_all_reduces": {k: v["all_reduces"] for k, v in res.items()},
                "max_loss_diff": loss_diff, "steps": args.steps, "tp": tp,
                "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2),
                "model": f"reference {name}-style, 4 layers, d_model 128, seq 128, mbs {MBS}"}),
                flush=True)


if __name__ == "__main__":
    main()
