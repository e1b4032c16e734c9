"""Sequence parallelism composed with tensor parallelism: which mixes work, and the loss.

**sp x 1D tp** (the Megatron "context parallel x tensor parallel" arrangement). The mesh gives
tp and sp separate axes. Tensor parallelism splits the heads and the MLP width over tp; each
tp rank still holds the whole sequence slice of its sp rank, so attention sees
q (B, nh/tp, T/sp, hs) and runs the chosen sp mode over the sp group on its own heads:

- ring and rsa: any head count (they never split heads);
- ulysses: splits the tp-local heads again over sp, so nh/tp must be divisible by sp (and the
  kv heads per tp rank must divide or be divisible by sp); Strategy.validate_for checks it.

The logits are (B, T/sp, V/tp): each rank sums the vocabulary-parallel cross-entropy of its
tokens (an all-reduce over tp of three numbers per token) and scales it like the plain sp
loss. Weights are sharded over tp and replicated over dp x sp, so their gradients are
averaged over the flattened dp x sp group.

**sp x 2D tp** is refused: 2D splits the micro-batch over grid rows and the hidden width over
grid columns, so every activation is already spread over q^2 ranks. Adding an sp axis would
need the ring inside each grid cell and a loss over three axes, for little memory left to save.

**sp x 1D tp with Megatron sequence parallelism** (``Strategy.tp_seq="on"``; Megatron-LM's
context x sequence x tensor parallelism). Between the blocks each tp rank holds 1/tp of its sp
rank's tokens, (B, T/(sp tp), C). A block's input is all-gathered over tp to the sp rank's
(B, T/sp, C) before the column layers, so attention sees the same (B, nh/tp, T/sp, hs) as
above and the sp mode runs unchanged; the row layers reduce-scatter back to the tp chunk. The
sp data path pads each row so that every sp rank's tokens split over tp
(``SequenceParallel(token_ways=tp)``; Strategy asks T divisible by sp x tp). Dropout between
the blocks draws the sp rank's whole (B, T/sp, C) mask from the tp peers' shared stream and
keeps the rank's rows (tensor/seq_dropout.py), so under one seed tp_seq=on drops exactly what
tp_seq=off drops.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from tessera.parallel.sequence.layout import SequenceParallelError

TokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_tensor_parallel(strategy) -> None:
    """Refuse the tensor-parallel mixes sequence parallelism does not compose with.

    Raises:
        SequenceParallelError: for tp_mode=2d, naming the reason.
    """
    if strategy.tp > 1 and strategy.tp_mode == "2d":
        raise SequenceParallelError(
            f"sp={strategy.sp} with tp={strategy.tp} (tp_mode=2d) is not supported: 2d "
            "splits the micro-batch over grid rows and the width over grid columns, so the "
            "ring would run inside each grid cell with a loss over three axes; use tp_mode=1d")


def vocab_parallel_loss_sum(tp_group: dist.ProcessGroup) -> TokenLoss:
    """``(logits (B, T, V/tp), labels (B, T)) -> summed token loss`` over vocabulary shards."""
    from tessera.parallel.tensor.comm import TPGroup
    from tessera.parallel.tensor.loss import VocabParallelCrossEntropyFn

    group = TPGroup(tp_group)

    def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        per_token = VocabParallelCrossEntropyFn.apply(logits.flatten(0, 1), labels.flatten(),
                                                      group)  # (B*T,), 0 where ignored
        return per_token.sum()

    return loss_sum
