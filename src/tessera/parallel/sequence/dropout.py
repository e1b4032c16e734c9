"""Attention dropout whose mask is a function of the tokens, not of the layout.

Dropout on attention probabilities needs the same mask in forward and backward, and the ring
computes both one (query block, key block) pair at a time, on whichever rank holds the
queries. Drawing the mask from a generator would tie it to the order of the draws. Instead a
(query, key) pair of head ``h`` in batch row ``b`` is kept when

    hash(seed, b, h, query index, key index) >= p * 2**32

with the indices the tokens' positions in the whole (padded) sequence (``meta[..., 0]``) and
``h`` the head's index in the layer. The mask is regenerated wherever a pair is computed, in
forward and in backward, and never stored; the same seed drops the same pairs whatever the sp
degree, mode, layout or block a pair falls in, so sp=N equals one device exactly (tested).
Flash-attention regenerates its mask from a counter-based generator for the same reason.

Kept probabilities are scaled by 1 / (1 - p). The softmax normaliser (the LSE) is that of the
undropped probabilities, so blocks merge as without dropout; the backward of
``out = (P * K) V``, ``K`` the scaled mask, is ``dV = (P * K)^T dO``, ``dP = (dO V^T) * K``
and ``dS = P * (dP - rowsum(dO * out))``, the last because rowsum(P * dP) = dO . out still.

The hash: 32-bit keys in int64 tensors, mixed by multiplying by a constant below 2**27, so no
product overflows; one mix per (row, key) pair, the row's and the key's parts hashed once each.
The pairs' mix, the largest work of the path, runs the same arithmetic on int32 bit patterns in
place (``mix32_bits_``), which gives the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # odd, below 2**27: x * _MUL < 2**59 for 32-bit x
_KEY_DOMAIN = 0x9E3779B9  # keeps key hashes apart from row hashes of the same integer


def mix32(x):
    """A 32-bit integer hash of ``x`` in [0, 2**32) (int or int64 tensor), elementwise."""
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    return x ^ (x >> 16)


def as_int32_bits(x: torch.Tensor) -> torch.Tensor:
    """Values in [0, 2**32) (int64) as int32 tensors of the same 32 bits (two's complement)."""
    return torch.where(x >= 2 ** 31, x - 2 ** 32, x).to(torch.int32)


def mix32_bits_(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` in place on the 32-bit patterns of an int32 tensor (the same bits).

    The (B, H, Tq, Tk) pair hashes are the largest tensors of the dropout path. As int64
    values, each of ten passes a fresh tensor, they took most of its time on CPU; int32 passes
    in place move half the bytes, vectorise, and allocate one scratch buffer. The shifts are
    logical (their sign bits masked off) and the products wrap modulo 2**32 as mix32's
    ``& _M32`` does (tested against mix32).
    """
    scratch = torch.empty_like(x)
    for multiply in (True, True, False):
        torch.bitwise_right_shift(x, 16, out=scratch)
        x.bitwise_xor_(scratch.bitwise_and_(0xFFFF))  # x ^ (x >>> 16)
        if multiply:
            x.mul_(_MUL)
    return x


def at_least_unsigned(bits: torch.Tensor, threshold: int) -> torch.Tensor:
    """Where the int32 patterns ``bits``, read as unsigned, are >= ``threshold`` in
    [0, 2**32]; ``bits`` is overwritten (flipping the sign bit orders them as signed)."""
    if threshold >= 2 ** 32:
        return torch.zeros_like(bits, dtype=torch.bool)
    return bits.bitwise_xor_(-(2 ** 31)) >= threshold - 2 ** 31


@dataclass(frozen=True)
class AttentionDropout:
    """Drop attention probabilities with probability ``p`` under ``seed`` (see module doc).

    Args:
        p: dropout probability, in (0, 1).
        seed: any integer. Ranks may use different ones (each pair is computed, forward
            and backward, on one rank: the one holding its query, under Ulysses its head);
            one seed on every rank drops the pairs one device would.
        head_offset: index in the layer of the first head the caller's tensors hold
            (Ulysses: this rank's share of the heads).
    """

    p: float
    seed: int
    head_offset: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.p < 1.0:
            raise ValueError(f"attention dropout p must lie in (0, 1), got {self.p}")

    def keep_scale(self, meta_q: torch.Tensor, meta_k: torch.Tensor, n_heads: int
                   ) -> torch.Tensor:
        """(B, n_heads, Tq, Tk) fp32: 1 / (1 - p) where a pair is kept, else 0.

        Args:
            meta_q: (B, Tq, 2), meta_k: (B, Tk, 2) token metadata; column 0 is the index.
            n_heads: query heads the caller holds, from ``head_offset`` on.
        """
        B = meta_q.shape[0]
        device = meta_q.device
        seed = mix32((self.seed & _M32) ^ mix32((self.seed >> 32) & _M32))
        rows = torch.arange(B, device=device, dtype=torch.int64).view(B, 1, 1)
        heads = torch.arange(self.head_offset, self.head_offset + n_heads, device=device,
                             dtype=torch.int64).view(1, n_heads, 1)
        row_keys = mix32(mix32(mix32(rows ^ seed) ^ heads) ^ meta_q[:, None, :, 0])  # (B, H, Tq)
        key_keys = mix32(meta_k[:, None, :, 0] ^ _KEY_DOMAIN)  # (B, 1, Tk)
        pair = mix32_bits_(as_int32_bits(row_keys).unsqueeze(-1)
                           ^ as_int32_bits(key_keys).unsqueeze(-2))  # (B, H, Tq, Tk)
        kept = at_least_unsigned(pair, int(round(self.p * 2 ** 32)))
        return kept.to(torch.float32).mul_(1.0 / (1.0 - self.p))


def grouped_keep_scale(dropout: AttentionDropout, meta_q: torch.Tensor, meta_k: torch.Tensor,
                       n_kv: int, group: int) -> torch.Tensor:
    """:meth:`AttentionDropout.keep_scale` viewed as (B, nkv, g, Tq, Tk), query head
    ``kv * g + i`` at [:, kv, i] as blocks.py groups heads."""
    scale = dropout.keep_scale(meta_q, meta_k, n_kv * group)
    B, _, Tq, Tk = scale.shape
    return scale.view(B, n_kv, group, Tq, Tk)
