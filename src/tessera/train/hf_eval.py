"""Evaluation as Hugging Face's Trainer reports it: one evaluation set or a dict of named
ones (each reported under ``eval_<name>_*``), with the loss and the speed metrics
(``*_runtime``, ``*_samples_per_second``, ``*_steps_per_second``) of each.

The core trainer evaluates the set it holds (``core.eval_dataset``); another set is swapped
in for the call and put back after it.
"""

from __future__ import annotations

import math
import time
from typing import Any

from torch.utils.data import Dataset

from tessera.data.stream import StreamList, check_same_stream, samples_digest
from tessera.train.hf_data import labels_shifted, readable


def eval_sets(eval_dataset: Any) -> dict[str, Dataset] | None:
    """The named sets of a dict ``eval_dataset`` (each checked, an iterable one read into a
    list), None for one set (checked by :func:`readable`).

    Raises:
        ValueError: for an empty dict, a name that is not a string or a set tessera
            cannot index (named).
    """
    if not isinstance(eval_dataset, dict):
        return None
    if not eval_dataset:
        raise ValueError("eval_dataset is an empty dict: give at least one named set")
    for name, dataset in eval_dataset.items():
        if not isinstance(name, str):
            raise ValueError(f"eval_dataset's keys name metrics (eval_<name>_loss): got "
                             f"{name!r}, a {type(name).__name__}")
    return {name: readable(f"eval_dataset[{name!r}]", dataset)
            for name, dataset in eval_dataset.items()}


def first_set(eval_dataset: Any) -> Dataset | None:
    """The set that stands for a dict of them where one is needed (shapes, lengths)."""
    return next(iter(eval_dataset.values())) if isinstance(eval_dataset, dict) else eval_dataset


class Evaluations:
    """Evaluates the Trainer's sets, or ones given to a call, as Hugging Face names them.

    Args:
        core: the core :class:`tessera.train.trainer.Trainer`.
        named: the named sets of a dict ``eval_dataset``, or None.
        reference: a set the others must match in kind (labels shifted or not).
    """

    def __init__(self, core: Any, named: dict[str, Dataset] | None,
                 reference: Dataset | None) -> None:
        self.core, self.named, self.reference = core, named, reference
        self._checked: set[int] = set()  # evaluation streams compared across ranks

    def during_training(self) -> list[dict[str, float]]:
        """The metrics of each of the Trainer's sets, for the core's evaluation steps."""
        return [self.metrics(dataset, prefix) for prefix, dataset in self.plan(None, "eval")]

    def plan(self, eval_dataset: Any, prefix: str) -> list[tuple[str, Dataset | None]]:
        """(prefix, set) pairs to evaluate; a None set is the core's own.

        Raises:
            ValueError: for a name ``eval_dataset`` when the Trainer's set is not a dict of
                them, or one it does not hold.
        """
        if eval_dataset is None and self.named is None:
            return [(prefix, None)]
        if isinstance(eval_dataset, str):
            if self.named is None or eval_dataset not in self.named:
                known = ", ".join(map(repr, self.named)) if self.named else "none: it is one set"
                raise ValueError(f"evaluate(eval_dataset={eval_dataset!r}): the Trainer's "
                                 f"eval_dataset has no set of that name (names: {known})")
            return [(prefix, self.named[eval_dataset])]
        if eval_dataset is None or isinstance(eval_dataset, dict):
            named = eval_sets(eval_dataset) if eval_dataset is not None else self.named
            return [(f"{prefix}_{name}", dataset) for name, dataset in named.items()]
        return [(prefix, readable("eval_dataset", eval_dataset))]

    def metrics(self, dataset: Dataset | None, prefix: str) -> dict[str, float]:
        """``{prefix}_loss`` over the whole set and the speed of its evaluation on this rank."""
        data = dataset if dataset is not None else self.core.eval_dataset
        if isinstance(data, StreamList) and id(data) not in self._checked:
            # Read by each rank from its own iterator: the same samples everywhere, or each
            # rank would evaluate other ones (and run other numbers of collectives).
            check_same_stream(samples_digest(data), self.core.ctx.device,
                              what="an evaluation stream")
            self._checked.add(id(data))
        started = time.perf_counter()
        loss = self._loss_on(dataset)
        runtime = time.perf_counter() - started
        samples = len(data)
        args, strategy = self.core.args, self.core.strategy
        per_step = (args.eval_micro_batch_size or strategy.micro_batch_size) \
            * self.core.mesh.size("dp")
        return {f"{prefix}_loss": loss, **speed_metrics(prefix, runtime, samples,
                                                       math.ceil(samples / per_step))}

    def _loss_on(self, dataset: Dataset | None) -> float:
        if dataset is None:
            return self.core.evaluate()
        labels_shifted(*[d for d in (self.reference, dataset) if d is not None])  # one kind
        kept = self.core.eval_dataset
        self.core.eval_dataset = dataset
        try:
            return self.core.evaluate()
        finally:
            self.core.eval_dataset = kept


def speed_metrics(prefix: str, runtime_s: float, samples: int, steps: int) -> dict[str, float]:
    """Hugging Face's ``speed_metrics``: runtime in seconds, samples and steps a second."""
    runtime = max(runtime_s, 1e-9)
    return {f"{prefix}_runtime": round(runtime_s, 4),
            f"{prefix}_samples_per_second": round(samples / runtime, 3),
            f"{prefix}_steps_per_second": round(steps / runtime, 3)}
