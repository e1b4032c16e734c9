"""Layout arithmetic and refusals of sequence parallelism (single process, no launch)."""

from __future__ import annotations

import pytest
import torch

from tessera.models.config import preset
from tessera.parallel.sequence import SequenceParallelError, apply_sequence_parallel
from tessera.parallel.sequence.layout import (check_layout, local_indices, padded_length,
                                              ring_step_slices)
from tessera.parallel.sequence.ulysses import check_heads
from tessera.strategy import Strategy, StrategyError


def test_zigzag_worked_example_from_the_note():
    assert local_indices(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert local_indices(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert local_indices(8, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]
    assert padded_length(13, 4, "zigzag") == 16 and padded_length(13, 4, "contiguous") == 16
    assert padded_length(10, 4, "zigzag") == 16 and padded_length(10, 4, "contiguous") == 12
    # Megatron sequence parallelism (tp_seq=on) splits each rank's tokens over tp again:
    # contiguous sp=2 x tp=2 pads 13 to 16 (14 would leave 7 a rank); zigzag's two chunks a
    # rank and tp=3 need 2 x 6 = 12 per multiple; tp=2 adds nothing to zigzag's 4.
    assert padded_length(13, 2, "contiguous", 2) == 16 and padded_length(13, 2, "zigzag", 2) == 16
    assert padded_length(13, 2, "zigzag", 3) == 24 and padded_length(13, 2, "contiguous", 3) == 18
    assert padded_length(16, 2, "zigzag", 4) == 16


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_steps_cover_every_causal_pair_and_zigzag_balances_them(sp, layout):
    T = 4 * sp
    idx = [local_indices(T, sp, r, layout) for r in range(sp)]
    work = torch.zeros(sp, sp, dtype=torch.long)  # (step, rank) -> pairs computed
    for r in range(sp):
        for step in range(sp):
            src = (r - step) % sp
            visible = idx[src][None, :] <= idx[r][:, None]  # (T/sp queries, T/sp keys)
            sl = ring_step_slices(src, r, T // sp, True, layout)
            computed = torch.zeros_like(visible)
            if sl is not None:
                computed[sl[0], sl[1]] = True
                work[step, r] = computed.sum()
            assert not (visible & ~computed).any(), (r, step)  # no visible pair skipped
    if layout == "zigzag":  # every rank does the same work at every step
        assert (work == work[:, :1]).all(), work


def test_bad_input_is_refused_with_the_rule():
    with pytest.raises(SequenceParallelError, match="zigzag needs causal=True"):
        check_layout("zigzag", causal=False)
    with pytest.raises(SequenceParallelError, match="layout must be one of"):
        check_layout("stripe", causal=True)
    with pytest.raises(SequenceParallelError, match="n_heads=6 must be divisible by sp=4"):
        check_heads(6, 6, 4)
    with pytest.raises(SequenceParallelError, match="n_kv_heads=3 must divide or be"):
        check_heads(12, 3, 4)
    check_heads(8, 2, 4)  # kv heads repeated: 2 divides 4
    for strategy, value in ((Strategy(sp=2, tp=4, tp_mode="2d"), "tp=4 \\(tp_mode=2d\\)"),):
        with pytest.raises(SequenceParallelError, match=f"sp=2 with {value} is not supported"):
            apply_sequence_parallel(None, strategy, None)


def test_a_direct_call_after_forward_loss_is_refused_not_run_on_stale_metadata():
    # forward_loss leaves the metadata set (recomputation in backward reads it): a later
    # direct call of the model on other tokens ran on it, giving wrong logits silently.
    from tessera.parallel.sequence.data_path import SequenceParallel

    sp = SequenceParallel.__new__(SequenceParallel)  # no process group: refused before any
    sp.size, sp.exportable, sp._meta = 2, False, None
    q = torch.zeros(2, 4, 16, 8)  # (B, nh, T/sp, hs)
    with pytest.raises(SequenceParallelError, match="ran without token metadata"):
        sp.attention(q, q, q)
    sp._meta = torch.zeros(2, 8, 2, dtype=torch.long)  # the last micro-batch: 2 x 8 tokens
    with pytest.raises(SequenceParallelError, match="got 2 x 16 tokens, but the token "
                                                    "metadata is for this rank's 2 x 8"):
        sp.attention(q, q, q)


def test_strategy_rules_for_sequence_parallelism():
    with pytest.raises(StrategyError, match="sequence length 30 is not divisible by sp"):
        Strategy(sp=4).validate_for(model=preset("tiny"), seq_len=30)
    with pytest.raises(StrategyError, match="ulysses: n_heads=4 must be divisible by sp"):
        Strategy(sp=8, sp_mode="ulysses").validate_for(model=preset("tiny"), seq_len=32)
    odd_kv = preset("tiny", d_model=96, n_heads=12, n_kv_heads=3)
    with pytest.raises(StrategyError, match=r"ulysses: n_kv_heads per tp rank \(3\)"):
        Strategy(sp=4, sp_mode="ulysses").validate_for(model=odd_kv, seq_len=32)
    Strategy(sp=4, sp_mode="ring").validate_for(model=odd_kv, seq_len=32)  # ring: any heads
    Strategy(sp=2).require_available()  # the gate is open


@pytest.mark.parametrize("path", ["fused", "explicit"])
def test_block_numerics_stay_fp32_under_bf16_autocast(path, monkeypatch):
    # precision=bf16 runs the attention hook inside torch.autocast; without fp32_numerics the
    # block matmuls were cast to bf16 and failed on their fp32 out= buffers. The explicit
    # path (what GPUs run) is the one autocast reaches: CPU autocast leaves the fused aten
    # kernel alone, so only the "explicit" case can catch a lost fp32_numerics.
    from tessera.parallel.sequence import fused
    from tessera.parallel.sequence.blocks import block_backward, block_forward

    if path == "explicit":
        monkeypatch.setattr(fused, "available", lambda q: False)
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16).bfloat16()  # (B, nh, T, hs)
    k, v = torch.randn(2, 2, 8, 16).bfloat16(), torch.randn(2, 2, 8, 16).bfloat16()
    meta = torch.stack((torch.arange(8), torch.zeros(8, dtype=torch.long)), -1).expand(2, 8, 2)
    dout = torch.randn(2, 4, 8, 16).bfloat16()
    out, lse = block_forward(q, k, v, meta, meta, True, 0.25)
    grads = block_backward(q, k, v, meta, meta, True, 0.25, dout, out, lse)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ac, lse_ac = block_forward(q, k, v, meta, meta, True, 0.25)
        grads_ac = block_backward(q, k, v, meta, meta, True, 0.25, dout, out, lse)
    assert out_ac.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads_ac)
    assert torch.equal(out_ac, out) and torch.equal(lse_ac, lse)  # the same fp32 arithmetic
    assert all(torch.equal(a, b) for a, b in zip(grads_ac, grads))


def test_the_hf_entry_returns_contiguous_rows_and_names_a_mask_it_cannot_apply():
    from types import SimpleNamespace

    from tessera.parallel.sequence.policy import hf_attention

    class Attention(torch.nn.Module):
        is_causal = True

    # One rank's ring as the entry sees it: whatever it computes, (B, nh, T, hs) back.
    ring = SimpleNamespace(exportable=False, row_length=8, size=1,
                           attention=lambda q, k, v, dropout, scaling: q * 2)
    module = Attention()
    module.tessera_sequence_parallel = ring
    q = torch.randn(2, 4, 8, 16)  # (B, nh, T, hs)
    out, _ = hf_attention(module, q, q, q, None)
    # (B, T, nh, hs), laid out so that a model's .view() of it works (JetMoE's does).
    assert out.shape == (2, 8, 4, 16) and out.is_contiguous()
    out.view(2, 8, 64)
    with pytest.raises(SequenceParallelError, match="Attention received a 4D attention mask "
                                                    "or bias.*or train this model with sp=1"):
        hf_attention(module, q, q, q, torch.zeros(2, 1, 8, 8))
    with pytest.raises(SequenceParallelError, match=r"s_aux=a tensor of shape \(4,\)"):
        hf_attention(module, q, q, q, None, s_aux=torch.zeros(4))
