"""Memory traffic of one transformer layer's element-wise work, run eagerly.

Eager PyTorch runs every element-wise op as its own kernel that reads its inputs from device
memory and writes its output back; torch.compile and Megatron-style fused kernels do the same
work in far fewer passes. The counts below are bytes per token of one layer's forward, for the
blocks as tessera's reference model writes them (``models/transformer.py``), which are also how
Hugging Face's Llama and GPT-2 and torchtitan's Llama write them:

- rmsnorm: ``x.float()``, ``pow(2)``, ``mean(-1)`` (reads), ``x * rsqrt(...)``,
  ``.type_as(x)``, ``* weight``: ``2 cast + 20 + 2e`` bytes per hidden element, where ``e``
  is the activation's bytes and ``cast = e + 4`` a copy to or from fp32 (0 in fp32). LayerNorm
  is one native kernel: ``2e``.
- rotary embedding of q and k (``h + kv`` elements): the halves cast to fp32, four half-width
  products and two sums, a concatenation and the cast back: ``2 cast + 36``.
- the attention output's (heads, tokens) -> (tokens, hidden) copy: ``2e`` per hidden element;
  two residual adds: ``3e`` each.
- swiglu: ``silu(gate)`` then ``* up``: ``5e`` per MLP element; gelu (one kernel): ``2e``.
- dropout, when the model has it, after attention and MLP: ``2e + 1`` each (the mask is bytes).

Matmuls (bias included, ``addmm``) and the fused attention kernel are priced elsewhere. The
backward is priced at twice the forward, as for fused kernels.
"""

from __future__ import annotations

from tessera.models.config import ModelConfig

FP32_BYTES = 4


def eager_bytes_per_token(model: ModelConfig, element_bytes: int) -> float:
    """Forward element-wise bytes of one layer per token on one device (no tensor parallelism).

    Args:
        model: the transformer.
        element_bytes: bytes of one activation element (2 under bf16/fp16, 4 in fp32).
    """
    e = element_bytes
    cast = 0 if e == FP32_BYTES else e + FP32_BYTES
    h, f = model.d_model, model.d_ff
    kv = model.n_kv_heads * model.head_dim
    norm = (2 * cast + 20 + 2 * e) if model.norm == "rmsnorm" else 2 * e
    per_hidden = 2 * norm + 2 * e + 2 * 3 * e  # two norms, output copy, two residual adds
    if model.dropout > 0:
        per_hidden += 2 * (2 * e + 1)
    rope = (2 * cast + 36) * (h + kv) if model.position == "rope" else 0.0
    per_ffn = 5 * e if model.activation == "swiglu" else 2 * e
    return per_hidden * h + rope + per_ffn * f
