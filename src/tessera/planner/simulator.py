"""Step-time simulator: computation + communication - overlap, under the schedule's bubble.

For each pipeline stage i, one micro-batch costs ``t_i = f_i + b_i + r_i + c_i``: forward,
backward and recomputation compute (compute.py) plus the tensor- and sequence-parallel
communication that compute cannot hide (comm.py). With m micro-batches:

- 1F1B and GPipe: ``T = m * max_i t_i + (sum_i t_i - max_i t_i)``; for equal stages this is the
  familiar ``(m + p - 1) t`` with bubble fraction ``(p - 1)/m`` (Narayanan et al. 2021), and
  for unequal stages Alpa's ``sum t_i + (m - 1) max t_i``.
- Interleaved 1F1B with v = 2 model chunks per device: the fill/drain term divides by v, and
  pipeline send/recv traffic multiplies by v (Narayanan et al. 2021, section 2.2).
- SCP (Merak's shifted critical path): the last stage never recomputes, stage i skips
  recomputation for its last ``p - 1 - i`` micro-batches, and recomputation runs while the
  gradient is being received, so up to one p2p time of it per micro-batch is hidden.

Then the step adds what the pipeline does not contain: pipeline p2p on the critical path,
data-parallel gradient synchronisation not hidden under the last backward, the optimizer update,
the Trainer's own host work and offload transfers (step_outside.py). The :class:`Estimate`
breakdown sums to the step time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tessera.models.config import ModelConfig
from tessera.planner import comm
from tessera.planner.activations import (boundary_split, layout, matrix_params,
                                          stages_read_shards)
from tessera.planner.cluster import Cluster
from tessera.planner.compute import (LayerTime, bytes_per_element, embedding_time, head_time,
                                     layer_time, weight_cast_time)
from tessera.planner.memory import (INTERLEAVE_CHUNKS, MemoryBreakdown, device_memory,
                                    keeps_no_scores, pipeline_stage_params, recomputed_layers,
                                    scp_kept, shares_weight_casts)
from tessera.planner.memory import in_flight as stage_in_flight
from tessera.planner.split import head_is_sliced
from tessera.planner.step_outside import outside_pipeline, straggler_time
from tessera.strategy import Strategy, StrategyError

@dataclass(frozen=True)
class SimOptions:
    """Knobs of the runtime that are not Strategy fields.

    Attributes:
        tp_overlap: fraction of tensor-parallel communication that sub-pipelined tensor
            parallelism (Merak) or async TP hides under compute; 0 = none.
        dp_overlap: overlap gradient synchronisation with the last backward (DDP buckets).
        tessera_runtime: price tessera's runtime: pipeline stages as its partitioner deals
            them (fewer layers beside a heavy head, a heavy head sliced over the last
            stages) and activations as its eager blocks keep them under autocast
            (activations.py); False: the equal split with the head on the last stage and
            fused 16-bit layers, as Megatron-LM runs (split.py, Korthikanti's count).
    """

    tp_overlap: float = 0.0
    dp_overlap: bool = True
    tessera_runtime: bool = True


@dataclass(frozen=True)
class Estimate:
    """Predicted performance of one strategy on one cluster."""

    strategy: Strategy
    step_time: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    memory: MemoryBreakdown
    capacity: float
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy.to_text(), "step_time_s": self.step_time,
                "tokens_per_s": self.tokens_per_s, "tflops_per_device": self.tflops_per_device,
                "mfu": self.mfu, "memory_per_device_bytes": self.memory.total,
                "memory_capacity_bytes": self.capacity, "fits": self.fits,
                # whether this build's runtime runs it (the planner also prices zero1-3)
                "runnable": self.strategy.is_runnable(),
                "memory": self.memory.to_dict(), "breakdown": dict(self.breakdown)}


def placed(cluster: Cluster, world: int) -> Cluster:
    """The cluster a job of ``world`` devices occupies (packed into as few nodes as possible)."""
    if world > cluster.num_devices:
        raise StrategyError(f"strategy needs {world} devices; the cluster {cluster.name} has "
                            f"{cluster.num_devices}")
    if world == cluster.num_devices:
        return cluster
    per = min(world, cluster.devices_per_node)
    return cluster.with_devices(per, math.ceil(world / per))


def estimate(model: ModelConfig, cluster: Cluster, strategy: Strategy,
             options: SimOptions | None = None, cache: dict | None = None) -> Estimate:
    """Predict step time, throughput and memory of ``strategy``.

    Args:
        model: the model (see :func:`tessera.planner.describe_model`).
        cluster: the cluster; the job is packed onto its first ``strategy.world_size`` devices.
        strategy: the strategy to price.
        options: runtime knobs that are not Strategy fields.
        cache: a dict the caller keeps across calls to reuse per-layer costs (the search does).

    Raises:
        StrategyError: when the strategy does not fit the model or the cluster's device count.
        HardwareError: when the device has no rate for the strategy's precision.
    """
    opt = options or SimOptions()
    s = strategy.validate_for(model=model)
    cl = placed(cluster, s.world_size)
    seq = model.max_seq_len
    groups = comm.mesh_groups(s.tp, s.sp, s.dp, s.pp)
    m = s.grad_accum_steps
    stages = _stage_costs(model, cl, s, groups, opt, cache)
    flash = keeps_no_scores(cl.device, model, s)
    kept = scp_kept(model, s, seq, cl.device.reserved_bytes, flash,
                    opt.tessera_runtime, host_is_device=cl.device.is_host
                    ) if s.schedule == "scp" else []
    pipe, parts = _pipeline(s, stages, m, cl, model, groups, kept)
    dp_parts = outside_pipeline(model, cl, s, groups, stages, _stage_params(model, s, opt),
                                opt.dp_overlap)
    step = pipe + sum(dp_parts.values())
    straggle = straggler_time(cl, s, step)
    step += straggle
    breakdown = {**parts, **dp_parts, "step_sync": dp_parts["step_sync"] + straggle}
    tokens = s.global_batch_size * seq
    model_flops = model.flops_per_token(seq) * tokens
    peak = cl.device.peak(s.precision)
    memory = device_memory(model, s, seq, cl.device.reserved_bytes, flash,
                           opt.tessera_runtime, kept, host_is_device=cl.device.is_host)
    return Estimate(strategy=s, step_time=step, tokens_per_s=tokens / step,
                    tflops_per_device=model_flops / step / s.world_size / 1e12,
                    mfu=model_flops / step / s.world_size / peak, memory=memory,
                    capacity=cl.device.memory_bytes, breakdown=breakdown)


@dataclass(frozen=True)
class _Stage:
    fwd: float  # compute seconds per micro-batch
    bwd: float
    rec: float
    comm: float  # exposed tp + sp communication per micro-batch (forward, backward, recompute)
    tp_comm: float
    sp_comm: float

    @property
    def total(self) -> float:
        return self.fwd + self.bwd + self.rec + self.comm


def lower_bound(model: ModelConfig, cluster: Cluster, strategy: Strategy,
                options: SimOptions | None = None, cache: dict | None = None) -> float:
    """Step time of ``strategy``'s layout without recomputation, gradient synchronisation,
    optimizer or offload: no recomputation or memory setting can make the step faster."""
    # memory=chunk: 16-bit parameters under bf16/fp16 make no weight casts and the least
    # element-wise traffic (no autocast copies); in fp32 every memory setting prices alike.
    s = strategy.replace(recompute=(0.0,), memory="chunk", offload=())
    cl = placed(cluster, s.world_size)
    groups = comm.mesh_groups(s.tp, s.sp, s.dp, s.pp)
    stages = _stage_costs(model, cl, s, groups, options or SimOptions(), cache)
    return _pipeline(s, stages, s.grad_accum_steps, cl, model, groups)[0]


def _stage_costs(model: ModelConfig, cl: Cluster, s: Strategy, groups, opt: SimOptions,
                 cache: dict | None = None) -> list[_Stage]:
    seq, b = model.max_seq_len, s.micro_batch_size
    lt = _cached_layer_time(model, cl, s, cache)
    # autocast's 16-bit weight copies, made again for every forward (and recomputation); the
    # backward casts each weight's 16-bit gradient back to fp32, the same traffic, and under
    # the eager tp ops (nothing kept) casts the weight again for the input gradient; 1d tp
    # pipeline stages keep autocast's copy, as plain layers do
    cast = head_cast = 0.0
    if opt.tessera_runtime:
        cast = weight_cast_time(cl, matrix_params(model) / s.tp, s.precision, s.memory)
        head_cast = weight_cast_time(cl, model.vocab_size * model.d_model / s.tp, s.precision,
                                     s.memory)
    bwd_casts = 1 if s.tp == 1 or stages_read_shards(s) else 2
    tp_f, tp_b = _tp_comm(model, cl, s, groups)
    sp_f, sp_b = _sp_comm(model, cl, s, groups, lt)
    out = []
    for i, sp_params in enumerate(_stage_params(model, s, opt)):
        layers = sp_params.layers
        n_rec = recomputed_layers(s.stage_recompute(i), layers)
        # Where the runtime keeps autocast's cache for the step (memory.shares_weight_casts)
        # the weights are cast once per step, for all the micro-batches; the gradients still
        # once per backward. A sliced head's rows are views: cast every time.
        once = shares_weight_casts(s, s.stage_recompute(i), layers,
                                   stage_in_flight(s, i, s.grad_accum_steps))
        fwd_cast = cast / s.grad_accum_steps if once else cast
        head_once = once and not head_is_sliced(model, s)
        fwd_head_cast = head_cast / s.grad_accum_steps if head_once else head_cast
        fwd = layers * (lt.forward + fwd_cast)
        bwd = layers * (lt.backward + bwd_casts * cast)
        # Tensor-parallel collectives outside the blocks: forward (g), backward (f), and the
        # loss's, which runs after the stage (never under a sub-pipelined half's compute).
        extra_fwd = extra_bwd = loss_tp = 0.0
        if i == 0:
            e = embedding_time(cl, model, b, seq, s.tp, s.sp, s.precision)
            fwd, bwd = fwd + e.forward, bwd + e.backward
            if s.tp_seq == "on":  # to sequence shards; backward gathers the gradient
                extra_fwd += _tp_collective(model, cl, s, groups, "reduce_scatter")
                extra_bwd += _tp_collective(model, cl, s, groups, "all_gather")
            else:  # vocab-parallel embedding: partial rows summed
                extra_fwd += _tp_collective(model, cl, s, groups, "all_reduce")
        if sp_params.head_share > 0:  # the whole head, or its slices' share (split.py)
            h = head_time(cl, model, b, seq, s.tp, s.sp, s.precision)
            share = sp_params.head_share
            fwd = fwd + share * (h.forward + fwd_head_cast)
            bwd = bwd + share * (h.backward + bwd_casts * head_cast)
            if s.tp > 1:  # vocab-parallel cross-entropy: the max, then the sum of exp
                # with the target logit; the vocab-split head sums its input gradient
                loss_tp += 2 * comm.call_time(cl, groups["tp"])
                if s.tp_seq == "on":  # the head gathers the sequence (backward scatters)
                    extra_fwd += _tp_collective(model, cl, s, groups, "all_gather")
                    extra_bwd += (_tp_collective(model, cl, s, groups, "reduce_scatter")
                                  + _norm_grad_calls(model, cl, groups))  # the final norm
                else:
                    extra_bwd += _tp_collective(model, cl, s, groups, "all_reduce")
        # The forward again, plus the checkpoint's own hooks (profiled, at a lone worker's
        # rate like the layer's other fixed costs).
        rec = n_rec * (lt.forward + cast + cl.device.overheads.get("recompute_layer", 0.0)
                       / cl.compute_share())
        tp = (layers * (tp_f + tp_b) + n_rec * (tp_f - _regathers_saved(model, cl, s, groups))
              + extra_fwd + extra_bwd + loss_tp)
        sp = layers * (sp_f + sp_b) + n_rec * sp_f
        hidden = opt.tp_overlap * tp
        if s.tp_overlap == "subpipe":
            # Each half micro-batch's all-reduces run while the other half computes, in the
            # forward (g, recomputation's too) and in the backward (f): at most half of each
            # pass's work is there to hide them under.
            fwd_tp = layers * tp_f + n_rec * tp_f + extra_fwd
            hidden += min(fwd_tp, cl.device.overlap_efficiency * (fwd + rec) / 2)
            # (not tp_seq's re-gathers: inside a segment's backward, tensor/ops_seq.py)
            bwd_tp = layers * (tp_b - _regathers(model, cl, s, groups)) + extra_bwd
            hidden += min(bwd_tp, cl.device.overlap_efficiency * bwd / 2)
        hidden = min(hidden, tp, cl.device.overlap_efficiency * (fwd + bwd))
        out.append(_Stage(fwd, bwd, rec, tp - hidden + sp, tp - hidden, sp))
    return out


def _stage_params(model: ModelConfig, s: Strategy, opt: SimOptions) -> list:
    return pipeline_stage_params(model, s, opt.tessera_runtime)


def _cached_layer_time(model: ModelConfig, cl: Cluster, s: Strategy,
                       cache: dict | None) -> LayerTime:
    """One layer's compute for one micro-batch; sub-pipelined tensor parallelism runs it as
    two half micro-batches (smaller matmuls, so a lower achieved rate, priced as such)."""
    halves = 2 if s.tp_overlap == "subpipe" else 1
    b = s.micro_batch_size // halves
    key = (id(cl.device), cl.devices_per_node, cl.nodes, b, s.tp, s.tp_mode, s.tp_seq, s.sp,
           s.sp_mode, s.precision, layout(s.precision, s.memory))
    lt = cache.get(key) if cache is not None else None
    if lt is None:
        lt = layer_time(cl, model, b, model.max_seq_len, s.tp, s.tp_mode, s.sp, s.precision,
                        s.sp_mode, s.memory, s.tp_seq)
        if cache is not None:
            cache[key] = lt
    return LayerTime(lt.forward * halves, lt.backward * halves)


def _tp_collective(model: ModelConfig, cl: Cluster, s: Strategy, groups, op: str) -> float:
    """One tp collective ``op`` over a micro-batch's (tokens, hidden) activation (all_gather:
    the gathered one; reduce_scatter: the one scattered)."""
    if s.tp == 1:
        return 0.0
    n = s.micro_batch_size * model.max_seq_len / s.sp
    nbytes = n * model.d_model * bytes_per_element(s.precision)
    return comm.collective_time(cl, op, nbytes, groups["tp"])


def _regathers(model: ModelConfig, cl: Cluster, s: Strategy, groups) -> float:
    """Under Megatron sequence parallelism, a layer's backward gathers its two block inputs
    again (the column layers keep their shard); 0 without it."""
    if s.tp_seq != "on":
        return 0.0
    return 2 * _tp_collective(model, cl, s, groups, "all_gather")


def _regathers_saved(model: ModelConfig, cl: Cluster, s: Strategy, groups) -> float:
    """Under Megatron sequence parallelism at pp = 1, a checkpointed block's column layers keep
    the input its recomputation gathers (tensor/modules.BlockInput): the backward's two
    re-gathers of a recomputed layer are not made. Pipeline stages keep the shard and gather
    it again, recomputed or not (tensor/ops_seq.tp_seq_linear)."""
    return 0.0 if s.pp > 1 else _regathers(model, cl, s, groups)


def _norm_grad_calls(model: ModelConfig, cl: Cluster, groups) -> float:
    """A norm's replicated weight (and bias) summing its gradient over tp under Megatron
    sequence parallelism: one small all-reduce each."""
    count = 2 if model.bias and model.norm == "layernorm" else 1
    return count * comm.call_time(cl, groups["tp"])


def _tp_comm(model: ModelConfig, cl: Cluster, s: Strategy, groups) -> tuple[float, float]:
    """Tensor-parallel communication of one layer and micro-batch: (forward, backward)."""
    if s.tp == 1:
        return 0.0, 0.0
    if s.tp_mode == "1d":
        # Megatron: one all-reduce after attention and one after the MLP; backward, one per
        # block input (the attention's and the MLP's pre-hook, tensor/modules.BlockInput),
        # however many column layers read it.
        ar = _tp_collective(model, cl, s, groups, "all_reduce")
        # Row-parallel biases sum their gradient over the group: two small all-reduces.
        extra = 2 * comm.call_time(cl, groups["tp"]) if model.bias else 0.0
        if model.n_kv_heads % s.tp:  # k, v weights replicated: their fp32 gradients summed
            kv_weight = model.n_kv_heads * model.head_dim * (model.d_model + model.bias) * 4.0
            extra += 2 * comm.collective_time(cl, "all_reduce", kv_weight, groups["tp"])
        if s.tp_seq == "on":
            # Megatron sequence parallelism: each block input all-gathered and each output
            # reduce-scattered in place of the all-reduce (backward: the reverse), each block
            # input gathered once more in backward (its column layers keep the shard); the
            # two norms' replicated weights sum their gradients over tp.
            gather = _tp_collective(model, cl, s, groups, "all_gather")
            seq = gather + _tp_collective(model, cl, s, groups, "reduce_scatter")
            return 2 * seq, 2 * (seq + gather) + extra + 2 * _norm_grad_calls(model, cl, groups)
        return 2 * ar, 2 * ar + extra
    q = math.isqrt(s.tp)
    el = bytes_per_element(s.precision)
    n = s.micro_batch_size * model.max_seq_len / s.sp
    h, kv, f = model.d_model, model.n_kv_heads * model.head_dim, model.d_ff
    # The runtime's products: q, k, v, o separately, then the MLP's.
    mlp_in = 2 if model.activation == "swiglu" else 1
    products = [(n, h, h, 2), (n, kv, h, 2), (n, f, h, mlp_in), (n, h, f, 1)]
    fwd = sum(comm.summa_time(cl, mm, o, k, count, q, el, groups["tp"])
              for mm, o, k, count in products)
    row, col = comm.Group(q, groups["tp"].stride), comm.Group(q, groups["tp"].stride * q)
    # Each norm reduces its statistics along grid rows (mean and variance forward; two
    # projections backward) and its weight (and bias) gradients down grid columns; each
    # linear's bias gradient is summed down the columns too.
    stats = comm.collective_time(cl, "all_reduce", n / q * 4, row)
    norm_grads = (2 if model.bias and model.norm == "layernorm" else 1) * comm.call_time(cl, col)
    linears = 4 + mlp_in + 1
    bias_grads = linears * comm.call_time(cl, col) if model.bias else 0.0
    return fwd + 2 * 2 * stats, 2 * fwd + 2 * (2 * stats + norm_grads) + bias_grads


def _sp_comm(model: ModelConfig, cl: Cluster, s: Strategy, groups, lt: LayerTime
             ) -> tuple[float, float]:
    """Exposed sequence-parallel communication of one layer and micro-batch."""
    if s.sp == 1:
        return 0.0, 0.0
    el = bytes_per_element(s.precision)
    heads_split = math.isqrt(s.tp) if s.tp_mode == "2d" else s.tp
    n_loc = s.micro_batch_size * model.max_seq_len / s.sp
    kv = model.n_kv_heads * model.head_dim
    group = groups["sp"]
    if s.sp_mode == "ulysses":
        # Four all-to-alls forward (q, k, v in; output back) and four backward.
        nbytes = n_loc * (2 * model.d_model + 2 * kv) / heads_split * el
        t = 4 * comm.collective_time(cl, "all_to_all", nbytes / 4, group)
        # The forward also gathers the token metadata (index, segment) of the whole sequence.
        meta = comm.collective_time(cl, "all_gather", n_loc * s.sp * 2 * 8, group)
        return t + meta, t
    # Ring: sp - 1 steps passing this rank's K and V blocks. Backward passes the blocks again
    # (sp - 1 steps) and, on a second ring one step behind, their dK, dV contributions, which
    # take sp hops to reach their owner (sequence/comm.py ring_pass_with_grads): 2 sp - 1.
    # A step waits for the whole ring (each rank for its predecessor): a profiled cluster
    # measured exactly that ("ring_step"); otherwise one p2p message.
    op = "ring_step" if "ring_step" in cl.collectives else "p2p"
    step = comm.collective_time(cl, op, n_loc * 2 * kv / heads_split * el, group)
    ring_f, ring_b = (s.sp - 1) * step, (2 * s.sp - 1) * step
    if s.sp_mode == "rsa":
        # Paper-faithful RSA: a pass of keys, then one of values, neither overlapped; each
        # step carries one of the two (the ring_step fit, of three messages, prices it high).
        half = comm.collective_time(cl, op, n_loc * kv / heads_split * el, group)
        return 2 * (s.sp - 1) * half, 2 * (2 * s.sp - 1) * half
    # Ring attention overlaps each step with the attention block it feeds.
    attn_f = lt.forward * 0.3
    ovl = cl.device.ring_overlap
    return (max(step, ring_f - ovl * attn_f), max(step, ring_b - ovl * 2.5 * attn_f))


def _pipeline(s: Strategy, stages: list[_Stage], m: int, cl: Cluster, model: ModelConfig,
              groups, kept: list[int] | None = None) -> tuple[float, dict[str, float]]:
    """Pipeline time and its parts; ``kept``: micro-batches each stage keeps whole under scp
    (memory.scp_kept)."""
    p2p = 0.0
    if s.pp > 1:
        n = s.micro_batch_size * model.max_seq_len / s.sp
        nbytes = n * model.d_model * bytes_per_element(s.precision)
        nbytes /= boundary_split(s)
        p2p = comm.collective_time(cl, "p2p", nbytes, comm.Group(2, groups["pp"].stride))
    recs = []
    for i, st in enumerate(stages):
        rec = st.rec
        if s.schedule == "scp" and s.pp > 1:
            recomputing = (m - min(kept[i], m)) / m if kept else 1.0
            rec = max(0.0, rec * recomputing - p2p)
        recs.append(rec)
    v = INTERLEAVE_CHUNKS if s.schedule == "interleaved" else 1
    pp_comm = (m + s.pp - 1) * 2 * p2p * v if s.pp > 1 else 0.0
    pipe, parts = _schedule(stages, recs, m, v, cl.compute_share())
    return pipe + pp_comm, {**parts, "pp_comm": pp_comm}


def _schedule(stages: list[_Stage], recs: list[float], m: int, v: int, share: float
              ) -> tuple[float, dict[str, float]]:
    """Pipeline time of ``m`` micro-batches over the stages (``recs``: their recomputation).

    Workers that share cores (a CPU, ``share`` < 1): the stage times are at the contended
    rate. A pipeline's waiting stages free their cores for the others, so the time is the
    longer of the critical path at a lone worker's rate and the mean stage work at the
    contended rate. With a core per worker (share 1) this is the usual pipeline formula.
    """
    lone = [share * (st.fwd + st.bwd + rec) + st.comm for st, rec in zip(stages, recs)]
    crit = max(range(len(lone)), key=lone.__getitem__)
    fill = (sum(lone) - lone[crit]) / v
    critical_path = m * lone[crit] + fill
    busy = [st.fwd + st.bwd + rec + st.comm for st, rec in zip(stages, recs)]
    if critical_path >= m * sum(busy) / len(busy):
        st = stages[crit]
        return critical_path, {
            "compute": m * share * (st.fwd + st.bwd), "recompute": m * share * recs[crit],
            "tp_comm": m * st.tp_comm, "sp_comm": m * st.sp_comm, "bubble": fill}
    n = len(stages)
    parts = {"compute": m * sum(st.fwd + st.bwd for st in stages) / n,
             "recompute": m * sum(recs) / n,
             "tp_comm": m * sum(st.tp_comm for st in stages) / n,
             "sp_comm": m * sum(st.sp_comm for st in stages) / n, "bubble": 0.0}
    return sum(parts.values()), parts


def with_precision(strategy: Strategy, precision: str) -> Strategy:
    """A copy of ``strategy`` at another precision."""
    return dataclasses.replace(strategy, precision=precision)
