"""Computation cost: the matmuls, fused attention and element-wise traffic of one layer.

One transformer layer on one device, for a micro-batch of ``b`` sequences of which the device
holds ``s_loc = seq / sp`` positions, with tensor parallelism of degree ``t``:

- Linear layers, forward: QKV ``(n, h) x (h, (h + 2 kv)/t)``, output ``(n, h/t) x (h/t, h)``,
  MLP ``(n, h) x (h, f/t)`` (twice for swiglu) and ``(n, f/t) x (f/t, h)``, with n = b * s_loc.
  Backward is two matmuls of the same size each (data and weight gradients), so 2x forward.
  For 2d (SUMMA on a q x q grid, Optimus) each product becomes q block products of size
  ``(n/q, k/q, m/q)``: the same FLOPs / t in smaller pieces.
- Attention core: ``4 * b * s_loc * seq * h / t`` forward FLOPs counted the way
  ``ModelConfig.flops_per_token`` counts them (PaLM appendix B, no causal saving); a causal fused
  kernel does half of that work, at ``attention_efficiency`` of peak; backward is 2.5x forward
  (flash attention recomputes the scores). With sequence parallelism the runtime runs its
  own block attention instead, priced per score element (:func:`sp_attention_time`).
- Element-wise kernels (norms, residual adds, activation, rope): fused, about
  ``n * (14 h + c f)`` elements forward (c = 2 for gelu, 5 for swiglu's silu-and-multiply);
  eager (``device.fused_elementwise`` false, tessera's runtime), one pass over memory per op
  (``elementwise.py``: about 3x the fused traffic for Llama-style blocks in bf16). A profiled
  device prices them at its measured seconds per element of real transformer layers (forward
  and backward separately); otherwise as memory traffic at ``memory_efficiency`` of memory
  bandwidth, twice that backward.
- Fixed per-layer seconds: the profiled ``overheads`` (Python and launches of a tiny reference
  layer) when the device has them, else ``kernel_overhead`` for about 16 kernels forward and 32
  backward.

Recomputing a layer costs its forward again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.models.config import ModelConfig
from tessera.planner.activations import FP32_BYTES, layout
from tessera.planner.cluster import Cluster
from tessera.planner.elementwise import eager_bytes_per_token

KERNELS_FWD = 16
# Bytes read and written per score to hash one attention-dropout keep mask in int32 passes
# (sequence/dropout.py): the xor of row and key hashes (4), three rounds of shift, mask and
# xor (28 each), two in-place products (8 each), the sign flip (8), the compare (5), the cast
# (5) and the scale (8).
MASK_BYTES = 130
KERNELS_BWD = 32
BWD_MATMUL_FACTOR = 2.0
BWD_ATTENTION_FACTOR = 2.5
BWD_ELEMENTWISE_FACTOR = 2.0


def bytes_per_element(precision: str) -> int:
    """Bytes of one activation / weight element: 2 for bf16/fp16 mixed precision, else 4."""
    return 2 if precision in ("bf16", "fp16") else 4


@dataclass(frozen=True)
class LayerTime:
    """Seconds one device spends on one layer for one micro-batch."""

    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def matmul_rate(cluster: Cluster, m: float, n: float, k: float, precision: str) -> float:
    """Achieved FLOP/s of one ``(m, k) x (k, n)`` product.

    With a profiled table: log-linear interpolation of measured FLOP/s in the product's FLOPs,
    scaled by the precision's peak relative to the peak of the table's precision
    (``cluster.matmul_precision``: fp32 for CPU workers, bf16 or fp16 for GPUs). Without
    one: the device's ``matmul_efficiency`` of peak. The per-kernel overhead is added by the
    caller.
    """
    device = cluster.device
    peak = device.peak(precision)
    if not cluster.matmul_table:
        return peak * device.matmul_efficiency
    scale = peak / device.peak(cluster.matmul_precision)
    flops = 2.0 * m * n * k
    points = sorted((2.0 * a * b * c, rate) for (a, b, c), rate in cluster.matmul_table)
    if flops <= points[0][0]:
        return points[0][1] * scale
    if flops >= points[-1][0]:
        return points[-1][1] * scale
    for (f0, r0), (f1, r1) in zip(points, points[1:]):
        if f0 <= flops <= f1:
            w = (math.log(flops) - math.log(f0)) / max(math.log(f1) - math.log(f0), 1e-12)
            return (r0 + w * (r1 - r0)) * scale
    return points[-1][1] * scale


def layer_matmuls(model: ModelConfig, n: int, tp: int, tp_mode: str
                  ) -> list[tuple[float, float, float, int]]:
    """Forward matmuls of one layer on one device as ``(m, n_out, k, count)``.

    ``n`` is the tokens of the micro-batch on this device (b * s_loc).
    """
    h, f = model.d_model, model.d_ff
    qkv_out = h + 2 * model.n_kv_heads * model.head_dim
    mlp_in = 2 if model.activation == "swiglu" else 1
    shapes = [(n, qkv_out, h, 1), (n, h, h, 1), (n, f, h, mlp_in), (n, h, f, 1)]
    if tp_mode == "2d" and tp > 1:
        q = math.isqrt(tp)
        return [(m / q, o / q, k / q, c * q) for m, o, k, c in shapes]
    # 1d: column-parallel splits the output features, row-parallel the input features.
    return [(n, qkv_out / tp, h, 1), (n, h, h / tp, 1), (n, f / tp, h, mlp_in), (n, h, f / tp, 1)]


def layer_elements(model: ModelConfig, n: float, tp: int) -> float:
    """Element-wise work of one layer's forward on one device, in elements: about
    ``n (14 h + c f) / t`` (norms, residual adds, rope and the activation; c = 2 for gelu,
    5 for swiglu's silu-and-multiply)."""
    c_f = 5 if model.activation == "swiglu" else 2
    return n * (14 * model.d_model + c_f * model.d_ff) / tp


# Keys per tile of PyTorch's fused CPU flash kernel: with a causal mask it skips the tiles
# wholly in the future, so an aligned causal block of T tokens computes about (T + 512) / 2T of
# its scores (measured with torch 2.13: 1.0 at T <= 512, 0.70-0.74 at 1024, 0.55-0.70 at
# 2048, 0.56-0.57 at 4096, 0.50-0.58 at 8192, forward and backward).
FUSED_CPU_KEY_TILE = 512


def fused_causal_share(tokens: float) -> float:
    """Share of an aligned causal block's scores the fused CPU kernel computes."""
    return min(1.0, (tokens + FUSED_CPU_KEY_TILE) / (2 * tokens))


def sp_causal_fraction(device_name: str, seq: int, sp: int, sp_mode: str,
                       dropout: bool = False) -> float:
    """Share of a causal layer's score elements the sequence-parallel runtime computes.

    The zigzag ring computes half blocks off the diagonal and its (seq/sp)-token diagonal
    block; Ulysses one causal block of the whole sequence. The explicit kernel (GPU, and any
    device with attention dropout) computes those causal blocks in full, masked; the fused
    CPU kernel (sequence/fused.py) skips their future tiles (:func:`fused_causal_share`). RSA
    builds full score rows everywhere."""
    fused = device_name == "cpu" and not dropout
    if sp_mode == "ring":
        diagonal = fused_causal_share(seq / sp) if fused else 1.0
        return (diagonal + (sp - 1) / 2) / sp  # explicit: (sp + 1) / (2 sp)
    if sp_mode == "ulysses" and fused:
        return fused_causal_share(seq)
    return 1.0


def sp_attention_time(cluster: Cluster, model: ModelConfig, b: int, seq: int, tp: int,
                      tp_mode: str, sp: int, sp_mode: str, dropout: bool = False) -> LayerTime:
    """Seconds of the sequence-parallel runtime's block attention (fp32; backward recomputes
    the probabilities) on one rank for one layer, at a lone worker's rate. Also 1D tensor
    parallelism's attention while it drops (sp = 1, one call on the whole sequence).

    Score elements per rank: ``b * heads * (seq / sp) * seq`` (Ulysses: heads / sp ranks of
    whole sequences, the same count), times the causal fraction the runtime computes
    (:func:`sp_causal_fraction`).
    Calls per layer: one block per ring step (sp), two ring passes for RSA (2 sp), one for
    Ulysses. A profiled device prices each call at its measured ``c + E (a + b head_size)``;
    otherwise four (eight backward) FLOPs per score and head dimension at the matmul rate,
    six (ten) fp32 passes over the scores at the memory bandwidth and twenty kernel launches
    per call.

    With ``dropout`` the blocks take the explicit path and hash a keep mask per score
    (sequence/dropout.py), forward and again backward: the profile's ``attn_drop_*`` figures,
    else :data:`MASK_BYTES` per score more each way at the memory bandwidth."""
    device = cluster.device
    heads = model.n_heads / (math.isqrt(tp) if tp_mode == "2d" else tp)
    hs = model.head_dim
    share = sp_causal_fraction(device.name, seq, sp, sp_mode, dropout)
    elements = b * heads * seq / sp * seq * share
    calls = {"ring": sp, "rsa": 2 * sp}.get(sp_mode, 1)
    fixed, key = device.overheads, "attn_drop" if dropout else "attn"
    if f"{key}_fwd_elem" in fixed:
        return LayerTime(
            calls * fixed[f"{key}_fwd_call"]
            + elements * (fixed[f"{key}_fwd_elem"] + fixed[f"{key}_fwd_elem_hs"] * hs),
            calls * fixed[f"{key}_bwd_call"]
            + elements * (fixed[f"{key}_bwd_elem"] + fixed[f"{key}_bwd_elem_hs"] * hs))
    rate = device.peak("fp32") * device.matmul_efficiency
    bw = device.memory_bandwidth * device.memory_efficiency
    launches = calls * 20 * device.kernel_overhead
    mask = MASK_BYTES * elements / bw if dropout else 0.0
    return LayerTime(4 * elements * hs / rate + 6 * 4 * elements / bw + launches + mask,
                     8 * elements * hs / rate + 10 * 4 * elements / bw + launches + mask)


def layer_core_time(cluster: Cluster, model: ModelConfig, b: int, seq: int, tp: int,
                    tp_mode: str, sp: int, precision: str, sp_mode: str = "ring") -> LayerTime:
    """Matmul and attention seconds of one layer for one micro-batch, at a lone worker's
    rate (no element-wise work, no fixed cost, no contention). With sp > 1 the attention is
    the sequence-parallel runtime's own (:func:`sp_attention_time`), not a fused kernel;
    likewise 1D tp's while the model drops attention (tensor/attention.py). Other layouts
    with attention dropout run SDPA at ``attention_dropout_efficiency``."""
    device = cluster.device
    s_loc = seq // sp
    n = b * s_loc
    fwd = bwd = 0.0
    for m, o, k, count in layer_matmuls(model, n, tp, tp_mode):
        rate = matmul_rate(cluster, m, o, k, precision)
        t = count * 2.0 * m * o * k / rate
        fwd += t
        bwd += BWD_MATMUL_FACTOR * t
    drops = model.attention_p > 0  # the planner prices training steps
    if sp > 1 or (drops and tp > 1 and tp_mode == "1d"):
        attn = sp_attention_time(cluster, model, b, seq, tp, tp_mode, sp,
                                 sp_mode if sp > 1 else "ulysses", drops)
        return LayerTime(fwd + attn.forward, bwd + attn.backward)
    attn_flops = 4.0 * b * s_loc * seq * model.d_model / tp * 0.5
    efficiency = device.attention_efficiency
    if drops and device.attention_dropout_efficiency is not None:
        efficiency = device.attention_dropout_efficiency
    t_attn = attn_flops / (device.peak(precision) * efficiency)
    return LayerTime(fwd + t_attn, bwd + BWD_ATTENTION_FACTOR * t_attn)


def elementwise_time(cluster: Cluster, model: ModelConfig, n: float, tp: int,
                     precision: str, memory: str = "ddp", tp_mode: str = "1d",
                     tp_seq: str = "off") -> LayerTime:
    """Element-wise seconds of one layer at a lone worker's rate.

    A profiled device carries seconds per element (``overheads["elem_fwd_<activation>"]`` and
    ``elem_bwd_``), measured on real transformer layers by ``tessera profile``: on CPUs the
    activation (erf, sigmoid) and the norms are compute-bound, so the memory bandwidth of a
    plain add prices them several times too cheap. Otherwise: bytes over memory bandwidth,
    the fused kernels' ``layer_elements`` or eager PyTorch's count (``elementwise.py``)."""
    device = cluster.device
    elements = layer_elements(model, n, tp)
    key = "swiglu" if model.activation == "swiglu" else "gelu"
    per_element = device.overheads.get(f"elem_fwd_{key}")
    if per_element is not None:
        return LayerTime(elements * per_element,
                         elements * device.overheads.get(f"elem_bwd_{key}", 2 * per_element))
    traffic = elements * bytes_per_element(precision)
    if not device.fused_elementwise:
        # LayerNorm and gelu blocks without autocast run one kernel per op even eagerly, and
        # there the op count falls below the coarse fused estimate: eager never prices below.
        eager = eager_bytes_per_token(model, layout(precision, memory), tp, tp_mode, tp_seq)
        traffic = max(traffic, n * eager)
    t_elem = traffic / (device.memory_bandwidth * device.memory_efficiency)
    return LayerTime(t_elem, BWD_ELEMENTWISE_FACTOR * t_elem)


def weight_cast_time(cluster: Cluster, elements: float, precision: str, memory: str) -> float:
    """Seconds autocast spends casting ``elements`` fp32 weight elements to 16 bits.

    tessera's runtime enters autocast for every micro-batch's forward, and a recomputed layer
    enters it again, so each reads the fp32 weights and writes their 16-bit copy (6 bytes per
    element) at memory bandwidth, at a lone worker's rate divided by the compute share like a
    layer; the backward casts the 16-bit gradients back to fp32, as much again (the caller
    counts it). 0 where the parameters are held in the training precision
    (``activations.layout``).
    """
    if not layout(precision, memory).weight_copy_bytes:
        return 0.0
    device = cluster.device
    traffic = (FP32_BYTES + 2) * elements
    return traffic / (device.memory_bandwidth * device.memory_efficiency) / cluster.compute_share()


def layer_time(cluster: Cluster, model: ModelConfig, b: int, seq: int, tp: int, tp_mode: str,
               sp: int, precision: str, sp_mode: str = "ring", memory: str = "ddp",
               tp_seq: str = "off") -> LayerTime:
    """Forward and backward seconds of one transformer layer for one micro-batch."""
    device = cluster.device
    share = cluster.compute_share()
    core = layer_core_time(cluster, model, b, seq, tp, tp_mode, sp, precision, sp_mode)
    elem = elementwise_time(cluster, model, b * seq // sp, tp, precision, memory, tp_mode,
                            tp_seq)
    fixed = device.overheads
    fwd = core.forward + elem.forward + fixed.get("layer_fwd", KERNELS_FWD * device.kernel_overhead)
    bwd = core.backward + elem.backward + fixed.get("layer_bwd",
                                                    KERNELS_BWD * device.kernel_overhead)
    tp_fixed = fixed.get("tp_layer" if tp_mode == "1d" else "tp2d_layer", 0.0) if tp > 1 else 0.0
    if tp_fixed:
        # Profiled as one figure per layer and micro-batch (planner/profile_tp.py, at tp=2
        # for 1d and on a 2 x 2 grid for 2d); split as the plain layer's fixed cost splits
        # between forward and backward.
        plain_fwd, plain_bwd = fixed.get("layer_fwd", 0.0), fixed.get("layer_bwd", 0.0)
        forward_share = plain_fwd / (plain_fwd + plain_bwd) if plain_fwd + plain_bwd else 1 / 3
        fwd += tp_fixed * forward_share
        bwd += tp_fixed * (1 - forward_share)
    return LayerTime(fwd / share, bwd / share)


def head_time(cluster: Cluster, model: ModelConfig, b: int, seq: int, tp: int, sp: int,
              precision: str) -> LayerTime:
    """Final norm, output projection and cross-entropy (last pipeline stage)."""
    device = cluster.device
    n = b * seq // sp
    vocab = model.vocab_size / tp
    t_mm = 2.0 * n * vocab * model.d_model / matmul_rate(cluster, n, vocab, model.d_model,
                                                          precision)
    # Logits are handled in fp32 by the loss: ~3 passes forward (max, exp-sum, gather) and
    # 2 backward (softmax minus one-hot, cast).
    t_loss = n * vocab * 4 * 3 / (device.memory_bandwidth * device.memory_efficiency)
    share = cluster.compute_share()
    # A profiled device's model overhead covers embedding, head and loss; it is charged here.
    fixed = device.overheads
    fwd = t_mm + t_loss + fixed.get("model_fwd", 6 * device.kernel_overhead)
    bwd = 2 * t_mm + t_loss * 2 / 3 + fixed.get("model_bwd", 10 * device.kernel_overhead)
    return LayerTime(fwd / share, bwd / share)


def embedding_time(cluster: Cluster, model: ModelConfig, b: int, seq: int, tp: int, sp: int,
                   precision: str) -> LayerTime:
    """Token (and position) embedding lookup and its dense gradient (first pipeline stage)."""
    device = cluster.device
    bw = device.memory_bandwidth * device.memory_efficiency
    n = b * seq // sp
    el = bytes_per_element(precision)
    launches = 0.0 if device.overheads else device.kernel_overhead  # else in head_time
    fwd = 3 * n * model.d_model * el / bw + 4 * launches
    # The embedding gradient is a dense (V, h) tensor: zeroed, then scattered into.
    bwd = (2 * model.vocab_size * model.d_model / tp * 4 + 2 * n * model.d_model * el) / bw
    bwd += 6 * launches
    share = cluster.compute_share()
    return LayerTime(fwd / share, bwd / share)


def optimizer_time(cluster: Cluster, params: float, n_tensors: int) -> float:
    """One Adam(W) update of ``params`` parameters held in ``n_tensors`` tensors."""
    device = cluster.device
    traffic = params * device.optimizer_bytes_per_param
    if "optim_fixed" in device.overheads:  # profiled; a layer holds ~12 tensors
        per_tensor = (device.overheads["optim_fixed"]
                      + device.overheads.get("optim_layer", 0.0) * n_tensors / 12)
    else:  # foreach kernels still pay a small per-tensor cost for each of their ~12 passes
        per_tensor = 12 * n_tensors * device.kernel_overhead * 0.1
    return (traffic / (device.memory_bandwidth * device.memory_efficiency) + per_tensor
            ) / cluster.compute_share()
