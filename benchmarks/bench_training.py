"""Training-step throughput and memory: tessera against plain PyTorch and torch DDP.

Prints JSON lines, one per figure: {"name", "value", "unit", "compared_against", ...}.

- single_vs_plain_torch_tokens_ratio: one worker, tessera's Trainer against a plain loop
  (same model, batches, AdamW, clipping, precision); target >= 0.95.
- dp2_vs_ddp_tokens_ratio: two workers, tessera against a torch DDP loop; target >= 0.95,
  with peak memory (max RSS per worker) no higher.

Each side runs in fresh processes (so peak RSS belongs to one side), rounds alternate
between the sides, and the best round of each counts (the least disturbed by other load).

    python benchmarks/bench_training.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from tessera.config import config_from_dict
from tessera.data.dataset import collate
from tessera.run import build_datasets, build_model, build_tokenizer
from tessera.testing import run_distributed
from tessera.train.engine import causal_lm_logits, lm_loss
from tessera.train.optim import build_optimizer
from tessera.train.trainer import Trainer


def run_config(out: str, dp: int, steps: int):
    return config_from_dict({
        "model": {"preset": "small", "max_seq_len": 128},
        "strategy": f"dp={dp},tp=1,pp=1,mbs=8,gbs={8 * dp}",
        "data": {"corpus": "stdlib", "seq_len": 128, "max_bytes": 2_000_000},
        "train": {"output_dir": out, "max_steps": steps, "warmup_steps": 2,
                  "progress": "off", "logging_steps": 1, "save_steps": 0},
    })


def _tessera_side(rank, world, out, warmup, steps):
    config = run_config(out, world, warmup + steps)
    train_ds, val_ds = build_datasets(config, build_tokenizer(config))
    trainer = Trainer(build_model(config), config.train.model_copy(update={
        "logging_steps": warmup}), train_ds, None, strategy=config.strategy)
    times = {}
    trainer.callbacks.append(lambda record: times.setdefault(record["step"], time.perf_counter()))
    trainer.train(until_step=warmup + steps)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if rank != 0:  # metrics callbacks run on rank 0 only
        return None, rss
    tokens = steps * config.strategy.global_batch_size * config.data.seq_len
    return tokens / (times[warmup + steps] - times[warmup]), rss


def _plain_side(rank, world, out, warmup, steps):
    """The loop a user writes by hand: DDP when world > 1, AdamW, clipping, no extras."""
    config = run_config(out, world, warmup + steps)
    train_ds, _ = build_datasets(config, build_tokenizer(config))
    model = build_model(config)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = build_optimizer(model, 1e-3, 0.1, (0.9, 0.95), 1e-8, torch.device("cpu"))
    mbs = config.strategy.micro_batch_size
    batches = [collate([train_ds[(s * world + rank) * mbs + i] for i in range(mbs)])
               for s in range(warmup + steps)]
    for s, batch in enumerate(batches):
        if s == warmup:
            start = time.perf_counter()
        loss = lm_loss(causal_lm_logits(model, batch["input_ids"]), batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # a user's loop reads the loss every step
    tokens = steps * mbs * world * config.data.seq_len
    return tokens / (time.perf_counter() - start), resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss


def compare(world: int, rounds: int, warmup: int, steps: int) -> dict:
    best = {"tessera": (0.0, 0), "peer": (0.0, 0)}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for side, fn in (("peer", _plain_side), ("tessera", _tessera_side)):
                out = str(Path(tmp) / f"{side}{r}")
                results = run_distributed(fn, world_size=world, args=(out, warmup, steps),
                                          timeout=900)
                tokens_per_s = results[0][0]
                rss = max(rss for _, rss in results)
                if tokens_per_s > best[side][0]:
                    best[side] = (tokens_per_s, rss)
    return best


def emit(name: str, best: dict, peer: str, target: str) -> None:
    (t_tps, t_rss), (p_tps, p_rss) = best["tessera"], best["peer"]
    print(json.dumps({"name": name, "value": round(t_tps / p_tps, 4), "unit": "ratio",
                      "compared_against": peer, "target": target,
                      "tessera_tokens_per_s": round(t_tps, 1), "peer_tokens_per_s": round(p_tps, 1),
                      "tessera_peak_rss_mib": round(t_rss / 1024, 1),
                      "peer_peak_rss_mib": round(p_rss / 1024, 1),
                      "peak_memory_ratio": round(t_rss / p_rss, 4)}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps (< 3 min)")
    args = parser.parse_args(argv)
    rounds, warmup, steps = (2, 3, 15) if args.quick else (3, 5, 40)
    emit("single_vs_plain_torch_tokens_ratio", compare(1, rounds, warmup, steps),
         "plain PyTorch loop, 1 process (small preset, seq 128, mbs 8, fp32)", ">= 0.95")
    emit("dp2_vs_ddp_tokens_ratio", compare(2, rounds, warmup, steps),
         "torch DDP loop, 2 gloo processes (small preset, seq 128, mbs 8 per rank, fp32)",
         ">= 0.95 with peak memory no higher")


if __name__ == "__main__":
    sys.exit(main())
