"""Attention dropout under 1D tensor parallelism: one mask per head, not one per rank.

1D tp peers draw from one random stream (parallel/rank_rng.py: the residual stream they
replicate must be dropped alike). Each holds its own group of heads, so attention dropout
drawn from that stream (SDPA's ``dropout_p``, ``F.dropout`` on the probabilities) would give
head group 2 on rank 1 the mask of head group 1 on rank 0: masks correlated across heads,
unlike one device.

So while a model drops attention probabilities (p > 0, training), its attention runs the
hashed dropout of sequence parallelism (sequence/dropout.py): a (query, key) pair of head h
is kept when a hash of (seed, batch row, h, query index, key index) clears p. ``h`` is the
head's index in the layer (rank r's local head j is head r * nh/tp + j), and the seed is
drawn from the shared stream, so every tp rank holds the same seed and together they drop
the pairs one device would drop with that seed over all heads. The attention itself is
sequence/blocks.py's explicit fp32 path on the whole sequence as one block, forward and
backward (the backward regenerates the mask). It is one custom op, so pipeline capture keeps
it with its backward, and the seed is a ``randint`` node of the captured graph: drawn on each
run, repeated by recomputation, which restores the generator's state.

With p = 0, or in eval, SDPA's fused kernel runs: the reference model's own attention, for
Hugging Face models transformers' ``sdpa`` attention (whatever implementation the model was
built with; a model without attention dropout is left alone). Under pipeline capture
(pp > 1) the op runs then too, without dropout, as sequence/blocks.py's block (the fused
flash kernel on CPU): the stages' eval graph must hold the nodes of the training graph the
partition was made on. The explicit path is slower than fused SDPA (docs/tensor_parallel.md
gives a measurement).

Policies: the reference model through ``Attention.attention_fn``; Hugging Face GPT-2 / Llama
through transformers' AttentionInterface, with a mask function of the same name: plain
causal attention gets no mask (tp's loss passes input_ids only), a padding mask reaches the
attention, where the dropout path refuses it and the SDPA fallback applies it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tessera.parallel.sequence.blocks import block_backward, block_forward
from tessera.parallel.sequence.dropout import AttentionDropout
from tessera.parallel.tensor.policy import PolicyError

HF_ATTENTION_NAME = "tessera_tp_head_dropout"
SEED_RANGE = 2 ** 62  # seeds as sequence parallelism draws them (SequenceParallel.attention)


def head_dropout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float,
                           head_offset: int, scale: float | None = None) -> torch.Tensor:
    """Causal attention of q (B, nh, T, hs), k, v (B, nkv, T, hs) with hashed dropout.

    Args:
        p: attention dropout probability, in [0, 1) (0: none, and no seed drawn).
        head_offset: the layer's index of q's first head (tp rank x local heads).
        scale: score multiplier (default hs ** -0.5).

    Returns:
        (B, nh, T, hs) in q's dtype.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads "
                         f"({k.shape[1]})")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"attention dropout p must lie in [0, 1), got {p}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # From torch's generator, so recomputation that restores its state draws it again.
    seed = torch.randint(0, SEED_RANGE, (), dtype=torch.int64) if p > 0 else None
    return dropout_attention_op(q, k, v, scale, p, head_offset, seed)[0]


def _causal_meta(q: torch.Tensor) -> torch.Tensor:
    """(B, T, 2) token metadata of blocks.py for a whole unpadded sequence: [index, 0]."""
    B, T = q.shape[0], q.shape[2]
    index = torch.arange(T, device=q.device).expand(B, T)  # (B, T)
    return torch.stack((index, torch.zeros_like(index)), dim=-1)


def _dropout(p: float, seed: torch.Tensor | None, head_offset: int
             ) -> AttentionDropout | None:
    return AttentionDropout(p, int(seed), head_offset) if p > 0 else None


@torch.library.custom_op("tessera::tp_dropout_attention", mutates_args=())
def dropout_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         p: float, head_offset: int, seed: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, nh, T, hs) in q's dtype and lse (B, nh, T) fp32 of :func:`head_dropout_attention`
    (the LSE is kept for the backward). The whole sequence is one block of blocks.py: with
    dropout its explicit path, without the fused kernel on CPU."""
    meta = _causal_meta(q)
    out, lse = block_forward(q, k, v, meta, meta, True, scale, _dropout(p, seed, head_offset))
    # Contiguous, as the fake says: CPU's flash kernel returns the LSE transposed, and its
    # output in q's layout (the models pass (B, T, nh, hs).transpose(1, 2)).
    return out.to(q.dtype).contiguous(), lse.contiguous()


@dropout_attention_op.register_fake
def _(q, k, v, scale, p, head_offset, seed):
    # Contiguous whatever q's strides, as the op returns them.
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, *ctx.args = inputs  # args: scale, p, head_offset, seed
    ctx.save_for_backward(q, k, v, *output)


def _backward(ctx, dout, _dlse):  # lse is a by-product: nothing differentiates it
    q, k, v, out, lse = ctx.saved_tensors
    scale, p, head_offset, seed = ctx.args
    meta = _causal_meta(q)
    dq, dk, dv = block_backward(q, k, v, meta, meta, True, scale, dout.contiguous(), out, lse,
                                _dropout(p, seed, head_offset))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


dropout_attention_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------ policies
class HeadGroupAttention:
    """A reference ``Attention.attention_fn``: hashed dropout on this rank's heads while
    dropping, else the function it replaces.

    Args:
        head_rank: this rank's tp rank (its heads are head_rank * local heads onwards).
        fallback: the attention function replaced (default SDPA), run when nothing drops
            (None: the caller runs its own, as :func:`hf_attention` does).
        exportable: under pipeline capture: the op runs without dropout too (module doc).
    """

    def __init__(self, head_rank: int, fallback: Callable | None, exportable: bool = False
                 ) -> None:
        self.head_rank, self.fallback, self.exportable = head_rank, fallback, exportable

    def drops(self, dropout_p: float) -> bool:
        """Whether a call with ``dropout_p`` takes the op rather than the fallback."""
        return dropout_p > 0 or self.exportable

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
        if not self.drops(dropout_p):
            return self.fallback(q, k, v, dropout_p=0.0)
        return head_dropout_attention(q, k, v, dropout_p, self.head_rank * q.shape[1], scale)


# Keyword arguments transformers passes for attention this path does not compute.
_VARIANTS = ("sliding_window", "softcap", "s_aux", "sinks", "attention_chunk_size")


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                 scaling: float | None = None, dropout: float = 0.0, **kwargs
                 ) -> tuple[torch.Tensor, None]:
    """transformers AttentionInterface entry: (B, nh, T, hs) in, (B, T, nh, hs) out.

    Without dropout it is transformers' SDPA attention; with dropout the hashed path, which
    computes full causal attention only (anything else is refused, not approximated).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    heads: HeadGroupAttention = module.tessera_tp_attention
    if not heads.drops(dropout):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=0.0, scaling=scaling, **kwargs)
    used = [name for name in _VARIANTS if kwargs.get(name) is not None]
    if attention_mask is not None or used or not getattr(module, "is_causal", True):
        what = f"{', '.join(used)}" if used else "an attention mask or non-causal attention"
        raise PolicyError(
            f"{type(module).__name__}: tensor parallelism's attention dropout computes full "
            f"causal attention only, and this call asks for {what}; set the model's "
            "attention dropout to 0")
    return heads(query, key, value, dropout, scaling).transpose(1, 2), None


def hf_attention_mask(*, attention_mask: torch.Tensor | None = None, **kwargs
                      ) -> torch.Tensor | None:
    """transformers AttentionMaskInterface entry for :func:`hf_attention`: SDPA's mask (None
    for plain causal attention, what the dropout path computes; else bool (B, 1, q, kv),
    which the dropout path refuses and the SDPA fallback applies).

    Under torch.export of a whole sequence without a padding mask (pipeline capture, which
    passes input_ids only), None: transformers, unable to read the model's own positions
    0..T-1 while tracing, would build a packed-sequence mask from them that the dropout path
    would refuse. torch.compile, a cache (q_length != kv_length) or a window keep their mask.
    """
    from transformers.masking_utils import sdpa_mask

    capture = (torch.compiler.is_exporting() and attention_mask is None
               and kwargs.get("q_length") == kwargs.get("kv_length")
               and not kwargs.get("q_offset") and not kwargs.get("kv_offset")
               and kwargs.get("local_size") is None)
    return None if capture else sdpa_mask(attention_mask=attention_mask, **kwargs)


def attention_dropout_p(module: nn.Module) -> float:
    """The attention dropout probability of an attention module: GPT-2's ``attn_dropout``
    module, Llama's ``attention_dropout``, the reference model's ``dropout``; 0 if none."""
    for name in ("attn_dropout", "attention_dropout", "dropout"):
        value = getattr(module, name, None)
        if isinstance(value, nn.Dropout):
            value = value.p
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.0


def install_head_dropout(model: nn.Module, attentions: list[nn.Module], head_rank: int,
                         exportable: bool = False) -> bool:
    """Route ``model``'s attention through the hashed dropout when any of its attention
    modules drops probabilities; returns whether it did (else nothing changes).

    Args:
        model: the tensor-parallel model (head counts already local).
        attentions: its attention modules (the policy's "attention" style).
        head_rank: this rank's tp rank.
        exportable: the model will be captured for pipeline stages (pp > 1).

    Raises:
        PolicyError: for a Hugging Face model whose attention does not go through
            transformers' AttentionInterface.
    """
    if not any(attention_dropout_p(m) > 0 for m in attentions):
        return False
    if hasattr(model, "set_attn_implementation"):
        _install_hugging_face(model, attentions, HeadGroupAttention(head_rank, None, exportable))
        return True
    for module in attentions:
        if not hasattr(module, "attention_fn"):
            raise PolicyError(f"{type(module).__name__} has no attention_fn hook for "
                              "tensor parallelism's attention dropout")
        module.attention_fn = HeadGroupAttention(head_rank, module.attention_fn, exportable)
    return True


def _install_hugging_face(model: nn.Module, attentions: list[nn.Module],
                          heads: HeadGroupAttention) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_ATTENTION_NAME, hf_attention)
    # Without a mask function of its own name transformers passes no mask at all: padding
    # would be dropped silently rather than refused (dropping) or applied (SDPA fallback).
    AttentionMaskInterface.register(HF_ATTENTION_NAME, hf_attention_mask)
    for module in attentions:
        module.tessera_tp_attention = heads
    model.set_attn_implementation(HF_ATTENTION_NAME)
    used = getattr(model.config, "_attn_implementation", None)
    if used != HF_ATTENTION_NAME:
        raise PolicyError(
            f"{type(model).__name__} computes attention in its own code, not through "
            f"transformers' AttentionInterface (its attention implementation stays {used!r}): "
            "its attention dropout would repeat one mask on every tp rank's heads; set the "
            "model's attention dropout to 0")
