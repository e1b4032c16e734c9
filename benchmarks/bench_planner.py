"""Planner benchmark: planning speed, accuracy at scale, and accuracy on this machine.

Prints one JSON line per figure: {"name", "value", "unit", "compared_against"}.

1. plan_time_175b_1024_s: search for GPT-3 175B on 1,024 A100-80GB (128 nodes of 8), with the
   candidate counts before and after pruning.
2. Accuracy at scale: predicted TFLOP/s per GPU against published measured runs (the table and
   its sources are in docs/planner.md and in PUBLISHED below).
3. Local validation: ``tessera profile`` measures this machine, then plain PyTorch training steps
   (tessera.models.Transformer, AdamW, torch DDP over gloo with 1, 2 and 4 CPU processes,
   OMP_NUM_THREADS=1) are timed and compared with the simulator's prediction for the same
   data-parallel strategy. local_best_pick_gap: for each (model, global batch) the strategy with
   the lowest predicted time is looked up among the measured ones and its measured time divided
   by the measured fastest.

Usage: python benchmarks/bench_planner.py [--quick] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from tessera.models.config import ModelConfig  # noqa: E402
from tessera.planner import estimate, search  # noqa: E402
from tessera.planner.published import SOURCES, validate_published  # noqa: E402
from tessera.strategy import Strategy  # noqa: E402


def emit(name: str, value, unit: str, compared_against: str, **extra) -> None:
    print(json.dumps({"name": name, "value": value, "unit": unit,
                      "compared_against": compared_against, **extra}), flush=True)


# ------------------------------------------------------------------------------ planning time
def bench_plan_time() -> None:
    start = time.perf_counter()
    result = search("gpt3-175b", "a100-80gb:8x128", 1536, top_k=10)
    elapsed = time.perf_counter() - start
    emit("plan_time_175b_1024_s", round(elapsed, 3), "s", "target <= 5 s (issue 7)",
         candidates_before_pruning=result.candidates_total,
         candidates_priced=result.candidates_evaluated, pruned=result.pruned,
         best=result.best.strategy.to_text(), best_step_time_s=round(result.best.step_time, 3),
         best_mfu=round(result.best.mfu, 4))


# ---------------------------------------------------------------------------- at-scale accuracy
def bench_published() -> None:
    rows = validate_published()
    for row in rows:
        emit(f"published/{row['name']}", round(row["predicted"], 1), "TFLOP/s/GPU (model FLOPs)",
             f"measured {row['measured']:.1f} ({SOURCES[row['source']]})",
             error=round(row["error"], 4), gpus=row["gpus"], strategy=row["strategy"],
             fits=row["fits"], memory_gib=round(row["memory_gib"], 1))
    errors = [abs(r["error"]) for r in rows]
    emit("published_mean_abs_error", round(statistics.mean(errors), 4), "fraction",
         f"{len(errors)} published large runs; target <= 0.15",
         max_abs_error=round(max(errors), 4))


# ---------------------------------------------------------------------------- local validation
def local_configs(quick: bool) -> list[dict]:
    """Data-parallel runs of the reference model: model shape, world size, mbs, gbs."""
    models = {
        "gpt-l2-d128": dict(n_layers=2, d_model=128, n_heads=4, vocab_size=256, max_seq_len=128),
        "gpt-l4-d256": dict(n_layers=4, d_model=256, n_heads=8, vocab_size=256, max_seq_len=128),
        "llama-l4-d256": dict(n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, vocab_size=512,
                              max_seq_len=256, norm="rmsnorm", activation="swiglu",
                              position="rope", tie_embeddings=False, bias=False),
    }
    plan = [("gpt-l2-d128", 8, (8, 4, 2, 1)), ("gpt-l4-d256", 8, (8, 4, 2, 1)),
            ("llama-l4-d256", 4, (4, 2, 1))]
    if quick:
        plan = [("gpt-l2-d128", 8, (4, 2)), ("gpt-l4-d256", 8, (4, 1)),
                ("llama-l4-d256", 4, (1,))]
    out = []
    for name, gbs, mbs_list in plan:
        for world in (1, 2, 4):
            for mbs in mbs_list:
                if gbs % (mbs * world) == 0:
                    out.append(dict(model=name, config=models[name], world=world, mbs=mbs,
                                    gbs=gbs))
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _train_worker(rank: int, world: int, port: int, configs: list[dict], steps: int,
                  out_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tessera.models import Transformer

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    times = []
    for index, cfg in enumerate(configs):
        torch.manual_seed(index)
        config = ModelConfig(**cfg["config"])
        model = Transformer(config)
        if world > 1:
            model = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        accum = cfg["gbs"] // (cfg["mbs"] * world)
        seq = config.max_seq_len
        data = torch.randint(0, config.vocab_size, (accum, cfg["mbs"], seq + 1))
        per_step = []
        for step in range(steps + 2):
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            for micro in range(accum):
                batch = data[micro]
                sync = world == 1 or micro == accum - 1
                ctx = model.no_sync() if not sync else _nullcontext()
                with ctx:
                    logits = model(batch[:, :-1])
                    loss = torch.nn.functional.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
                    (loss / accum).backward()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start])
            if world > 1:
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= 2:  # two warm-up steps
                per_step.append(float(elapsed))
        # The minimum: the machine may be shared, and other load only ever adds time.
        times.append(min(per_step))
    if rank == 0:
        with open(os.path.join(out_dir, f"times_{world}.json"), "w") as handle:
            json.dump(times, handle)
    if world > 1:
        dist.destroy_process_group()


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def measure_local(configs: list[dict], steps: int) -> list[float]:
    """Measured median step time of each config (each world size in one set of processes)."""
    import torch.multiprocessing as mp

    measured: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in sorted({c["world"] for c in configs}):
            idx = [i for i, c in enumerate(configs) if c["world"] == world]
            subset = [configs[i] for i in idx]
            mp.spawn(_train_worker, args=(world, _free_port(), subset, steps, tmp),
                     nprocs=world, join=True)
            with open(os.path.join(tmp, f"times_{world}.json")) as handle:
                for i, t in zip(idx, json.load(handle)):
                    measured[i] = t
    return [measured[i] for i in range(len(configs))]


def bench_local(quick: bool, out_dir: str | None) -> None:
    from tessera.planner.cluster import save_cluster
    from tessera.planner.profile import profile_cluster

    start = time.perf_counter()
    cluster = profile_cluster(workers=4, quick=quick)
    profile_s = time.perf_counter() - start
    if out_dir:
        save_cluster(cluster, os.path.join(out_dir, "local_cluster.yaml"))
    configs = local_configs(quick)
    measured = measure_local(configs, steps=4 if quick else 6)
    rows = []
    for cfg, meas in zip(configs, measured):
        model = ModelConfig(**cfg["config"])
        s = Strategy(dp=cfg["world"], micro_batch_size=cfg["mbs"], global_batch_size=cfg["gbs"])
        pred = estimate(model, cluster.with_devices(cfg["world"], 1), s).step_time
        rows.append(dict(model=cfg["model"], strategy=s.to_text(), measured_s=meas,
                         predicted_s=pred, error=(pred - meas) / meas))
        emit(f"local/{cfg['model']}/{s.to_text()}", round(pred, 4), "s predicted step",
             f"measured {meas:.4f} s (torch DDP, gloo, {cfg['world']} CPU processes)",
             error=round((pred - meas) / meas, 4))
    errors = [abs(r["error"]) for r in rows]
    emit("local_mean_abs_error", round(statistics.mean(errors), 4), "fraction",
         f"{len(rows)} data-parallel configs measured here; target <= 0.10",
         max_abs_error=round(max(errors), 4), profile_s=round(profile_s, 1))
    gaps = []
    for key in sorted({(r["model"], r["strategy"].split("gbs=")[1]) for r in rows}):
        group = [r for r in rows if (r["model"], r["strategy"].split("gbs=")[1]) == key]
        pick = min(group, key=lambda r: r["predicted_s"])
        best = min(group, key=lambda r: r["measured_s"])
        gaps.append(pick["measured_s"] / best["measured_s"])
        emit(f"local_pick/{key[0]}", round(pick["measured_s"] / best["measured_s"], 4),
             "ratio", f"picked {pick['strategy']}, measured fastest {best['strategy']}")
    emit("local_best_pick_gap", round(max(gaps), 4), "ratio (worst group)",
         "measured fastest of the same model and batch; target <= 1.05",
         mean_gap=round(statistics.mean(gaps), 4))
    if out_dir:
        with open(os.path.join(out_dir, "local_rows.json"), "w") as handle:
            json.dump(rows, handle, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer configs (< 3 minutes)")
    parser.add_argument("--out-dir", default=None, help="also write rows and the profile here")
    parser.add_argument("--skip-local", action="store_true", help="no local measurement")
    args = parser.parse_args()
    bench_plan_time()
    bench_published()
    if not args.skip_local:
        bench_local(args.quick, args.out_dir)


if __name__ == "__main__":
    main()
