"""What a training step adds outside the pipeline, priced for the simulator (simulator.py).

Data-parallel gradient synchronisation not hidden under the last backward (DDP buckets, ZeRO
collectives, the chunk runtime's blocking gathers), the optimizer update, host offload
transfers, the tessera runtime's profiled host work, and on workers that share cores the wait
for the last one to finish its step.
"""

from __future__ import annotations

import math

from tessera.models.config import ModelConfig
from tessera.planner import comm
from tessera.planner.cluster import Cluster
from tessera.planner.compute import optimizer_time
from tessera.planner.memory import StageParams, local_params, state_bytes
from tessera.strategy import Strategy

DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20
HOST_ADAM_BANDWIDTH = 20e9  # bytes/s per device of a CPU Adam (ZeRO-Offload's is memory-bound)


def held_back(model: ModelConfig, s: Strategy, stage_params: list[StageParams],
               stage: StageParams) -> float:
    """Parameters of ``stage`` the pipeline averages over dp only after the drain
    (pipeline/module.py): a sliced head's home weight, whose rows' gradients arrive then."""
    if s.pp == 1 or not any(st.head_rows for st in stage_params):
        return 0.0
    return stage.head_params if not model.tie_embeddings else min(
        stage.embed_params, model.vocab_size * model.d_model)  # tied: the home is stage 0


def outside_pipeline(model: ModelConfig, cl: Cluster, s: Strategy, groups, stages: list,
                     stage_params: list[StageParams], dp_overlap: bool) -> dict[str, float]:
    """Exposed gradient sync, optimizer, offload and runtime seconds of the critical stage.

    ``stages``: the simulator's per-stage compute (``fwd``, ``bwd`` seconds per micro-batch);
    ``stage_params``: what each stage holds (memory.pipeline_stage_params); ``dp_overlap``:
    gradient synchronisation overlaps the last backward (DDP buckets)."""
    w_b, g_b, o_b = state_bytes(s.precision)
    params = [local_params(model, p, s.tp) for p in stage_params]
    worst = max(range(s.pp), key=params.__getitem__)
    p = params[worst]
    st = stages[worst]
    m = s.grad_accum_steps
    group = groups["dp_sp"]
    ovl = cl.device.overlap_efficiency if dp_overlap else 0.0
    bw = cl.device.memory_bandwidth * cl.device.memory_efficiency
    sync = 0.0
    if group.size > 1:
        if s.memory == "ddp":
            # torch DDP, or the buckets of pipeline/overlap.py (under pp, and tensor-parallel
            # shards at pp = 1, tensor/data_parallel.py): a first bucket of 1 MiB, then
            # 25 MiB buckets, one all-reduce each, overlapping the last backward. A sliced
            # head's home weight is averaged after the drain (its rows' gradients arrive
            # then), exposed.
            held = held_back(model, s, stage_params, stage_params[worst]) / s.tp
            free = max(0.0, p - held) * g_b
            rest = max(0.0, free - DDP_FIRST_BUCKET_BYTES)
            buckets = 1 + math.ceil(rest / DDP_BUCKET_BYTES)
            ar = (comm.collective_time(cl, "all_reduce", free, group)
                  + (buckets - 1) * comm.call_time(cl, group))
            last = comm.collective_time(cl, "all_reduce", min(free, DDP_BUCKET_BYTES), group)
            sync = max(last, ar - ovl * st.bwd) + 2 * p * g_b / bw  # bucket copies
            if held:
                sync += comm.collective_time(cl, "all_reduce", held * g_b, group)
        elif s.memory in ("zero1", "zero2"):
            rs = comm.collective_time(cl, "reduce_scatter", p * g_b, group)
            ag = comm.collective_time(cl, "all_gather", p * w_b, group)
            sync = max(0.0, rs - ovl * st.bwd) + max(0.0, ag - ovl * st.fwd)
        elif s.memory == "chunk":
            sync = chunk_collectives_time(model, cl, s, p, group, s.stage_recompute(worst))
        else:  # zero3: gather weights for forward and backward of every micro-batch
            ag = comm.collective_time(cl, "all_gather", p * w_b, group)
            rs = comm.collective_time(cl, "reduce_scatter", p * g_b, group)
            sync = m * max(0.0, 2 * ag - ovl * (st.fwd + st.bwd)) + max(0.0, rs - ovl * st.bwd)
    head_rows = sum(stage.head_rows for stage in stage_params)
    pp_pair = comm.Group(2, groups["pp"].stride)
    if head_rows:
        # Rows of a sliced head (pipeline/rows.py): the home sends them before the step and
        # receives their gradients after it, one message each way per holder, in series.
        sync += (comm.collective_time(cl, "p2p", head_rows * w_b, pp_pair)
                 + comm.collective_time(cl, "p2p", head_rows * g_b, pp_pair))
    elif s.pp > 1 and model.tie_embeddings:
        tied = model.vocab_size * model.d_model / s.tp * g_b
        sync += comm.collective_time(cl, "all_reduce", tied, pp_pair)
    shard = group.size if s.memory != "ddp" else 1
    n_tensors = 12 * max(1, model.n_layers // s.pp)
    offload = offload_time(cl, s, p / shard, st.bwd) if s.offload else 0.0
    if s.offload and not cl.device.is_host:
        optim = (p / shard) * cl.device.optimizer_bytes_per_param / HOST_ADAM_BANDWIDTH
    else:  # a CPU worker's offloaded update runs on its own cores, as profiled
        optim = optimizer_time(cl, p / shard, n_tensors)
    if s.tp > 1 and s.memory == "ddp":  # clip + AdamW over DTensors (chunks step their own)
        key = "tp_optim_layer" if s.tp_mode == "1d" else "tp2d_optim_layer"
        optim += (cl.device.overheads.get(key, 0.0) * stage_params[worst].layers
                  / cl.compute_share())
    return {"dp_comm": sync, "optimizer": optim, "offload": offload,
            "chunk_runtime": chunk_runtime(cl, s, model), "trainer": trainer_runtime(cl, s),
            "step_sync": step_sync_time(cl, s)}


def step_sync_time(cl: Cluster, s: Strategy) -> float:
    """With workers sharing cores, a step ends when its last worker has been scheduled
    through its optimizer update, and the next step's first collective waits for it: one
    more blocking call of the whole job, at the measured (loaded) latency, when the cluster
    has no measured straggler fraction (:func:`straggler_time` then prices it). With a core per
    worker (every GPU cluster) ranks finish together and this is 0."""
    if (s.world_size == 1 or cl.compute_share() >= 1.0
            or cl.straggler_fraction(s.world_size) is not None):
        return 0.0
    return comm.call_time(cl, comm.Group(s.world_size, 1))


def straggler_time(cl: Cluster, s: Strategy, step: float) -> float:
    """Seconds a synchronous step waits for its slowest worker when workers share cores:
    the profile's measured straggler fraction of the step (0 without one, or with a core
    per worker)."""
    fraction = cl.straggler_fraction(s.world_size)
    if s.world_size == 1 or fraction is None or cl.compute_share() >= 1.0:
        return 0.0
    return fraction * step


def chunk_collectives_time(model: ModelConfig, cl: Cluster, s: Strategy, p: float, group,
                       recompute: float = 0.0) -> float:
    """ZeRO collectives of the memory=chunk runtime over a step. It gathers each group of dp
    chunks before the forward and again before the backward of every micro-batch, and
    reduce-scatters each group's gradients once, after the last micro-batch's backward (the
    others accumulate locally under no_sync), all blocking (nothing to overlap with).
    The chunk size search lands near the largest tensor, so a rank holds about
    ``p / largest`` chunks, in ``ceil(chunks / dp)`` groups. Under pp a stage's recomputed
    head is a piece of its own, gathered a third time for its recomputation (memory/stages.py);
    ``recompute`` is that stage's ratio."""
    w_b, g_b, _ = state_bytes(s.precision)
    h, f = model.d_model, model.d_ff
    largest = max(model.vocab_size * h, h * f, h * (h + 2 * model.n_kv_heads * model.head_dim))
    groups = math.ceil(math.ceil(p / (largest / s.tp)) / group.size)
    extra_calls = (groups - 1) * comm.call_time(cl, group)
    ag = comm.collective_time(cl, "all_gather", p * w_b, group) + extra_calls
    rs = comm.collective_time(cl, "reduce_scatter", p * g_b, group) + extra_calls
    head = recompute if s.pp > 1 else 0.0
    return s.grad_accum_steps * (2 + head) * ag + rs


# An unprofiled host's memory=chunk runtime, per layer and micro-batch: about four operations
# the size of a kernel launch for each of a layer's ~12 parameter tensors (fetched for the
# forward and again for the backward, its gradient copied into the chunk, released). At the
# cpu preset's 20 us that is 0.96 ms; `tessera profile` measured 1.0 ms (`chunk_layer`, its
# tiny model, 2-core host, docs/planner.md).
CHUNK_OPS_PER_LAYER = 4 * 12


def chunk_runtime(cl: Cluster, s: Strategy, model: ModelConfig) -> float:
    """Cost of the memory=chunk runtime over a step: hooks and chunk copies every
    micro-batch, gradient reduction and the chunked optimizer once; profiled
    (``chunk_layer``, ``chunk_step_layer``), else on a host counted in kernel overheads
    (``CHUNK_OPS_PER_LAYER``); 0 on an accelerator without a profile, where this host work
    runs ahead of the kernels."""
    fixed = cl.device.overheads
    per_micro_batch = fixed.get("chunk_layer")
    if per_micro_batch is None:
        per_micro_batch = (CHUNK_OPS_PER_LAYER * cl.device.kernel_overhead
                           if cl.device.is_host else 0.0)
    per_layer = s.grad_accum_steps * per_micro_batch + fixed.get("chunk_step_layer", 0.0)
    if s.memory != "chunk" or not per_layer:
        return 0.0
    layers = max(1, model.n_layers // s.pp)
    return per_layer * layers / cl.compute_share()


def trainer_runtime(cl: Cluster, s: Strategy) -> float:
    """Profiled cost of the tessera Trainer beyond a bare training loop: collating each
    micro-batch, the loss bookkeeping, clipping through the parallel plan and the learning-rate
    schedule (0 on a cluster without a profile: on an accelerator this host work runs ahead
    of the kernels)."""
    fixed = cl.device.overheads
    seconds = (fixed.get("trainer_step", 0.0)
               + s.grad_accum_steps * fixed.get("trainer_micro_batch", 0.0))
    return seconds / cl.compute_share()


def offload_time(cl: Cluster, s: Strategy, p_shard: float, bwd: float) -> float:
    """Host transfers of an offloaded step (ZeRO-Offload style): gradients down during the
    last backward, updated weights back up; with disk, optimizer states in and out of NVMe."""
    w_b, g_b, o_b = state_bytes(s.precision)
    disk = 2 * p_shard * o_b / cl.device.disk_bandwidth if "disk" in s.offload else 0.0
    if cl.device.is_host:  # a CPU worker: device and host memory are one
        return disk
    host = cl.device.host_bandwidth
    down = max(0.0, p_shard * g_b / host - cl.device.overlap_efficiency * bwd)
    up = p_shard * w_b / host
    return down + up + disk
