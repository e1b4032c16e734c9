"""The reshard matrix: a checkpoint saved under each strategy resumes under every other one.

Seven strategies over world sizes 1, 2 and 4 (single device, dp=2, tp=2 1d, tp=4 2d (2x2),
pp=2, sp=2 ring, chunk memory under dp=2 ZeRO) each train 3 of 5 steps and save. Then every
strategy loads every other's checkpoint and trains steps 4 and 5 (42 pairs). Step 4's loss
checks the model weights; step 5's loss also checks the optimizer state, because the update
between them is AdamW's, which reads the moments (m, v) and the step count saved at step 3.
Five launches in all (world 1 save, world 2 save, world 4 save and load, world 2 load,
world 1 load); within a launch one Trainer per target strategy resumes each source in turn,
as a fresh one would: a resume replaces model, optimizer, schedule, step and data position.

The same launches check the safetensors export and import (``train.init_from``): the tp=4 2d
model at step 3 is exported, then imported under sp=2 (ring) and on a single device; all three
evaluate the same held-out batches to the same loss (same tolerance).

Tolerance 2e-5 absolute on losses of about 5 (fp32), the sequence-parallel parity tests'
bound: each strategy computes the same sums in another order (tensor-parallel partial sums,
the ring's online softmax, ZeRO's reduce-scatter, DDP's bucketed all-reduce), which moves
losses by rounding only (measured: at most 4.8e-7 over the 42 pairs), while a lost or
mis-mapped tensor moves them by far more (asserted below: a resume whose AdamW moments are
dropped misses step 5's loss by over 50x the tolerance (measured 0.09), and a fresh model's
evaluation misses the exported one's likewise (0.77)).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.run import build_datasets, build_model, build_tokenizer
from tessera.testing import run_distributed, tiny_run_config
from tessera.train.checkpoint import find_latest
from tessera.train.export import save_full_model
from tessera.train.trainer import Trainer

TOLERANCE = 2e-5
EXPORTER, IMPORTERS = "tp4_2d", ("single", "sp2_ring")
STEPS, SAVED_AT = 5, 3
CHUNK_MEMORY = {"placement": "auto", "chunk_size": 20000, "device_budget": 1_500_000}
# name: (world size, strategy text, memory section or None)
STRATEGIES = {
    "single": (1, "dp=1,mbs=4,gbs=8", None),
    "dp2": (2, "dp=2,mbs=4,gbs=8", None),
    "tp2": (2, "dp=1,tp=2,mbs=4,gbs=8", None),
    "pp2": (2, "dp=1,pp=2,mbs=2,gbs=8", None),
    "sp2_ring": (2, "dp=1,sp=2,mbs=4,gbs=8", None),
    "chunk_dp2": (2, "dp=2,mbs=4,gbs=8,memory=chunk,offload=cpu", CHUNK_MEMORY),
    "tp4_2d": (4, "dp=1,tp=4,tp_mode=2d,mbs=4,gbs=8", None),
}


def _trainer(out: Path, name: str, datasets, **train) -> Trainer:
    _, text, memory = STRATEGIES[name]
    config = tiny_run_config(out, text, train={"max_steps": STEPS, **train},
                             **({"memory": memory} if memory else {}))
    return Trainer(build_model(config), config.train, datasets[0], datasets[1],
                   strategy=config.strategy, memory=config.memory)


def _datasets():
    config = tiny_run_config("unused")
    return build_datasets(config, build_tokenizer(config))


def _save_and_load(rank, world_size, root, save, load):
    """Save under this world size's strategies, then resume every source under them."""
    root, datasets, out = Path(root), _datasets(), {}
    names = [name for name, (world, _, _) in STRATEGIES.items() if world == world_size]
    if save and world_size == 1:
        out["straight"] = _trainer(root / "straight", "single", datasets).train().losses
    for name in names if save else ():
        trainer = _trainer(root / "saved" / name, name, datasets)
        out[name] = trainer.train(until_step=SAVED_AT).losses
        if name == EXPORTER:
            out["exported_eval"] = trainer.evaluate()
            save_full_model(trainer, root / "exported")
    for target in names if load else ():
        trainer = _trainer(root / "loaded" / target, target, datasets)
        for source in STRATEGIES:
            if source != target:
                trainer.args.resume_from = str(_saved(root, source))
                out[(source, target)] = trainer.train().losses
    for name in set(names) & set(IMPORTERS) if load else ():
        trainer = _trainer(root / "imported" / name, name, datasets,
                           init_from=str(root / "exported"))
        out[f"imported_eval_{name}"] = trainer.evaluate()
        out[f"imported_{name}"] = trainer.train().losses
    if load and world_size == 1:
        out["fresh_eval"] = _trainer(root / "fresh", "single", datasets).evaluate()
    if load and world_size == 1:  # the negative control: a resume with AdamW's state dropped
        trainer = _trainer(root / "control", "single", datasets)
        trainer.args.resume_from = str(_saved(root, "dp2"))
        trainer.resume()
        trainer.optimizer.state.clear()
        trainer.args.resume_from = None
        out["moments_dropped"] = trainer.train().losses
    return out


def _saved(root: Path, name: str) -> Path:
    return find_latest(root / "saved" / name / "checkpoints")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    results = {}
    # Every source is saved before any load: world 4 loads right after saving.
    for world, save, load in ((1, True, False), (2, True, False), (4, True, True),
                              (2, False, True), (1, False, True)):
        results.update(run_distributed(_save_and_load, world_size=world,
                                       args=(root, save, load), timeout=400)[0])
    saved = {k: v for k, v in results.items() if not isinstance(k, tuple)}
    return saved, {k: v for k, v in results.items() if isinstance(k, tuple)}


def test_every_strategy_trains_like_one_device_before_saving(matrix):
    saved, _ = matrix
    straight = saved["straight"]
    for name in STRATEGIES:
        assert saved[name] == pytest.approx(straight[:SAVED_AT], abs=TOLERANCE), name


def test_every_checkpoint_resumes_under_every_other_strategy(matrix):
    saved, loaded = matrix
    expected = saved["straight"][SAVED_AT:]
    pairs = [(s, t) for t in STRATEGIES for s in STRATEGIES if s != t]
    assert sorted(loaded) == sorted(pairs)
    wrong = {pair: loaded[pair] for pair in pairs
             if loaded[pair] != pytest.approx(expected, abs=TOLERANCE)}
    assert not wrong, f"expected steps 4-5 losses {expected}, got {wrong}"


def test_the_optimizer_state_is_what_step_five_checks(matrix):
    saved, _ = matrix
    dropped = saved["moments_dropped"]
    expected = saved["straight"][SAVED_AT:]
    assert dropped[0] == pytest.approx(expected[0], abs=TOLERANCE)  # same weights at step 4
    assert abs(dropped[1] - expected[1]) > 50 * TOLERANCE  # other moments: another step 5


def test_a_safetensors_export_starts_a_run_under_another_strategy(matrix):
    saved, _ = matrix
    exported = saved["exported_eval"]
    assert abs(saved["fresh_eval"] - exported) > 50 * TOLERANCE  # the import changes weights
    for name in IMPORTERS:
        assert saved[f"imported_eval_{name}"] == pytest.approx(exported, abs=TOLERANCE), name
    # A fresh optimizer from the same weights: both importers train alike.
    single, ring = (saved[f"imported_{name}"] for name in IMPORTERS)
    assert len(single) == STEPS and single == pytest.approx(ring, abs=TOLERANCE)
