"""Sequence parallelism: each sp rank holds L/sp tokens; attention passes blocks between ranks.

Modes (``Strategy.sp_mode``):

- ``rsa``: Ring Self-Attention as published (rsa.py): keys ring-passed to build full score
  rows, exact softmax, values ring-passed; O(L^2/sp) scores per rank.
- ``ring``: online-softmax ring attention (ring.py) with fp32 LSE merging, send/recv overlapped
  with compute and the zigzag layout for causal balance (layout.py); O(L/sp) memory.
- ``ulysses``: all-to-all between sequence and head splits (ulysses.py).

Numerics are in blocks.py, communication in comm.py, the data path and model policies in
policy.py. :func:`apply_sequence_parallel` is the step `tessera.parallel.parallelize` runs.
"""

from __future__ import annotations

from tessera.parallel.sequence.layout import SequenceParallelError
from tessera.parallel.sequence.policy import SequenceParallel, apply_policy
from tessera.parallel.sequence.ring import ring_attention
from tessera.parallel.sequence.rsa import rsa_attention
from tessera.parallel.sequence.ulysses import ulysses_attention

__all__ = ["SequenceParallel", "SequenceParallelError", "apply_sequence_parallel",
           "ring_attention", "rsa_attention", "ulysses_attention"]


def apply_sequence_parallel(plan, strategy, mesh) -> SequenceParallel:
    """Lay ``plan.model`` out for sequence parallelism over ``mesh``'s sp axis.

    Installs the sp attention into the model (policy.py), makes ``plan.forward_loss`` shard
    each micro-batch, and widens ``plan.loss_group`` to the dp x sp ranks.

    Raises:
        SequenceParallelError: for a combination not supported yet (tp > 1, pp > 1,
            memory=chunk), a model no policy knows, or heads Ulysses cannot split.
    """
    _check_combination(strategy)
    sp = SequenceParallel(mesh.group("sp"), mode=strategy.sp_mode)
    apply_policy(plan.model, sp)
    plan.forward_loss = sp.forward_loss
    plan.loss_group = mesh.flat_group("dp", "sp")
    plan.features.append(f"sequence_parallel:{strategy.sp_mode}")
    return sp


def _check_combination(strategy) -> None:
    """Refuse combinations whose other half does not know about sequence shards (yet)."""
    why = {
        "tp": "tensor and sequence parallelism each replace the loss (vocabulary-sharded vs "
              "sequence-sharded logits), and Megatron sequence parallelism would split the "
              "same token axis",
        "pp": "the pipeline captures the model with torch.export and runs its own loss per "
              "stage, neither of which carries the ring's process group and token metadata",
        "memory=chunk": "chunk memory reduces gradients over dp only; sp ranks must average "
                        "theirs too",
    }
    clashes = [name for name, on in (("tp", strategy.tp > 1), ("pp", strategy.pp > 1),
                                     ("memory=chunk", strategy.memory == "chunk")) if on]
    if clashes:
        name = clashes[0]
        value = name if "=" in name else f"{name}={getattr(strategy, name)}"
        raise SequenceParallelError(
            f"sp={strategy.sp} with {value} is not supported yet: {why[name]}; sp composes "
            "with dp (DDP over dp x sp)")
