"""What Hugging Face-style callbacks see and may ask for in tessera's Trainer front: the
events fired, ``TrainerState`` and ``TrainerControl`` (hf_api.py fires them)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tessera.config import TrainingArguments as CoreArguments
    from tessera.train.hf_arguments import TrainingArguments


# The Hugging Face callback events this Trainer fires (all with args, state, control).
SUPPORTED_EVENTS = ("on_init_end", "on_train_begin", "on_log", "on_evaluate", "on_save",
                    "on_train_end")
# Events it does not fire (and, when transformers is installed, any other its
# TrainerCallback defines).
_UNFIRED_EVENTS = ("on_epoch_begin", "on_epoch_end", "on_step_begin", "on_step_end",
                   "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step",
                   "on_prediction_step", "on_predict", "on_push_begin")


def check_callback_events(callback: Any) -> None:
    """Refuse a callback that defines an event this Trainer never fires (it would be
    silently ignored). A Hugging Face ``TrainerCallback`` defines every event as a no-op:
    only the ones its class overrides count.

    Raises:
        ValueError: naming the callback, the events and the ones fired.
    """
    base = _hf_base_callback()
    defined = {name for name in vars(base) if name.startswith("on_")} if base else set()
    unsupported = []
    for event in sorted((defined | set(_UNFIRED_EVENTS)) - set(SUPPORTED_EVENTS)):
        method = getattr(type(callback), event, None)
        if method is not None and (base is None or method is not getattr(base, event, None)):
            unsupported.append(event)
    if unsupported:
        raise ValueError(f"{type(callback).__name__} handles {', '.join(unsupported)}, which "
                         f"tessera's Trainer does not fire (it fires "
                         f"{', '.join(SUPPORTED_EVENTS)}): move that logic to one of those")


def _hf_base_callback():
    try:
        from transformers import TrainerCallback
    except ImportError:
        return None
    return TrainerCallback


class TrainerState:
    """What callbacks see (Hugging Face's names): step counters, the run's settings, the
    log history (every rank), and which process this is."""

    def __init__(self) -> None:
        self.global_step = 0
        self.max_steps = 0
        self.epoch = 0.0
        self.num_train_epochs = 0.0
        self.logging_steps = self.eval_steps = self.save_steps = 0
        self.train_batch_size = 0
        self.best_metric = self.best_model_checkpoint = None  # no best-model tracking
        self.is_world_process_zero = self.is_local_process_zero = True
        self.log_history: list[dict[str, Any]] = []

    def describe(self, core: CoreArguments, args: TrainingArguments,
                 steps_per_epoch: int, micro_batch_size: int) -> None:
        """The run's settings, as the core Trainer will run them (epochs as Hugging Face
        counts them when max_steps decides: the epochs those steps start; the batch of one
        device's forward is the strategy's micro-batch, which strategy text or "auto" may
        set apart from ``per_device_train_batch_size``)."""
        self.max_steps, self.logging_steps = core.max_steps, core.logging_steps
        self.eval_steps, self.save_steps = core.eval_steps, core.save_steps
        self.num_train_epochs = (math.ceil(args.num_train_epochs) if args.max_steps <= 0
                                 else math.ceil(core.max_steps / steps_per_epoch))
        self.train_batch_size = micro_batch_size


class TrainerControl:
    """What callbacks may ask for: ``should_training_stop`` pauses with a checkpoint.
    Hugging Face's other flags are refused when set, not ignored."""

    __slots__ = ("should_training_stop",)

    def __init__(self) -> None:
        self.should_training_stop = False

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.__slots__:
            raise AttributeError(f"TrainerControl.{name} is not supported by tessera's "
                                 "Trainer (it acts on should_training_stop only)")
        object.__setattr__(self, name, value)
