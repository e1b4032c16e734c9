"""What one transformer layer keeps for its backward in tessera's runtime, in bytes.

tessera trains eager PyTorch blocks (``models/transformer.py``; Hugging Face's Llama and GPT-2
are written the same way) and runs bf16/fp16 under ``torch.autocast`` over fp32 parameters,
except memory=chunk, whose chunks hold the parameters in the training precision (the ZeRO
settings, priced but not run by tessera, are priced like it, as DeepSpeed holds 16-bit
parameters). Three layouts follow, with ``e`` the bytes of a matmul's output and ``r`` those
of the residual stream:

- fp32: e = r = 4.
- bf16/fp16 under autocast over fp32 parameters: e = 2, r = 4 (the embedding and the residual
  adds stay fp32). Every linear layer casts its input to 16 bits and keeps that copy, so the
  three attention projections keep three copies of the normed input and the MLP one or two;
  without tensor parallelism each also keeps its 16-bit weight copy, ``2`` bytes per
  weight-matrix element (biases are not kept: their gradient needs no input), and autocast's
  cache holds every copy until the micro-batch's forward ends, recomputed layers' included.
  1d tp pipeline stages keep a copy of the rank's shard likewise (not cached: a shard is not
  a leaf; shared per step where the stage shares casts, ``keeps_weight_copies``); the eager
  tp ops keep their fp32 shard.
- bf16/fp16 with parameters held in 16 bits (memory=chunk, zero1/2/3): e = r = 2.

Per token of one layer (h hidden, kv the key/value width, f the MLP width):

- a norm: LayerNorm keeps its input (``r h``) and two fp32 statistics; RMSNorm, computed in
  fp32 (``x.float()``, ``* rsqrt``, ``.type_as(x) * weight``), keeps ``x`` in fp32 and the
  normed value in the residual's precision: ``(4 + r) h`` and one statistic.
- the linear layers' inputs: ``e h`` once per norm when they share it, once per layer when
  autocast casts it for each.
- attention (fused, no scores): q, k, v ``e (h + 2 kv)``, its output ``e h`` (which is the
  output projection's input) and the fp32 log-sum-exp per head.
- MLP: gelu keeps its input and output (``2 e f``); swiglu keeps gate and up and their product
  (``3 e f``, ``SiluMul`` recomputes the silu).

Under 1d tensor parallelism see :func:`layer_bytes_per_token`. Against the tensors autograd
saves for a real block, alone, under 2-rank 1d tp and 2 x 2 2d tp
(tests/planner/test_activations.py), these counts are exact but for LayerNorm's statistics
under 16-bit parameters (0.2%). With attention dropout on CPU, SDPA's math path keeps the
scores (``memory.unfused_attention_bytes``). A checkpointed layer keeps only its input,
``r h``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.models.config import ModelConfig
from tessera.strategy import Strategy

FP32_BYTES = 4
LOW_PRECISIONS = ("bf16", "fp16")


@dataclass(frozen=True)
class Layout:
    """How tessera's runtime holds one layer's tensors for a precision and memory setting."""

    matmul_bytes: int  # e: a linear layer's output
    residual_bytes: int  # r: the residual stream, norm inputs
    cast_per_linear: bool  # autocast over fp32 weights: each linear keeps its own input copy
    weight_copy_bytes: int  # per parameter, the 16-bit weight copy each linear keeps


def layout(precision: str, memory: str) -> Layout:
    """The runtime's layout for ``precision`` under the ``memory`` setting."""
    if precision not in LOW_PRECISIONS:
        return Layout(FP32_BYTES, FP32_BYTES, False, 0)
    if memory != "ddp":  # chunk, and the ZeRO settings priced as DeepSpeed runs them
        return Layout(2, 2, False, 0)
    return Layout(2, FP32_BYTES, True, 2)


def layer_bytes_per_token(model: ModelConfig, lay: Layout, tp: int = 1,
                          tp_mode: str = "1d", host_is_device: bool = False,
                          tp_seq: str = "off") -> float:
    """Bytes one layer keeps for backward per token on one device (fused attention).

    Under 1d tensor parallelism (tessera's column/row-parallel ops, no sequence parallelism
    around the norms) the norms and the linear layers' input stay whole on every rank, and the
    column-parallel op keeps that input once, as it comes (in the residual's precision, not a
    16-bit copy per linear); attention's heads and the MLP's width are split t ways. With
    Megatron sequence parallelism (``tp_seq`` "on") the norms and dropout masks hold 1/t of
    the tokens, and the column layers keep the shard of their gathered input (gathered again
    in backward, as Megatron-LM does): all of it divided by t. 2d
    (Optimus) partitions every activation over the grid: all of it divided by t; its norms
    (layers2d.Norm2DFn, both styles) keep the normalised value in fp32 and the statistic.
    Dropout keeps a 1-byte mask per element on CUDA (its fused kernel); on a CPU
    (``host_is_device``) PyTorch's dropout keeps its noise tensor, in the dropped values'
    dtype (the linears' output precision).
    """
    e, r = lay.matmul_bytes, lay.residual_bytes
    h, f = model.d_model, model.d_ff
    kv = model.n_kv_heads * model.head_dim
    if tp > 1 and tp_mode == "2d":
        # The 2D norms keep the normalised value in fp32 and one fp32 statistic per token,
        # that one whole along the grid row (q ranks): 4q per token before dividing by t.
        norm = FP32_BYTES * h + FP32_BYTES * math.isqrt(tp)
    elif model.norm == "rmsnorm":
        norm = (FP32_BYTES + r) * h + FP32_BYTES
    else:
        norm = r * h + 2 * FP32_BYTES
    mlp_linears = 2 if model.activation == "swiglu" else 1
    split_1d = tp > 1 and tp_mode == "1d"
    if split_1d:
        linear_inputs = 2 * r * h
    elif lay.cast_per_linear:
        linear_inputs = (3 + mlp_linears) * e * h
    else:
        linear_inputs = 2 * e * h
    attention = e * (h + 2 * kv) + e * h + FP32_BYTES * model.n_heads
    mlp = (3 if model.activation == "swiglu" else 2) * e * f
    mask = e if host_is_device else 1
    masks = 2 * mask * h if model.dropout > 0 else 0  # after attention and after the MLP
    whole = 2 * norm + linear_inputs + masks
    if split_1d and tp_seq != "on":
        return whole + (attention + mlp) / tp
    return (whole + attention + mlp) / tp


def keeps_weight_copies(lay: Layout, s: Strategy) -> bool:
    """Whether the layer's linears keep 16-bit weight copies: nn.Linear under autocast does
    (and autocast's cache holds them, the weights being leaves); so do 1d tensor-parallel
    pipeline stages, whose captured matmuls read each shard through autocast (one copy of the
    rank's shard; pipeline/shard_casts.py shares it where the step shares casts). The eager
    tensor-parallel ops (pp = 1, and 2d always) keep their fp32 shard and cast it themselves."""
    return lay.weight_copy_bytes > 0 and (s.tp == 1 or stages_read_shards(s))


def stages_read_shards(s: Strategy) -> bool:
    """Whether tensor-parallel weights are read as shards by captured pipeline stages."""
    return s.tp > 1 and s.pp > 1 and s.tp_mode == "1d"


def boundary_split(s: Strategy) -> int:
    """How many ways the activation crossing a pipeline stage boundary is split over a stage's
    tp ranks: each sends its own part under 2d (the grid's) and under Megatron sequence
    parallelism (the sequence shard); 1d without it sends the whole from every rank."""
    return s.tp if s.tp_mode == "2d" or s.tp_seq == "on" else 1


def copied_matrix_params(model: ModelConfig, s: Strategy) -> int:
    """Elements of one layer's weight matrices whose 16-bit copies it keeps under autocast
    (:func:`keeps_weight_copies`): all of them, except in 1d tensor-parallel pipeline stages
    under Megatron sequence parallelism, whose column layers (tensor/ops_seq.tp_seq_linear)
    keep their fp32 shard and cast it themselves, forward and backward; the row layers (the
    attention's output, the MLP's down projection) still read theirs through autocast."""
    if stages_read_shards(s) and s.tp_seq == "on":
        return model.d_model * (model.d_model + model.d_ff)  # (h, h) and (h, f) rows
    return matrix_params(model)


def matrix_params(model: ModelConfig) -> int:
    """Elements of one layer's weight matrices (what autocast copies to 16 bits)."""
    h, f = model.d_model, model.d_ff
    kv = model.n_kv_heads * model.head_dim
    mlp_in = 2 if model.activation == "swiglu" else 1
    return h * (h + 2 * kv) + h * h + (mlp_in + 1) * h * f
