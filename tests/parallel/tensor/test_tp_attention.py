"""1D tp's attention dropout op (tensor/attention.py) in one process: numerics, refusals, price.

Multi-rank parity with one device is in test_tp_layers.py, training in
test_tp_dropout_training.py.

Tolerance: the op's fp32 explicit (dropout) or fused (no dropout) block against a float64
dense reference, 1e-5 absolute + 1e-4 relative, as test_attention_dropout.py: the block sums
in pieces of rows and in another order.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tessera.parallel.pipeline.cost import matmul_flops
from tessera.parallel.sequence.dropout import AttentionDropout
from tessera.parallel.tensor.attention import (SEED_RANGE, HeadGroupAttention,
                                               attention_dropout_p, head_dropout_attention,
                                               hf_attention)
from tessera.parallel.tensor.policy import PolicyError

B, NH, NKV, T, HS = 2, 4, 2, 24, 8
TOL = dict(atol=1e-5, rtol=1e-4)


def _inputs(heads: int = NH, kv: int = NKV):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, heads, T, HS, generator=g)
    k, v = (torch.randn(B, kv, T, HS, generator=g) for _ in range(2))
    return q, k, v, torch.randn(B, heads, T, HS, generator=g)  # w: weights of the loss


def _reference(q, k, v, keep):
    """float64 causal attention, probabilities multiplied by ``keep`` (B, nh, T, T)."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(HS)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return (torch.softmax(scores, -1) * keep.double()) @ v


def _keep(seed: int, heads: int) -> torch.Tensor:
    index = torch.arange(T).expand(B, T)
    meta = torch.stack((index, torch.zeros_like(index)), -1)  # (B, T, 2)
    return AttentionDropout(0.3, seed).keep_scale(meta, meta, heads)  # (B, heads, T, T)


def _grads(fn, inputs, w):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out * w.to(out.dtype)).sum().backward()
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_head_group_drops_the_pairs_one_device_drops_on_those_heads(rank):
    # Rank ``rank`` of tp=2 holds query heads 2r, 2r+1 and kv head r of a 4-head layer.
    q, k, v, w = _inputs()
    torch.manual_seed(3)
    seed = int(torch.randint(0, SEED_RANGE, (), dtype=torch.int64))  # as the op draws it
    heads, kv = slice(2 * rank, 2 * rank + 2), slice(rank, rank + 1)
    local = (q[:, heads], k[:, kv], v[:, kv])
    keep = _keep(seed, NH)[:, heads]
    ref, ref_grads = _grads(lambda *t: _reference(*t, keep), local, w[:, heads])
    torch.manual_seed(3)
    out, grads = _grads(lambda *t: head_dropout_attention(*t, 0.3, head_offset=2 * rank),
                        local, w[:, heads])
    torch.testing.assert_close(out.double(), ref, **TOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want.double(), **TOL)
    # The other group's mask would be another: heads are not interchangeable.
    assert not torch.equal(_keep(seed, NH)[:, 0:2], _keep(seed, NH)[:, 2:4])


def test_without_dropout_the_op_is_plain_causal_attention_and_draws_nothing():
    q, k, v, w = _inputs()
    ones = torch.ones(B, NH, T, T)
    ref, ref_grads = _grads(lambda *t: _reference(*t, ones), (q, k, v), w)
    state = torch.get_rng_state()
    out, grads = _grads(lambda *t: head_dropout_attention(*t, 0.0, head_offset=0), (q, k, v), w)
    assert torch.equal(torch.get_rng_state(), state)  # no seed drawn
    torch.testing.assert_close(out.double(), ref, **TOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want.double(), **TOL)


def test_the_reference_hook_keeps_its_fallback_unless_dropping_or_exportable():
    calls = []

    def fallback(q, k, v, dropout_p=0.0):
        calls.append(dropout_p)
        return q

    q, k, v, _ = _inputs()
    assert HeadGroupAttention(1, fallback)(q, k, v, dropout_p=0.0) is q and calls == [0.0]
    assert HeadGroupAttention(1, fallback)(q, k, v, dropout_p=0.2).shape == q.shape
    assert HeadGroupAttention(1, fallback, exportable=True)(q, k, v).shape == q.shape
    assert calls == [0.0]


def test_bad_input_is_refused_with_the_reason():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"p must lie in \[0, 1\), got 1.0"):
        head_dropout_attention(q, k, v, 1.0, 0)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        head_dropout_attention(q[:, :3], k, v, 0.1, 0)
    module = nn.Module()
    module.tessera_tp_attention = HeadGroupAttention(0, None)
    mask = torch.zeros(B, 1, T, T)
    with pytest.raises(PolicyError, match="an attention mask or non-causal attention"):
        hf_attention(module, q, k, v, mask, dropout=0.1)
    with pytest.raises(PolicyError, match="sliding_window"):
        hf_attention(module, q, k, v, None, dropout=0.1, sliding_window=8)


def test_attention_dropout_is_read_from_each_architectures_attribute():
    gpt2, llama, ref, none = nn.Module(), nn.Module(), nn.Module(), nn.Module()
    gpt2.attn_dropout, gpt2.resid_dropout = nn.Dropout(0.1), nn.Dropout(0.2)
    llama.attention_dropout = 0.3
    ref.dropout = 0.4
    assert [attention_dropout_p(m) for m in (gpt2, llama, ref, none)] == [0.1, 0.3, 0.4, 0.0]


def test_the_pipeline_prices_the_op_like_sdpa():
    class Attend(nn.Module):
        def forward(self, q, k, v):
            return head_dropout_attention(q, k, v, 0.1, 0)

    q, k, v, _ = _inputs()
    graph = torch.export.export(Attend(), (q, k, v)).graph
    node = next(n for n in graph.nodes if "tp_dropout_attention" in str(n.target))
    assert matmul_flops(node) == 4.0 * B * NH * T * HS * T  # q k^T and p v


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_under_bf16_autocast_the_op_computes_in_fp32_and_returns_bf16(p):
    # On bf16 inputs the op equals itself on the same values in fp32 but for the rounding of
    # the output to bf16: relative 2^-8 (8 mantissa bits). The gradients also read that
    # rounded output, saved in q's dtype as sp's ring op saves it, in the row term
    # rowsum(dO * out) (blocks.py): up to hs x 2^-9 x |out| = 1.6% of |out| (hs = 8), times
    # scale x |k| (about 1) in dq and dk: 3e-2 absolute (1.3e-2 seen). What this checks is
    # that autocast neither crashes the op nor lowers its inner precision to bf16.
    q, k, v, _ = (t.bfloat16() for t in _inputs())
    low = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(1)
        out = head_dropout_attention(*low, p, head_offset=2)
    out.float().sum().backward()
    full = [t.float().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(1)
    ref = head_dropout_attention(*full, p, head_offset=2)
    ref.sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in low)
    torch.testing.assert_close(out.float(), ref.detach(), rtol=2 ** -8, atol=1e-6)
    for a, b in zip(low, full):
        torch.testing.assert_close(a.grad.float(), b.grad, rtol=2 ** -8, atol=3e-2)


def test_the_op_and_its_fake_agree_on_strides_and_dtypes():
    # Pipeline capture traces the fake: its outputs must match the real op's layout (the CPU
    # flash kernel's LSE comes back transposed and is made contiguous). Without dropout: with
    # it the backward reads the seed's value, which opcheck's dynamic AOT test rejects.
    from tessera.parallel.tensor.attention import dropout_attention_op

    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(2))
    # Contiguous, and as the models pass them: (B, T, n, hs).transpose(1, 2)
    laid_out = [torch.randn(2, 16, t.shape[1], 8).transpose(1, 2).requires_grad_()
                for t in (q, k, v)]
    for q, k, v in ((q, k, v), laid_out):
        torch.library.opcheck(dropout_attention_op, (q, k, v, 8 ** -0.5, 0.0, 0, None),
                              test_utils=("test_schema", "test_faketensor",
                                          "test_autograd_registration"))


def _gpt2_with_attention_dropout():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                        attn_pdrop=0.1, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(config)


def test_hugging_face_padding_masks_are_applied_or_refused_never_dropped():
    # The op's mask function: transformers hands a padding mask to the attention, where the
    # SDPA fallback (eval) applies it and the dropout path refuses it; plain causal calls
    # and torch.export (pipeline capture) get no mask.
    import copy

    from tessera.parallel.tensor.attention import install_head_dropout

    original = _gpt2_with_attention_dropout().eval()
    model = copy.deepcopy(original)
    assert install_head_dropout(model, [b.attn for b in model.transformer.h], head_rank=0)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    with torch.no_grad():
        want = original(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
        unmasked = original(ids).logits
    assert (want - unmasked)[0].abs().max() > 1e-3  # the mask matters to this input
    torch.testing.assert_close(got, want)  # same kernel, same mask
    model.train()
    with pytest.raises(PolicyError, match="an attention mask or non-causal attention"):
        model(ids, attention_mask=mask)
    assert model(ids).logits.shape == (2, 10, 64)  # plain causal: dropped, not refused
    exported = torch.export.export(model, (ids,))  # as pipeline capture does
    assert any("tp_dropout_attention" in str(n.target) for n in exported.graph.nodes)


def test_under_torch_compile_hugging_face_masks_are_kept():
    # Only export's capture of a whole unpadded sequence goes without a mask: compiled, a
    # packed-sequence mask (documents restarting their positions) still reaches the attention.
    import copy

    from tessera.parallel.tensor.attention import install_head_dropout

    original = _gpt2_with_attention_dropout().eval()
    model = copy.deepcopy(original)
    install_head_dropout(model, [b.attn for b in model.transformer.h], head_rank=0)
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])  # two documents
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        want = original(ids, position_ids=packed).logits
        assert (want - original(ids).logits).abs().max() > 1e-3  # packing matters here
        torch.testing.assert_close(compiled(ids, position_ids=packed).logits, want)
    model.train()
    with pytest.raises(PolicyError, match="an attention mask or non-causal attention"):
        compiled(ids, position_ids=packed)
