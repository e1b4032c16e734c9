"""Which tokens each sequence-parallel rank holds, and which block pairs a ring step computes.

Note [zigzag layout and causal block skipping]
----------------------------------------------
With a causal mask, a contiguous split gives the last rank the most work: its queries see every
earlier key, while rank 0's see almost none. The zigzag layout cuts the (padded) sequence into
2*sp chunks of c = T / (2*sp) tokens and gives rank r chunks r and 2*sp-1-r, one early and one
late, so every rank does the same causal work.

Worked example, sp = 2, T = 8, c = 2. Chunks: C0=[0,1] C1=[2,3] C2=[4,5] C3=[6,7].

    rank 0 holds C0 + C3 = tokens [0, 1, 6, 7]
    rank 1 holds C1 + C2 = tokens [2, 3, 4, 5]

Causal (query, key) pairs: rank 0: 1+2 + 7+8 = 18; rank 1: 3+4 + 5+6 = 18. Balanced.

In the ring, at step i rank r holds the key/value block of rank s = (r - i) mod sp. Each half of
r's queries (early chunk r, late chunk 2sp-1-r) against each half of s's keys (chunk s, chunk
2sp-1-s) is either wholly visible or wholly in the future, so one step computes one of:

    s == r  (step 0)   full local block, causal mask inside it
    s <  r             all queries x first key half (chunk s): chunk 2sp-1-s is after both
                       query chunks
    s >  r             second query half (chunk 2sp-1-r) x all keys: chunk r precedes both
                       key chunks, chunk 2sp-1-r follows both

In the example, step 1: rank 0 gets s=1 > 0: queries [6, 7] x keys [2, 3, 4, 5]; rank 1 gets
s=0 < 1: queries [2, 3, 4, 5] x keys [0, 1]. Both compute c x 2c = 4 pairs.

The skipping only saves work: every block's mask is still built from the tokens' real
indices (blocks.block_mask), so a wrong skip rule would show up as a parity failure. A shard
in another layout than the one the ring is told would be skipped wrongly without an error:
ring_attention refuses it (check_shard_layout). Labels and position ids follow the same
permutation (the model's RoPE / learned positions use the real indices).

A contiguous layout (rank r holds chunk r of sp) is used for non-causal attention (nothing to
balance) and for rsa and ulysses (rsa builds full rows; ulysses gathers the whole sequence).
"""

from __future__ import annotations

import math

import torch

LAYOUTS = ("contiguous", "zigzag")


class SequenceParallelError(ValueError):
    """Input that sequence parallelism refuses; the message names the rule."""


def check_layout(layout: str, causal: bool) -> None:
    """Refuse unknown layouts and zigzag without a causal mask (nothing to balance).

    Raises:
        SequenceParallelError: naming the rule.
    """
    if layout not in LAYOUTS:
        raise SequenceParallelError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    if layout == "zigzag" and not causal:
        raise SequenceParallelError(
            "layout=zigzag needs causal=True: zigzag balances causal work; non-causal "
            "attention has none to balance, use layout=contiguous")


def chunks_per_rank(layout: str) -> int:
    """Number of equal chunks each rank holds: 2 for zigzag, 1 for contiguous."""
    return 2 if layout == "zigzag" else 1


def padded_length(length: int, sp: int, layout: str, token_ways: int = 1) -> int:
    """Smallest length >= ``length`` that the layout splits evenly over ``sp`` ranks, each
    rank's tokens a multiple of ``token_ways`` (the ways Megatron sequence parallelism splits
    them again over tp)."""
    multiple = length_multiple(sp, layout, token_ways)
    return -(-length // multiple) * multiple


def length_multiple(sp: int, layout: str, token_ways: int = 1) -> int:
    """What :func:`padded_length` rounds up to: sp ranks, each holding the layout's equal
    chunks and a multiple of ``token_ways`` tokens."""
    return sp * math.lcm(chunks_per_rank(layout), token_ways)


def local_indices(length: int, sp: int, rank: int, layout: str) -> torch.Tensor:
    """Indices into the full (padded) sequence of the tokens ``rank`` holds, in local order.

    Args:
        length: the padded sequence length (a multiple of sp, or of 2*sp for zigzag).
        sp: number of sequence-parallel ranks.
        rank: this rank's position in the sequence-parallel group.
        layout: "contiguous" or "zigzag".
    """
    if layout == "contiguous":
        size = length // sp
        return torch.arange(rank * size, (rank + 1) * size)
    c = length // (2 * sp)
    late = 2 * sp - 1 - rank
    early = torch.arange(rank * c, (rank + 1) * c)
    return torch.cat((early, torch.arange(late * c, (late + 1) * c)))


def check_shard_layout(meta: torch.Tensor, sp: int, rank: int, layout: str) -> None:
    """Refuse a shard whose token indices are not ``layout``'s for this rank: the ring skips
    key blocks by layout (ring_step_slices), so a shard laid out otherwise would silently
    attend to the wrong keys.

    Args:
        meta: (B, T/sp, 2) [index in the full sequence, segment] of this rank's tokens.

    Raises:
        SequenceParallelError: naming the layout and the indices found.
    """
    expected = local_indices(meta.shape[1] * sp, sp, rank, layout).to(meta.device)
    if not bool((meta[..., 0] == expected).all()):
        found = meta[0, :, 0].tolist()
        raise SequenceParallelError(
            f"rank {rank} of sp={sp} holds token indices {found[:4]}...{found[-2:]}, not the "
            f"{layout} layout's {expected[:4].tolist()}...{expected[-2:].tolist()}: shard the "
            f"batch with the same layout (SequenceParallel.shard) or pass layout= to match")


def ring_step_slices(src: int, rank: int, local_len: int, causal: bool, layout: str
                     ) -> tuple[slice, slice] | None:
    """(query slice, key slice) of the local block pair a ring step computes; None to skip.

    See the note at the top of this module.
    """
    everything = slice(0, local_len)
    if not causal or src == rank:
        return everything, everything
    if layout == "contiguous":
        # Earlier ranks hold wholly earlier tokens: fully visible; later ranks: all future.
        return (everything, everything) if src < rank else None
    half = local_len // 2
    if src < rank:
        return everything, slice(0, half)
    return slice(half, local_len), everything
