"""Hugging Face-style ``TrainingArguments``: its names, what tessera takes at one value,
what it takes elsewhere (the strategy), and the refusals naming each (hf_api.py's Trainer
translates them into tessera's own arguments)."""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping

from pydantic import field_validator, model_validator

from tessera.config import _Section, parse_budget
from tessera.strategy import StrategyError
from tessera.train.hf_process import ProcessView


# Hugging Face arguments whose job is done elsewhere in tessera, and where.
MOVED_ARGUMENTS = {
    "gradient_checkpointing": "activation recomputation is part of the strategy: add "
                              "recompute=full (or a ratio) to the strategy text",
    "evaluation_strategy": "renamed eval_strategy (as in transformers 5)",
    "per_gpu_train_batch_size": "use per_device_train_batch_size",
    "deepspeed": "tessera lays the model out itself: set strategy (text or 'auto')",
    "fsdp": "tessera lays the model out itself: set strategy (text or 'auto'; memory=chunk "
            "shards parameters, gradients and optimizer states)",
}


# Hugging Face arguments tessera takes at the value that describes what it does (each is
# Hugging Face's default, kept as a field scripts and callbacks can read): any other value
# is refused, naming what tessera does instead.
AT_TESSERA_VALUE = {
    "optim": (("adamw_torch", "adamw_torch_fused"),
              "tessera trains with torch.optim.AdamW, set by adam_beta1, adam_beta2, "
              "adam_epsilon and weight_decay"),
    "optim_args": ((None, ""), "tessera's AdamW takes adam_beta1, adam_beta2, adam_epsilon "
                               "and weight_decay"),
    "lr_scheduler_kwargs": ((None, {}), "tessera's schedules take no further arguments"),
    "logging_strategy": (("steps",), "tessera logs every logging_steps steps"),
    "logging_first_step": ((False,), "tessera logs every logging_steps steps"),
    "remove_unused_columns": ((True,), "the model gets the columns its forward takes "
                                       "(and the loss its labels and masks), nothing else"),
    "label_names": ((None, ["labels"]), "the loss reads the labels column"),
    "label_smoothing_factor": ((0.0,), "tessera's loss is plain cross-entropy"),
    "dataloader_num_workers": ((0,), "tessera's loader reads samples in the training "
                                     "process"),
    "push_to_hub": ((False,), "save_model writes a folder from_pretrained reads; upload it "
                              "yourself"),
}


class TrainingArguments(_Section, ProcessView):
    """Hugging Face ``TrainingArguments`` names, plus ``strategy``, ``stage_memory_budget``,
    ``planner_cluster``, ``pipeline_split_points`` and ``pipeline_leaf_modules``; what scripts read about their
    process (``device``, ``world_size``, ``main_process_first()``, ...: hf_process.py).

    Unknown names are refused (naming the key) rather than ignored. ``max_steps=-1`` trains
    for ``num_train_epochs``. ``strategy`` is Strategy text, "auto" (the planner picks the
    fastest layout the runtime can run), or None (data parallel over all workers).
    """

    output_dir: str = "runs/trainer"
    strategy: str | None = None
    stage_memory_budget: int | None = None  # pp > 1: bytes per stage, e.g. "12GiB"
    planner_cluster: str | None = None  # strategy="auto" plans for this cluster YAML
    pipeline_split_points: list[str] | None = None  # pp > 1: modules that start stages
    pipeline_leaf_modules: list[str] | None = None  # pp > 1: modules run eagerly, uncaptured
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    num_train_epochs: float = 3.0
    max_steps: int = -1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    average_tokens_across_devices: bool = True
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    warmup_steps: float = 0  # below 1: a ratio of the training steps (transformers 5)
    warmup_ratio: float = 0.0  # transformers 4's name for that ratio
    # Below 1: a ratio of the training steps, as Hugging Face reads them (steps_of)
    logging_steps: float = 500
    eval_strategy: Literal["no", "steps", "epoch"] = "no"
    eval_steps: float | None = None
    save_strategy: Literal["no", "steps", "epoch"] = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    seed: int = 42
    bf16: bool = False
    fp16: bool = False
    report_to: str | list[str] | None = "none"  # None: none (no reporter runs here)
    resume_from_checkpoint: str | None = None
    disable_tqdm: bool = False
    use_cpu: bool = False  # train on the CPU even where CUDA is available
    # Flags Hugging Face's Trainer does not read either: scripts (run_clm.py) branch on them.
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    overwrite_output_dir: bool = False  # transformers 4 scripts' flag (its Trainer ignored it)
    # Taken at the values AT_TESSERA_VALUE names (checked there), readable as in Hugging Face
    optim: str = "adamw_torch_fused"
    optim_args: str | None = None
    lr_scheduler_kwargs: dict | None = None
    logging_strategy: str = "steps"
    logging_first_step: bool = False
    remove_unused_columns: bool = True
    label_names: list[str] | None = None
    label_smoothing_factor: float = 0.0
    dataloader_num_workers: int = 0
    push_to_hub: bool = False

    @model_validator(mode="before")
    @classmethod
    def _renamed_or_elsewhere(cls, values: Any) -> Any:
        """Hugging Face arguments tessera takes under another name or in the strategy:
        refused naming what to use; those it takes at one value (``AT_TESSERA_VALUE``):
        dropped at it, else refused naming what tessera does; other Hugging Face fields:
        refused by name (unknown names get pydantic's message)."""
        if isinstance(values, Mapping):
            values = dict(values)
            for name in MOVED_ARGUMENTS:
                # Hugging Face's own default (None, False, "") asks for nothing: dropped
                if name in values and is_hf_default(values[name]):
                    del values[name]
                elif name in values:
                    raise ValueError(not_taken(name))
            for name, (accepted, what) in AT_TESSERA_VALUE.items():
                if name not in values:
                    continue
                values[name] = _plain(values[name])  # an enum member: its text
                if values[name] not in accepted:
                    raise ValueError(f"{name}: only {_either(accepted)} (what tessera does: "
                                     f"{what})")
            _refuse_other_hf_fields(values, cls.model_fields)
        return values

    @field_validator("stage_memory_budget", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> int | None:
        return parse_budget(value)

    @field_validator("report_to")
    @classmethod
    def _only_local_reports(cls, value: str | list[str] | None) -> str | list[str] | None:
        names = [value] if isinstance(value, str) else value or []
        if any(n not in ("none", "jsonl") for n in names):
            raise ValueError("tessera writes metrics.jsonl in output_dir; other reporters "
                             "(wandb, tensorboard, ...) are not supported: use 'none'")
        return value

    @field_validator("per_device_train_batch_size", "per_device_eval_batch_size",
                     "gradient_accumulation_steps")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be >= 1")
        return value

    @field_validator("logging_steps", "eval_steps", "save_steps")
    @classmethod
    def _steps_or_ratio(cls, value: float | None) -> float | int | None:
        """A step count (an int, as Hugging Face makes it) or below 1 a ratio; 0 is
        checked against its strategy (``_intervals``)."""
        if value is not None and (value < 0 or (value > 1 and value != int(value))):
            raise ValueError("must be a whole number of steps, or in (0, 1) a ratio of the "
                             "training steps (save_strategy / eval_strategy 'no' turn saving "
                             "and evaluation off)")
        return int(value) if value is not None and (value >= 1 or value == 0) else value

    @field_validator("num_train_epochs")
    @classmethod
    def _some_epochs(cls, value: float) -> float:
        if value < 0:  # 0 only with max_steps, which overrides it (check_some_training)
            raise ValueError("must be >= 0")
        return value

    def model_post_init(self, context: Any) -> None:
        # At construction only (assignments may set max_steps after num_train_epochs=0,
        # as Hugging Face allows); the Trainer checks again.
        check_some_training(self)
        self._intervals()

    def _intervals(self) -> None:
        """0 as Hugging Face reads it: ``eval_steps`` 0 (like None) falls back to
        ``logging_steps``; ``logging_steps`` 0 and ``save_steps`` 0 under
        ``save_strategy="steps"`` name no interval and are refused."""
        if self.logging_steps == 0:
            raise ValueError("logging_steps=0: must be a whole number of steps, or in (0, 1) "
                             "a ratio of the training steps")
        if self.save_steps == 0 and self.save_strategy == "steps":
            raise ValueError("save_steps=0 with save_strategy='steps': give a number of steps "
                             "(or a ratio below 1), or save_strategy='no'")

    @field_validator("warmup_ratio")
    @classmethod
    def _a_ratio(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError("must lie in [0, 1]")
        return value

    @field_validator("warmup_steps")
    @classmethod
    def _no_negative_warmup(cls, value: float) -> float:
        if value < 0:
            raise ValueError("must be >= 0 (a step count, or below 1 a ratio of the steps)")
        return value

    @staticmethod
    def steps_of(value: float, max_steps: int) -> int:
        """An interval as Hugging Face reads ``logging_steps``, ``eval_steps`` and
        ``save_steps``: a step count, or below 1 a ratio of ``max_steps`` (rounded up)."""
        return int(value) if value >= 1 else max(1, math.ceil(max_steps * value))

    def warmup_steps_of(self, max_steps: int) -> int:
        """Warm-up steps as transformers 5 reads ``warmup_steps`` (1 or more: a count, whole
        steps; below 1: a ratio of ``max_steps``), else ``warmup_ratio`` (transformers 4)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(max_steps * (self.warmup_steps or self.warmup_ratio))

    @property
    def precision(self) -> str:
        if self.bf16 and self.fp16:
            raise StrategyError("bf16 and fp16 are both set: choose one")
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


def _plain(value: Any) -> Any:
    """An enum member's value (Hugging Face's OptimizerNames, IntervalStrategy), else as is."""
    return getattr(value, "value", value)


def _either(values: tuple) -> str:
    return " or ".join(repr(v) for v in values)


def _refuse_other_hf_fields(values: Mapping, ours: Mapping) -> None:
    """Name a Hugging Face TrainingArguments field tessera does not take (pydantic would
    only say "extra inputs are not permitted")."""
    for name in values:
        if name not in ours and name in _hf_field_names():
            raise ValueError(not_taken(name))


def not_taken(name: str) -> str:
    """Why the Hugging Face argument ``name`` is not one of tessera's."""
    if name in MOVED_ARGUMENTS:
        return f"{name} is not a tessera TrainingArguments field: {MOVED_ARGUMENTS[name]}"
    return (f"{name} is a Hugging Face TrainingArguments field that tessera does not take "
            "(docs/training.md lists the ones it does, and why the others are left out): "
            "remove it")


def screen_hf_values(values: Mapping) -> None:
    """Refuse Hugging Face arguments tessera does not take, as the constructor does: those
    done elsewhere (``MOVED_ARGUMENTS``) pass at Hugging Face's defaults (None, False, "",
    []), every other is refused by name.

    Raises:
        ValueError: naming the first refused, and what to do instead.
    """
    for name, value in values.items():
        if not (name in MOVED_ARGUMENTS and is_hf_default(value)):
            raise ValueError(not_taken(name))


def is_hf_default(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face default that asks for nothing: None, False, ""
    or [] (not 0, which equals False)."""
    return value is None or value is False or (isinstance(value, (str, list)) and not value)


def hf_bool_fields() -> set[str]:
    """Hugging Face TrainingArguments fields that are flags (``bool`` or ``bool | None``)."""
    import typing

    return {f.name for f in _hf_fields() if f.type is bool or bool in typing.get_args(f.type)}


def hf_only_fields() -> set[str]:
    """Hugging Face TrainingArguments fields tessera does not take (empty without
    transformers)."""
    return (_hf_field_names() | set(MOVED_ARGUMENTS)) - set(TrainingArguments.model_fields)


def _hf_field_names() -> set[str]:
    return {f.name for f in _hf_fields()}


def _hf_fields() -> tuple:
    """transformers' TrainingArguments fields; none without transformers (pydantic's message
    then names an unknown key)."""
    import dataclasses

    try:
        from transformers import TrainingArguments as HfArguments
    except ImportError:
        return ()
    return dataclasses.fields(HfArguments)


def check_some_training(args: TrainingArguments) -> None:
    """Refuse arguments that train nothing: ``num_train_epochs=0`` without ``max_steps``."""
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        raise ValueError("num_train_epochs=0 with max_steps unset trains nothing: set "
                         "num_train_epochs > 0 or max_steps > 0")
