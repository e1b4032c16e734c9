"""Hugging Face ``TrainingArguments`` as tessera runs them: the Strategy (given, "auto", or
data parallel), tessera's own arguments (schedule, intervals, epochs as whole global batches)
and the checks between the two (hf_api.py's Trainer calls :func:`translate` once, when it is
built)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import Dataset

from tessera.config import TrainingArguments as CoreArguments
from tessera.data.stream import StreamSamples
from tessera.strategy import Strategy, StrategyError
from tessera.train.auto import PIPELINE_ONLY_KEYS
from tessera.train.evaluation import check_eval_micro_batch
from tessera.train.hf_arguments import TrainingArguments, check_some_training
from tessera.train.hf_strategy import check_batch_arguments, resolve_strategy, sample_length


def translate(a: TrainingArguments, model: nn.Module, train_dataset: Dataset | None,
              eval_dataset: Dataset | None) -> tuple[CoreArguments, Strategy, int]:
    """tessera's own arguments, the Strategy and the steps of an epoch for Hugging Face
    arguments, a model and its datasets (``eval_dataset`` shapes the job without a
    ``train_dataset``).

    Raises:
        ValueError: for arguments that train nothing or evaluate no set.
        StrategyError: for batch arguments, split points or leaf modules the strategy does
            not follow.
    """
    if a.eval_strategy != "no" and eval_dataset is None:
        raise ValueError(f"eval_strategy={a.eval_strategy!r} needs an eval_dataset "
                         "(or set eval_strategy='no')")
    check_some_training(a)  # before any planning
    shaping = train_dataset if train_dataset is not None else eval_dataset
    strategy = _strategy(a, model, shaping)
    # Global batches are whole (no short last batch), so an epoch is the full batches
    # that fit: len // gbs steps (docs/training.md). A stream has no length: its epoch
    # is max_steps, as Hugging Face counts it.
    if isinstance(shaping, StreamSamples):
        if a.max_steps <= 0:
            raise ValueError("train_dataset is iterable (no length), so the number of "
                             "training steps cannot be inferred: set max_steps > 0")
        steps_per_epoch = a.max_steps
    else:
        steps_per_epoch = max(1, len(shaping) // strategy.global_batch_size)
    max_steps = a.max_steps if a.max_steps > 0 else math.ceil(
        a.num_train_epochs * steps_per_epoch)
    return _core_arguments(a, max_steps, steps_per_epoch), strategy, steps_per_epoch


def _strategy(a: TrainingArguments, model: nn.Module, shaping: Dataset) -> Strategy:
    """The run's Strategy, checked against the batch and pipeline arguments."""
    world = a.world_size  # the process group's, else torchrun's WORLD_SIZE (hf_process.py)
    planned = a.strategy is not None and a.strategy.strip() == "auto"
    strategy = resolve_strategy(a.strategy, model, world, a.per_device_train_batch_size,
                                a.gradient_accumulation_steps, a.precision,
                                seq_len=sample_length(shaping) if planned else None,
                                device="cpu" if a.use_cpu else "auto",
                                cluster_file=a.planner_cluster)
    check_batch_arguments(a, strategy)
    if "per_device_eval_batch_size" in a.model_fields_set:
        check_eval_micro_batch(a.per_device_eval_batch_size, strategy,
                               "per_device_eval_batch_size",
                               "leave it unset (evaluation then runs the training "
                               f"micro-batch, {strategy.micro_batch_size} samples)")
    for key in PIPELINE_ONLY_KEYS:
        if planned and getattr(a, key):
            raise StrategyError(f"{key} shapes the pipeline of a pp the strategy fixes: "
                                "give strategy text with pp > 1, not 'auto'")
    strategy.check_split_points(a.pipeline_split_points)
    strategy.check_leaf_modules(a.pipeline_leaf_modules)
    return strategy


def _core_arguments(a: TrainingArguments, max_steps: int, steps_per_epoch: int
                    ) -> CoreArguments:
    """tessera's own arguments for a run of ``max_steps``."""
    every = {"no": 0, "steps": None, "epoch": steps_per_epoch}
    eval_steps = every[a.eval_strategy]
    save_steps = every[a.save_strategy]
    return CoreArguments(
        output_dir=a.output_dir, max_steps=max_steps, learning_rate=a.learning_rate,
        min_lr_ratio=0.0,
        # Hugging Face's "constant" ignores warmup; "constant_with_warmup" is tessera's
        # constant schedule (a linear warmup, then the peak).
        lr_scheduler_type=a.lr_scheduler_type.removesuffix("_with_warmup"),
        warmup_steps=(0 if a.lr_scheduler_type == "constant" else
                      a.warmup_steps_of(max_steps)),
        weight_decay=a.weight_decay, adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2,
        adam_epsilon=a.adam_epsilon, max_grad_norm=a.max_grad_norm,
        average_tokens_across_devices=a.average_tokens_across_devices,
        warmup_from_zero=True,  # Hugging Face's schedules start the warm-up at lr 0
        logging_steps=a.steps_of(a.logging_steps, max_steps),
        eval_steps=(a.steps_of(a.eval_steps or a.logging_steps, max_steps)
                    if eval_steps is None else eval_steps),
        save_steps=(a.steps_of(a.save_steps, max_steps) if save_steps is None
                    else save_steps), seed=a.seed,
        progress="off" if a.disable_tqdm else "auto",
        device="cpu" if a.use_cpu else "auto",
        stage_memory_budget=a.stage_memory_budget,
        pipeline_split_points=a.pipeline_split_points,
        pipeline_leaf_modules=a.pipeline_leaf_modules,
        eval_batches=0,  # Hugging Face evaluates the whole set
        eval_micro_batch_size=(a.per_device_eval_batch_size
                               if "per_device_eval_batch_size" in a.model_fields_set else 0),
        save_total_limit=a.save_total_limit or 0, save_final=a.save_strategy != "no",
        write_metrics="jsonl" in ([a.report_to] if isinstance(a.report_to, str)
                                  else a.report_to or []))


def seed_everything(seed: int) -> None:
    """Seed torch (every device), numpy and random, as Hugging Face's ``set_seed``."""
    import random

    random.seed(seed)
    torch.manual_seed(seed)  # all devices, CUDA included
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)
