"""1D tensor parallelism: one input-gradient all-reduce per block against one per column layer.

Prints JSON lines, one per (model, tp): {"name", "value", "unit", "compared_against", ...}.

- tp1d_block_f_step_ratio_{gpt,llama}_tp{2,4}: median step time (forward, backward, AdamW;
  slowest rank) with Megatron's f applied once per attention / MLP block input (what tessera
  does) over the same model with f in every column layer (q, k, v, up; + gate for Llama),
  which is what tessera did before 2026-11-22. Lower is better; < 1.0 means the saving shows.

- tp1d_shared_norm_step_ratio_cohere_tp{2,4}[_seq]: Hugging Face Cohere, whose attention and
  MLP read one norm's output: entered once for both (policy.PARALLEL_LAYERS, tessera since
  2026-11-29) over once per block (the same model built without that entry, what tessera
  did before), plain 1D and with Megatron sequence parallelism (``_seq``, tp=2).
  The line counts both variants' collectives of one step (``collectives``).

Both variants live in the same workers: the second is the first's twin (same seed) with the
blocks' pre-hooks removed and its column layers switched to mode "replicated", so it runs the
same code but for where the input gradient is summed. Steps alternate between the two, so load
from other programs on a shared machine falls on both alike. Model: the planner-validation
model (4 layers, d_model 128, 4 heads, vocab 256, seq 128), micro-batch 8, dp=1; "llama" is the
same with rmsnorm, swiglu and rope.

    python benchmarks/bench_tp_block_input.py [--steps 30] [--only-cohere]
"""

from __future__ import annotations

import argparse
import contextlib
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


def _cohere_plan(strategy: Strategy, mesh: Mesh, shared: bool):
    """HF Cohere at the model's shape, its norm output entered once (``shared``) or once
    per block (the policy's PARALLEL_LAYERS entry left out while it is built)."""
    import transformers

    from tessera.parallel.tensor import policy

    torch.manual_seed(0)
    config = transformers.CohereConfig(
        hidden_size=MODEL["d_model"], num_hidden_layers=MODEL["n_layers"],
        num_attention_heads=MODEL["n_heads"], num_key_value_heads=MODEL["n_heads"],
        intermediate_size=4 * MODEL["d_model"], vocab_size=MODEL["vocab_size"],
        max_position_embeddings=MODEL["max_seq_len"], use_cache=False, logit_scale=1.0,
        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    model = transformers.CohereForCausalLM(config)
    plan = Parallelized(module=model, model=model, loss_group=None)
    entry = policy.PARALLEL_LAYERS.pop("CohereForCausalLM") if not shared else None
    try:
        apply_tensor_parallel(plan, strategy, mesh)
    finally:
        if entry is not None:
            policy.PARALLEL_LAYERS["CohereForCausalLM"] = entry
    return plan, torch.optim.AdamW(model.parameters(), lr=1e-4)


@contextlib.contextmanager
def _counted(names: tuple[str, ...]):
    """Calls of the TPGroup collectives ``names`` while the block runs: {name: count}."""
    calls = dict.fromkeys(names, 0)
    originals = {name: getattr(TPGroup, name) for name in names}

    def counting(name):
        def call(self, *args, **kwargs):
            calls[name] += 1
            return originals[name](self, *args, **kwargs)
        return call

    for name in names:
        setattr(TPGroup, name, counting(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(TPGroup, name, original)


def _count_collectives(plan, batch) -> dict[str, int]:
    """Calls of each tp collective in one forward and backward."""
    with _counted(("all_reduce", "all_gather", "reduce_scatter")) as calls:
        plan.forward_loss(plan.module, batch).backward()
    plan.model.zero_grad(set_to_none=True)
    return calls


def _count_backward_all_reduces(plan, batch) -> int:
    loss = plan.forward_loss(plan.module, batch)
    with _counted(("all_reduce",)) as calls:
        loss.backward()
    plan.model.zero_grad(set_to_none=True)
    return calls["all_reduce"]


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


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (MBS, MODEL["max_seq_len"] + 1), generator=gen)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def _worker(rank, world, llama: bool, steps: int):
    config = ModelConfig(**MODEL, **(LLAMA if llama else {}))
    strategy = Strategy(tp=world, micro_batch_size=MBS, global_batch_size=MBS)
    mesh = Mesh(strategy, "cpu")
    batch = _batch()
    variants = {"block": _plan(config, strategy, mesh, False),
                "per_layer": _plan(config, strategy, mesh, True)}
    out = {name: {"all_reduces": _count_backward_all_reduces(plan, batch), "times": [],
                  "losses": []} for name, (plan, _) in variants.items()}
    return _alternate(variants, batch, steps, out)


def _cohere_worker(rank, world, tp_seq: str, steps: int):
    strategy = Strategy(tp=world, micro_batch_size=MBS, global_batch_size=MBS, tp_seq=tp_seq)
    mesh = Mesh(strategy, "cpu")
    batch = _batch()
    variants = {"shared": _cohere_plan(strategy, mesh, True),
                "per_block": _cohere_plan(strategy, mesh, False)}
    out = {name: {"collectives": _count_collectives(plan, batch), "times": [], "losses": []}
           for name, (plan, _) in variants.items()}
    return _alternate(variants, batch, steps, out)


def _alternate(variants, batch, steps: int, out: dict) -> dict:
    """Steps of the variants in turn (3 warm-up steps each), times and losses into ``out``."""
    for i in range(steps + 3):
        for name, (plan, optimizer) in variants.items():
            elapsed, loss = _step(plan, optimizer, batch)
            out[name]["losses"].append(loss)
            if i >= 3:
                out[name]["times"].append(elapsed)
    return out


def _emit(name: str, res: dict, ours: str, theirs: str, against: str, load: float,
          **context) -> None:
    """One JSON line: the median step of variant ``ours`` over ``theirs`` in ``res``."""
    med = {k: statistics.median(v["times"]) for k, v in res.items()}
    loss_diff = max(abs(a - b) for a, b in zip(res[ours]["losses"], res[theirs]["losses"]))
    print(json.dumps({
        "name": name, "value": round(med[ours] / med[theirs], 3), "unit": "ratio",
        "compared_against": against,
        f"{ours}_median_ms": round(1e3 * med[ours], 1),
        f"{theirs}_median_ms": round(1e3 * med[theirs], 1),
        "max_loss_diff": loss_diff, **context, "load_before": round(load, 2),
        "load_after": round(os.getloadavg()[0], 2)}), flush=True)


def _cohere_lines(steps: int) -> None:
    for tp, tp_seq in ((2, "off"), (4, "off"), (2, "on")):
        load = os.getloadavg()[0]
        res = run_distributed(_cohere_worker, world_size=tp, args=(tp_seq, steps),
                              timeout=900)[0]
        suffix = "_seq" if tp_seq == "on" else ""
        _emit(f"tp1d_shared_norm_step_ratio_cohere_tp{tp}{suffix}", res, "shared", "per_block",
              "the norm output entered once per block (former tessera)", load,
              collectives={k: v["collectives"] for k, v in res.items()}, steps=steps, tp=tp,
              tp_seq=tp_seq, model=f"HF Cohere, 4 layers, hidden 128, seq 128, mbs {MBS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--only-cohere", action="store_true",
                        help="only the shared-norm lines (Hugging Face Cohere)")
    args = parser.parse_args()
    _cohere_lines(args.steps)
    if args.only_cohere:
        return
    for llama in (False, True):
        for tp in (2, 4):
            load = os.getloadavg()[0]
            res = run_distributed(_worker, world_size=tp, args=(llama, args.steps),
                                  timeout=900)[0]
            name = "llama" if llama else "gpt"
            _emit(f"tp1d_block_f_step_ratio_{name}_tp{tp}", res, "block", "per_layer",
                  "f in every column layer (former tessera)", load,
                  backward_all_reduces={k: v["all_reduces"] for k, v in res.items()},
                  steps=args.steps, tp=tp,
                  model=f"reference {name}-style, 4 layers, d_model 128, seq 128, mbs {MBS}")

if __name__ == "__main__":
    main()
