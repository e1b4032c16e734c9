"""Each micro-batch's share of a step's loss: its labels over all the labels of the step.

A step's loss is the mean over every label it trains on, on every data-parallel rank and in
every micro-batch (Hugging Face's ``num_items_in_batch`` with ``average_tokens_across_devices``,
its default). Each layout's loss is the mean of one micro-batch, so micro-batch ``i`` of a rank
is weighted

    w_i = c_i * dp / N      (c_i: its labels; N: the labels of the step on all dp ranks)

and the rank's loss is ``sum_i w_i * loss_i``. The data-parallel gradient reduction averages
over dp (and sp, whose ranks scale their share by sp already), so the step's gradient is that
of ``sum(token losses) / N``: a single device's on the whole batch, however unevenly padding
falls. Equal weights (1/n) give this only when every micro-batch holds as many labels; with
padding they overweight the tokens of short micro-batches.

With ``average_tokens_across_devices=False`` (Hugging Face's other choice) ``N`` is this rank's
own count and ``dp`` is 1: each rank's token mean, averaged over ranks, without a collective.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from tessera.parallel.plan import Batch, labels_without_padding


def label_count(batch: Batch) -> torch.Tensor:
    """Labels the loss averages over in ``batch`` (padding and -100 excluded)."""
    return (labels_without_padding(batch) != -100).sum()


class TokenWeights:
    """The weights ``w_i`` of one step's micro-batches on this rank (module doc).

    Build with :func:`token_weights` or :func:`equal_weights`. A count's all-reduce, when
    there is one, is waited for at the first weight read (so it overlaps the first
    micro-batch's forward) or at :meth:`settle`, which engines call at the end of the step
    (a rank that never reads a weight, a pipeline stage without the loss, still completes
    it).

    Args:
        counts: (n,) labels of each micro-batch (float64).
        total: the labels the weights divide by (being all-reduced when ``work`` is set).
        ranks: the dp ranks ``total`` spans.
        work: the pending all-reduce of ``total``, if any.
    """

    def __init__(self, counts: torch.Tensor, total: torch.Tensor, ranks: int,
                 work: dist.Work | None = None) -> None:
        self._counts, self._total, self._ranks, self._work = counts, total, ranks, work
        self._weights: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._counts)

    def __getitem__(self, i: int) -> torch.Tensor:
        """Weight of micro-batch ``i`` (a float32 scalar on the counts' device)."""
        if self._weights is None:
            self.settle()
            # No labels anywhere: every loss is 0 (the layouts' means over none), weight 0.
            share = self._counts * self._ranks / self._total.clamp_min(1)
            self._weights = share.float()
        return self._weights[i]

    def settle(self) -> None:
        """Wait for the count's all-reduce, if one is pending."""
        if self._work is not None:
            self._work.wait()
            self._work = None


def token_weights(micro_batches: Sequence[Batch], device: torch.device,
                  group: dist.ProcessGroup | None, dp: int,
                  across_ranks: bool = True) -> TokenWeights:
    """Weights by labels (module doc); starts the count's all-reduce over ``group``.

    Args:
        micro_batches: this rank's micro-batches of the step (labels on any device).
        device: where the weights live (the collective's device: CUDA under NCCL).
        group: the data-parallel ranks (None: this rank alone).
        dp: the size of ``group``.
        across_ranks: divide by the labels on all dp ranks, not this rank's alone.
    """
    if not micro_batches:
        raise ValueError("a step needs at least one micro-batch")
    counts = torch.stack([label_count(b) for b in micro_batches])  # (n,)
    counts = counts.to(device=device, dtype=torch.float64)
    total = counts.sum()
    if not (across_ranks and group is not None and dp > 1):
        return TokenWeights(counts, total, 1)
    return TokenWeights(counts, total, dp, dist.all_reduce(total, group=group, async_op=True))


def equal_weights(n: int, device: torch.device | str = "cpu") -> TokenWeights:
    """Weights of ``n`` micro-batches counted alike (1/n each): the mean of their means."""
    if n < 1:
        raise ValueError("a step needs at least one micro-batch")
    ones = torch.ones(n, dtype=torch.float64, device=device)
    return TokenWeights(ones, ones.sum(), 1)


def check_weights(weights: TokenWeights, n: int) -> None:
    """Refuse weights built for another number of micro-batches."""
    if len(weights) != n:
        raise ValueError(f"{len(weights)} loss weights for {n} micro-batches: build them "
                         "from the same micro-batches the step runs")
