"""The Hugging Face front's state across train() calls and resumes, in one process."""

import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

from tessera import Trainer, TrainingArguments


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


def test_resumes_load_before_train_begins_and_once(tmp_path):
    # Checkpoints at steps 2, 4, 6, 8.
    Trainer(model=_tiny_gpt2(), args=_args(tmp_path, max_steps=8, save_steps=2),
            train_dataset=_data()).train()
    step_2 = tmp_path / "checkpoints" / "step_00000002"
    for asked in ("call", "arguments"):  # train(resume_from_checkpoint=...) or args' field
        stop = StopAt(5)
        args = _args(tmp_path / asked, max_steps=10, save_strategy="no",
                     resume_from_checkpoint=str(step_2) if asked == "arguments" else None)
        trainer = Trainer(model=_tiny_gpt2(), args=args, train_dataset=_data(),
                          callbacks=[stop])
        first = trainer.train(**({"resume_from_checkpoint": str(step_2)}
                                 if asked == "call" else {}))
        second = trainer.train()  # goes on from step 5: the checkpoint is not read again
        assert (first.first_step, first.step) == (2, 5), asked
        assert (second.first_step, second.step) == (5, 10), asked
        # on_train_begin sees the resumed step, as Hugging Face's callbacks do
        assert stop.began == [2, 5], asked
    # False asks for no resume, as in Hugging Face, whatever the arguments say
    refused = Trainer(model=_tiny_gpt2(), args=_args(
        tmp_path / "false", max_steps=3, save_strategy="no",
        resume_from_checkpoint=str(step_2)), train_dataset=_data())
    assert refused.train(resume_from_checkpoint=False).first_step == 0


def test_state_train_batch_size_is_the_strategys_micro_batch(tmp_path):
    # strategy text sets the micro-batch apart from per_device_train_batch_size (default 8)
    trainer = Trainer(model=_tiny_gpt2(), args=TrainingArguments(
        output_dir=str(tmp_path), strategy="dp=1,mbs=2,gbs=8", max_steps=1,
        save_strategy="no", disable_tqdm=True), train_dataset=_data())
    assert trainer.state.train_batch_size == 2
    trainer.train()
    trainer.save_state()
    assert json.loads((tmp_path / "trainer_state.json").read_text())["train_batch_size"] == 2
