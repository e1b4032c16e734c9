"""Parity and resume of the training runtime, in two multi-process launches.

Tolerances: fp32 on CPU. dp=2 averages gradients with an all-reduce, which sums in a
different order than one process does, so losses agree to rounding (1e-5 absolute on losses
of about 5), not bit for bit. Gradient accumulation likewise reorders the same sums.
A resume in the same world size replays the same operations, so it must match to 1e-6.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tessera.testing import run_distributed, train_tiny
from tessera.train.checkpoint import read_meta

FP32_PARITY = dict(rtol=0, atol=1e-5)


_train = train_tiny


class IgnoredTails(torch.utils.data.Dataset):
    """A dataset whose samples ignore a varying tail of labels (-100), as right padding does:
    sample i keeps 32 - (7 i mod 27) labels, so micro-batches hold unequal label counts."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        sample = dict(self.base[i])
        labels = sample["labels"].clone()
        cut = (7 * i) % 27
        if cut:
            labels[-cut:] = -100
        sample["labels"] = labels
        return sample


class Ragged(torch.utils.data.Dataset):
    """Samples of 12-32 tokens (sample i keeps 32 - (5 i mod 21)), for a collator that pads
    each micro-batch to its own longest sample, as Hugging Face's DataCollatorWithPadding."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        keep = 32 - (5 * i) % 21 if i else self.first
        return {key: value[:keep] for key, value in self.base[i].items()}

    first = 32  # the first sample, whose length a run plans at (Trainer._seq_len)


def pad_to_longest(samples):
    """input_ids, labels (-100 on padding) and attention_mask, padded on the right."""
    longest = max(len(s["input_ids"]) for s in samples)
    out = {"input_ids": torch.zeros(len(samples), longest, dtype=torch.long),
           "labels": torch.full((len(samples), longest), -100, dtype=torch.long),
           "attention_mask": torch.zeros(len(samples), longest, dtype=torch.long)}
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        out["input_ids"][row, :n] = sample["input_ids"]
        out["labels"][row, :n] = sample["labels"]
        out["attention_mask"][row, :n] = 1
    return out


def _train_ragged(out, strategy: str, first: int = 32, **train):
    """Five steps on :class:`Ragged` micro-batches padded each to its own longest sample
    (the first sample ``first`` tokens long): (losses, gradient norms, warnings' texts)."""
    import warnings

    from tessera.run import build_datasets, build_model, build_tokenizer
    from tessera.testing import tiny_run_config
    from tessera.train.trainer import Trainer

    config = tiny_run_config(out, strategy, train=train)
    train_ds, _ = build_datasets(config, build_tokenizer(config))
    data = Ragged(train_ds)
    data.first = first
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = Trainer(build_model(config), config.train, data,
                         strategy=config.strategy, data_collator=pad_to_longest).train()
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").open()]
    return (result.losses, [r["grad_norm"] for r in records if "grad_norm" in r],
            [str(w.message) for w in caught])


def _evaluate_with_unlabelled_samples(out):
    """(evaluate() over 6 samples of which 3 have no labels, one per micro-batch; the mean
    loss of the 3 labelled ones, computed directly)."""
    from tessera.parallel.plan import lm_loss
    from tessera.run import build_datasets, build_model, build_tokenizer
    from tessera.testing import tiny_run_config
    from tessera.train.trainer import Trainer

    config = tiny_run_config(out, "dp=1,mbs=2,gbs=2",
                             train={"eval_micro_batch_size": 1, "eval_batches": 0})
    train_ds, val_ds = build_datasets(config, build_tokenizer(config))
    samples = [dict(val_ds[i]) for i in range(6)]
    for sample in samples[1::2]:
        sample["labels"] = torch.full_like(sample["labels"], -100)
    trainer = Trainer(build_model(config), config.train, train_ds, samples,
                      strategy=config.strategy)
    with torch.no_grad():
        direct = [float(lm_loss(trainer.model(s["input_ids"][None]), s["labels"][None]))
                  for s in samples[0::2]]
    return trainer.evaluate(), sum(direct) / len(direct)


def _train_ignored_tails(out, strategy: str, **train):
    """Five steps of the tiny model on :class:`IgnoredTails`: (per-step losses, per-step
    gradient norms before clipping, from metrics.jsonl)."""
    from tessera.run import build_datasets, build_model, build_tokenizer
    from tessera.testing import tiny_run_config
    from tessera.train.trainer import Trainer

    config = tiny_run_config(out, strategy, train=train)
    train_ds, _ = build_datasets(config, build_tokenizer(config))
    result = Trainer(build_model(config), config.train, IgnoredTails(train_ds),
                     strategy=config.strategy).train()
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").open()]
    return result.losses, [r["grad_norm"] for r in records if "grad_norm" in r]


def _single_process_runs(rank, world_size, root):
    root = Path(root)
    out = {}
    out["dp1"], _ = _train(root / "dp1", "dp=1,tp=1,pp=1,mbs=8,gbs=8")
    out["accum"], _ = _train(root / "accum", "dp=1,tp=1,pp=1,mbs=4,gbs=8")
    out["recompute"], _ = _train(root / "rc", "dp=1,tp=1,pp=1,mbs=8,gbs=8,recompute=full")
    out["bf16"], _ = _train(root / "bf16", "dp=1,tp=1,pp=1,mbs=8,gbs=8,precision=bf16")
    out["fp16"], _ = _train(root / "fp16", "dp=1,tp=1,pp=1,mbs=8,gbs=8,precision=fp16")
    out["straight"], out["straight_params"] = _train(root / "straight", "dp=1,mbs=4,gbs=8",
                                                     steps=10)
    out["first_half"], _ = _train(root / "resumed", "dp=1,mbs=4,gbs=8", steps=10, until=5)
    shutil.copytree(root / "resumed", root / "resumed_dp2")
    out["second_half"], out["resumed_params"] = _train(
        root / "resumed", "dp=1,mbs=4,gbs=8", steps=10, train={"resume": True})
    # With dropout: each step's masks come from the run's seed and the step number
    # (rank_rng.step_seed), not from the generator's state after start-up.
    dropout = {"preset": "tiny", "dropout": 0.2}
    out["dropout_straight"], _ = _train(root / "d_straight", "dp=1,mbs=4,gbs=8", steps=6,
                                        model=dropout)
    out["dropout_first"], _ = _train(root / "d_resumed", "dp=1,mbs=4,gbs=8", steps=6,
                                     until=3, model=dropout)
    out["dropout_second"], _ = _train(root / "d_resumed", "dp=1,mbs=4,gbs=8", steps=6,
                                      model=dropout, train={"resume": True})
    _train(root / "resize", "dp=1,mbs=4,gbs=8", steps=10, until=4)
    resized, _ = _train(root / "resize", "dp=1,mbs=4,gbs=16", steps=10,
                        train={"resume": True, "learning_rate": 6e-3})
    out["resized_meta"] = read_meta(Path(resized.checkpoint))
    (root / "paused").mkdir()
    (root / "paused" / "PAUSE").touch()
    out["paused"], _ = _train(root / "paused", "dp=1,mbs=4,gbs=8", steps=10,
                              train={"logging_steps": 2})
    out["pause_file_left"] = (root / "paused" / "PAUSE").exists()
    for arch in ("gpt2", "llama"):
        out[arch], _ = _train(root / arch, "dp=1,mbs=8,gbs=8", steps=12,
                              model={"preset": "tiny", "hf": arch})
    out["tails_dp1"] = _train_ignored_tails(root / "tails_dp1", "dp=1,mbs=8,gbs=8")
    out["tails_accum"] = _train_ignored_tails(root / "tails_accum", "dp=1,mbs=2,gbs=8")
    out["eval_unlabelled"] = _evaluate_with_unlabelled_samples(root / "eval_unlabelled")
    out["ragged_dp1"] = _train_ragged(root / "ragged_dp1", "dp=1,mbs=8,gbs=8")
    return out


def _two_process_runs(rank, world_size, root):
    root = Path(root)
    dp2, _ = _train(root / "dp2", "dp=2,tp=1,pp=1,mbs=4,gbs=8")
    # Resume a dp=1 checkpoint on two ranks: the data order continues at the same sample.
    resumed, _ = _train(root / "resumed_dp2", "dp=2,mbs=4,gbs=8", steps=10,
                        train={"resume": True})
    tails = {name: _train_ignored_tails(root / name, text, **train) for name, text, train in (
        ("tails_dp2", "dp=2,mbs=2,gbs=8", {}),
        ("tails_pp2", "pp=2,mbs=2,gbs=8,schedule=1f1b", {}),
        ("tails_dp2_local", "dp=2,mbs=2,gbs=8", {"average_tokens_across_devices": False}))}
    ragged = _train_ragged(root / "ragged_pp2", "pp=2,mbs=2,gbs=8,schedule=1f1b")
    # A stage budget chosen at a first sample of 12 tokens, then steps of up to 32
    budgeted = _train_ragged(root / "ragged_budget", "pp=2,mbs=2,gbs=8,schedule=1f1b",
                             first=12, stage_memory_budget="1GiB")
    return {"dp2": dp2, "resumed_dp2": resumed, **tails, "ragged_pp2": ragged,
            "ragged_budget": budgeted}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("training")
    single = run_distributed(_single_process_runs, world_size=1, args=(str(root),),
                             timeout=400)[0]
    double = run_distributed(_two_process_runs, world_size=2, args=(str(root),), timeout=300)
    assert double[0]["dp2"].losses == double[1]["dp2"].losses  # every rank logs the dp mean
    return {**single, **double[0]}


def _close(a, b, **tol):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **tol)


@pytest.mark.slow
def test_dp2_equals_dp1_on_the_same_global_batch(runs):
    assert len(runs["dp1"].losses) == 5
    _close(runs["dp2"].losses, runs["dp1"].losses, **FP32_PARITY)


@pytest.mark.slow
def test_grad_accumulation_2x4_equals_1x8(runs):
    _close(runs["accum"].losses, runs["dp1"].losses, **FP32_PARITY)


@pytest.mark.slow
def test_the_loss_is_the_mean_over_all_labels_of_the_step(runs):
    """With unequal label counts per micro-batch, accumulation, dp=2 and pp=2 train as one
    micro-batch of the whole global batch does: each micro-batch is weighted by its labels
    (as Hugging Face's num_items_in_batch), not 1/n."""
    losses, norms = runs["tails_dp1"]
    assert len(losses) == len(norms) == 5
    for name in ("tails_accum", "tails_dp2", "tails_pp2"):
        _close(runs[name][0], losses, **FP32_PARITY)
        # The gradients' scale too (clipping and Adam hide it from the losses): norms of
        # about 4, reduced in another order, to 1e-4 relative.
        _close(runs[name][1], norms, rtol=1e-4, atol=0)
    # Each rank's own token mean, averaged over ranks (Hugging Face's other choice), is not
    # the global mean when the ranks hold unequal counts: the losses differ by far more than
    # the parity tolerance (about 1e-3 on losses near ln 256 from an untrained model).
    local = runs["tails_dp2_local"][0]
    assert max(abs(a - b) for a, b in zip(local, losses)) > 1e-4, (local, losses)


@pytest.mark.slow
def test_pipeline_stages_take_micro_batches_of_different_lengths(runs):
    # A step's micro-batches, each padded to its own longest sample, are padded on to one
    # length for the stages: the same training as one micro-batch of all 8 (fp32, sums in
    # another order; norms to 1e-4 relative as above).
    (losses, norms, _), (want, want_norms, _) = runs["ragged_pp2"], runs["ragged_dp1"]
    _close(losses, want, **FP32_PARITY)
    _close(norms, want_norms, rtol=1e-4, atol=0)


@pytest.mark.slow
def test_steps_longer_than_the_stage_budget_was_planned_at_are_warned_of(runs):
    # Recomputation ratios chosen at the first sample's 12 tokens, steps of up to 32: the
    # budget's estimate no longer holds, and the run says so once (not at each step).
    budget_warnings = [w for w in runs["ragged_budget"][2] if "stage_memory_budget" in w]
    assert len(budget_warnings) == 1, runs["ragged_budget"][2]
    assert "longer than the 12 that" in budget_warnings[0]
    assert not [w for w in runs["ragged_pp2"][2] if "stage_memory_budget" in w]  # no budget


@pytest.mark.slow
def test_pipeline_captures_of_new_training_lengths_are_warned_of(runs):
    # Each new length is captured and split again: said at the 2nd, 4th, ... shape, naming
    # the way out; a run of one length (the dp run has no pipeline) says nothing.
    again = [w for w in runs["ragged_pp2"][2] if "captured again" in w]
    assert again and len(again) <= 3, runs["ragged_pp2"][2]
    assert "2 training shapes so far" in again[0] and "padding='max_length'" in again[0]
    assert not [w for w in runs["ragged_dp1"][2] if "captured again" in w]


@pytest.mark.slow
def test_evaluation_leaves_out_micro_batches_without_labels(runs):
    got, want = runs["eval_unlabelled"]
    assert abs(got - want) < 1e-5, (got, want)  # fp32, the same forward: rounding only


@pytest.mark.slow
def test_recomputation_changes_nothing_but_memory(runs):
    _close(runs["recompute"].losses, runs["dp1"].losses, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_bf16_autocast_tracks_fp32(runs):
    # bf16 keeps 8 bits of mantissa: per-step losses drift from fp32 by up to ~1e-2.
    _close(runs["bf16"].losses, runs["dp1"].losses, rtol=0, atol=5e-2)


@pytest.mark.slow
def test_fp16_autocast_with_loss_scaling_tracks_fp32(runs):
    # fp16 keeps 11 bits of mantissa; the scaler may skip a step on overflow, which would show
    # as a large jump, so the bound is tight enough to catch a skipped update.
    _close(runs["fp16"].losses, runs["dp1"].losses, rtol=0, atol=2e-2)


@pytest.mark.slow
def test_resume_equals_an_uninterrupted_run(runs):
    straight, first, second = runs["straight"], runs["first_half"], runs["second_half"]
    assert second.step == 10 and len(second.losses) == 5
    _close(first.losses + second.losses, straight.losses, rtol=0, atol=1e-6)
    for name, value in runs["straight_params"].items():
        torch.testing.assert_close(runs["resumed_params"][name], value, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_resume_with_dropout_draws_the_masks_of_an_uninterrupted_run(runs):
    resumed = runs["dropout_first"].losses + runs["dropout_second"].losses
    _close(resumed, runs["dropout_straight"].losses, rtol=0, atol=1e-6)
    assert runs["dropout_straight"].losses != runs["straight"].losses[:6]  # dropout ran


@pytest.mark.slow
def test_resume_under_a_different_dp_size(runs):
    _close(runs["resumed_dp2"].losses, runs["straight"].losses[5:], **FP32_PARITY)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hugging_face_models_train(runs, arch):
    losses = runs[arch].losses
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses


@pytest.mark.slow
def test_a_pause_file_checkpoints_and_stops_at_the_first_check(runs):
    # Present before the run: seen after its first step (a check runs there, at logging,
    # evaluation and saving steps), with that step's loss logged although logging_steps=2.
    paused = runs["paused"]
    assert paused.paused and paused.step == 1 and len(paused.losses) == 1
    assert paused.checkpoint.endswith("step_00000001")
    assert not runs["pause_file_left"]  # consumed, so a resume runs on


@pytest.mark.slow
def test_resume_with_a_new_batch_size_and_learning_rate(runs):
    meta = runs["resized_meta"]
    assert meta["step"] == 10
    assert meta["samples_consumed"] == 4 * 8 + 6 * 16  # the stream went on at sample 32
    assert meta["scheduler"]["base_lrs"] == [6e-3, 6e-3]  # the resumed run's learning rate
