"""Parity of ring, rsa and ulysses attention with full single-device attention.

One 4-process launch runs every case (sp = 1, 2, 4 via subgroups; worker start-up dominates).
Each case shards random q/k/v of the full sequence the way the data path does, runs the
sequence-parallel attention, back-propagates sum(out * w), and compares this rank's outputs
and gradients with a float64 reference computed from the same inputs with an explicit mask.

With attention dropout, each mode drops exactly the (query, key) pairs one device drops under
the same seed (the mask is a hash of token indices, dropout.py), so the same reference applies
with the mask multiplied in.

Also whole models (tiny, tiny-llama) on padded samples: the ranks' mean loss and gradient
equal one device's, including ranks that hold only padding.

Tolerances:
- fp32: 2e-5 absolute + 1e-4 relative. The ring sums softmax blocks in a different order
  (log-sum-exp merge) than one softmax over the row; differences are fp32 rounding, ~1e-6.
- bf16: inputs and results are bf16 (8-bit mantissa, relative step 2^-8 = 3.9e-3); internal
  math is fp32, so outputs are within about one bf16 rounding of the exact value: 1e-2 +
  2e-2 relative. Gradients go through one more bf16 rounding (the saved output in
  rowsum(dout * out)): 2e-2 + 3e-2 relative.
"""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
import torch.distributed as dist

from tessera.models import Transformer
from tessera.models.config import preset
from tessera.parallel.plan import lm_loss
from tessera.parallel.sequence import SequenceParallel, SequenceParallelError
from tessera.parallel.sequence.policy import apply_policy
from tessera.parallel.sequence import blocks, fused, ring, rsa, ulysses
from tessera.parallel.sequence.dropout import AttentionDropout
from tessera.parallel.sequence.layout import local_indices, padded_length
from tessera.testing import run_distributed

TOL = {torch.float32: dict(out=(2e-5, 1e-4), grad=(2e-5, 1e-4)),
       torch.bfloat16: dict(out=(1e-2, 2e-2), grad=(2e-2, 3e-2))}
B, NH, NKV, HS = 2, 4, 2, 8
FUNCTIONS = (ring.RingAttention, rsa.RingSelfAttention, ulysses.SeqToHeads,
             ulysses.HeadsToSeq, ulysses.LocalAttention)


def reference(q, k, v, segment, causal, keep=None):
    """Full attention in float64 with an explicitly built mask (independent of blocks.py);
    ``keep`` (B, NH, T, T): attention dropout's scaled mask, applied to the probabilities."""
    T = q.shape[2]
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    allowed = (segment[:, :, None] == segment[:, None, :]) & (segment[:, None, :] >= 0)
    if causal:
        allowed &= torch.ones(T, T, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0
    return (probs if keep is None else probs * keep.double()) @ v


def _inputs(T, segment_kind, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, NH, T, HS, generator=g)
    k, v = (torch.randn(B, NKV, T, HS, generator=g) for _ in range(2))
    w = torch.randn(B, NH, T, HS, generator=g)
    segment = torch.zeros(B, T, dtype=torch.long)
    if segment_kind == "documents":  # packed: three documents per row, different cuts
        segment[0, T // 3:] = 1
        segment[0, 2 * T // 3:] = 2
        segment[1, T // 2:] = 1
    elif segment_kind == "padding":  # random padding tokens plus two documents
        segment[:, T // 2:] = 1
        segment[torch.rand(B, T, generator=g) < 0.25] = -1
    elif segment_kind == "mostly_padding":  # only the first 3 tokens are real
        segment[:, 3:] = -1
    return q, k, v, w, segment


def _case(group, mode, causal, dtype, T, segment_kind, layout, seed=0, exportable=False,
          dropout_p=0.0):
    """Errors (out, dq, dk, dv) of this rank vs the reference, and whether any is NaN.

    ``exportable`` runs the attention through the torch.library custom ops that pipeline
    stages capture (staged.py) instead of the autograd Functions. With ``dropout_p`` the
    attention draws its dropout seed from torch's generator, seeded alike on every rank
    here, and the reference drops the same (query, key) pairs (dropout.py).
    """
    sp, r = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, w, segment = _inputs(T, segment_kind, seed)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    full = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    keep = None
    if dropout_p:
        torch.manual_seed(100 + seed)
        drawn = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))  # what attention draws
        full_meta = torch.stack((torch.arange(T).expand(B, T), segment), -1)
        keep = AttentionDropout(dropout_p, drawn).keep_scale(full_meta, full_meta, NH)
    ref = reference(*full, segment, causal, keep)
    (ref * w.double()).sum().backward()
    Tp = padded_length(T, sp, layout)
    pad = lambda t, val=0.0: torch.nn.functional.pad(t, (0, 0, 0, Tp - T), value=val)  # noqa
    idx = local_indices(Tp, sp, r, layout)
    local = [pad(t)[:, :, idx].detach().clone().requires_grad_() for t in (q, k, v)]
    seg = torch.nn.functional.pad(segment, (0, Tp - T), value=-1)
    meta = torch.stack((torch.arange(Tp).expand(B, Tp), seg), -1)[:, idx]
    sp_attn = SequenceParallel(group, mode=mode, causal=causal, layout=layout)
    sp_attn.set_tokens(meta)
    sp_attn.exportable = exportable
    torch.manual_seed(100 + seed)
    out = sp_attn.attention(*local, dropout_p)
    (out.float() * pad(w)[:, :, idx]).sum().backward()
    real = idx < T  # compare real tokens only (padding rows are 0 in both anyway)
    pairs = [(out, ref)] + [(lo.grad, fu.grad) for lo, fu in zip(local, full)]
    errors, nan = [], False
    for got, want in pairs:
        nan |= bool(got.isnan().any())
        got, want = got[:, :, real].double(), pad(want)[:, :, idx][:, :, real]
        errors.append((got - want).abs().max().item() if got.numel() else 0.0)
        errors.append((want.abs().max().item() if want.numel() else 0.0))
    return {"errors": errors, "nan": nan}


CASES = [  # (mode, causal, dtype, T, segment kind, layout)
    *[(m, True, torch.float32, 16, "none", lay) for m, lay in
      (("ring", "zigzag"), ("ring", "contiguous"), ("rsa", "contiguous"),
       ("ulysses", "contiguous"))],
    *[(m, False, torch.float32, 16, "none", "contiguous") for m in ("ring", "rsa", "ulysses")],
    *[(m, True, torch.bfloat16, 16, "none", lay) for m, lay in
      (("ring", "zigzag"), ("rsa", "contiguous"), ("ulysses", "contiguous"))],
    *[(m, True, torch.float32, 14, "padding", lay) for m, lay in
      (("ring", "zigzag"), ("rsa", "contiguous"), ("ulysses", "contiguous"))],
    ("ring", False, torch.float32, 13, "padding", "contiguous"),
    *[(m, True, torch.float32, 16, "documents", lay) for m, lay in
      (("ring", "zigzag"), ("rsa", "contiguous"), ("ulysses", "contiguous"))],
    ("ring", False, torch.float32, 16, "documents", "contiguous"),
    *[(m, True, torch.float32, 16, "mostly_padding", lay) for m, lay in
      (("ring", "zigzag"), ("ring", "contiguous"), ("rsa", "contiguous"),
       ("ulysses", "contiguous"))],
]


def _record_grad_counts(counts):
    """Wrap each Function's backward to record (#grads returned, #forward inputs)."""
    for cls in FUNCTIONS:
        original = cls.backward
        n_inputs = len(inspect.signature(cls.forward).parameters) - 1  # minus ctx

        def backward(ctx, *grads, _orig=original, _name=cls.__name__, _n=n_inputs):
            result = _orig(ctx, *grads)
            counts[_name] = (len(result), _n)
            return result

        cls.backward = staticmethod(backward)


def _refusals(group):
    """Messages of the bad inputs sequence parallelism must refuse."""
    out = {}
    attempts = {
        "zigzag_non_causal": lambda: SequenceParallel(group, "ring", causal=False,
                                                      layout="zigzag"),
        "no_padding": lambda: SequenceParallel(group, "ring", pad=False).shard(
            {"input_ids": torch.zeros(1, 13, dtype=torch.long),
             "labels": torch.zeros(1, 13, dtype=torch.long)}),
        "ulysses_heads": lambda: ulysses.ulysses_attention(
            torch.zeros(1, 6, 4, 8), torch.zeros(1, 6, 4, 8), torch.zeros(1, 6, 4, 8),
            torch.zeros(1, 4, 2, dtype=torch.long), group),
        "ulysses_kv_heads": lambda: ulysses.check_heads(12, 3, 4),
        "shard_not_in_layout": lambda: _contiguous_shard_as_zigzag(group),
        "hf_sliding_window": lambda: _hf_sliding_window(group, 4),
        "hf_window_longer_than_sequence": lambda: _hf_sliding_window(group, 16),
        # 15 real tokens, padded to 16 (zigzag over 4 ranks): a window of 15 covers them
        "hf_window_covering_real_tokens": lambda: _hf_sliding_window(group, 15, length=15),
        **_too_long(group),
        **_silent_model_refusals(group),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = None
        except SequenceParallelError as err:
            out[name] = str(err)
    return out


def _too_long(group):
    """Rows longer than the model's positions: each rank's shard fits, so the model's own
    check passed and the position lookup failed on some ranks only (an IndexError)."""
    import transformers as T

    def run(model, length, **batch):
        sp = SequenceParallel(group, "ring")
        apply_policy(model, sp)
        ids = torch.randint(0, 64, (1, length + 1))
        sp.forward_loss(model, {"input_ids": ids[:, :-1], "labels": ids[:, 1:], **batch})

    gpt2 = lambda: T.GPT2LMHeadModel(T.GPT2Config(  # noqa: E731
        vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))
    restart = torch.arange(20).remainder(10)[None]  # two packed documents of 10
    return {"too_long_reference": lambda: run(Transformer(preset("tiny", max_seq_len=16)), 20),
            "too_long_hf": lambda: run(gpt2(), 20),
            # positions of its own, all within the table: as on one device, it runs
            "long_hf_own_positions": lambda: run(gpt2(), 20, position_ids=restart),
            # its own ids past the table: the lookup would fail on some ranks only
            "hf_own_positions_too_far": lambda: run(gpt2(), 12,
                                                    position_ids=torch.arange(8, 20)[None]),
            # RoBERTa counts positions from its padding index: refused, not misnumbered
            "hf_positions_from_padding_idx": lambda: run(T.RobertaForCausalLM(T.RobertaConfig(
                vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                intermediate_size=64, is_decoder=True, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)), 8),
            **_position_dependent(run, T),
            # a per-token key of another length: each rank padded it and took its columns
            "labels_longer": lambda: run(gpt2(), 12, labels=torch.zeros(1, 13, dtype=torch.long)),
            # values with their own head size (multi-head latent attention)
            "v_head_size": lambda: run(T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
                vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=2,
                num_experts_per_tok=1, first_k_dense_replace=1, kv_lora_rank=8,
                q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=4,
                moe_intermediate_size=32, n_group=1, topk_group=1)), 16)}


def _position_dependent(run, T):
    """Models whose numbers follow each call's positions: dynamic NTK RoPE and Phi-3's
    longrope (frequencies from the call's largest position id), Llama 4's attention
    temperature (scaled by index in the call). Each sp rank's call sees its own shard."""
    llama = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2)
    dynamic = lambda: T.LlamaForCausalLM(T.LlamaConfig(  # noqa: E731
        **llama, max_position_embeddings=16,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}))
    longrope = lambda: T.Phi3ForCausalLM(T.Phi3Config(  # noqa: E731
        **llama, max_position_embeddings=64, pad_token_id=0, original_max_position_embeddings=16,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
                         "original_max_position_embeddings": 16}))
    tuned = lambda: T.Llama4ForCausalLM(T.Llama4TextConfig(  # noqa: E731
        **llama, intermediate_size_mlp=64, head_dim=8, num_local_experts=2,
        no_rope_layers=[0], moe_layers=[], floor_scale=4, attn_temperature_tuning=True))
    return {"hf_dynamic_rope_past_original": lambda: run(dynamic(), 20),
            "hf_dynamic_rope_within_original": lambda: run(dynamic(), 16),
            "hf_longrope_past_original": lambda: run(longrope(), 20),
            "hf_temperature_past_floor": lambda: run(tuned(), 8)}


def _silent_model_refusals(group):
    """Models the policies used to accept and then train wrongly, without an error."""
    import transformers as T

    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)

    def run(model, sp=None):
        sp = sp or SequenceParallel(group, "ring")
        apply_policy(model, sp)
        ids = torch.randint(0, 64, (1, 17))
        sp.forward_loss(model.train(), {"input_ids": ids[:, :-1], "labels": ids[:, 1:]})

    return {
        # GPT-Neo computes attention itself: transformers keeps "eager" (only logs it).
        "hf_no_interface": lambda: run(T.GPTNeoForCausalLM(T.GPTNeoConfig(
            vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
            attention_types=[[["global"], 2]], embed_dropout=0.0, attention_dropout=0.0,
            resid_dropout=0.0))),
        # LFM2's short convolution mixes tokens outside attention.
        "hf_other_mixer": lambda: run(T.Lfm2ForCausalLM(T.Lfm2Config(
            **tiny, layer_types=["conv", "full_attention"]))),
        # Qwen2-MoE applies its window through the mask only, not as a keyword.
        "hf_window_in_mask": lambda: run(T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            **tiny, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts=2, num_experts_per_tok=1, use_sliding_window=True, sliding_window=2,
            max_window_layers=2))),
        # Residual dropout outside a random stream per rank: the same mask at the same local
        # position on every rank.
        "dropout": lambda: run(T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.5, embd_pdrop=0.0,
            attn_pdrop=0.0))),
        # GPT-2's default dropout (attention included) inside one (the Trainer's way): runs.
        "dropout_in_rank_stream": lambda: _in_rank_stream(group, lambda: run(
            T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4)))),
        "causal_false": lambda: run(Transformer(preset("tiny")),
                                    SequenceParallel(group, "ring", causal=False)),
        # 4 heads over tp=2 leave 2 per rank, not divisible by sp=4: named with the totals.
        "ulysses_heads_under_tp": lambda: apply_policy(
            Transformer(preset("tiny")), SequenceParallel(group, "ulysses", head_ways=2)),
        # 24 heads pass (12 per tp rank); 6 kv heads leave 3: the kv rule, by its own name.
        "ulysses_kv_heads_under_tp": lambda: apply_policy(
            Transformer(preset("tiny", d_model=96, n_heads=24, n_kv_heads=6)),
            SequenceParallel(group, "ulysses", head_ways=2)),
        # OPT draws dropout with F.dropout (no module): its config says so.
        "hf_functional_dropout": lambda: run(T.OPTForCausalLM(T.OPTConfig(
            vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
            num_attention_heads=4, word_embed_proj_dim=32))),
        # Llama 4's chunks exist in its mask only.
        "hf_chunked_attention": lambda: run(T.Llama4ForCausalLM(T.Llama4TextConfig(
            **tiny, head_dim=8, attention_chunk_size=8, intermediate_size_mlp=64,
            num_local_experts=2, no_rope_layers=[1, 1], moe_layers=[]))),
        # BART's decoder numbers positions itself: every rank would count from 0.
        "hf_no_position_ids": lambda: run(T.BartForCausalLM(T.BartConfig(
            vocab_size=64, d_model=32, decoder_layers=1, decoder_attention_heads=4,
            decoder_ffn_dim=64, encoder_layers=1, encoder_attention_heads=4,
            encoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))),
        # StableLM calls the interface but leaves _supports_attention_backend False: runs.
        "hf_stablelm_runs": lambda: run(T.StableLmForCausalLM(T.StableLmConfig(**tiny))),
    }


def _in_rank_stream(group, body):
    from tessera.parallel.rank_rng import rank_stream

    with rank_stream({"sp": dist.get_rank(group)}):
        body()


def _contiguous_shard_as_zigzag(group):
    """ring_attention told zigzag about a contiguous shard (its skips would be wrong)."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    index = local_indices(16, sp, rank, "contiguous")
    meta = torch.stack((index, torch.zeros_like(index)), -1)[None]
    q = torch.zeros(1, 2, len(index), 8)
    ring.ring_attention(q, q, q, meta, group, causal=True, layout="zigzag")


def _hf_sliding_window(group, window, length=16):
    """A Hugging Face Mistral with a sliding window over 16 tokens: one shorter than the
    sequence changes attention, which the ring does not compute (refused at the first
    attention call); one as long changes nothing (runs)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           sliding_window=window)
    model = MistralForCausalLM(config)
    sp = SequenceParallel(group, "ring")
    apply_policy(model, sp)
    ids = torch.randint(0, 64, (1, length + 1))
    sp.forward_loss(model, {"input_ids": ids[:, :-1], "labels": ids[:, 1:]})


def _model_case(group, mode, name, real):
    """A whole model on one sample of 13 tokens of which ``real`` are real (padding after).

    Returns (|mean of the ranks' losses - single-device loss|, max |mean gradient - single
    device gradient|, any NaN). Causal attention and right padding make the single-device
    loss over the real tokens the exact reference.
    """
    torch.manual_seed(3)
    model = Transformer(preset(name))
    ref_model = copy.deepcopy(model)
    ids = torch.randint(0, 256, (1, 14))
    inputs, labels = ids[:, :-1], ids[:, 1:].clone()
    mask = torch.zeros_like(inputs)
    mask[:, :real] = 1
    labels[mask == 0] = -100
    ref = lm_loss(ref_model(inputs), labels)
    return _sp_errors(group, mode, model, ref, ref_model,
                      {"input_ids": inputs, "labels": labels, "attention_mask": mask})


def _sp_errors(group, mode, model, ref, ref_model, batch):
    """Backward of ``ref`` (the one-device loss of ``ref_model``), then ``model`` under
    sequence parallelism on ``batch``: (|mean of the ranks' losses - ref|, max |mean
    gradient - ref gradient|, any NaN)."""
    ref.backward()
    sp = SequenceParallel(group, mode)
    apply_policy(model, sp)
    loss = sp.forward_loss(model, batch)
    loss.backward()
    size = dist.get_world_size(group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(grads, group=group)  # the dp x sp gradient average DDP does
    ref_grads = torch.cat([p.grad.flatten() for p in ref_model.parameters()])
    return ((total / size - ref).abs().item(), (grads / size - ref_grads).abs().max().item(),
            bool(loss.isnan() or grads.isnan().any()))


def _hf_left_padding(group, mode, kind, _real=None):
    """Hugging Face models on two rows, the second left-padded, against their own forward
    with the attention mask on one device: OPT numbers positions over the mask (padding
    shifts them), Llama 0..T-1 whatever the mask."""
    import transformers as T

    torch.manual_seed(5)
    model = (T.OPTForCausalLM(T.OPTConfig(
        vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)) if kind == "hf-opt" else
        T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)))
    ref_model = copy.deepcopy(model)
    ids = torch.randint(2, 64, (2, 14))
    inputs, labels = ids[:, :-1], ids[:, 1:].clone()
    mask = torch.ones_like(inputs)
    mask[1, :4] = 0  # (2, 13): row 1 starts with 4 padding tokens
    labels[mask == 0] = -100
    ref = lm_loss(ref_model(inputs, attention_mask=mask).logits, labels)
    return _sp_errors(group, mode, model, ref, ref_model,
                      {"input_ids": inputs, "labels": labels, "attention_mask": mask})


def _hf_packed(group, mode, kind, _real=None):
    """A Hugging Face Llama on rows packed as DataCollatorWithFlattening packs them: position
    ids restarting at each document, no attention mask. Its own one-device forward keeps each
    document to itself with use_cache=False (transformers' masking reads the restarts; until
    2026-11-28 sequence parallelism let every document attend to the ones before it in the
    row), and attends across them with a cache ("hf-packed-cache"), as sp does then too."""
    import transformers as T

    torch.manual_seed(6)
    model = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=kind.endswith("cache")))
    ref_model = copy.deepcopy(model)
    ids = torch.randint(2, 64, (2, 14))
    inputs, labels = ids[:, :-1], ids[:, 1:].clone()
    # (2, 13): row 0 documents of 5, 4 and 4 tokens, row 1 of 9 and 4
    positions = torch.tensor([[*range(5), *range(4), *range(4)], [*range(9), *range(4)]])
    labels[positions.roll(-1, dims=1) == 0] = -100  # no label across a document's end
    ref = lm_loss(ref_model(inputs, position_ids=positions).logits, labels)
    return _sp_errors(group, mode, model, ref, ref_model,
                      {"input_ids": inputs, "labels": labels, "position_ids": positions})


# The custom ops of pipeline stages (sequence/staged.py), on the harder inputs.
OP_CASES = [("ring", True, torch.float32, 14, "padding", "zigzag"),
            ("ring", False, torch.float32, 16, "documents", "contiguous"),
            ("rsa", True, torch.float32, 14, "padding", "contiguous"),
            ("ulysses", True, torch.float32, 16, "documents", "contiguous")]


# The explicit fp32 block path, which GPUs run (CPU blocks take the fused kernel).
EXPLICIT_CASES = [("ring", True, torch.float32, 14, "padding", "zigzag"),
                  ("ring", False, torch.float32, 16, "documents", "contiguous"),
                  ("ring", True, torch.float32, 16, "mostly_padding", "zigzag"),
                  ("ulysses", True, torch.float32, 16, "documents", "contiguous")]


# Attention dropout: every mode, with padding or documents, against the same dropped pairs.
DROPOUT_CASES = [("ring", True, torch.float32, 14, "padding", "zigzag"),
                 ("ring", False, torch.float32, 16, "documents", "contiguous"),
                 ("rsa", True, torch.float32, 14, "padding", "contiguous"),
                 ("ulysses", True, torch.float32, 16, "documents", "contiguous"),
                 ("ring", True, torch.bfloat16, 16, "none", "zigzag")]


MODEL_CASES = [(4, m, "tiny-llama", real) for m in ("ring", "rsa", "ulysses") for real in (13, 2)]
MODEL_CASES += [(2, "ring", "tiny", 13), (2, "ulysses", "tiny", 5)]
# Hugging Face models with a left-padded row (until 2026-11-28 OPT's positions were 0..T-1
# under sp, its own forward counts them over the mask)
MODEL_CASES += [(2, m, kind, None) for m in ("ring", "ulysses") for kind in ("hf-opt",
                                                                           "hf-llama")]
MODEL_CASES += [(2, "ring", "hf-packed", None), (4, "rsa", "hf-packed", None),
                (2, "ring", "hf-packed-cache", None)]


def _all_cases(rank, world_size):
    torch.manual_seed(0)
    blocks.piece_rows = lambda q_rows, n_keys, hs: 3  # exercise query tiling at test lengths
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([i]) for i in range(world_size)]
    groups = {1: singles[rank], 2: pairs[rank // 2], 4: dist.group.WORLD}
    counts: dict = {}
    _record_grad_counts(counts)
    results = {}
    for sp, group in groups.items():
        for case in CASES:
            results[(sp,) + case] = _case(group, *case)
    ops = {(sp,) + case: _case(groups[sp], *case, exportable=True)
           for sp in (2, 4) for case in OP_CASES}
    model_cases = {"hf-packed": _hf_packed, "hf-packed-cache": _hf_packed,
                   "hf-opt": _hf_left_padding, "hf-llama": _hf_left_padding}
    models = {case: model_cases.get(case[2], _model_case)(groups[case[0]], *case[1:])
              for case in MODEL_CASES}
    dropout = {(sp,) + case: _case(groups[sp], *case, dropout_p=0.2)
               for sp in (1, 2, 4) for case in DROPOUT_CASES}
    dropout_ops = {(sp,) + case: _case(groups[sp], *case, exportable=True, dropout_p=0.2)
                   for sp in (2, 4) for case in DROPOUT_CASES[:4]}
    fused_available = fused.available
    fused.available = lambda q: False  # every block through blocks.explicit_*
    try:
        explicit = {(sp,) + case: _case(groups[sp], *case)
                    for sp in (2, 4) for case in EXPLICIT_CASES}
    finally:
        fused.available = fused_available
    return {"results": results, "counts": counts, "refusals": _refusals(groups[4]),
            "models": models, "ops": ops, "explicit": explicit, "dropout": dropout,
            "dropout_ops": dropout_ops}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_cases, world_size=4, timeout=300)


def _label(key):
    sp, mode, causal, dtype, T, seg, layout = key
    return f"sp={sp} {mode} {'causal' if causal else 'full'} {dtype} T={T} {seg} {layout}"


@pytest.mark.slow
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_outputs_and_gradients_match_full_attention(runs, sp):
    assert _check_errors(runs, "results", sp) == 4 * len(CASES)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 4])
def test_custom_ops_of_pipeline_stages_match_full_attention(runs, sp):
    assert _check_errors(runs, "ops", sp) == 4 * len(OP_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 4])
def test_explicit_block_path_gpus_run_matches_full_attention(runs, sp):
    assert _check_errors(runs, "explicit", sp) == 4 * len(EXPLICIT_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_attention_dropout_drops_the_same_pairs_as_one_device(runs, sp):
    assert _check_errors(runs, "dropout", sp) == 4 * len(DROPOUT_CASES)
    if sp > 1:
        assert _check_errors(runs, "dropout_ops", sp) == 4 * 4


def _check_errors(runs, kind, sp) -> int:
    """Assert every case of ``kind`` at ``sp`` is within tolerance; returns how many."""
    checked = 0
    for rank_result in runs:
        for key, res in rank_result[kind].items():
            if key[0] != sp:
                continue
            assert not res["nan"], _label(key)
            out_tol, grad_tol = TOL[key[3]]["out"], TOL[key[3]]["grad"]
            errs = res["errors"]
            for i, name in enumerate(("out", "dq", "dk", "dv")):
                atol, rtol = out_tol if name == "out" else grad_tol
                err, scale = errs[2 * i], errs[2 * i + 1]
                assert err <= atol + rtol * scale, f"{_label(key)} {name}: {err:.3g}"
            checked += 1
    return checked


@pytest.mark.slow
def test_a_rank_with_only_padding_gives_zeros_not_nan(runs):
    # T=3 real tokens over sp=4: with either layout some rank holds padding only.
    keys = [k for k in runs[3]["results"] if k[0] == 4 and k[5] == "mostly_padding"]
    assert len(keys) == 4
    for key in keys:
        assert not runs[3]["results"][key]["nan"], _label(key)


@pytest.mark.slow
def test_every_autograd_function_returns_one_gradient_per_input(runs):
    counts = runs[0]["counts"]
    assert set(counts) == {cls.__name__ for cls in FUNCTIONS}
    for name, (returned, inputs) in counts.items():
        assert returned == inputs, f"{name}: {returned} gradients for {inputs} inputs"


@pytest.mark.slow
def test_bad_input_is_refused_with_the_rule(runs):
    msgs = runs[0]["refusals"]
    assert "zigzag needs causal=True" in msgs["zigzag_non_causal"]
    assert "must be divisible by 8" in msgs["no_padding"]
    assert "padding is disabled" in msgs["no_padding"]
    assert "n_heads=6 must be divisible by sp=4" in msgs["ulysses_heads"]
    assert "n_kv_heads=3 must divide or be divisible by sp=4" in msgs["ulysses_kv_heads"]
    assert "not the zigzag layout's" in msgs["shard_not_in_layout"]
    assert "sliding attention window (sliding_window=4) over a sequence of 16" in \
        msgs["hf_sliding_window"]
    assert msgs["hf_window_longer_than_sequence"] is None
    assert msgs["hf_window_covering_real_tokens"] is None  # was refused over 16 (padded)
    assert "sequence length 20 exceeds the model's 16 positions (max_seq_len)" in \
        msgs["too_long_reference"]
    assert "exceeds the model's 16 positions (position table transformer.wpe)" in \
        msgs["too_long_hf"]
    assert msgs["long_hf_own_positions"] is None
    assert "sequence length 20 exceeds the model's 16 positions" in \
        msgs["hf_own_positions_too_far"]
    assert "numbers positions from its input ids, after padding_idx=1" in \
        msgs["hf_positions_from_padding_idx"]
    # Frequencies or scales that follow each call's positions: rows past the point where
    # they start to change are refused (before, up to 1.4e-2 off in a gradient, silently)
    assert ("exceeds the model's 16 positions (model.rotary_emb's rope_type 'dynamic' "
            "changes its frequencies past 16 positions") in msgs["hf_dynamic_rope_past_original"]
    assert msgs["hf_dynamic_rope_within_original"] is None
    assert "rope_type 'longrope' changes its frequencies past 16" in \
        msgs["hf_longrope_past_original"]
    assert "exceeds the model's 3 positions" in msgs["hf_temperature_past_floor"]
    assert "temperature tuning" in msgs["hf_temperature_past_floor"]
    assert "batch labels has shape (1, 13), but input_ids is (1, 12)" in msgs["labels_longer"]
    assert "head sizes q 16, k 16, v 4" in msgs["v_head_size"]
    assert "not through transformers' AttentionInterface" in msgs["hf_no_interface"]
    assert "mixes tokens outside attention (layer types ['conv'])" in msgs["hf_other_mixer"]
    assert "sliding attention window (sliding_window=2) over a sequence of 16" in \
        msgs["hf_window_in_mask"]
    assert "dropout (transformer.h.0.attn.resid_dropout (p=0.5)" in msgs["dropout"]
    assert "needs a random stream per sp rank" in msgs["dropout"]
    assert msgs["dropout_in_rank_stream"] is None
    assert "causal language models" in msgs["causal_false"]
    assert "n_heads must be divisible by sp x tp = 8" in msgs["ulysses_heads_under_tp"]
    assert ("the model's n_kv_heads=6 split over tp=2 leave 3 kv heads per tp rank, which "
            "must divide or be divisible by sp=4") in msgs["ulysses_kv_heads_under_tp"]
    assert "dropout (model.decoder.dropout=0.1" in msgs["hf_functional_dropout"]
    assert "takes no position_ids" in msgs["hf_no_position_ids"]
    assert "chunked attention (attention_chunk_size=8) over a sequence of 16" in \
        msgs["hf_chunked_attention"]
    assert msgs["hf_stablelm_runs"] is None


@pytest.mark.slow
@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: f"sp{c[0]}-{c[1]}-{c[2]}-real{c[3]}")
def test_model_loss_and_gradients_over_local_tokens_match_one_device(runs, case):
    # fp32 model of 2 layers: differences are rounding of reordered sums (~1e-7); 1e-5 on a
    # loss of about 5.5 and 1e-5 on gradients of about 1e-2 leave room for that only.
    loss_err, grad_err, nan = runs[0]["models"][case]
    assert not nan
    assert loss_err < 1e-5, loss_err
    assert grad_err < 1e-5, grad_err
