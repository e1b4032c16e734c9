"""What a Hugging Face training script reads off ``TrainingArguments`` about its process.

transformers' ``run_clm.py`` (and scripts like it) set up logging, name the device and guard
dataset preprocessing with these before they build the Trainer: ``should_log``,
``get_process_log_level()``, ``local_rank``, ``device``, ``n_gpu``, ``parallel_mode``,
``world_size``, ``process_index``, ``main_process_first()``, ``train_batch_size``,
``to_dict()``. They read torchrun's environment (one process per device, as tessera runs);
only ``main_process_first`` with several processes starts the process group, which the
Trainer then uses as it finds it.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
from typing import Any, Iterator

import torch


PREPROCESS_TIMEOUT_S = 1800.0


class ParallelMode(enum.Enum):
    """Hugging Face's names for how the processes of a run are laid out (tessera: one
    process per device, distributed when there are several)."""

    NOT_PARALLEL = "not_parallel"
    DISTRIBUTED = "distributed"


class ProcessView:
    """Properties of the running process, under Hugging Face ``TrainingArguments``' names.

    Mixed into tessera's :class:`~tessera.train.hf_arguments.TrainingArguments`; reads
    ``use_cpu``, ``per_device_train_batch_size`` and ``per_device_eval_batch_size``.
    """

    @property
    def world_size(self) -> int:
        """Processes in the run (torchrun's ``WORLD_SIZE``; 1 alone)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size()
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def process_index(self) -> int:
        """This process's global rank."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return int(os.environ.get("RANK", "0"))

    @property
    def local_process_index(self) -> int:
        """This process's rank on its machine."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def local_rank(self) -> int:
        """``LOCAL_RANK`` under torchrun, -1 alone (as Hugging Face's)."""
        return int(os.environ.get("LOCAL_RANK", "-1"))

    @property
    def should_log(self) -> bool:
        """Whether this process logs: the first on each machine (Hugging Face's default)."""
        return self.local_process_index == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes files: global rank 0 (Hugging Face's default)."""
        return self.process_index == 0

    def get_process_log_level(self) -> int:
        """The ``logging`` level for this process: transformers' current verbosity where
        the process logs (Hugging Face's "passive" default), WARNING on the others."""
        if not self.should_log:
            return logging.WARNING
        try:
            from transformers.utils import logging as hf_logging
        except ImportError:
            return logging.getLogger().getEffectiveLevel()
        return hf_logging.get_verbosity()

    @property
    def device(self) -> torch.device:
        """The device this process trains on: its CUDA device under torchrun's local rank,
        else the CPU (``use_cpu``, or no GPU)."""
        if self.use_cpu or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", max(0, self.local_rank))

    @property
    def n_gpu(self) -> int:
        """GPUs this process drives: 1 on CUDA (one process per device), else 0."""
        return 1 if self.device.type == "cuda" else 0

    @property
    def parallel_mode(self) -> Any:
        """DISTRIBUTED with several processes, else NOT_PARALLEL: transformers'
        ``ParallelMode`` when installed (scripts compare against it), else tessera's."""
        try:
            from transformers.training_args import ParallelMode as HfParallelMode
        except ImportError:
            HfParallelMode = ParallelMode
        return (HfParallelMode.DISTRIBUTED if self.world_size > 1
                else HfParallelMode.NOT_PARALLEL)

    @property
    def train_batch_size(self) -> int:
        """Samples of one process's forward in training (one device per process): the
        strategy text's micro-batch (its ``mbs``, or its ``gbs`` over the accumulation steps
        and dp), else ``per_device_train_batch_size``. Under ``strategy="auto"`` the planner
        picks it when the Trainer is built: ``trainer.state.train_batch_size`` then says."""
        text = self.strategy
        if text is None or text.strip() == "auto":
            return self.per_device_train_batch_size
        # Imported here: hf_strategy imports the arguments class this mixin is part of.
        from tessera.train.hf_strategy import batch_from_arguments

        values = batch_from_arguments(text, self.per_device_train_batch_size,
                                      self.gradient_accumulation_steps)
        try:
            return int(values.get("micro_batch_size", self.per_device_train_batch_size))
        except ValueError:  # not a number: the Trainer refuses the text, naming the field
            return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        """Samples of one process's forward in evaluation: ``per_device_eval_batch_size``
        when given, else the training micro-batch (what tessera's evaluation runs)."""
        if "per_device_eval_batch_size" in self.model_fields_set:
            return self.per_device_eval_batch_size
        return self.train_batch_size

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """Run the block on the main process first (dataset preprocessing that caches), the
        others after it, as Hugging Face's. ``local``: the first process of each machine
        goes first; else global rank 0. With several processes this starts the process group
        (gloo on CPU, NCCL on CUDA) if nothing has yet, its collectives timing out after
        1800 s (Hugging Face's ``ddp_timeout``; the Trainer then runs on that group)."""
        if self.world_size == 1:
            yield
            return
        from tessera.distributed import init_distributed

        # The others wait in a barrier while the main process preprocesses: Hugging Face's
        # ddp_timeout (1800 s), not tessera's 600 s for a training collective.
        init_distributed("cpu" if self.device.type == "cpu" else "cuda",
                         timeout_s=PREPROCESS_TIMEOUT_S)
        first = self.local_process_index == 0 if local else self.process_index == 0
        if not first:
            torch.distributed.barrier()  # wait for the main process's pass over ``desc``
        try:
            yield
        finally:
            if first:
                torch.distributed.barrier()  # let the others run it, from its cache

    def to_dict(self) -> dict[str, Any]:
        """Every argument by name (JSON-ready values)."""
        return self.model_dump(mode="json")

    def to_json_string(self) -> str:
        """``to_dict()`` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)
