"""Memory traffic of one transformer layer's element-wise work, run eagerly.

Eager PyTorch runs every element-wise op as its own kernel that reads its inputs from device
memory and writes its output back; torch.compile and Megatron-style fused kernels do the same
work in far fewer passes. The counts below are bytes per token of one layer's forward, for the
blocks as tessera's reference model writes them (``models/transformer.py``; Hugging Face's
Llama and GPT-2 and torchtitan's Llama are written the same way), in the runtime's layout
(``activations.Layout``: ``e`` the bytes of a matmul output, ``r`` those of the residual
stream, ``cast = e + 4`` for a copy between 16 bits and fp32, 0 where both are fp32):

- rmsnorm, computed in fp32: ``x.float()``, ``pow(2)``, ``mean(-1)`` (reads), ``* rsqrt``,
  ``.type_as(x)``, ``* weight``: ``2 cast(r) + 20 + 2r`` per hidden element. LayerNorm is one
  native kernel: ``2r``.
- autocast over fp32 weights casts each linear layer's input to 16 bits: ``r + e`` per hidden
  element, for the three attention projections and the MLP's one or two input projections.
- rotary embedding of q and k (``h + kv`` elements): the halves cast to fp32, four half-width
  products and two sums, a concatenation and the cast back: ``2 cast(e) + 36``.
- two residual adds (residual plus branch output): ``2r + e`` each.
- swiglu: ``silu(gate)`` then ``* up``: ``5e`` per MLP element; gelu (one kernel): ``2e``.
- dropout, when the model has it, on each branch output: ``2e + 1`` (a 1-byte mask).

Matmuls (bias included, ``addmm``) and the fused attention kernel are priced elsewhere; the
attention's output is already laid out (tokens, heads, head dim), so the output projection
reads it without a copy. The backward is priced at twice the forward, as for fused kernels.
tests/planner/test_elementwise.py counts the bytes every op of a real block moves.
"""

from __future__ import annotations

from tessera.models.config import ModelConfig
from tessera.planner.activations import FP32_BYTES, Layout


def _cast(element_bytes: int) -> int:
    """Bytes a copy between ``element_bytes`` and fp32 moves per element (0 if already fp32)."""
    return 0 if element_bytes == FP32_BYTES else element_bytes + FP32_BYTES


def eager_bytes_per_token(model: ModelConfig, lay: Layout, tp: int = 1,
                          tp_mode: str = "1d", tp_seq: str = "off") -> float:
    """Forward element-wise bytes of one layer per token on one device, in the runtime layout
    ``lay`` (``activations.layout``). Under 1d tensor parallelism the norms, the input casts
    and the residual adds run whole on every rank and the rotary embedding (of the local
    heads) and the MLP's activation t ways; with Megatron sequence parallelism (``tp_seq``
    "on") the norms, residual adds and dropout run on the rank's 1/t of the tokens and the
    casts on the gathered input, whole; 2d (Optimus) partitions all of it."""
    e, r = lay.matmul_bytes, lay.residual_bytes
    h, f = model.d_model, model.d_ff
    kv = model.n_kv_heads * model.head_dim
    norm = (2 * _cast(r) + 20 + 2 * r) if model.norm == "rmsnorm" else 2 * r
    mlp_linears = 2 if model.activation == "swiglu" else 1
    casts = (3 + mlp_linears) * (r + e) if lay.cast_per_linear else 0
    sequence = 2 * norm + 2 * (2 * r + e)  # two norms, two residual adds
    if model.dropout > 0:
        sequence += 2 * (2 * e + 1)
    per_hidden = sequence + casts
    rope = (2 * _cast(e) + 36) * (h + kv) if model.position == "rope" else 0.0
    per_ffn = 5 * e if model.activation == "swiglu" else 2 * e
    if tp > 1 and tp_mode == "1d" and tp_seq == "on":
        return casts * h + (sequence * h + rope + per_ffn * f) / tp
    if tp > 1 and tp_mode == "1d":
        return per_hidden * h + (rope + per_ffn * f) / tp
    return (per_hidden * h + rope + per_ffn * f) / tp
