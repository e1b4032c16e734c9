"""Training: engine, trainer, checkpoints, metrics."""

from tessera.config import TrainingArguments
from tessera.train.trainer import Trainer, TrainResult

__all__ = ["Trainer", "TrainResult", "TrainingArguments"]
