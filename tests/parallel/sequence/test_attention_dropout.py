"""Attention dropout of the sequence-parallel blocks (dropout.py) and per-rank random streams
(parallel/rank_rng.py), in one process.

The multi-rank checks (ring, rsa and ulysses with dropout equal one device with the same mask;
training with dropout and recomputation) ride the launches of test_sp_attention.py and
test_sp_training.py.

Tolerance: fp32 blocks against a float64 reference, 1e-5 absolute + 1e-4 relative; the block
path sums in a different order (pieces of rows, two key blocks merged by log-sum-exp).
"""

from __future__ import annotations

import math

import pytest
import torch

from tessera.parallel.rank_rng import in_rank_stream, rank_stream, step_seed, stream_seed
from tessera.parallel.sequence import blocks
from tessera.parallel.sequence.dropout import AttentionDropout

B, NH, NKV, T, HS = 2, 4, 2, 24, 8


def _meta(T, offset=0):
    index = torch.arange(offset, offset + T).expand(B, T)
    return torch.stack((index, torch.zeros_like(index)), -1)  # (B, T, 2)


def test_the_mask_keeps_one_minus_p_and_is_independent_across_heads_rows_and_keys():
    index = torch.arange(512).expand(4, 512)
    meta = torch.stack((index, torch.zeros_like(index)), -1)  # (4, 512, 2)
    scale = AttentionDropout(0.3, seed=11).keep_scale(meta, meta, 8)  # (4, 8, 512, 512)
    kept = scale > 0
    n = kept.numel()
    # Binomial: the kept share is within 6 standard deviations of 0.7 (sd = 1.6e-4 here).
    assert abs(kept.float().mean().item() - 0.7) < 6 * math.sqrt(0.21 / n)
    assert torch.equal(scale[kept], torch.full_like(scale[kept], 1 / 0.7))
    # Two independent masks agree on p^2 + (1-p)^2 = 0.58 of the pairs, identical ones on all.
    agree = lambda a, b: (a == b).float().mean().item()  # noqa: E731
    pairs = ((kept[:, 0], kept[:, 1]), (kept[0], kept[1]),  # heads, batch rows
             (kept[..., :-1, :], kept[..., 1:, :]), (kept[..., :-1], kept[..., 1:]))  # q, k
    for a, b in pairs:
        assert abs(agree(a, b) - 0.58) < 0.01
    other = AttentionDropout(0.3, seed=12).keep_scale(meta, meta, 8) > 0
    assert abs(agree(kept, other) - 0.58) < 0.01


def test_the_in_place_int32_hash_gives_mix32s_bits():
    # The pairs' hash runs on int32 patterns in place (wrapping products, masked shifts);
    # it must give the int64 reference's values, the edges of both ranges included.
    from tessera.parallel.sequence.dropout import (as_int32_bits, at_least_unsigned, mix32,
                                                   mix32_bits_)

    edges = torch.tensor([0, 1, 2 ** 16 - 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1])
    x = torch.cat([edges, torch.randint(0, 2 ** 32, (4096,), generator=torch.Generator()
                                        .manual_seed(0))])
    reference = mix32(x)
    assert torch.equal(mix32_bits_(as_int32_bits(x)), as_int32_bits(reference))
    for threshold in (0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 1, 2 ** 32 - 1, 2 ** 32):
        got = at_least_unsigned(as_int32_bits(reference), threshold)
        assert torch.equal(got, reference >= threshold), threshold


def test_the_mask_depends_on_token_indices_and_heads_not_on_blocks():
    drop = AttentionDropout(0.5, seed=3)
    full = drop.keep_scale(_meta(T), _meta(T), NH)  # (B, NH, T, T)
    part = drop.keep_scale(_meta(8, offset=16), _meta(8, offset=4), NH)
    assert torch.equal(part, full[:, :, 16:24, 4:12])
    heads = AttentionDropout(0.5, seed=3, head_offset=2).keep_scale(_meta(T), _meta(T), 2)
    assert torch.equal(heads, full[:, 2:4])
    with pytest.raises(ValueError, match="p must lie in"):
        AttentionDropout(1.0, seed=0)


def _reference(q, k, v, keep):
    """float64 causal attention with dropped probabilities, through autograd."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(NH // NKV, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(HS)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return (torch.softmax(scores, -1) * keep.double()) @ v


def test_explicit_blocks_with_dropout_equal_dropped_full_attention(monkeypatch):
    monkeypatch.setattr(blocks, "piece_rows", lambda q_rows, n_keys, hs: 5)  # tile the rows
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, NH, T, HS, generator=g)
    k, v = (torch.randn(B, NKV, T, HS, generator=g) for _ in range(2))
    w = torch.randn(B, NH, T, HS, generator=g)
    drop = AttentionDropout(0.25, seed=5)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _reference(*leaves, drop.keep_scale(_meta(T), _meta(T), NH))
    (ref * w.double()).sum().backward()

    meta, cut, scale = _meta(T), 10, HS ** -0.5  # two key blocks, merged as the ring does
    out = torch.zeros(B, NH, T, HS)
    lse = torch.full((B, NH, T), float("-inf"))
    for ks in (slice(0, cut), slice(cut, T)):
        o, s = blocks.block_forward(q, k[:, :, ks], v[:, :, ks], meta, meta[:, ks], True,
                                    scale, drop)
        blocks.merge_into(out, lse, o, s)
    dout = w
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for ks in (slice(0, cut), slice(cut, T)):
        dq, dk, dv = blocks.block_backward(q, k[:, :, ks], v[:, :, ks], meta, meta[:, ks],
                                           True, scale, dout, out, lse, drop)
        grads[0] += dq
        grads[1][:, :, ks] += dk
        grads[2][:, :, ks] += dv
    tol = dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.double(), ref.detach(), **tol)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got.double(), leaf.grad, **tol)
    # Without dropout the same blocks give a different output: the mask was applied.
    plain, _ = blocks.block_forward(q, k, v, meta, meta, True, scale)
    assert (plain - out).abs().max() > 1e-2


def test_rank_streams_differ_off_1d_tensor_parallelism_and_follow_the_step():
    base = {"pp": 0, "dp": 0, "sp": 0, "tp": 0}
    assert stream_seed(5, base) == stream_seed(5, {**base, "tp": 1})  # 1D peers replicate
    grid = {"pp": 0, "dp": 0, "sp": 0, "tp_row": 0, "tp_col": 0}  # 2D ranks hold blocks
    seeds = {stream_seed(5, {**base, axis: 1}) for axis in ("pp", "dp", "sp")}
    seeds |= {stream_seed(5, {**grid, axis: 1}) for axis in ("tp_row", "tp_col")}
    assert len(seeds | {stream_seed(5, base), stream_seed(6, base)}) == 7
    # The step's shared seed is a function of the run's seed and the step only.
    assert step_seed(7, 3) == step_seed(7, 3) != step_seed(7, 4) != step_seed(8, 4)

    def step(coords, shared=None):
        torch.manual_seed(0)
        assert not in_rank_stream()
        with rank_stream(coords, shared=shared):
            assert in_rank_stream()
            drawn = torch.rand(4)
        return drawn, torch.rand(1)  # the generator outside, after the step

    sp0, after0 = step(base)
    sp1, after1 = step({**base, "sp": 1})
    tp1, after_tp = step({**base, "tp": 1})
    assert not torch.equal(sp0, sp1) and torch.equal(sp0, tp1)
    # Drawing the shared seed advances every rank's generator alike, whatever its stream.
    assert torch.equal(after0, after1) and torch.equal(after0, after_tp)
    # A given shared seed: the same stream whatever the generator's state, which stays put.
    given, after = step(base, shared=step_seed(7, 3))
    torch.manual_seed(1)
    with rank_stream(base, shared=step_seed(7, 3)):
        again = torch.rand(4)
    assert torch.equal(given, again)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(1))
