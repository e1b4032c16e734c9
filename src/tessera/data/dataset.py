"""Fixed-length language-modelling samples and the deterministic, resumable batch order."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from tessera.data.corpus import DataError


class TokenDataset(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens: inputs and next-token labels.

    Sample ``i`` is ``tokens[i*T : i*T + T]`` with labels shifted by one token.
    """

    labels_shifted = True  # labels[t] is the token after input_ids[t]

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if seq_len < 1:
            raise DataError(f"data.seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self._n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self._n:
            raise IndexError(f"sample {index} outside 0..{self._n - 1}")
        start = index * self.seq_len
        window = torch.from_numpy(self.tokens[start: start + self.seq_len + 1].astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}

    def split(self, val_fraction: float) -> tuple["Subset", "Subset"]:
        """(train, validation): validation is the last ``val_fraction`` of the samples."""
        n_val = int(len(self) * val_fraction) if val_fraction > 0 else 0
        if val_fraction > 0:
            n_val = max(1, n_val)
        if len(self) - n_val < 1:
            raise DataError(f"corpus gives {len(self)} samples: too few to hold out "
                            f"{n_val} for validation")
        return Subset(self, 0, len(self) - n_val), Subset(self, len(self) - n_val, len(self))


class Subset(Dataset):
    """A contiguous range of another dataset's samples."""

    @property
    def labels_shifted(self) -> bool:
        return getattr(self.base, "labels_shifted", False)

    def __init__(self, base: Dataset, start: int, stop: int) -> None:
        self.base, self.start, self.stop = base, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside 0..{len(self) - 1}")
        return self.base[self.start + index]


class GlobalBatchOrder:
    """Which samples make up each global batch, as a pure function of (seed, step).

    The samples form an endless stream: epoch ``e`` visits every sample once in the order of
    a permutation seeded by ``(seed, e)``. Global batch ``s`` is stream positions
    ``[s*gbs, (s+1)*gbs)``; data-parallel rank ``r`` of ``dp`` takes the ``r``-th contiguous
    slice of it. Resuming at step ``s`` therefore continues at the exact sample, whatever the
    data-parallel size was before.

    When the global batch size changes at a resume, the stream continues at the sample
    where it stopped: ``start_step`` and ``start_sample`` give the step and stream position of
    the resume, and batch ``s`` is then positions ``start_sample + (s - start_step) * gbs``.

    ``num_samples=None`` is a stream (an iterable dataset, ``data/stream.py``): its order is
    its own, so the indices are the stream positions themselves.
    """

    def __init__(self, num_samples: int | None, global_batch_size: int, seed: int,
                 start_step: int = 0, start_sample: int | None = None) -> None:
        if num_samples is not None and num_samples < 1:
            raise DataError("the dataset is empty")
        self.num_samples, self.global_batch_size, self.seed = (
            num_samples, global_batch_size, seed)
        self.start_step = start_step
        self.start_sample = start_step * global_batch_size if start_sample is None else start_sample
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._perm = epoch, rng.permutation(self.num_samples)
        return self._perm

    def global_batch(self, step: int) -> np.ndarray:
        """Sample indices of global batch ``step`` (length gbs)."""
        first = self.samples_before(step)
        positions = np.arange(first, first + self.global_batch_size)
        if self.num_samples is None:
            return positions
        out = np.empty_like(positions)
        for epoch in np.unique(positions // self.num_samples):
            mask = positions // self.num_samples == epoch
            out[mask] = self._permutation(int(epoch))[positions[mask] % self.num_samples]
        return out

    def samples_before(self, step: int) -> int:
        """Stream position of the first sample of global batch ``step``."""
        return self.start_sample + (step - self.start_step) * self.global_batch_size

    def rank_batch(self, step: int, dp_rank: int, dp_size: int) -> np.ndarray:
        """The slice of global batch ``step`` that data-parallel rank ``dp_rank`` trains on."""
        per_rank = self.global_batch_size // dp_size
        return self.global_batch(step)[dp_rank * per_rank: (dp_rank + 1) * per_rank]


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples into a batch: each key becomes a (B, T) tensor."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
