"""The fused CPU block path (sequence/fused.py) against the explicit matmul path (blocks.py).

Both compute a block's out and LSE, and its dq, dk, dv from the final out and LSE, in fp32.
Tolerance 2e-5: both are fp32, summing the same products in different orders (the fused
kernel in tiles with a running max, the explicit path whole rows), so they differ by a few
fp32 rounding steps of values of order 1-10.
"""

from __future__ import annotations

import pytest
import torch

from tessera.parallel.sequence import blocks, fused

TOL = 2e-5


def _meta(index: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    return torch.stack((index, segment), -1)  # (B, T, 2)


def _zigzag_first_rank(B: int, T: int, segment=None) -> torch.Tensor:
    """Rank 0 of sp=2 under zigzag holds chunks 0 and 3 of 4: indices not contiguous."""
    c = T // 2
    index = torch.cat((torch.arange(c), torch.arange(3 * c, 4 * c))).expand(B, T)
    return _meta(index, torch.zeros(B, T, dtype=torch.long) if segment is None else segment)


def _case(name: str, B=2, T=24, Tk=24):
    arange_q, arange_k = torch.arange(T).expand(B, T), torch.arange(Tk).expand(B, Tk)
    zeros_q, zeros_k = (torch.zeros(B, n, dtype=torch.long) for n in (T, Tk))
    if name == "causal_aligned":
        m = _meta(arange_q, zeros_q)
        return m, m, True, fused.CAUSAL
    if name == "causal_all_visible":  # keys wholly before the queries
        return _meta(arange_q + Tk, zeros_q), _meta(arange_k, zeros_k), True, fused.ALL
    if name == "non_causal":
        return _meta(arange_q, zeros_q), _meta(arange_k, zeros_k), False, fused.ALL
    if name == "zigzag_own_block":  # a ring's first step under zigzag: aligned, ascending
        m = _zigzag_first_rank(B, T)
        return m, m, True, fused.CAUSAL
    if name == "partly_future":  # queries in the middle of the keys: needs a mask
        return _meta(arange_q + Tk // 2, zeros_q), _meta(arange_k, zeros_k), True, fused.MASK
    if name == "padding":  # the last tokens of row 1 are padding (segment -1)
        seg = zeros_q.clone()
        seg[1, -7:] = -1
        m = _meta(arange_q, seg)
        return m, m, True, fused.MASK
    if name == "documents":  # packed documents, row 0 three of them
        seg = zeros_q.clone()
        seg[0, 5:13], seg[0, 13:] = 1, 2
        m = _meta(arange_q, seg)
        return m, m, False, fused.MASK
    if name == "all_padding_row":  # row 1 only padding: no visible key, LSE -inf
        seg = zeros_q.clone()
        seg[1] = -1
        m = _meta(arange_q, seg)
        return m, m, True, fused.MASK
    raise KeyError(name)


CASES = ["causal_aligned", "causal_all_visible", "non_causal", "zigzag_own_block",
         "partly_future", "padding", "documents", "all_padding_row"]


@pytest.mark.parametrize("n_kv", [4, 2])
@pytest.mark.parametrize("name", CASES)
def test_fused_block_equals_explicit(name, n_kv, monkeypatch):
    # 5 query rows per mask piece: several pieces per block, one of them partly padding
    monkeypatch.setattr(blocks, "piece_rows", lambda q_rows, n_keys, hs: 5)
    torch.manual_seed(0)
    meta_q, meta_k, causal, kind = _case(name)
    B, Tq, Tk, nh, hs = 2, meta_q.shape[1], meta_k.shape[1], 4, 8
    q = torch.randn(B, nh, Tq, hs)
    k, v = torch.randn(B, n_kv, Tk, hs), torch.randn(B, n_kv, Tk, hs)
    assert fused.structure(meta_q, meta_k, causal) == kind

    out_f, lse_f = fused.block_forward(q, k, v, meta_q, meta_k, causal, 0.3)
    out_e, lse_e = blocks.explicit_forward(q, k, v, meta_q, meta_k, causal, 0.3)
    assert torch.equal(torch.isinf(lse_f), torch.isinf(lse_e))  # the same empty rows
    visible = ~torch.isinf(lse_e)
    assert (lse_f[visible] - lse_e[visible]).abs().max() <= TOL
    assert (out_f - out_e).abs().max() <= TOL and not out_f.isnan().any()

    dout = torch.randn_like(q)
    grads_f = fused.block_backward(q, k, v, meta_q, meta_k, causal, 0.3, dout, out_e, lse_e)
    grads_e = blocks.explicit_backward(q, k, v, meta_q, meta_k, causal, 0.3, dout, out_e, lse_e)
    for g_f, g_e in zip(grads_f, grads_e):
        assert g_f.shape == g_e.shape and g_f.dtype == torch.float32
        assert not g_f.isnan().any() and (g_f - g_e).abs().max() <= TOL


def test_fused_gradients_match_autograd_of_dense_attention():
    # Independent of blocks.py: the fused block's gradients, given the block's own out and
    # LSE (one block = the whole attention), equal autograd through masked softmax attention.
    torch.manual_seed(1)
    meta_q, meta_k, causal, _ = _case("padding")
    q = torch.randn(2, 4, 24, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 24, 8, requires_grad=True) for _ in range(2))
    allowed = blocks.block_mask(meta_q, meta_k, causal)[:, 0]  # (B, 1, Tq, Tk)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ kr.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # all-masked rows: 0, as blocks.py
    dense = probs @ vr
    dout = torch.randn_like(dense)
    dense.backward(dout)
    out, lse = fused.block_forward(q.detach(), k.detach(), v.detach(), meta_q, meta_k,
                                   causal, 0.3)
    assert (out - dense.detach()).abs().max() <= TOL
    grads = fused.block_backward(q.detach(), k.detach(), v.detach(), meta_q, meta_k, causal,
                                 0.3, dout, out, lse)
    for mine, ref in zip(grads, (q.grad, k.grad, v.grad)):
        assert (mine - ref).abs().max() <= TOL


def test_block_functions_take_the_fused_path_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(fused, "_FORWARD", lambda *a, **kw: calls.append("f") or
                        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*a, **kw))
    meta_q, meta_k, causal, _ = _case("causal_aligned")
    q, k, v = torch.randn(2, 4, 24, 8), torch.randn(2, 4, 24, 8), torch.randn(2, 4, 24, 8)
    blocks.block_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), meta_q, meta_k, causal, 0.3)
    assert calls == ["f"]


def _compare(q, k, v, meta_q, meta_k, causal, dout, out, lse):
    """Fused against explicit given a final (out, lse): gradients within TOL, no NaN."""
    grads_f = fused.block_backward(q, k, v, meta_q, meta_k, causal, 0.3, dout, out, lse)
    grads_e = blocks.explicit_backward(q, k, v, meta_q, meta_k, causal, 0.3, dout, out, lse)
    for g_f, g_e in zip(grads_f, grads_e):
        assert not g_f.isnan().any() and (g_f - g_e).abs().max() <= TOL


@pytest.mark.parametrize("causal", [False, True])
def test_several_key_tiles_with_a_wholly_masked_first_tile(causal):
    # 1100 keys are three tiles of the kernel's 512; a document starting at token 600 leaves
    # its rows' first tile wholly masked (torch < 2.5 returned NaN there, pytorch#127055).
    # Causal: the mask path also trims each piece's keys to those not in its future.
    torch.manual_seed(2)
    T = 1100
    seg = torch.zeros(2, T, dtype=torch.long)
    seg[:, 600:] = 1
    seg[1, -50:] = -1  # and padding in one row
    meta = _meta(torch.arange(T).expand(2, T), seg)
    q, k, v = torch.randn(2, 4, T, 16), torch.randn(2, 2, T, 16), torch.randn(2, 2, T, 16)
    out_f, lse_f = fused.block_forward(q, k, v, meta, meta, causal, 0.3)
    out_e, lse_e = blocks.explicit_forward(q, k, v, meta, meta, causal, 0.3)
    assert not out_f.isnan().any() and (out_f - out_e).abs().max() <= TOL
    assert torch.equal(torch.isinf(lse_f), torch.isinf(lse_e))
    _compare(q, k, v, meta, meta, causal, torch.randn_like(q), out_e, lse_e)


def test_backward_from_the_merged_output_of_two_blocks():
    # A ring step's backward gets the *final* out and LSE, merged over blocks, not the block's
    # own: here a block of earlier keys (all visible) and the queries' own block (causal).
    torch.manual_seed(3)
    B, T = 2, 40
    earlier = _meta(torch.arange(T).expand(B, T), torch.zeros(B, T, dtype=torch.long))
    own = _meta(torch.arange(T, 2 * T).expand(B, T), torch.zeros(B, T, dtype=torch.long))
    q = torch.randn(B, 4, T, 8)
    kv = [(torch.randn(B, 2, T, 8), torch.randn(B, 2, T, 8)) for _ in range(2)]
    metas = [earlier, own]
    out = torch.zeros(B, 4, T, 8)
    lse = torch.full((B, 4, T), float("-inf"))
    for (k, v), meta_k in zip(kv, metas):
        blocks.merge_into(out, lse, *blocks.explicit_forward(q, k, v, own, meta_k, True, 0.3))
    dout = torch.randn_like(q)
    for (k, v), meta_k in zip(kv, metas):
        _compare(q, k, v, own, meta_k, True, dout, out, lse)


def test_rows_with_different_single_segments_need_no_mask():
    # Each batch row one document of its own id: the block is wholly visible (ALL).
    torch.manual_seed(4)
    seg = torch.tensor([[0] * 16, [3] * 16])
    meta = _meta(torch.arange(16).expand(2, 16), seg)
    assert fused.structure(meta, meta, False) == fused.ALL
    assert fused.structure(meta, meta, True) == fused.CAUSAL
    q, k, v = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    out_f, _ = fused.block_forward(q, k, v, meta, meta, True, 0.3)
    out_e, _ = blocks.explicit_forward(q, k, v, meta, meta, True, 0.3)
    assert (out_f - out_e).abs().max() <= TOL


def test_torch_before_2_5_takes_the_explicit_path(monkeypatch):
    q = torch.randn(1, 2, 8, 4)
    assert fused.available(q)
    monkeypatch.setattr(torch, "__version__", "2.4.1+cpu")
    assert not fused.available(q)
    monkeypatch.setattr(fused, "block_forward", lambda *a: pytest.fail("fused path taken"))
    meta = _meta(torch.arange(8).expand(1, 8), torch.zeros(1, 8, dtype=torch.long))
    blocks.block_forward(q, q, q, meta, meta, True, 0.5)
