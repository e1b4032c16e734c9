"""Tensor parallelism: 2D (Optimus SUMMA) against 1D (Megatron), and 1D against PyTorch's.

Prints JSON lines, one per figure: {"name", "value", "unit", "compared_against", ...}.

- activation_mem_ratio_2d_vs_1d: bytes of tensors saved for backward (one forward of the
  whole model, parameters excluded, each storage counted once), per rank, 2D 2x2 over 1D
  tp=4, same model and micro-batch; target <= 0.6.
- max_batch_ratio_2d_vs_1d: the largest micro-batch whose model state (parameters, gradients,
  two Adam states) plus saved activations fit a per-rank budget, 2D over 1D, 4 ranks; the
  budget is what 1D needs at micro-batch 8; target >= 1.5. Both ends are measured.
- comm_bytes_per_layer_{1d,2d}: collective payload bytes per rank per transformer layer per
  step (forward + backward), measured by counting every collective's payload (models with 2
  and 1 layers, difference), beside the analytic formula of docs/tensor_parallel.md; within 5%.
- tp1d_vs_dtensor_tokens_ratio_tp{2,4}: tokens/s of a forward + backward step, tessera 1D
  against torch.distributed.tensor.parallel.parallelize_module with ColwiseParallel /
  RowwiseParallel (vocabulary-parallel embedding and loss_parallel), same model and batch;
  target >= 1.0. Rounds alternate between the two; the best round of each counts. The load
  average is reported beside it: other work shares this machine's cores.
- dp2_tp2_train_vs_torch_2d_tokens_ratio: whole training steps (forward, backward, dp
  gradient averaging, clipping, AdamW) at dp=2 x tp=2, tessera's Trainer (memory=ddp) against
  PyTorch's 2D recipe, parallelize_module for tp and FSDP2's fully_shard over dp
  (reshard_after_forward=False), same model and batch shape (_tp_training.py); best round
  of each, rounds alternating. FSDP2 also shards gradients and Adam states over dp, which
  tessera does under memory=chunk.
- tp_attention_dropout_vs_sdpa_dropout_time_ratio_t{256,1024}: one attention call, forward
  and backward, on one thread: 1D tp's hashed-dropout attention (tensor/attention.py, the
  path a tp rank runs while the model drops attention) against PyTorch's SDPA with
  dropout_p=0.1 (what one device runs; on CPU it leaves its fused kernel), best of 3; SDPA
  without dropout beside it.

- activation_mem_ratio_tp_seq_vs_1d, tp_seq_vs_torch_sp_activation_mem_ratio,
  tp_seq_vs_torch_sp_tokens_ratio_tp4: Megatron sequence parallelism (tp_seq=on) at tp=4 on
  a Llama-style model (_tp_seq.py): saved bytes against tessera's plain 1D and against
  PyTorch's own recipe (SequenceParallel norms, PrepareModuleInput, Colwise/Rowwise with
  sequence-sharded outputs, loss_parallel), and forward + backward tokens/s against the
  latter (best round, rounds alternating).

    python benchmarks/bench_tensor_parallel.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn

from tessera.mesh import Mesh
from tessera.models import Transformer
from tessera.models.config import preset
from tessera.parallel.plan import Parallelized
from tessera.parallel.tensor import CommCounter, apply_tensor_parallel
from tessera.parallel.tensor.shard import local
from tessera.strategy import Strategy
from tessera.testing import run_distributed

from _tp_training import tokens_per_s as training_tokens_per_s  # noqa: E402 (beside this script)
from _tp_training import race, torch_tp_plan  # noqa: E402
from _tp_seq import figures as tp_seq_figures  # noqa: E402

T = 128
MODEL = dict(vocab_size=256, d_model=256, n_heads=8, max_seq_len=T, tie_embeddings=False)


def _batch(b: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MODEL["vocab_size"], (b, T + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def _tp_model(mesh: Mesh, strategy: Strategy, n_layers: int = 2,
              counter: CommCounter | None = None) -> Parallelized:
    torch.manual_seed(0)
    model = Transformer(preset("tiny", n_layers=n_layers, **MODEL))
    plan = Parallelized(module=model, model=model, loss_group=None)
    apply_tensor_parallel(plan, strategy, mesh, counter=counter)
    return plan


# ------------------------------------------------------------------------------- memory
def saved_bytes(plan: Parallelized, batch) -> int:
    """Bytes of the distinct storages autograd saves for backward, parameters excluded."""
    params = {local(p).untyped_storage().data_ptr() for p in plan.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = plan.forward_loss(plan.module, batch)
    loss.backward()
    return sum(seen.values())


def state_bytes(plan: Parallelized) -> int:
    """Parameters, gradients and two Adam moments of this rank's shards (fp32)."""
    return 4 * sum(local(p).numel() * local(p).element_size() for p in plan.model.parameters())


def memory_figures(meshes: dict[str, Mesh]) -> dict[str, float]:
    plans = {mode: _tp_model(mesh, mesh.strategy) for mode, mesh in meshes.items()}
    act = {mode: saved_bytes(plan, _batch(8)) for mode, plan in plans.items()}
    state = {mode: state_bytes(plan) for mode, plan in plans.items()}
    budget = state["1d"] + act["1d"]  # 1D fits micro-batch 8 exactly
    fits, b = 0, 2
    while state["2d"] + saved_bytes(plans["2d"], _batch(b)) <= budget:  # 2D: multiples of q
        fits, b = b, b + 2
    return {"act_1d": act["1d"], "act_2d": act["2d"], "state_1d": state["1d"],
            "state_2d": state["2d"], "budget": budget, "max_batch_1d": 8, "max_batch_2d": fits}


# --------------------------------------------------------------------------------- comm
def measured_layer_bytes(mesh: Mesh, batch) -> float:
    """Payload bytes per rank of one layer's forward + backward (2-layer minus 1-layer)."""
    per_rank = []
    for layers in (1, 2):
        counter = CommCounter()
        plan = _tp_model(mesh, mesh.strategy, layers, counter)
        counter.bytes.clear()  # building sends nothing, but be sure
        plan.forward_loss(plan.module, batch).backward()
        per_rank.append(counter.total())
    return per_rank[1] - per_rank[0]


def formula_1d(n: int, c: int, f: int) -> float:
    """1D per rank: all-reduce of (N, C) after each row layer forward (o, down: 2) and of each
    block input's gradient backward (attention, MLP: 2; one f per block, however many column
    layers read the input). fp32 bytes."""
    return 4.0 * (2 + 2) * n * c


def formula_2d(n: int, c: int, f: int, q: int) -> float:
    """2D per rank (grid total / q^2): SUMMA linears, biases, two layernorms. fp32 bytes.

    Linear (in I, out O, N tokens): forward broadcasts weight blocks (O*I) and reduces
    partial outputs (q*N*O); backward broadcasts dY and W (N*O + O*I) for dX, dY again (N*O)
    and reduces weight partials (q*O*I) for dW. Bias gradient: q*O. Layernorm: 4 row
    all-reduces of N/q per rank (2 forward, 2 backward) and 2 column all-reduces of C/q.
    """
    linears = [(c, c)] * 4 + [(c, f), (f, c)]  # (in, out): q, k, v, o, up, down
    total = 0.0
    for i, o in linears:
        total += 2 * o * i + q * o * i + q * n * o + 2 * n * o + q * o
    total += 2 * (4 * q * n + 2 * q * c)
    return 4.0 * total / q ** 2


# ----------------------------------------------------------------------------- throughput
def _dtensor_model(mesh: Mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = Transformer(preset("tiny", **MODEL))
    return parallelize_module(model, mesh.submesh("tp"), torch_tp_plan(model))


def _dtensor_step(model: nn.Module, batch) -> None:
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        logits = model(batch["input_ids"])  # DTensor (B, T, V) sharded on V
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()


def tokens_per_s(mesh: Mesh, rounds: int, steps: int) -> dict[str, float]:
    # Tensor parallelism only on both sides: no dp gradient averaging even on a dp=2 mesh.
    ours = _tp_model(mesh, mesh.strategy.replace(dp=1, global_batch_size=1))
    theirs = _dtensor_model(mesh)
    batch = _batch(8)
    sides = {"tessera": lambda: ours.forward_loss(ours.module, batch).backward(),
             "dtensor": lambda: _dtensor_step(theirs, batch)}
    check = _loss_check(ours, theirs, batch)
    best = race(sides, batch["input_ids"].numel(), rounds, steps)
    return {**best, "loss_diff": check}


def _loss_check(ours: Parallelized, theirs: nn.Module, batch) -> float:
    """Both sides compute the same loss (same weights): the comparison is like for like."""
    from torch.distributed.tensor.parallel import loss_parallel

    with torch.no_grad(), loss_parallel():
        ref = nn.functional.cross_entropy(theirs(batch["input_ids"]).flatten(0, 1),
                                          batch["labels"].flatten())
        ref = ref.full_tensor() if hasattr(ref, "full_tensor") else ref
        return abs(ours.forward_loss(ours.module, batch).item() - ref.item())


# ------------------------------------------------------------------------------ workers
def _worker(rank, world, quick):
    meshes = {"1d": Mesh(Strategy(tp=4), "cpu"),
              "2d": Mesh(Strategy(tp=4, tp_mode="2d", micro_batch_size=2,
                                  global_batch_size=2), "cpu")}
    out = {"memory": memory_figures(meshes),
           "comm": {mode: measured_layer_bytes(mesh, _batch(8)) for mode, mesh in meshes.items()}}
    rounds, steps = (3, 4) if quick else (6, 10)
    out["speed_tp4"] = tokens_per_s(meshes["1d"], rounds, steps)
    out["speed_tp2"] = tokens_per_s(Mesh(Strategy(dp=2, tp=2, global_batch_size=2), "cpu"),
                                    rounds, steps)
    out["train_dp2_tp2"] = training_tokens_per_s(preset("tiny", n_layers=4, **MODEL),
                                                 micro_batch=4, rounds=rounds, steps=steps)
    out["tp_seq"] = tp_seq_figures(meshes["1d"], 8, rounds, steps)
    return out


def _emit(name, value, unit, against, **context) -> None:
    print(json.dumps({"name": name, "value": value, "unit": unit,
                      "compared_against": against, **context}), flush=True)


def _attention_dropout_figures() -> None:
    """Time one causal attention call, fwd+bwd, three ways (module doc)."""
    import torch.nn.functional as F

    from tessera.parallel.tensor.attention import head_dropout_attention
    from tessera.planner.calibrate import _best_of

    calls = {"hashed": lambda q, k, v: head_dropout_attention(q, k, v, 0.1, 0),
             "sdpa_dropout": lambda q, k, v: F.scaled_dot_product_attention(
                 q, k, v, dropout_p=0.1, is_causal=True),
             "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for B, T in ((4, 256), (2, 1024)):
            shape = (B, 6, T, 64)  # (B, local heads, T, hs)
            q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
            # one warm-up call, then the fastest of 3
            best = {name: _best_of(lambda call=call: call(q, k, v).sum().backward(),
                                   rounds=3, calls=1) for name, call in calls.items()}
            _emit(f"tp_attention_dropout_vs_sdpa_dropout_time_ratio_t{T}",
                  round(best["hashed"] / best["sdpa_dropout"], 3), "ratio",
                  "torch SDPA with dropout_p=0.1 (one device's attention)",
                  hashed_ms=round(best["hashed"] * 1e3, 1),
                  sdpa_dropout_ms=round(best["sdpa_dropout"] * 1e3, 1),
                  sdpa_no_dropout_ms=round(best["sdpa"] * 1e3, 1), shape_b_h_t_hs=shape,
                  threads=1, dtype="fp32", loadavg=os.getloadavg()[0])
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timing rounds (< 3 min)")
    args = parser.parse_args()
    _attention_dropout_figures()
    load_before = os.getloadavg()[0]
    res = run_distributed(_worker, world_size=4, args=(args.quick,), timeout=900)
    load_after = os.getloadavg()[0]
    mem = {k: max(r["memory"][k] for r in res) for k in res[0]["memory"]}
    setup = dict(model="reference gpt-style, 2 layers, d_model=256, 8 heads, vocab 256",
                 seq_len=T, micro_batch=8, ranks=4)
    _emit("activation_mem_ratio_2d_vs_1d", round(mem["act_2d"] / mem["act_1d"], 4), "ratio",
          "tessera 1D tp=4", target="<= 0.6", bytes_2d=mem["act_2d"], bytes_1d=mem["act_1d"],
          method="saved_tensors_hooks, distinct storages, params excluded, max over ranks",
          **setup)
    _emit("max_batch_ratio_2d_vs_1d", mem["max_batch_2d"] / mem["max_batch_1d"], "ratio",
          "tessera 1D tp=4", target=">= 1.5", budget_bytes=mem["budget"],
          max_batch_2d=mem["max_batch_2d"], max_batch_1d=mem["max_batch_1d"],
          state_bytes_1d=mem["state_1d"], state_bytes_2d=mem["state_2d"], **setup)
    n, c, f = 8 * T, MODEL["d_model"], 4 * MODEL["d_model"]
    for mode, formula in (("1d", formula_1d(n, c, f)), ("2d", formula_2d(n, c, f, 2))):
        measured = sum(r["comm"][mode] for r in res) / len(res)
        _emit(f"comm_bytes_per_layer_{mode}", measured, "bytes/rank/layer/step",
              "analytic formula", formula=formula, deviation=round(measured / formula - 1, 4),
              target="within 5%", **setup)
    for tp in (2, 4):
        speed = res[0][f"speed_tp{tp}"]
        _emit(f"tp1d_vs_dtensor_tokens_ratio_tp{tp}",
              round(speed["tessera"] / speed["dtensor"], 3), "ratio",
              "torch parallelize_module ColwiseParallel/RowwiseParallel + loss_parallel",
              target=">= 1.0", tessera_tokens_per_s=round(speed["tessera"], 1),
              dtensor_tokens_per_s=round(speed["dtensor"], 1), tp=tp,
              loss_diff=speed["loss_diff"], loadavg_before=load_before,
              loadavg_after=load_after, cpu_cores=os.cpu_count(), **setup)
    train = res[0]["train_dp2_tp2"]
    _emit("dp2_tp2_train_vs_torch_2d_tokens_ratio",
          round(train["tessera"] / train["torch_2d"], 3), "ratio",
          "torch parallelize_module (tp) + FSDP2 fully_shard over dp, reshard_after_forward=False",
          target=">= 1.0", tessera_tokens_per_s=round(train["tessera"], 1),
          torch_tokens_per_s=round(train["torch_2d"], 1), model="reference, 4 layers, "
          "d_model=256, 8 heads, vocab 256", seq_len=T, micro_batch=4, dp=2, tp=2,
          loadavg_before=load_before, loadavg_after=load_after, cpu_cores=os.cpu_count())
    _emit_tp_seq(res, load_before, load_after)


def _emit_tp_seq(res: list[dict], load_before: float, load_after: float) -> None:
    seq = {k: max(r["tp_seq"][k] for r in res) for k in ("saved_1d", "saved_tp_seq",
                                                          "saved_torch_sp")}
    setup = dict(model="reference llama-style, 2 layers, d_model=256, 8 heads, vocab 256",
                 seq_len=T, micro_batch=8, tp=4)
    _emit("activation_mem_ratio_tp_seq_vs_1d", round(seq["saved_tp_seq"] / seq["saved_1d"], 4),
          "ratio", "tessera 1D tp=4 without Megatron sequence parallelism",
          bytes_tp_seq=seq["saved_tp_seq"], bytes_1d=seq["saved_1d"], **setup)
    _emit("tp_seq_vs_torch_sp_activation_mem_ratio",
          round(seq["saved_tp_seq"] / seq["saved_torch_sp"], 4), "ratio",
          "torch parallelize_module SequenceParallel + PrepareModuleInput + Colwise/Rowwise",
          target="<= 1.0", bytes_tp_seq=seq["saved_tp_seq"],
          bytes_torch_sp=seq["saved_torch_sp"], **setup)
    speed = res[0]["tp_seq"]
    _emit("tp_seq_vs_torch_sp_tokens_ratio_tp4",
          round(speed["tokens_tessera"] / speed["tokens_torch_sp"], 3), "ratio",
          "torch parallelize_module SequenceParallel + PrepareModuleInput + Colwise/Rowwise, "
          "loss_parallel", target=">= 1.0",
          tessera_tokens_per_s=round(speed["tokens_tessera"], 1),
          torch_tokens_per_s=round(speed["tokens_torch_sp"], 1), loss_diff=speed["loss_diff"],
          loadavg_before=load_before, loadavg_after=load_after, cpu_cores=os.cpu_count(),
          **setup)


if __name__ == "__main__":
    main()
