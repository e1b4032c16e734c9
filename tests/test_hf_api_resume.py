"""The Hugging Face front's state across train() calls and resumes.

The Trainers run in one worker process (run_distributed): in the pytest process they would
leave a one-rank process group behind that later tests read as the world size.
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

from tessera import Trainer, TrainingArguments
from tessera.testing import run_distributed


def _tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1,
                                      n_head=2, use_cache=False, bos_token_id=None,
                                      eos_token_id=None))


def _data():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 64, (16,), generator=g)} for _ in range(32)]


class StopAt(TrainerCallback):
    """Records the step each train() begins at; asks to stop at ``step``."""

    def __init__(self, step):
        self.step, self.began = step, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.began.append(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _args(out, **kw):
    return TrainingArguments(output_dir=str(out), per_device_train_batch_size=4,
                             logging_steps=1, disable_tqdm=True, **kw)


def _resumes(root: Path) -> dict:
    """(first call's steps, second call's steps, steps on_train_begin saw) per way of asking,
    and the first step of train(resume_from_checkpoint=False)."""
    # Checkpoints at steps 2, 4, 6, 8.
    Trainer(model=_tiny_gpt2(), args=_args(root, max_steps=8, save_steps=2),
            train_dataset=_data()).train()
    step_2 = root / "checkpoints" / "step_00000002"
    out = {}
    for asked in ("call", "arguments"):  # train(resume_from_checkpoint=...) or args' field
        stop = StopAt(5)
        args = _args(root / asked, max_steps=10, save_strategy="no",
                     resume_from_checkpoint=str(step_2) if asked == "arguments" else None)
        trainer = Trainer(model=_tiny_gpt2(), args=args, train_dataset=_data(),
                          callbacks=[stop])
        first = trainer.train(**({"resume_from_checkpoint": str(step_2)}
                                 if asked == "call" else {}))
        second = trainer.train()  # goes on from step 5: the checkpoint is not read again
        out[asked] = ((first.first_step, first.step), (second.first_step, second.step),
                      stop.began)
    refused = Trainer(model=_tiny_gpt2(), args=_args(
        root / "false", max_steps=3, save_strategy="no",
        resume_from_checkpoint=str(step_2)), train_dataset=_data())
    out["false_first_step"] = refused.train(resume_from_checkpoint=False).first_step
    return out


def _batch_size(root: Path) -> tuple[int, int]:
    """(state.train_batch_size, the one trainer_state.json holds) under strategy text."""
    trainer = Trainer(model=_tiny_gpt2(), args=TrainingArguments(
        output_dir=str(root), strategy="dp=1,mbs=2,gbs=8", max_steps=1,
        save_strategy="no", disable_tqdm=True), train_dataset=_data())
    before = trainer.state.train_batch_size
    trainer.train()
    trainer.save_state()
    return before, json.loads((root / "trainer_state.json").read_text())["train_batch_size"]


def _runs(rank, world_size, root):
    root = Path(root)
    return {"resumes": _resumes(root / "resumes"), "batch_size": _batch_size(root / "batch")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_resume")
    return run_distributed(_runs, world_size=1, args=(str(root),), timeout=300)[0]


def test_resumes_load_before_train_begins_and_once(runs):
    for asked in ("call", "arguments"):
        first, second, began = runs["resumes"][asked]
        assert first == (2, 5), asked
        assert second == (5, 10), asked  # the second train() did not reload step 2
        assert began == [2, 5], asked  # on_train_begin sees the resumed step, as HF's
    # False asks for no resume, as in Hugging Face, whatever the arguments say
    assert runs["resumes"]["false_first_step"] == 0


def test_state_train_batch_size_is_the_strategys_micro_batch(runs):
    # strategy text sets the micro-batch apart from per_device_train_batch_size (default 8)
    assert runs["batch_size"] == (2, 2)


def _tied_gpt2():
    torch.manual_seed(0)  # no dropout: the layouts draw their masks from other streams
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2,
                                      n_head=2, use_cache=False, bos_token_id=None,
                                      eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def _across_pp(rank, world_size, root):
    """GPT-2 (lm_head tied to wte) saved at pp=2, resumed at dp=2 and back: losses of each
    resumed run, and of the run straight through at pp=2."""
    root = Path(root)

    def run(name, strategy, steps, resume=None):
        args = TrainingArguments(output_dir=str(root / name), strategy=strategy,
                                 max_steps=steps, save_steps=2, logging_steps=1,
                                 learning_rate=1e-2, lr_scheduler_type="constant",
                                 disable_tqdm=True, report_to="none")
        trainer = Trainer(model=_tied_gpt2(), args=args, train_dataset=_data())
        return trainer.train(resume_from_checkpoint=resume).losses

    straight = run("pp", "pp=2,mbs=2,gbs=8", 6)
    to_dp = run("dp", "dp=2,mbs=2,gbs=8", 4, str(root / "pp/checkpoints/step_00000002"))
    to_pp = run("pp_again", "pp=2,mbs=2,gbs=8", 6, str(root / "dp/checkpoints/step_00000004"))
    # A checkpoint as stages wrote them before 2026-11-28: parameters registered sorted, the
    # tied weight's optimizer state under "lm_head.weight".
    from tessera.parallel.pipeline import module

    in_model_order = module.StageModule.__init__
    module.StageModule.__init__ = lambda self, params, buffers: in_model_order(
        self, dict(sorted(params.items())), buffers)
    try:
        run("old", "pp=2,mbs=2,gbs=8", 2)
    finally:
        module.StageModule.__init__ = in_model_order
    old = root / "old/checkpoints/step_00000002"
    from_old = [run(f"from_old_{name}", text, 4, str(old))
                for name, text in (("pp", "pp=2,mbs=2,gbs=8"), ("dp", "dp=2,mbs=2,gbs=8"))]
    return straight, to_dp, to_pp, from_old


def test_a_tied_hugging_face_model_resumes_across_pipeline_layouts(tmp_path):
    # The tied weight's optimizer state is keyed by its first name; pipeline stages once
    # named it "lm_head.weight" (sorted) where the whole model names it
    # "transformer.wte.weight", and such resumes failed on the missing key.
    straight, to_dp, to_pp, from_old = run_distributed(
        _across_pp, world_size=2, args=(str(tmp_path),), timeout=300)[0]
    # 2e-5 on losses near 4: the layouts sum the same terms in another order (rounding,
    # measured below 1e-6). The first loss of each pair reads the restored weights, the
    # second also the AdamW moments of the update between them.
    assert to_dp == pytest.approx(straight[2:4], abs=2e-5)
    assert to_pp == pytest.approx(straight[4:6], abs=2e-5)
    # The old checkpoints load too, at pp=2 and at dp=2 (the key read under its old name).
    for losses in from_old:
        assert losses == pytest.approx(straight[2:4], abs=2e-5)
