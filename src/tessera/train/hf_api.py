"""A Trainer with the Hugging Face Trainer's interface, on tessera's runtime.

A Hugging Face training script changes in two lines::

    from tessera import Trainer, TrainingArguments      # was: from transformers import ...
                                                        # (HfArgumentParser too: hf_parser.py)
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=8,
                             strategy="auto")           # added: how to lay the job out
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                      data_collator=collator, callbacks=[...])
    result = trainer.train(); trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics); trainer.save_state()
    trainer.evaluate(); trainer.save_model()

and runs under ``torchrun --nproc-per-node N script.py`` (or alone, as one worker).

Labels follow Hugging Face's convention: ``labels`` (or ``input_ids`` when absent) line up with
the inputs and the model predicts position t+1 from t. tessera's own datasets hold labels
already shifted; batches from any other dataset are shifted here, which gives exactly the loss
a Hugging Face model computes internally.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import nn
from torch.utils.data import Dataset

from tessera.train.checkpoint import checkpoint_root, find_latest
from tessera.train.trainer import Trainer as CoreTrainer
from tessera.train.hf_card import model_card, write_model_card
from tessera.train.hf_callbacks import TrainerControl, TrainerState, check_callback_events
from tessera.train.hf_data import hf_collator, labels_shifted, model_columns, readable
from tessera.train.hf_arguments import TrainingArguments
from tessera.train.hf_eval import Evaluations, eval_sets, first_set
from tessera.train.hf_overrides import check_overrides
from tessera.train.hf_translate import seed_everything, translate
from tessera.train.hf_reports import (TrainOutput, format_metrics, train_output,
                                      write_metrics, write_state)


class Trainer:
    """Hugging Face-style front for :class:`tessera.train.trainer.Trainer`.

    Args:
        model: any causal LM returning logits or an output with ``.logits``.
        args: :class:`TrainingArguments`.
        train_dataset: map-style dataset of ``{"input_ids", ["labels"], ["attention_mask"]}``,
            or an iterable one (read in order; needs ``max_steps``, docs/training.md); None
            for a Trainer that only evaluates (``train()`` is then refused).
        eval_dataset: same kind, or a dict of named sets, optional (required without a
            train_dataset); an iterable one is read once into memory.
        data_collator: pads/stacks samples into a batch (as in Hugging Face).
        callbacks: Hugging Face-style callback objects or plain functions of a record. The
            events fired are ``SUPPORTED_EVENTS``; a callback defining another is refused,
            as is a control flag other than ``should_training_stop``.
        processing_class: the tokenizer (or processor), kept with the model: ``save_model``
            writes it beside the weights when it has ``save_pretrained``, as Hugging Face.
        compute_metrics, preprocess_logits_for_metrics, optimizers: taken so that scripts
            passing Hugging Face's defaults (None, (None, None)) run; anything else is
            refused, naming it (``evaluate()`` computes ``eval_loss`` only, and the optimizer
            is built by the layout: chunk memory's HybridAdam, sharded states).

    Arguments after ``args`` are keyword-only: Hugging Face's positional order differs.
    Sample keys the model's forward does not take (a ``text`` column) are dropped, as
    Hugging Face's ``remove_unused_columns`` does; ``args.seed`` seeds torch, numpy and
    random here, as Hugging Face's Trainer does.
    """

    def __init__(self, model: nn.Module, args: TrainingArguments | None = None, *,
                 train_dataset: Dataset | None = None, eval_dataset: Dataset | None = None,
                 data_collator: Callable[[list], dict] | None = None,
                 callbacks: Sequence[Any] | None = None, processing_class: Any = None,
                 compute_metrics: Callable | None = None,
                 preprocess_logits_for_metrics: Callable | None = None,
                 optimizers: tuple[Any, Any] = (None, None)) -> None:
        if train_dataset is None and eval_dataset is None:
            raise ValueError("Trainer needs a train_dataset or an eval_dataset (without a "
                             "train_dataset it can evaluate but not train)")
        refuse_unsupported(compute_metrics=compute_metrics,
                           preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                           optimizers=None if optimizers == (None, None) else optimizers)
        self.args = check_arguments_type(args) or TrainingArguments()
        check_overrides(type(self), Trainer, self.args)
        seed_everything(self.args.seed)
        self.state = TrainerState()
        self.control = TrainerControl()
        self._trained = False  # train() has run (args.resume_from_checkpoint is spent)
        self.processing_class = processing_class
        # A callback class is instantiated, as Hugging Face does.
        callbacks = [c() if isinstance(c, type) else c for c in callbacks or ()]
        self._hf_callbacks: list[Any] = []
        for callback in (c for c in callbacks if not callable(c)):
            check_callback_events(callback)
            self._hf_callbacks.append(callback)
        plain = [c for c in callbacks if callable(c)]
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset  # as given
        train_dataset = readable("train_dataset", train_dataset, training=True)  # in order
        named = eval_sets(eval_dataset)  # a dict: each set evaluated under eval_<name>
        eval_dataset = named if named is not None else readable("eval_dataset", eval_dataset)
        single = first_set(eval_dataset)  # shapes the job when there is no train_dataset
        self._core_args, strategy, self._steps_per_epoch = translate(self.args, model,
                                                                     train_dataset, single)
        self._translated = self.args.model_dump()  # what the layout and core were built from
        self.state.describe(self._core_args, self.args, self._steps_per_epoch,
                            strategy.micro_batch_size)
        reference = train_dataset if train_dataset is not None else single
        shifted = labels_shifted(reference)
        for other in (named or {"": single}).values():
            labels_shifted(reference, other)  # one kind of labels throughout
        # before layouts wrap model.forward
        collator = hf_collator(data_collator, not shifted, model_columns(model))
        self._core = CoreTrainer(model, self._core_args, train_dataset, single,
                                 strategy=strategy, callbacks=plain, data_collator=collator)
        self._evaluations = Evaluations(self._core, named, reference)
        self._core.evaluations = self._evaluations.during_training
        # Hugging Face fires every event on every process (callbacks that write check
        # state.is_world_process_zero); the core's records and saves reach every rank.
        self._core.record_hooks.append(self._dispatch)
        self._core.save_callbacks.append(self._saved)
        self.model = self._core.model
        self.state.is_world_process_zero = self._core.ctx.is_main
        self.state.is_local_process_zero = self._core.ctx.local_rank == 0
        self._each("on_init_end")

    # ------------------------------------------------------------------------------- API
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train; ``resume_from_checkpoint`` is a checkpoint folder or True (the newest).

        Returns tessera's :class:`TrainResult` with Hugging Face's ``global_step``,
        ``training_loss`` and ``metrics`` (``train_runtime``, ``train_samples_per_second``,
        ``train_steps_per_second``, ``train_loss``, ``epoch``) of this call.

        Raises:
            ValueError: for True when ``output_dir`` holds no checkpoint (as Hugging Face).
        """
        if self._core.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset (this one was built "
                             "with eval_dataset only)")
        self._check_args_unchanged("train()")
        # args.resume_from_checkpoint is for the first call: a later train() (after a
        # callback's stop) goes on from the steps trained, not from that checkpoint again.
        # False asks for no resume, as in Hugging Face; None falls back on the arguments.
        resume = (resume_from_checkpoint if resume_from_checkpoint is not None
                  else None if self._trained else self.args.resume_from_checkpoint)
        if resume is True and find_latest(checkpoint_root(self.args.output_dir)) is None:
            raise ValueError(f"resume_from_checkpoint=True: no valid checkpoint found in "
                             f"{self.args.output_dir}")
        if resume:  # loaded before on_train_begin, so callbacks see the resumed step (as HF)
            self._core.args = self._core.args.model_copy(update={
                "resume_from": None if resume is True else str(resume)})
            self._core.resume()
        self._check_steps_left()
        self._trained = True
        # What was asked of this call only: the core trainer resumes nothing by itself.
        self._core.args = self._core.args.model_copy(update={"resume": False,
                                                             "resume_from": None})
        self.state.global_step = self._core.step
        self.state.epoch = self._epoch_at(self._core.step)
        # A stop asked for in an earlier train() does not end this one (as Hugging Face).
        self.control.should_training_stop = self._core.stop_requested = False
        self._each("on_train_begin")
        started = time.perf_counter()
        result = self._core.train()
        output = train_output(result, time.perf_counter() - started,
                              self._core.strategy.global_batch_size, self._steps_per_epoch)
        self.state.global_step = result.step
        self.log(dict(output.metrics))  # the run's closing log entry, as Hugging Face's
        self._each("on_train_end")
        return output

    def evaluate(self, eval_dataset: Dataset | dict[str, Dataset] | str | None = None,
                 ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
                 ) -> dict[str, float]:
        """``{prefix}_loss`` over the whole evaluation set, each sample once (all ranks call
        it), in micro-batches of ``per_device_eval_batch_size`` when set (pp=1), with
        ``{prefix}_runtime``, ``_samples_per_second`` and ``_steps_per_second``; logged as
        Hugging Face logs it (``on_log``, then ``on_evaluate``, on every rank).

        ``eval_dataset``: another set than the Trainer's (of the same kind), a dict of them,
        or the name of one of the Trainer's when its ``eval_dataset`` is a dict. Each set of
        a dict is evaluated and logged under ``{metric_key_prefix}_{name}``, as Hugging
        Face's. ``ignore_keys`` (output keys to leave out of predictions) has nothing to act
        on: only the loss is computed.
        """
        self._check_args_unchanged("evaluate()")
        metrics: dict[str, float] = {}
        for prefix, dataset in self._evaluations.plan(eval_dataset, metric_key_prefix):
            these = self._evaluations.metrics(dataset, prefix)
            self.log(these)  # adds the epoch, as Hugging Face's
            self._each("on_evaluate", metrics=these)
            metrics.update(these)
        return metrics

    def save_model(self, output_dir: str | None = None) -> Path:
        """Write the full (unsharded) weights for ``from_pretrained`` or reloading."""
        from tessera.train.export import save_full_model

        folder = save_full_model(self._core, Path(output_dir or self.args.output_dir))
        if self._core.ctx.is_main and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(folder)
        return folder

    def create_model_card(self, language: Any = None, license: Any = None, tags: Any = None,
                          model_name: str | None = None, finetuned_from: Any = None,
                          tasks: Any = None, dataset_tags: Any = None, dataset: Any = None,
                          dataset_args: Any = None) -> Path | None:
        """Write ``README.md`` in ``output_dir`` (rank 0), as Hugging Face's: Hub metadata
        from these keywords, the layout, hyperparameters, logged losses and versions.
        Returns its path (None on other ranks)."""
        if not self.is_world_process_zero():
            return None
        text = model_card(
            Path(self.args.output_dir).name, self.args, self.state,
            self._core.strategy.to_text(),
            is_transformers_model=type(self.model).__module__.startswith("transformers."),
            language=language, license=license, tags=tags, model_name=model_name,
            finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags,
            dataset=dataset, dataset_args=dataset_args)
        return write_model_card(self.args.output_dir, text)

    def add_callback(self, callback: Any) -> None:
        """Add a Hugging Face-style callback (a class is instantiated; refused, naming it,
        when it handles an event this Trainer never fires) or a plain function of a record."""
        callback = callback() if isinstance(callback, type) else callback
        if callable(callback):
            self._core.callbacks.append(callback)
            return
        check_callback_events(callback)
        self._hf_callbacks.append(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove a callback (an instance, or the first instance of a class) and return it;
        None when there is none."""
        for found in self._hf_callbacks + self._core.callbacks:
            if found is callback or (isinstance(callback, type) and isinstance(found, callback)):
                owner = self._hf_callbacks if found in self._hf_callbacks else self._core.callbacks
                owner.remove(found)
                return found
        return None

    def remove_callback(self, callback: Any) -> None:
        """Remove a callback (an instance, or the first instance of a class).

        Raises:
            ValueError: for an instance this Trainer does not hold (as Hugging Face's).
        """
        if self.pop_callback(callback) is None and not isinstance(callback, type):
            raise ValueError(f"{type(callback).__name__} is not one of this Trainer's callbacks")

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Log ``logs`` (every rank, as Hugging Face's): the epoch is added, the record with
        the step goes to ``state.log_history``, and callbacks' ``on_log`` see it. Training
        and evaluation logs go through here, so a subclass overriding ``log`` sees them all.
        (``start_time``: Hugging Face's speed metrics for it are not computed here.)"""
        logs["epoch"] = self.state.epoch  # in place, as Hugging Face's (on_evaluate sees it)
        record = {**logs, "step": self.state.global_step}
        self.state.log_history.append(record)
        self._each("on_log", logs=record)  # with the step, as the training logs here

    def is_world_process_zero(self) -> bool:
        """Whether this is the process that logs and saves (global rank 0)."""
        return self._core.ctx.is_main

    def is_local_process_zero(self) -> bool:
        """Whether this is the first process on its machine."""
        return self._core.ctx.local_rank == 0

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print ``metrics`` under a ``***** {split} metrics *****`` header (rank 0)."""
        if self.is_world_process_zero():
            print(format_metrics(split, metrics), flush=True)

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """Write ``{split}_results.json`` in ``output_dir`` and, with ``combined``, merge the
        metrics into ``all_results.json`` (rank 0)."""
        if self.is_world_process_zero():
            write_metrics(self.args.output_dir, split, metrics, combined)

    def save_state(self) -> None:
        """Write ``trainer_state.json`` (step counters and log history) in ``output_dir``
        (rank 0)."""
        if self.is_world_process_zero():
            write_state(self.args.output_dir, self.state)

    # --------------------------------------------------------------------------- helpers
    def _check_args_unchanged(self, call: str) -> None:
        """Refuse ``trainer.args`` changed after the Trainer was built: the layout, optimizer,
        schedule and intervals were made from them then, so a change would be ignored
        (``resume_from_checkpoint`` is read by each ``train()``, and the script flags
        ``do_*`` by no one)."""
        now = self.args.model_dump()
        changed = [k for k, v in now.items() if v != self._translated.get(k)
                   and k not in _READ_LATER]
        if changed:
            was = ", ".join(f"{k}={self._translated.get(k)!r} -> {now[k]!r}" for k in changed)
            raise ValueError(
                f"{call}: trainer.args changed after the Trainer was built ({was}); tessera "
                "lays out the job from the arguments once, when the Trainer is built: build a "
                "new Trainer with them (resume_from_checkpoint=True goes on from this one's "
                "checkpoints)")

    def _check_steps_left(self) -> None:
        """Refuse a second ``train()`` with no step left: where Hugging Face's Trainer would
        run ``max_steps`` again with a fresh schedule (its optimizer kept), tessera's goes on
        with the run it has (after a callback's stop), so a finished one would train
        nothing. A first call resuming at the last step trains nothing and returns, as
        Hugging Face's (a finished script run again, a restart after the final save)."""
        if self._trained and self._core.step >= self._core_args.max_steps:
            raise ValueError(
                f"train(): this Trainer has trained all its {self._core_args.max_steps} steps "
                "(max_steps, or num_train_epochs); to train on, build a new Trainer with a "
                "larger max_steps and resume_from_checkpoint=True (the schedule then spans "
                "the new total), or with the model as it is now for a fresh run")

    def _saved(self, _path: Path) -> None:
        self.state.global_step = self._core.step  # saves need not fall on logging steps
        self.state.epoch = self._epoch_at(self._core.step)
        self._each("on_save")

    def _epoch_at(self, step: int) -> float:
        """Hugging Face's fractional epoch after ``step`` steps."""
        return round(step / self._steps_per_epoch, 4)

    def _dispatch(self, record: dict[str, Any]) -> None:
        # Hugging Face's names: its logs say learning_rate where tessera's records say lr.
        logs = {("learning_rate" if k == "lr" else k): v for k, v in record.items()}
        self.state.global_step = logs.pop("step")
        self.state.epoch = self._epoch_at(self.state.global_step)
        logs.pop("epoch", None)
        self.log(logs)  # evaluations too, then on_evaluate, as HF does
        if any(key.startswith("eval_") for key in record):  # an evaluation's metrics
            self._each("on_evaluate", metrics=logs)

    def _each(self, hook: str, **kwargs: Any) -> None:
        # What Hugging Face's CallbackHandler passes with every event; tessera feeds batches
        # from its own sample order, so there are no dataloaders to pass (None).
        core = getattr(self, "_core", None)
        kwargs = {"model": self.model, "processing_class": self.processing_class,
                  "optimizer": getattr(core, "optimizer", None),
                  "lr_scheduler": getattr(core, "scheduler", None),
                  "train_dataloader": None, "eval_dataloader": None, **kwargs}
        for callback in self._hf_callbacks:
            method = getattr(callback, hook, None)
            if method is None:
                continue
            try:
                result = method(self.args, self.state, self.control, **kwargs)
            except AttributeError as err:
                if not any(err.obj is o for o in (self.args, self.state, self.control)):
                    raise
                raise ValueError(
                    f"{type(callback).__name__}.{hook} reads {type(err.obj).__name__}."
                    f"{err.name}, which tessera's Trainer does not have (e.g. best-model "
                    "tracking, load_best_model_at_end, is not supported)") from err
            if isinstance(result, TrainerControl):
                self.control = result
        if self.control.should_training_stop and core is not None:
            core.stop_requested = True  # seen at the next step the core agrees on a stop


# TrainingArguments read when they are used, not when the Trainer is built: changing them
# on trainer.args between calls is taken (resume_from_checkpoint) or acts on nothing here.
_READ_LATER = frozenset({"resume_from_checkpoint", "do_train", "do_eval", "do_predict",
                         "overwrite_output_dir"})


def check_arguments_type(args: Any) -> TrainingArguments | None:
    """Refuse arguments of another class (a script half-migrated, still building
    ``transformers.TrainingArguments``), naming the class to use.

    Raises:
        TypeError: for anything but tessera's TrainingArguments or None.
    """
    if args is None or isinstance(args, TrainingArguments):
        return args
    kind = f"{type(args).__module__}.{type(args).__name__}"
    raise TypeError(f"args is a {kind}: tessera's Trainer takes tessera.TrainingArguments "
                    "(Hugging Face's names, plus strategy): import TrainingArguments from "
                    "tessera")


# Why each Hugging Face Trainer argument tessera takes only at its default is not supported.
_UNSUPPORTED = {
    "compute_metrics": "evaluate() computes eval_loss only: logits are not gathered across "
                       "the layouts that shard them (vocabulary, sequence, pipeline stages)",
    "preprocess_logits_for_metrics": "evaluate() computes eval_loss only (no logits kept)",
    "optimizers": "the optimizer and scheduler are built by the layout (sharded states, "
                  "chunk memory's HybridAdam); set learning_rate, weight_decay, adam_* and "
                  "lr_scheduler_type instead",
}


def refuse_unsupported(**given: Any) -> None:
    """Refuse Hugging Face Trainer arguments tessera does not act on, when set.

    Raises:
        ValueError: naming the argument and why.
    """
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"{name} is not supported by tessera's Trainer: {_UNSUPPORTED[name]}")
