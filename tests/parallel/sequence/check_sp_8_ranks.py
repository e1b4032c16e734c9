"""By-hand check (not collected by pytest): 8-rank sp compositions train like one device.

dp=2 x sp=2 x pp=2 (ring; rsa with full recompute), dp=2 x sp=2 x tp=2 (ring) and
sp=2 x tp=2 x pp=2 (ring; ulysses), 5 Trainer steps each.

The suite runs four of these five for 3 steps in one 8-process launch
(``test_sp_compositions.py``, which also compares gradient norms). This script adds the
ring under sp=2 x tp=2 x pp=2 and the longer runs; it takes about 1.5 minutes on a lightly
loaded machine, 3-4 minutes under load:

    OMP_NUM_THREADS=1 .venv/bin/python tests/parallel/sequence/check_sp_8_ranks.py

It prints the loss differences and exits non-zero when any exceeds the tolerance (fp32,
2e-5: only the order of sums differs, as in the suite's parity tests).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tessera.testing import run_distributed

# The spawned workers re-run this file's top level, so they find test_sp_training.py too.
sys.path.insert(0, str(Path(__file__).parent))
import test_sp_training  # noqa: E402

RUNS = {"gpt_dp2_sp2_pp2_ring": ("gpt", "dp=2,sp=2,pp=2,mbs=2,gbs=8"),
        "llama_dp2_sp2_pp2_rsa_recompute": ("llama", "dp=2,sp=2,pp=2,mbs=2,gbs=8,sp_mode=rsa,"
                                                      "recompute=full"),
        "gpt_dp2_sp2_tp2_ring": ("gpt", "dp=2,tp=2,sp=2,mbs=4,gbs=8"),
        "gpt_sp2_tp2_pp2_ring": ("gpt", "dp=1,tp=2,sp=2,pp=2,mbs=4,gbs=8"),
        "llama_sp2_tp2_pp2_ulysses": ("llama", "dp=1,tp=2,sp=2,pp=2,mbs=4,gbs=8,"
                                               "sp_mode=ulysses")}
TOLERANCE = 2e-5


def main() -> int:
    runs = test_sp_training._runs
    root = tempfile.mkdtemp(prefix="sp_8_ranks_")
    models = {model for model, _ in RUNS.values()}
    base = run_distributed(runs, 1, args=(root, {m: (m, "dp=1,mbs=8,gbs=8") for m in models}),
                           timeout=600)[0]
    results = run_distributed(runs, 8, args=(root, RUNS), timeout=900)
    worst, steps_ok = 0.0, True
    for name, (model, _) in RUNS.items():
        losses = results[0][name]["losses"]
        assert all(r[name]["losses"] == losses for r in results), f"{name}: ranks disagree"
        diffs = [abs(a - b) for a, b in zip(losses, base[model]["losses"])]
        steps_ok &= len(diffs) == 5 and losses[-1] < losses[0]
        worst = max(worst, *diffs)
        print(f"{name}: features={results[0][name]['features']} "
              f"max |loss - one device| = {max(diffs):.2e} over {len(diffs)} steps")
    print(f"worst {worst:.2e} (tolerance {TOLERANCE})")
    return 0 if worst <= TOLERANCE and steps_ok else 1


if __name__ == "__main__":
    sys.exit(main())
