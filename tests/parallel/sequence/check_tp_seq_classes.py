"""By-hand check (not collected by pytest): every model class sp x tp lays out, with and
without Megatron sequence parallelism inside each sp rank, equals one device.

One 4-process launch: sp=2 x tp=2, ring and ulysses, tp_seq off and on, on the reference
models and the Hugging Face classes tensor parallelism has a policy for (built at tiny
Llama's shape by ``tests/parallel/tensor/tp_checks.build``). For each: one forward and
backward through ``tessera.parallel.parallelize`` against one device on the same batch; the
mean of the sp ranks' losses and every gradient (sp-averaged, tp shards gathered) compared.
A class that sequence parallelism refuses (Gemma 2's logit soft-capping) must be refused
alike with tp_seq on and off. The suite runs the Trainer on a few of these combinations
(``test_sp_compositions.py``); this covers the classes, in about 2 minutes:

    OMP_NUM_THREADS=1 .venv/bin/python tests/parallel/sequence/check_tp_seq_classes.py

Tolerances, fp32: losses 2e-5 absolute, gradients 1e-5 relative to the largest (only the
order of sums differs, as in test_tp_layers.py and test_sp_compositions.py). It prints one
line a case and exits non-zero when any case is off or refused one way only.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tensor"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tp_checks  # noqa: E402
from test_sp_compositions import gaps_to_one_device  # noqa: E402

from tessera.mesh import Mesh  # noqa: E402
from tessera.parallel import parallelize  # noqa: E402
from tessera.parallel.plan import default_forward_loss  # noqa: E402
from tessera.strategy import Strategy  # noqa: E402
from tessera.testing import run_distributed  # noqa: E402

LOSS_TOL, GRAD_TOL = 2e-5, 1e-5


def kinds() -> tuple[str, ...]:
    """The reference models, HF GPT-2 and Llama, and the classes of test_tp_layers'
    LLAMA_LAYOUT (Llama's layout and the policies derived from it or of their own)."""
    from test_tp_layers import LLAMA_LAYOUT

    return ("ref-gpt", "ref-llama", "hf-gpt2", "hf-llama", *LLAMA_LAYOUT)


def one_case(kind: str, strategy: Strategy, mesh: Mesh) -> tuple[float, float]:
    """(|mean sp loss - one device's|, largest gradient difference / largest gradient)."""
    single = tp_checks.build(kind)
    model = copy.deepcopy(single)
    data = tp_checks.batch()
    ref = default_forward_loss(single, data)
    ref.backward()
    plan = parallelize(model, strategy, mesh)
    if (strategy.tp_seq == "on") != ("tp_sequence_parallel" in plan.features):
        raise AssertionError(f"tp_seq={strategy.tp_seq} but features {plan.features}")
    loss = plan.forward_loss(plan.module, data)
    loss.backward()  # gradients averaged over sp as they complete (ShardGradSync)
    return gaps_to_one_device(model, single, loss, ref, mesh)


def work(rank: int, world_size: int) -> dict:
    out = {}
    for mode in ("ring", "ulysses"):
        base = Strategy(tp=2, sp=2, sp_mode=mode, micro_batch_size=tp_checks.B,
                        global_batch_size=tp_checks.B)
        mesh = Mesh(base, "cpu")
        for kind in kinds():
            for tp_seq in ("off", "on"):
                try:
                    out[kind, mode, tp_seq] = one_case(kind, base.replace(tp_seq=tp_seq), mesh)
                except Exception as err:  # a refusal: compared between tp_seq off and on
                    out[kind, mode, tp_seq] = f"{type(err).__name__}: {str(err)[:100]}"
    return out


def main() -> int:
    results = run_distributed(work, 4, timeout=1800)[0]
    failed = 0
    for (kind, mode, tp_seq), got in results.items():
        if isinstance(got, str):
            other = results[kind, mode, "off" if tp_seq == "on" else "on"]
            ok = isinstance(other, str)  # refused both ways
        else:
            ok = got[0] <= LOSS_TOL and got[1] <= GRAD_TOL
        failed += not ok
        print(f"{'ok ' if ok else 'BAD'} {kind:18s} {mode:8s} tp_seq={tp_seq:3s} {got}")
    print(f"{len(results) - failed} of {len(results)} cases ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
