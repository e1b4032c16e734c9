"""By-hand check (not collected by pytest): dp=2 x 2D tp=4 (2 x 2 SUMMA grid) x pp=2 on 16
processes trains like one device.

The suite tests 2D tp x pp at tp=4 x pp=2 (8 processes, test_tp2d_pipeline.py) and 1D
dp x tp x pp at 2 x 2 x 2; with dp as well, 2D needs 16 processes, which start too slowly on
a 2-core machine for the suite (each imports torch). This script trains the reference model
and Hugging Face GPT-2 for 3 Trainer steps (1f1b, AdamW, gradient clipping) at
dp=2 x tp=4 (2d) x pp=2 and compares every rank's losses and its stage's weights (tp blocks
gathered whole) with one device's run:

    OMP_NUM_THREADS=1 .venv/bin/python tests/parallel/pipeline/check_3d_2d_16_ranks.py

Tolerances as in the suite's fp32 parity tests: losses 1e-5, weights 3e-5 (only the order of
fp32 sums differs: SUMMA's partial products, the dp average, the tied gradient's sum over pp).
It prints the differences and exits non-zero when one exceeds its tolerance.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from tessera.testing import run_distributed, tiny_trainer

STEPS = 3
MODELS = {"reference": None, "hf_gpt2": {"preset": "tiny", "hf": "gpt2"}}
STRATEGY = "dp=2,tp=4,tp_mode=2d,pp=2,mbs=2,gbs=8,schedule=1f1b"
LOSS_TOL, WEIGHT_TOL = 1e-5, 3e-5


def _train(rank: int, world: int, root: str, strategy: str) -> dict:
    out = {}
    for name, model in MODELS.items():
        sections = {"model": model} if model else {}
        trainer = tiny_trainer(Path(root) / name, strategy, STEPS, **sections)
        losses = trainer.train().losses
        state = trainer.plan.module.state_dict()  # this rank's stage under pp
        out[name] = {"losses": losses, "features": list(trainer.plan.features),
                     "params": {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
                                for k, v in state.items()}}
    return out


def _worst(run: dict, ref: dict) -> tuple[float, float]:
    loss = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))
    weight = max((v - ref["params"][k]).abs().max().item() for k, v in run["params"].items())
    return loss, weight


def main() -> int:
    root = tempfile.mkdtemp(prefix="3d_2d_16_")
    one = run_distributed(_train, 1, args=(root + "/one", "dp=1,mbs=2,gbs=8"), timeout=600)[0]
    ranks = run_distributed(_train, 16, args=(root + "/sixteen", STRATEGY), timeout=1800)
    ok = True
    for name in MODELS:
        keys = set().union(*(r[name]["params"].keys() for r in ranks))
        ok &= keys == set(one[name]["params"].keys())  # the stages together hold every weight
        worst = [_worst(r[name], one[name]) for r in ranks]
        loss, weight = max(w[0] for w in worst), max(w[1] for w in worst)
        ok &= loss <= LOSS_TOL and weight <= WEIGHT_TOL and len(ranks[0][name]["losses"]) == STEPS
        print(f"{name}: {STRATEGY} features={ranks[0][name]['features']}\n"
              f"  max |loss - one device| {loss:.2e} (tol {LOSS_TOL}), "
              f"max |weight - one device| {weight:.2e} (tol {WEIGHT_TOL}), "
              f"all weights covered: {keys == set(one[name]['params'].keys())}")
    return 0 if ok else 1


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
