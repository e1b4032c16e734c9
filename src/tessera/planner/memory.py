"""Per-device memory: model states under each memory setting, activations, buffers.

Model states (ZeRO paper, Rajbhandari et al. 2020, section 3): mixed-precision Adam holds
2 bytes of half weights, 2 of half gradients and 12 of fp32 master weights, momentum and
variance per parameter (16 in all); fp32 training holds 4 + 4 + 8 (also 16).

========  ==================  ==================  =========================
memory    weights             gradients           optimizer states
========  ==================  ==================  =========================
ddp       W                   G (+ G of buckets)  O
zero1     W                   G                   O / dp
zero2     W                   G / dp              O / dp
zero3     W / dp (+ 2 layers) G / dp              O / dp
chunk     as zero3, gathered in chunks of one layer
========  ==================  ==================  =========================

memory=chunk keeps remote chunks' gradients on the device while it accumulates (no_sync:
every micro-batch but the last, the whole schedule under pp), so G then counts whole; under pp
the gathered unit is a whole stage piece (its recomputed head or its tail), not one layer.

``offload=cpu`` keeps optimizer states (with the fp32 master) in host memory; ``disk`` on NVMe.
On a CPU worker the host memory is the device's own (:func:`place_optimizer`).
torch DDP copies gradients into its own buckets, hence the extra G under ``ddp`` with dp > 1.

Activations of one layer for one micro-batch: as tessera's runtime keeps them
(``activations.py``: its eager blocks; under bf16/fp16 autocast over fp32 weights an fp32
residual stream, a 16-bit copy of each linear layer's input and, without tensor parallelism or
in 1d tensor-parallel pipeline stages, a 16-bit copy of each weight (of the rank's shard) per
micro-batch in flight, or one for all where the step shares its casts
(:func:`shares_weight_casts`); under its 1d tensor parallelism the norms
and the layer's input whole on every rank, the rest split t ways; 2d splits all of it). For
other runtimes (``tessera=False``: the published runs) in elements of the training precision,
counted like Korthikanti et al. 2022, "Reducing activation recomputation", section 4.1, which
gives 34 s b h bytes in 16-bit for a GPT layer with f = 4h, without the s^2 attention term
that a fused attention kernel does not keep: norm inputs 2 n h, the QKV input n h, Q, K and V
n (h + 2 kv), the attention output n h, the MLP input n h, the MLP hidden and activation
2 n f (4 n f for swiglu's gate, up, silu and product), plus 1-byte dropout masks when dropout
is on, all divided by t (Megatron's sequence parallelism in the norm and dropout regions).
Sequence parallelism divides either by sp. A recomputed layer keeps only its input (n h), and
the layer being recomputed needs its full activations once.

Stage i of a 1F1B pipeline holds min(pp - i, m) micro-batches in flight (GPipe: all m).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.models.config import ModelConfig
from tessera.planner.activations import (FP32_BYTES, boundary_split, copied_matrix_params,
                                          keeps_weight_copies, layer_bytes_per_token, layout,
                                          stages_read_shards)
from tessera.planner.compute import bytes_per_element
from tessera.planner.split import Split, equal_split, head_is_sliced, stage_split
from tessera.strategy import Strategy, blocks_to_recompute

INTERLEAVE_CHUNKS = 2


@dataclass(frozen=True)
class StageParams:
    """Parameter counts held by one pipeline stage (before tensor parallel splitting)."""

    layers: int
    block_params: int
    embed_params: int
    head_params: int
    final_norm_params: int
    head_share: float = 0.0  # fraction of the LM head's work this stage runs (split.py)
    # Rows of the head weight held for its slices only: weights and gradients, no optimizer
    # state, not reduced over dp (the weight's home does that; pipeline/rows.py).
    head_rows: float = 0.0

    @property
    def total(self) -> int:
        return (self.layers * self.block_params + self.embed_params + self.head_params
                + self.final_norm_params)


def block_params(model: ModelConfig) -> int:
    """Parameters of one transformer block (exact, from ModelConfig.num_params)."""
    final_norm = model.d_model * (2 if model.norm == "layernorm" and model.bias else 1)
    return (model.num_params(include_embedding=False) - final_norm) // model.n_layers


def stage_params(model: ModelConfig, pp: int, split: Split | None = None,
                 rows: bool = False) -> list[StageParams]:
    """Parameters of each stage under ``split`` (split.py; default: the equal split). The
    final norm sits with the first head stage.

    A stage running any share of the head holds its whole weight; with tied embeddings a
    head stage other than the first keeps a copy of the embedding (as Megatron-LM and
    tessera's tied-weight rule do). With ``rows`` (tessera's runtime for a head sliced over
    several stages, without tp or chunk memory: :func:`holds_head_rows`) only the weight's
    home holds it whole (the first stage when tied, else the first head stage); the other
    head stages hold their share of its rows (``head_rows``)."""
    split = split or equal_split(model.n_layers, pp)
    final_norm = model.d_model * (2 if model.norm == "layernorm" and model.bias else 1)
    embed = model.vocab_size * model.d_model
    pos = model.max_seq_len * model.d_model if model.position == "learned" else 0
    head = embed if not model.tie_embeddings else 0
    first_head = next(i for i, (_, share) in enumerate(split) if share > 0)
    home = 0 if model.tie_embeddings else first_head
    out = []
    for i, (layers, share) in enumerate(split):
        holds = share > 0
        head_here = (head if holds else 0) + (embed if holds and i > 0 and model.tie_embeddings
                                              else 0)
        head_rows = 0.0
        if rows and holds and i != home:
            head_here, head_rows = 0, share * embed
        out.append(StageParams(layers, block_params(model), embed + pos if i == 0 else 0,
                               head_here, final_norm if i == first_head else 0, share,
                               head_rows))
    return out


def holds_head_rows(s: Strategy, split: Split) -> bool:
    """Whether tessera's runtime holds the head as rows on all but its home (pipeline/rows.py):
    the head sliced over several stages (only without tp), not under chunk memory."""
    return s.tp == 1 and s.memory != "chunk" and sum(share > 0 for _, share in split) > 1


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on the most loaded device, by kind."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    host: float = 0.0

    @property
    def total(self) -> float:
        """Device bytes (host memory is reported apart)."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers

    def to_dict(self) -> dict[str, float]:
        return {"weights": self.weights, "gradients": self.gradients,
                "optimizer": self.optimizer, "activations": self.activations,
                "buffers": self.buffers, "host": self.host, "total": self.total}


def place_optimizer(optim: float, offload: tuple[str, ...], host_is_device: bool
                    ) -> tuple[float, float]:
    """(device, host) bytes of ``optim`` optimizer-state bytes under ``offload``. Offloaded
    states leave the device for host memory (disk: reported as host too). On a CPU worker
    (``host_is_device``) host memory is the device's own: offload to cpu moves nothing, and
    only disk takes the states out of it."""
    if not offload:
        return optim, 0.0
    if host_is_device:
        return (0.0, 0.0) if "disk" in offload else (optim, 0.0)
    return 0.0, optim


def state_bytes(precision: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter."""
    return (2, 2, 12) if precision in ("bf16", "fp16") else (4, 4, 8)


def layer_activation_elements(model: ModelConfig, n: int) -> float:
    """Elements one layer keeps for backward for ``n`` tokens, without parallel splitting."""
    h, kv, f = model.d_model, model.n_kv_heads * model.head_dim, model.d_ff
    mlp = 4 * f if model.activation == "swiglu" else 2 * f
    elements = n * (2 * h + h + (h + 2 * kv) + h + h + mlp)
    return elements


def keeps_no_scores(device, model: ModelConfig, s: Strategy) -> bool:
    """Whether attention keeps no (s x s) scores for backward on ``device`` (a DeviceSpec)
    under ``s``: the device's fused kernel, unless attention dropout sends SDPA to its math
    path there (CPU, where ``attention_dropout_efficiency`` is set) and the runtime runs SDPA:
    sp = 1 without 1D tp. Sequence parallelism and 1D tp run their own hashed-dropout blocks
    (sequence/dropout.py), which regenerate the mask and keep no scores; 2D tp runs the model's
    SDPA on its heads. Counting no scores there undercounted a CPU step with dropout 4x
    (helper review, 2026-11-28). RSA as published keeps its rows of probabilities
    (sequence/rsa.py) on any device."""
    if not device.flash_attention or (s.sp > 1 and s.sp_mode == "rsa"):
        return False
    math_path = device.is_host and model.attention_p > 0
    return not (math_path and s.sp == 1 and (s.tp == 1 or s.tp_mode == "2d"))


def unfused_attention_bytes(model: ModelConfig, s: Strategy, seq: int, tessera: bool,
                            host_is_device: bool = False) -> float:
    """Bytes one layer's attention keeps for one micro-batch beyond the fused kernel's count
    (``activations.py``) where attention is not fused: mostly (s x s) scores.

    On a CPU with attention dropout SDPA's math path keeps the softmax, the dropout noise and
    the dropped probabilities, all fp32 whatever autocast's precision (12 bytes a score), and
    q, k and v upcast to fp32, but no log-sum-exp: measured with saved-tensor hooks, torch
    2.13 (tests/planner/test_activations.py). Elsewhere Megatron's count (Korthikanti et
    al.): 2.5 elements of the training precision a score. Under grouped kv heads the math
    path repeats k and v to every head before it upcasts them. RSA (sp_mode=rsa) keeps its
    local rows of fp32 probabilities, 4 bytes a score, with or without dropout."""
    n = s.micro_batch_size * seq / s.sp  # tokens of the micro-batch on this device
    scores = model.n_heads * n * seq  # (query, key) pairs of every head
    if tessera and s.sp > 1 and s.sp_mode == "rsa":
        return FP32_BYTES * scores
    if not (tessera and host_is_device and model.attention_p > 0):
        return 2.5 * bytes_per_element(s.precision) * scores
    e = layout(s.precision, s.memory).matmul_bytes
    h, kv = model.d_model, model.n_kv_heads * model.head_dim
    upcast = FP32_BYTES * (3 * h if kv < h else h + 2 * kv) - e * (h + 2 * kv)
    return 12 * scores + n * (upcast - FP32_BYTES * model.n_heads)


def layer_activation(model: ModelConfig, s: Strategy, seq: int, flash: bool,
                     tessera: bool = True, host_is_device: bool = False
                     ) -> tuple[float, float]:
    """(full, checkpointed) activation bytes of one layer for one micro-batch on one device:
    as tessera's runtime keeps them (``activations.py``), or with ``tessera`` False as a model
    held in the training precision with fused kernels keeps them (Korthikanti et al.).
    ``host_is_device``: a CPU worker, whose eager dropout keeps wider masks."""
    el = bytes_per_element(s.precision)
    n = s.micro_batch_size * seq / s.sp
    scores = 0.0 if flash else unfused_attention_bytes(model, s, seq, tessera, host_is_device)
    if tessera:
        # tessera's 1d tp keeps the norms and the layer's input whole on every rank (tp_seq=on:
        # on the rank's sequence shard, as everything the layer keeps)
        lay = layout(s.precision, s.memory)
        # else split t ways: 2d's grid, or 1d's sequence shard under tp_seq
        whole_input = s.tp_mode == "1d" and s.tp_seq == "off"
        per_token = layer_bytes_per_token(model, lay, s.tp, s.tp_mode, host_is_device,
                                          s.tp_seq)
        full = n * per_token + scores / s.tp
        ckpt = n * model.d_model * lay.residual_bytes / (1 if whole_input else s.tp)
        return full, ckpt
    full = layer_activation_elements(model, n) * el + scores
    if model.dropout > 0:
        full += 2 * n * model.d_model  # 1-byte masks after attention and MLP
    # Megatron: 2d splits every activation over the grid (Optimus); 1d with Megatron's
    # sequence parallelism in the norm/dropout regions splits the rest by t as well, and a
    # layer's input is sequence-sharded too.
    return full / s.tp, n * model.d_model * el / s.tp


def weight_copies(model: ModelConfig, s: Strategy, layers: int, in_flight: float,
                  recomputed: int, whole: float, tessera: bool = True,
                  shared: bool = False) -> float:
    """Bytes of the 16-bit weight copies autocast makes over fp32 parameters without tensor
    parallelism: every linear layer keeps its copy for its backward, per micro-batch in flight,
    and autocast's cache holds the copies of the recomputed layers too until the micro-batch's
    forward ends. ``shared`` (:func:`shares_weight_casts`): one copy for all of them."""
    lay = layout(s.precision, s.memory)
    if not tessera or not keeps_weight_copies(lay, s):
        return 0.0
    per_layer = lay.weight_copy_bytes * copied_matrix_params(model, s) / s.tp  # rank's shards
    if shared:
        return layers * per_layer
    dropping = in_flight - whole
    # A shard's copy is not cached: only the layer being rematerialised holds one.
    rematerialised = recomputed if s.tp == 1 else min(recomputed, 1)
    held = (whole * layers + dropping * (layers - recomputed)
            + (rematerialised if dropping > 0 else 0))
    return held * per_layer


def shares_weight_casts(s: Strategy, ratio: float, layers: int, in_flight: float) -> bool:
    """Whether a stage's micro-batches share one 16-bit copy of each weight, cast once per
    step, as the runtime does where nothing recomputes: train/engine.py at pp = 1 (unless
    ``apply_recompute`` checkpoints a block, :func:`recomputed_layers`; one micro-batch is in
    flight there, so only the casts are saved), and pipeline/program.py's ``step_casts`` at
    pp > 1 (ratio 0, more than one micro-batch in flight, one virtual stage per rank), 1d
    tensor-parallel shards included (pipeline/shard_casts.py). Never at pp = 1 under tensor
    parallelism: its eager ops cast each shard themselves."""
    if s.schedule == "interleaved" or (s.tp > 1 and not stages_read_shards(s)):
        return False
    if s.pp == 1:
        return recomputed_layers(ratio, layers) == 0
    return ratio <= 0 and in_flight > 1


def recomputed_layers(ratio: float, layers: int) -> int:
    """Layers of a stage that recompute, for a recomputation ratio: the runtime's count
    (``apply_recompute`` at pp = 1; under pp the cut nearest the ratio of the stage's time,
    which for equal layers is the same count)."""
    return blocks_to_recompute(ratio, layers)


def activation_bytes(model: ModelConfig, s: Strategy, seq: int, layers: int, in_flight: float,
                     ratio: float, flash: bool, whole: int = 0, tessera: bool = True,
                     host_is_device: bool = False) -> float:
    """Activation bytes of one stage: ``in_flight`` micro-batches of ``layers`` layers, of
    which ``whole`` (scp) keep every layer's activations; while a recomputing one runs its
    backward, one recomputed layer is rematerialised at a time. ``tessera``: as tessera's
    runtime keeps them (with autocast's weight copies), else a fused 16-bit model."""
    full, ckpt = layer_activation(model, s, seq, flash, tessera, host_is_device)
    recomputed = recomputed_layers(ratio, layers)
    whole = min(whole, in_flight)
    dropping = in_flight - whole
    kept = recomputed * ckpt + (layers - recomputed) * full
    working = full if recomputed and dropping > 0 else 0.0
    copies = weight_copies(model, s, layers, in_flight, recomputed, whole, tessera,
                           shares_weight_casts(s, ratio, layers, in_flight))
    return dropping * kept + whole * layers * full + working + copies


def in_flight(s: Strategy, stage: int, micro_batches: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak."""
    if s.pp == 1:
        return 1
    if s.schedule == "gpipe":
        return micro_batches
    if s.schedule == "interleaved":
        # Megatron's order: a rank runs (pp - stage - 1) * 2 + (chunks - 1) * pp forwards of
        # its chunks before the first backward, then alternates; each chunk holds 1/chunks of
        # the stage's activations. (Korthikanti et al.'s (1 + (pp-1)/(pp v)) x pp is this
        # count for stage 0 only; later stages hold more than it gives them.)
        chunks = INTERLEAVE_CHUNKS
        warmup = (s.pp - stage - 1) * 2 + (chunks - 1) * s.pp
        return min(warmup + 1, micro_batches * chunks) / chunks
    held = min(s.pp - stage, micro_batches)
    if s.schedule == "scp" and stage == s.pp - 2 and micro_batches >= 3:
        held += 1  # its third forward runs before its first backward (scp's swap)
    return held


def logits_bytes(model: ModelConfig, s: Strategy, seq: int) -> float:
    """Logits of one micro-batch and their fp32 copy for the loss (last stage)."""
    n = s.micro_batch_size * seq / s.sp
    return n * model.vocab_size / s.tp * (bytes_per_element(s.precision) + 8)


def local_params(model: ModelConfig, stage: StageParams, tp: int) -> float:
    """Parameters one device of a stage holds: matrices split tp ways, norms replicated."""
    norm = model.d_model * (2 if model.norm == "layernorm" and model.bias else 1)
    replicated = stage.layers * 2 * norm + stage.final_norm_params
    return (stage.total - replicated) / tp + replicated


def stage_memory(model: ModelConfig, s: Strategy, seq: int, reserved: float = 0.0,
                 flash: bool = True, tessera: bool = True,
                 kept: list[int] | None = None, *,
                 host_is_device: bool = False) -> list[MemoryBreakdown]:
    """Memory of one device of each pipeline stage.

    Args:
        model: the model.
        s: the strategy (every memory-relevant field is read).
        seq: training sequence length.
        reserved: bytes the runtime keeps for itself (device preset).
        flash: whether attention keeps no (s x s) scores.
        tessera: tessera's runtime: stages as its partitioner deals them (split.py) and
            activations as its blocks keep them (activations.py); False: Megatron-LM's equal
            split and fused 16-bit layers.
        kept: :func:`scp_kept`'s answer when the caller has it (computed here otherwise).
        host_is_device: the device is the host CPU (:attr:`DeviceSpec.is_host`), where
            offloading to cpu frees nothing (:func:`place_optimizer`).
    """
    w_b, g_b, o_b = state_bytes(s.precision)
    shard_dp = s.dp * s.sp if s.memory != "ddp" else 1  # sp ranks replicate parameters too
    m = s.grad_accum_steps
    if kept is None:
        kept = (scp_kept(model, s, seq, reserved, flash, tessera, host_is_device=host_is_device)
                if s.schedule == "scp" else [])
    out = []
    for i, stage in enumerate(pipeline_stage_params(model, s, tessera)):
        p = local_params(model, stage, s.tp)
        sharded_w = s.memory in ("zero3", "chunk")
        weights = p * w_b / (shard_dp if sharded_w else 1)
        grads = p * g_b / (shard_dp if s.memory in ("zero2", "zero3", "chunk") else 1)
        if s.memory == "chunk" and (m > 1 or s.pp > 1):
            # Under no_sync (every micro-batch but the last; the whole schedule under pp) the
            # gradients of remote chunks accumulate on the device until the reduce-scatter.
            grads = p * g_b
        optim, host = place_optimizer(p * o_b / shard_dp, s.offload, host_is_device)
        weights, grads = weights + stage.head_rows * w_b, grads + stage.head_rows * g_b
        ratio = s.stage_recompute(i)
        held = in_flight(s, i, m)
        # scp: micro-batches kept whole, within 1F1B's peak (scp_kept)
        acts = activation_bytes(model, s, seq, stage.layers, held, ratio, flash,
                                kept[i] if kept else 0, tessera, host_is_device)
        acts += stage.head_share * logits_bytes(model, s, seq)  # its slices' logits
        if stage.head_share and tessera and keeps_weight_copies(layout(s.precision, s.memory),
                                                                  s):
            # the head's 16-bit weight copy (of its rows, for a slice), per micro-batch in
            # flight; one for all where the stage shares its casts and holds the whole head
            # (a slice reads rows of the weight, a view, whose casts autocast never caches)
            whole_head = (not head_is_sliced(model, s)
                          and shares_weight_casts(s, ratio, stage.layers, held))
            acts += (1 if whole_head else held) * 2 * stage.head_share * (
                model.vocab_size * model.d_model) / s.tp  # a vocabulary shard under tp
        buffers = reserved + _buffers(model, s, seq, p, stage, w_b, g_b, ratio)
        out.append(MemoryBreakdown(weights, grads, optim, acts, buffers, host))
    return out


def scp_kept(model: ModelConfig, s: Strategy, seq: int, reserved: float = 0.0,
             flash: bool = True, tessera: bool = True, *,
             host_is_device: bool = False) -> list[int]:
    """Micro-batches each stage keeps whole (without recomputing) under scp: at most the
    last pp-1-i (on the last stage all or none), and only as many as keep the stage under
    the peak 1F1B with the same recomputation reaches on its fullest stage (the runtime's
    rule, Partition.keep)."""
    if s.pp == 1:
        return []
    m, one_f_one_b = s.grad_accum_steps, s.replace(schedule="1f1b")
    base = stage_memory(model, one_f_one_b, seq, reserved, flash, tessera,
                        host_is_device=host_is_device)
    stages = pipeline_stage_params(model, s, tessera)
    # What scp holds keeping nothing whole: 1F1B's, but for its swap's extra micro-batch on
    # stage S-2. The budget is 1F1B's fullest stage, or that where higher (Partition.keep).
    rest, scp_plain = [], []
    for i, stage in enumerate(stages):
        ratio = s.stage_recompute(i)
        rest.append(base[i].total - activation_bytes(
            model, s, seq, stage.layers, in_flight(one_f_one_b, i, m), ratio, flash,
            tessera=tessera, host_is_device=host_is_device))
        scp_plain.append(rest[i] + activation_bytes(model, s, seq, stage.layers,
                                                    in_flight(s, i, m), ratio, flash,
                                                    tessera=tessera,
                                                    host_is_device=host_is_device))
    budget = max(max(b.total for b in base), max(scp_plain))
    out = []
    for i, stage in enumerate(stages):
        ratio, held = s.stage_recompute(i), in_flight(s, i, m)
        keep = (m if i == s.pp - 1 else min(s.pp - 1 - i, m)) if ratio > 0 else 0
        while keep > 0 and rest[i] + activation_bytes(
                model, s, seq, stage.layers, held, ratio, flash, keep, tessera,
                host_is_device) > budget:
            keep = min(keep, held) - 1
        out.append(keep)
    return out


def pipeline_stage_params(model: ModelConfig, s: Strategy, tessera: bool = True
                          ) -> list[StageParams]:
    """:func:`stage_params` of ``s``'s stages, dealt as tessera's partitioner deals them
    (``tessera``) or equally, with the head's rows where the runtime holds them so."""
    split = stage_split(model, s, tessera)
    return stage_params(model, s.pp, split, rows=tessera and holds_head_rows(s, split))


def _buffers(model: ModelConfig, s: Strategy, seq: int, p: float, stage: StageParams,
             w_b: int, g_b: int, recompute: float = 0.0) -> float:
    extra = 0.0
    if s.memory == "ddp" and s.dp * s.sp > 1:
        extra += p * g_b  # torch DDP's gradient buckets are copies
    if s.memory == "chunk" and s.pp > 1:
        # Under pp the gathered unit is a stage piece (memory/stages.py): the whole stage, or
        # the larger of its recomputed head and its tail, beyond this rank's own shard.
        extra += max(recompute, 1 - recompute) * p * w_b * (1 - 1 / (s.dp * s.sp))
    elif s.memory in ("zero3", "chunk"):
        # The layer being computed and the one being prefetched, gathered in full.
        extra += 2 * stage.block_params / s.tp * w_b
    if s.pp > 1:
        n = s.micro_batch_size * seq / s.sp
        # send/recv buffers, each this rank's part of the boundary activation
        extra += 2 * n * model.d_model * bytes_per_element(s.precision) / boundary_split(s)
    return extra


def device_memory(model: ModelConfig, s: Strategy, seq: int, reserved: float = 0.0,
                  flash: bool = True, tessera: bool = True,
                  kept: list[int] | None = None, *,
                  host_is_device: bool = False) -> MemoryBreakdown:
    """The most loaded device's memory (the stage that decides whether a strategy fits)."""
    return max(stage_memory(model, s, seq, reserved, flash, tessera, kept,
                            host_is_device=host_is_device),
               key=lambda m: m.total)
