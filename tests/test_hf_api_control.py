"""The Hugging Face front's control of a run, on one process: a stop asked for in any event,
the losses of a run stopped between logs, arguments changed after the Trainer was built, a
finished Trainer trained again, and what scripts read off TrainingArguments before training
(run_clm.py's HfArgumentParser, device, process, main_process_first)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
from transformers import TrainerCallback
from transformers import TrainingArguments as HfTrainingArguments

from tessera import HfArgumentParser, Trainer, TrainingArguments
from tessera.data.dataset import TokenDataset
from tessera.models import Transformer, preset
from tessera.train.checkpoint import step_dirname


def _data(n_tokens: int = 400) -> TokenDataset:
    return TokenDataset(np.arange(n_tokens) % 50, seq_len=16)


def _args(tmp_path, **kwargs) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path), max_steps=10, per_device_train_batch_size=2,
                logging_steps=500, save_strategy="no", learning_rate=1e-3, disable_tqdm=True)
    return TrainingArguments(**{**base, **kwargs})


class StopIn(TrainerCallback):
    """Asks to stop the first time ``event`` fires; records (event, step) of every event."""

    def __init__(self, event: str):
        self.event, self.events = event, []
        setattr(self, event, self._stop)

    def _record(self, name, state):
        self.events.append((name, state.global_step))

    def _stop(self, args, state, control, **kwargs):
        self._record(self.event, state)
        if not any(e == self.event for e, _ in self.events[:-1]):
            control.should_training_stop = True

    def on_train_begin(self, args, state, control, **kwargs):
        self._record("on_train_begin", state)

    def on_save(self, args, state, control, **kwargs):
        self._record("on_save", state)

    def on_evaluate(self, args, state, control, **kwargs):
        self._record("on_evaluate", state)


@pytest.mark.parametrize("event, kwargs, stopped_at", [
    # on_save at a step that logs nothing (logging every 500 steps): before the fix the stop
    # waited for a logging step, and with none before max_steps it was never seen.
    ("on_save", dict(save_strategy="steps", save_steps=2), 2),
    # on_train_begin: seen after the first step, as Hugging Face's loop sees it.
    ("on_train_begin", {}, 1),
    # on_evaluate at a step that is not a logging step (logs every 2, evaluates every 3).
    ("on_evaluate", dict(eval_strategy="steps", eval_steps=3, logging_steps=2), 3),
])
def test_a_stop_asked_for_in_any_event_ends_the_run_there(own_process_group, tmp_path,
                                                          event, kwargs, stopped_at):
    data = _data()
    stopper = StopIn(event)
    trainer = Trainer(model=Transformer(preset("tiny")), args=_args(tmp_path, **kwargs),
                      train_dataset=data, eval_dataset=data if "eval_strategy" in kwargs
                      else None, callbacks=[stopper])
    output = trainer.train()
    assert output.global_step == stopped_at
    assert (event, stopped_at if event != "on_train_begin" else 0) in stopper.events
    # The steps since the last log are logged when the run stops, so train_loss covers them.
    steps = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert steps[-1] == stopped_at
    assert math.isfinite(output.metrics["train_loss"])
    # A stop pauses with a checkpoint to go on from (docs/training.md).
    assert (tmp_path / "checkpoints" / step_dirname(stopped_at)).is_dir()


def test_unlogged_steps_count_in_the_loss_of_a_run_stopped_between_logs(own_process_group,
                                                                        tmp_path):
    # Stopped at step 3 by an evaluation, logging every 2 steps: Hugging Face's train_loss is
    # the mean over steps 1-3; before the fix step 3's loss was dropped.
    data = _data()
    trainer = Trainer(model=Transformer(preset("tiny")),
                      args=_args(tmp_path, eval_strategy="steps", eval_steps=3,
                                 logging_steps=2),
                      train_dataset=data, eval_dataset=data, callbacks=[StopIn("on_evaluate")])
    output = trainer.train()
    logged = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    assert [step for step, _ in logged] == [2, 3]
    # The first log is the mean of steps 1-2, the second step 3 alone: the run's mean over
    # its 3 steps weighs them so (float32 sums: 1e-6).
    expected = (2 * logged[0][1] + logged[1][1]) / 3
    assert output.metrics["train_loss"] == pytest.approx(expected, rel=1e-6)


def test_callbacks_none_as_hugging_faces_default(own_process_group, tmp_path):
    trainer = Trainer(model=Transformer(preset("tiny")), args=_args(tmp_path, max_steps=1),
                      train_dataset=_data(), callbacks=None)
    assert trainer.train().global_step == 1


def test_hugging_faces_arguments_class_is_refused_naming_tessera_s(tmp_path):
    # Built without __init__: transformers' needs accelerate, which the check does not read.
    hf_args = HfTrainingArguments.__new__(HfTrainingArguments)
    with pytest.raises(TypeError, match="args is a transformers.training_args."
                                        "TrainingArguments: .*import TrainingArguments from "
                                        "tessera"):
        Trainer(model=Transformer(preset("tiny")), args=hf_args, train_dataset=_data())


def test_arguments_changed_after_the_trainer_was_built_are_refused(own_process_group,
                                                                   tmp_path):
    trainer = Trainer(model=Transformer(preset("tiny")), args=_args(tmp_path, max_steps=2),
                      train_dataset=_data(), eval_dataset=_data())
    trainer.args.learning_rate = 0.05
    trainer.args.max_steps = 5
    with pytest.raises(ValueError, match=r"train\(\): trainer.args changed after the Trainer "
                                         r"was built \(max_steps=2 -> 5, learning_rate=0.001 "
                                         r"-> 0.05\)"):
        trainer.train()
    with pytest.raises(ValueError, match=r"evaluate\(\): trainer.args changed"):
        trainer.evaluate()
    trainer.args.learning_rate, trainer.args.max_steps = 1e-3, 2  # back as built: taken
    trainer.args.do_train = True  # a script flag the Trainer does not read
    trainer.args.resume_from_checkpoint = None  # read by each train()
    assert trainer.train().global_step == 2


def test_a_finished_trainer_trained_again_is_refused_not_run_for_nothing(own_process_group,
                                                                       tmp_path):
    trainer = Trainer(model=Transformer(preset("tiny")), args=_args(tmp_path, max_steps=2),
                      train_dataset=_data())
    trainer.train()
    with pytest.raises(ValueError, match="has trained all its 2 steps .* build a new Trainer "
                                         "with a larger max_steps and "
                                         "resume_from_checkpoint=True"):
        trainer.train()


def test_a_finished_run_resumed_by_a_new_trainer_returns_as_hugging_face_s(
        own_process_group, tmp_path):
    # A finished script run again (or restarted after its final save) resumes at the last
    # step: it trains nothing and returns, with Hugging Face's loss of 0 (0 / 0.001).
    args = _args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    Trainer(model=Transformer(preset("tiny")), args=args, train_dataset=_data()).train()
    final = tmp_path / "checkpoints" / step_dirname(2)
    written = (final / "meta.json").stat().st_mtime_ns
    saves = StopIn("on_log")  # records on_save events too
    again = Trainer(model=Transformer(preset("tiny")), args=args, train_dataset=_data(),
                    callbacks=[saves])
    output = again.train(resume_from_checkpoint=True)
    assert output.global_step == 2 and output.metrics["train_loss"] == 0.0
    # Nothing trained, nothing saved (Hugging Face saves nothing there either).
    assert (final / "meta.json").stat().st_mtime_ns == written
    assert not any(event == "on_save" for event, _ in saves.events)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None)


def test_run_clm_style_parsing_gives_tessera_arguments_with_what_was_given_as_set():
    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    model_args, args = parser.parse_args_into_dataclasses([
        "--model_name_or_path", "gpt2", "--output_dir", "out", "--do_train",
        "--per_device_train_batch_size", "4", "--max_steps", "3", "--bf16",
        "--stage_memory_budget", "12GiB", "--pipeline_split_points", "h.2", "h.4",
        "--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", "{}", "--report_to", "none",
        "--logging_steps", "0.25"])
    assert model_args.model_name_or_path == "gpt2"
    assert isinstance(args, TrainingArguments)
    assert (args.per_device_train_batch_size, args.max_steps, args.do_train, args.bf16) == (
        4, 3, True, True)
    assert args.stage_memory_budget == 12 * 2**30
    assert args.pipeline_split_points == ["h.2", "h.4"]
    assert (args.lr_scheduler_type, args.lr_scheduler_kwargs, args.logging_steps) == (
        "cosine", {}, 0.25)
    # Only what was given counts as set: batch arguments beside strategy text are checked
    # against the strategy when set (hf_strategy.check_batch_arguments), not otherwise.
    assert "gradient_accumulation_steps" not in args.model_fields_set
    assert "per_device_train_batch_size" in args.model_fields_set
    (from_dict,) = HfArgumentParser(TrainingArguments).parse_dict({"learning_rate": 0.1})
    assert from_dict.learning_rate == 0.1 and from_dict.model_fields_set == {"learning_rate"}


@pytest.mark.parametrize("flags, fragment", [
    (["--load_best_model_at_end"], "--load_best_model_at_end: load_best_model_at_end is a "
                                   "Hugging Face TrainingArguments field that tessera does "
                                   "not take"),
    (["--gradient-checkpointing"], "--gradient-checkpointing: .*add recompute=full"),
    # Text is a flag's value only for flags: "no" is a strategy name here, as in a dict.
    (["--evaluation_strategy", "no"], "--evaluation_strategy: .*renamed eval_strategy"),
    # transformers' negation of a flag defaulting to True, refused by its name.
    (["--no_dataloader_pin_memory"], "--no_dataloader_pin_memory: dataloader_pin_memory is "
                                     "a Hugging Face TrainingArguments field"),
    (["--no_such_flag", "1"], "not used by the HfArgumentParser: \\['--no_such_flag', '1'\\]"),
    (["--optim", "sgd"], "optim: only 'adamw_torch' or 'adamw_torch_fused'"),
])
def test_parsed_arguments_tessera_does_not_take_are_refused_by_name(flags, fragment):
    with pytest.raises(ValueError, match=fragment):
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(flags)


def test_hugging_face_defaults_pass_and_other_values_are_refused_in_every_form(tmp_path):
    parser = HfArgumentParser(TrainingArguments)
    # At Hugging Face's default, an argument done elsewhere asks for nothing (as in the
    # constructor); on the command line, in a dict and in a JSON file alike.
    (args,) = parser.parse_args_into_dataclasses(["--gradient_checkpointing", "false",
                                                  "--deepspeed=", "--max_steps", "3"])
    assert args.max_steps == 3
    (args,) = parser.parse_dict({"gradient_checkpointing": False, "max_steps": 4})
    assert args.max_steps == 4 and args.model_fields_set == {"max_steps"}
    config = tmp_path / "args.json"
    config.write_text('{"gradient_checkpointing": true, "max_steps": 5}')
    # Until 2026-11-28 a file (and allow_extra_keys) dropped it without a word.
    with pytest.raises(ValueError, match="gradient_checkpointing is not a tessera "
                                         "TrainingArguments field: .*recompute=full"):
        parser.parse_json_file(str(config))
    with pytest.raises(ValueError, match="load_best_model_at_end is a Hugging Face"):
        parser.parse_dict({"load_best_model_at_end": True}, allow_extra_keys=True)
    with pytest.raises(ValueError, match="deepspeed is not a tessera"):  # 0 == False, but
        parser.parse_dict({"deepspeed": 0})  # not Hugging Face's default
    # A script's own dataclass may declare a Hugging Face name: it is the script's.
    @dataclass
    class Own:
        hub_model_id: str | None = None

    own, _ = HfArgumentParser((Own, TrainingArguments)).parse_args_into_dataclasses(
        ["--hub_model_id", "me/model"])
    assert own.hub_model_id == "me/model"


def test_flags_that_default_to_true_have_their_negation_as_in_transformers():
    parser = HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--no-average-tokens-across-devices"])
    assert args.average_tokens_across_devices is False
    assert "average_tokens_across_devices" in args.model_fields_set
    (args,) = parser.parse_args_into_dataclasses([])
    assert args.average_tokens_across_devices is True and not args.model_fields_set
    # Taken at its Hugging Face default only: the negation parses, then is refused by name.
    with pytest.raises(ValueError, match="remove_unused_columns: only True"):
        parser.parse_args_into_dataclasses(["--no_remove_unused_columns"])


def test_a_wrong_choice_on_the_command_line_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
            ["--lr_scheduler_type", "polynomial"])
    assert "invalid choice: 'polynomial'" in capsys.readouterr().err


def test_what_scripts_read_about_their_process_alone(monkeypatch):
    import logging

    import torch
    from transformers.training_args import ParallelMode

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    args = TrainingArguments(use_cpu=True, per_device_train_batch_size=4)
    assert (args.world_size, args.process_index, args.local_rank) == (1, 0, -1)
    assert args.should_log and args.should_save
    assert args.device == torch.device("cpu") and args.n_gpu == 0
    assert args.parallel_mode is ParallelMode.NOT_PARALLEL  # transformers' own enum
    # Evaluation runs the training micro-batch unless per_device_eval_batch_size is given.
    assert args.train_batch_size == 4 and args.eval_batch_size == 4
    assert TrainingArguments(per_device_eval_batch_size=8).eval_batch_size == 8
    # Strategy text's micro-batch is what a process runs (not the untouched default 8).
    assert TrainingArguments(strategy="dp=1,mbs=2,gbs=8").train_batch_size == 2
    assert TrainingArguments(strategy="dp=2,gbs=8", gradient_accumulation_steps=2
                             ).train_batch_size == 2  # gbs / (accumulation x dp)
    assert TrainingArguments(strategy="auto").train_batch_size == 8  # planned later
    assert args.get_process_log_level() in (logging.DEBUG, logging.INFO, logging.WARNING,
                                            logging.ERROR, logging.CRITICAL)
    with args.main_process_first(desc="tokenizing"):  # alone: no process group needed
        assert not torch.distributed.is_initialized()
    assert args.to_dict()["per_device_train_batch_size"] == 4
    assert '"use_cpu": true' in args.to_json_string()


def test_what_scripts_read_about_their_process_under_torchrun(monkeypatch):
    import logging

    from transformers.training_args import ParallelMode

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = TrainingArguments(use_cpu=True)
    assert (args.world_size, args.process_index, args.local_rank) == (4, 3, 1)
    assert not args.should_log and not args.should_save  # not the first on its machine
    assert args.get_process_log_level() == logging.WARNING
    assert args.parallel_mode is ParallelMode.DISTRIBUTED
