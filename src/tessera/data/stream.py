"""Iterable datasets (streams) as the trainer reads them: sample ``p`` is the ``p``-th of an
endless stream of passes over the iterable, read in order.

Every rank reads the whole stream and keeps the positions its share of each global batch
names (as accelerate's ``IterableDatasetShard`` does), so the iterable must yield the same
samples in the same order on every rank; :func:`check_same_stream` verifies that. A pass
that ends starts the next one, after ``set_epoch(pass)`` when the iterable has it (a
``datasets`` stream reshuffles then). A resume at position ``p`` reads and drops the first
``p`` samples again, as Hugging Face's Trainer skips the batches of a resumed epoch.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist


class StreamError(ValueError):
    """A stream that cannot be read as the trainer needs it (named)."""


class StreamSamples:
    """Position-indexed view of an iterable read forward: ``view[p]`` for increasing ``p``.

    The first sample stays readable (the run's shape is read from it); a position behind
    the last one read starts the stream again from its first pass.
    """

    labels_shifted = False  # Hugging Face-style samples: labels at the input positions

    def __init__(self, stream: Iterable) -> None:
        if iter(stream) is stream:  # a generator or iterator: one pass, no going back
            raise StreamError(
                f"the iterable dataset is a one-pass {type(stream).__name__} (iter() returns "
                "itself): a stream must start again on iter() for a new pass or a resume; "
                "give an iterable that does, e.g. a torch IterableDataset")
        self.stream = stream
        self._first: Any = None
        self._restart()

    def _restart(self) -> None:
        self.passes = 0  # passes begun
        self._iterator: Iterator | None = None
        self._position = 0  # the position the iterator yields next
        self._last: tuple[int, Any] | None = None
        self._digest = hashlib.blake2b(digest_size=8)  # of every sample read, in order

    def __getitem__(self, position: int) -> Any:
        if position == 0 and self._first is not None:
            return self._first
        if self._last is not None and position == self._last[0]:
            return self._last[1]
        if position < self._position:  # behind (a resume to an earlier step): start again
            self._restart()
        self._read_to(position + 1)
        return self._last[1]

    def digest_through(self, end: int) -> int:
        """A 62-bit digest of samples ``[0, end)`` (read now if not yet): equal on ranks
        whose streams yielded the same token ids."""
        if end > self._position:
            self._read_to(end)
        return _to_int(self._digest.copy())

    def _read_to(self, end: int) -> None:
        while self._position < end:
            sample = self._next()
            if self._position == 0:
                self._first = sample
            self._digest.update(_sample_bytes(sample))
            self._last = (self._position, sample)
            self._position += 1

    def _next(self) -> Any:
        if self._iterator is not None:
            try:
                return next(self._iterator)
            except StopIteration:
                pass
        if hasattr(self.stream, "set_epoch"):  # a new pass: datasets' streams reshuffle
            self.stream.set_epoch(self.passes)
        self.passes += 1
        self._iterator = iter(self.stream)
        try:
            return next(self._iterator)
        except StopIteration:
            raise StreamError(f"the iterable dataset {type(self.stream).__name__} yields no "
                              f"sample in pass {self.passes}") from None


def _sample_bytes(sample: Any) -> bytes:
    """Every value of a sample as bytes, keys sorted (token ids and labels as int64, text
    and anything else pickled: repr would shorten large tensors)."""
    items = sorted(sample.items()) if isinstance(sample, dict) else [("", sample)]
    out = []
    for key, value in items:
        try:
            data = torch.as_tensor(value).to(torch.int64).numpy().tobytes()
        except (TypeError, ValueError, RuntimeError):
            data = pickle.dumps(value, protocol=4)
        out.append(str(key).encode() + b"\0" + data)
    return b"\1".join(out)


def samples_digest(samples: list[Any]) -> int:
    """A 62-bit digest of samples read whole (an evaluation stream), their count included."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(len(samples).to_bytes(8, "little"))
    for sample in samples:
        digest.update(_sample_bytes(sample))
    return _to_int(digest)


def _to_int(digest: Any) -> int:
    """A 64-bit hash as a 62-bit integer: its negation fits int64 (check_same_stream)."""
    return int.from_bytes(digest.digest(), "little") >> 2


class StreamList(list):
    """An evaluation stream read whole into memory (checked across ranks when evaluated)."""


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is read by iterating (no length or no index)."""
    return isinstance(dataset, torch.utils.data.IterableDataset) or (
        hasattr(dataset, "__iter__") and not (hasattr(dataset, "__len__")
                                              and hasattr(dataset, "__getitem__")))


def sample_count(dataset: Any) -> int | None:
    """Samples in a map-style dataset; None for a stream (endless, read in order)."""
    return None if isinstance(dataset, StreamSamples) else len(dataset)


def check_same_stream(digest: int, device: torch.device, group: Any = None,
                      what: str = "the training stream") -> None:
    """Refuse ranks that read different samples from the same stream positions.

    Raises:
        StreamError: on every rank, when the digests differ.
    """
    values = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    if values[0].item() != -values[1].item():
        raise StreamError(
            f"the ranks read different samples from {what}: every rank reads the "
            "whole iterable and keeps its share, so it must yield the same samples in the same "
            "order everywhere (seed its shuffle; do not split it by rank, e.g. with "
            "datasets.distributed.split_dataset_by_node: tessera shards it)")
