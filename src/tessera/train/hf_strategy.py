"""The Strategy of a Hugging Face-style run: strategy text, "auto" or data parallelism, and
the batch arguments (``per_device_train_batch_size``, ``gradient_accumulation_steps``)
reconciled with it."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from torch.utils.data import Dataset

from tessera.strategy import Strategy, StrategyError, text_values
from tessera.train.hf_arguments import TrainingArguments


def check_batch_arguments(args: TrainingArguments, strategy: Strategy) -> None:
    """Refuse batch arguments set explicitly that the run would not follow: with strategy
    text the strategy's mbs and gbs decide the batch. (``per_device_eval_batch_size`` is
    the core's ``eval_micro_batch_size``, which refuses what the layout cannot run.)

    Raises:
        StrategyError: naming the argument, its value and the strategy's.
    """
    given = args.model_fields_set
    if args.strategy is None or args.strategy.strip() == "auto":
        return  # the batch comes from these arguments
    checks = [("per_device_train_batch_size", strategy.micro_batch_size,
               "the strategy's mbs decides it"),
              ("gradient_accumulation_steps", strategy.grad_accum_steps,
               "the strategy's gbs / (mbs x dp) decides it")]
    for name, expected, why in checks:
        if name in given and getattr(args, name) != expected:
            raise StrategyError(
                f"{name}={getattr(args, name)} disagrees with strategy "
                f"{strategy.to_text()} ({why}: {expected}); leave {name} unset or set it "
                f"to {expected}")


def resolve_strategy(text: str | None, model: nn.Module, world: int, per_device: int,
                     accumulation: int, precision: str, seq_len: int | None = None,
                     device: str = "auto", cluster_file: str | None = None) -> Strategy:
    """The Strategy for a run: given text, "auto" (planned at ``seq_len`` tokens, default
    the model's position count, for ``device`` as ``local_cluster`` reads it, or for the
    devices ``cluster_file`` describes), or data parallel over ``world``."""
    gbs = per_device * accumulation * world
    if cluster_file is not None and (text is None or text.strip() != "auto"):
        raise StrategyError(f"planner_cluster is what strategy='auto' plans for; with "
                            f"strategy {text!r} nothing reads it: set strategy='auto' or "
                            "leave it out")
    if text is None:
        strategy = Strategy(dp=world, micro_batch_size=per_device, global_batch_size=gbs,
                            precision=precision)
    elif text.strip().startswith("auto,"):
        raise StrategyError(f"strategy {text!r}: fields held after 'auto' are read by "
                            "tessera train's config only; here give 'auto' alone (the batch "
                            "comes from the arguments, precision from the bf16/fp16 flags) "
                            "or the whole strategy text")
    elif text.strip() == "auto":
        from tessera.train.auto import plan_strategy

        strategy = plan_strategy(model, world, gbs, precision, seq_len, device, cluster_file)
    else:
        values = batch_from_arguments(text, per_device, accumulation)
        # Text that leaves precision out takes the bf16/fp16 flags, as it takes mbs and gbs.
        values.setdefault("precision", precision)
        strategy = Strategy.from_mapping(values)
        if precision != "fp32" and strategy.precision != precision:
            raise StrategyError(f"strategy says precision={strategy.precision} but the "
                                f"arguments ask for {precision} (bf16/fp16 flags): add "
                                f"precision={precision} to the strategy text")
    return strategy.validate_for(world_size=world)


def batch_from_arguments(text: str, per_device: int, accumulation: int) -> dict[str, Any]:
    """Strategy ``text`` as fields, where a left-out ``mbs`` or ``gbs`` comes from Hugging
    Face's batch identity, gbs = mbs x ``gradient_accumulation_steps`` x dp, with mbs =
    ``per_device_train_batch_size`` when the text gives neither (the Strategy's own
    defaults, 1 and 1, would silently train one sample per step).

    Raises:
        StrategyError: for a gbs that the accumulation steps and dp do not divide.
    """
    values: dict[str, Any] = text_values(text)
    given = {"micro_batch_size", "global_batch_size"} & set(values)
    try:
        dp = int(values.get("dp", 1))
        mbs = int(values.get("micro_batch_size", per_device))
        gbs = int(values["global_batch_size"]) if "global_batch_size" in given else None
    except ValueError:  # from_mapping refuses the value, naming its field
        return values
    if given == {"global_batch_size"}:
        if gbs % (accumulation * dp):
            raise StrategyError(
                f"strategy {text!r} gives gbs={gbs} without mbs: mbs = gbs / "
                f"(gradient_accumulation_steps={accumulation} x dp={dp}) is not whole; add "
                "mbs to the text")
        values["micro_batch_size"] = gbs // (accumulation * dp)
    elif "global_batch_size" not in given:
        values["micro_batch_size"] = mbs
        values["global_batch_size"] = mbs * accumulation * dp
    return values


def sample_length(dataset: Dataset) -> int | None:
    """Tokens in the dataset's first example (the length to plan for), when it says."""
    try:
        sample = dataset[0]
        ids = sample.get("input_ids") if isinstance(sample, Mapping) else sample
        shape = torch.as_tensor(ids).shape  # a list, tensor or numpy array of token ids
    except (TypeError, KeyError, IndexError, ValueError, RuntimeError):
        return None
    return int(shape[-1]) if len(shape) >= 1 and shape[-1] > 1 else None
