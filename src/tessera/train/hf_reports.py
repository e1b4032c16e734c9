"""What a Hugging Face training script reads and writes after ``train()`` and ``evaluate()``.

Scripts in the style of transformers' examples (``run_clm.py``) do::

    result = trainer.train()
    metrics = result.metrics
    trainer.log_metrics("train", metrics); trainer.save_metrics("train", metrics)
    trainer.save_state()

:class:`TrainOutput` is the core's :class:`~tessera.train.trainer.TrainResult` with Hugging
Face's ``global_step``, ``training_loss`` and ``metrics``; the rest are the files and lines
those calls produce (``{split}_results.json``, ``all_results.json``, ``trainer_state.json``).
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.train.checkpoint import write_text_durably
from tessera.train.trainer import TrainResult


@dataclass
class TrainOutput(TrainResult):
    """The run's :class:`TrainResult`, plus Hugging Face's ``TrainOutput`` fields.

    Attributes:
        global_step: steps completed in total (as ``step``).
        training_loss: mean per-step training loss of this ``train()`` call.
        metrics: ``train_runtime`` (s), ``train_samples_per_second``,
            ``train_steps_per_second``, ``train_loss`` and ``epoch``, over this call.
    """

    global_step: int = 0
    training_loss: float = math.nan
    metrics: dict[str, float] = field(default_factory=dict)

    def __iter__(self):
        """``global_step, training_loss, metrics = trainer.train()``, as Hugging Face's
        NamedTuple unpacks."""
        return iter((self.global_step, self.training_loss, self.metrics))

    def __getitem__(self, index: int):
        return tuple(self)[index]


def train_output(result: TrainResult, runtime_s: float, global_batch: int,
                 steps_per_epoch: int) -> TrainOutput:
    """``result`` with Hugging Face's fields, for a call that ran from step
    ``result.first_step`` (after its resume) to ``result.step``, taking ``runtime_s`` seconds
    in all, of ``global_batch`` samples a step. No step run (a resume at the last step): a
    loss of 0, as Hugging Face's 0 / max(steps, 0.001)."""
    steps_run = result.step - result.first_step
    loss = sum(result.losses) / len(result.losses) if result.losses else 0.0
    runtime = max(runtime_s, 1e-9)
    metrics = {"train_runtime": round(runtime_s, 4),
               "train_samples_per_second": round(steps_run * global_batch / runtime, 3),
               "train_steps_per_second": round(steps_run / runtime, 3),
               "train_loss": loss,
               "epoch": round(result.step / steps_per_epoch, 4)}
    fields = {name: getattr(result, name) for name in TrainResult.__dataclass_fields__}
    return TrainOutput(**fields, global_step=result.step, training_loss=loss,
                       metrics=metrics)


def _shown(key: str, value: Any) -> str:
    """A metric as Hugging Face's log_metrics shows it: runtimes as h:mm:ss.ss, other
    floats to 4 decimals."""
    if "_runtime" in key and isinstance(value, (int, float)):
        # Whole seconds and hundredths, each truncated (rounding would show 59.999 s as
        # 0:00:60.00)
        whole = int(value)
        hundredths = int((float(value) - whole) * 100)
        return f"{datetime.timedelta(seconds=whole)}.{hundredths:02d}"  # 1 day, 0:00:00.25
    return str(round(value, 4)) if isinstance(value, float) else str(value)


def format_metrics(split: str, metrics: dict[str, Any]) -> str:
    """The lines ``log_metrics`` prints: a header, then ``key = value`` aligned, sorted."""
    shown = {key: _shown(key, value) for key, value in metrics.items()}
    key_width = max((len(k) for k in shown), default=0)
    value_width = max((len(v) for v in shown.values()), default=0)
    lines = [f"***** {split} metrics *****"]
    lines += [f"  {key:<{key_width}} = {shown[key]:>{value_width}}" for key in sorted(shown)]
    return "\n".join(lines)


def write_metrics(output_dir: str | Path, split: str, metrics: dict[str, Any],
                  combined: bool = True) -> Path:
    """Write ``{split}_results.json``; with ``combined``, merge into ``all_results.json``.

    Raises:
        ValueError: for a metric that is not a JSON number, string or bool (named).
    """
    for key, value in metrics.items():
        if not isinstance(value, (int, float, str, bool)) and value is not None:
            raise ValueError(f"metric {key!r} is a {type(value).__name__}: save_metrics "
                             "writes JSON numbers, strings and booleans")
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{split}_results.json"
    write_text_durably(path, json.dumps(metrics, indent=4, sort_keys=True) + "\n")
    if combined:
        everything = folder / "all_results.json"
        merged = json.loads(everything.read_text()) if everything.exists() else {}
        merged.update(metrics)
        write_text_durably(everything, json.dumps(merged, indent=4, sort_keys=True) + "\n")
    return path


# TrainerState fields written by save_state (Hugging Face's trainer_state.json names).
STATE_FIELDS = ("global_step", "max_steps", "epoch", "num_train_epochs", "logging_steps",
                "eval_steps", "save_steps", "train_batch_size", "best_metric",
                "best_model_checkpoint", "is_world_process_zero", "is_local_process_zero",
                "log_history")


def write_state(output_dir: str | Path, state: Any) -> Path:
    """Write ``trainer_state.json``: the state's Hugging Face fields."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "trainer_state.json"
    write_text_durably(path, json.dumps({name: getattr(state, name) for name in STATE_FIELDS},
                                        indent=2, sort_keys=True) + "\n")
    return path
