"""Sequence parallelism: each sp rank holds L/sp tokens; attention passes blocks between ranks.

Modes (``Strategy.sp_mode``):

- ``rsa``: Ring Self-Attention as published (rsa.py): keys ring-passed to build full score
  rows, exact softmax, values ring-passed; O(L^2/sp) scores per rank.
- ``ring``: online-softmax ring attention (ring.py) with fp32 LSE merging, send/recv overlapped
  with compute and the zigzag layout for causal balance (layout.py); O(L/sp) memory.
- ``ulysses``: all-to-all between sequence and head splits (ulysses.py).

Numerics are in blocks.py, communication in comm.py, the data path in data_path.py, the model
policies in policy.py, the composition with tensor parallelism (Megatron sequence parallelism
included) in compose.py and with pipeline stages in staged.py. :func:`apply_sequence_parallel`
is the step `tessera.parallel.parallelize` runs.
"""

from __future__ import annotations

from tessera.parallel.sequence.compose import check_tensor_parallel, vocab_parallel_loss_sum
from tessera.parallel.sequence.layout import SequenceParallelError
from tessera.parallel.sequence.data_path import SequenceParallel
from tessera.parallel.sequence.policy import apply_policy
from tessera.parallel.sequence.ring import ring_attention
from tessera.parallel.sequence.rsa import rsa_attention
from tessera.parallel.sequence.ulysses import ulysses_attention

__all__ = ["SequenceParallel", "SequenceParallelError", "apply_sequence_parallel",
           "ring_attention", "rsa_attention", "ulysses_attention"]


def apply_sequence_parallel(plan, strategy, mesh) -> SequenceParallel:
    """Lay ``plan.model`` out for sequence parallelism over ``mesh``'s sp axis.

    Installs the sp attention into the model (policy.py), makes ``plan.forward_loss`` shard
    each micro-batch, and widens ``plan.loss_group`` to the dp x sp ranks. Under 1D tensor
    parallelism (applied before) the loss is the vocabulary-parallel one (compose.py).

    Raises:
        SequenceParallelError: for a combination not supported (tp_mode=2d),
            a model no policy knows, or heads Ulysses cannot split.
    """
    _check_combination(strategy)
    token_loss = vocab_parallel_loss_sum(mesh.group("tp")) if strategy.tp > 1 else None
    sp = SequenceParallel(mesh.group("sp"), mode=strategy.sp_mode, token_loss=token_loss,
                          head_ways=strategy.tp,
                          head_rank=mesh.rank("tp") if strategy.tp > 1 else 0,
                          token_ways=strategy.tp if strategy.tp_seq == "on" else 1)
    apply_policy(plan.model, sp)
    plan.forward_loss = sp.forward_loss
    plan.batch_keys = frozenset({"document_ids", "attention_mask", "position_ids"})
    plan.loss_group = mesh.flat_group("dp", "sp")
    plan.features.append(f"sequence_parallel:{strategy.sp_mode}")
    return sp


def _check_combination(strategy) -> None:
    """Refuse combinations whose other half does not know about sequence shards."""
    check_tensor_parallel(strategy)
