"""Pipeline parallelism (Merak, arXiv 2206.04959): capture, partition, schedules, recompute.

Files: ``capture`` (torch.export -> proxy graph with per-node costs), ``cost`` (FLOPs and bytes
from shapes), ``partition`` (balanced cuts under memory limits, stage-aware recomputation),
``split`` (graph pieces bound to the model's own parameters), ``schedules`` (gpipe, 1f1b,
interleaved, scp as action lists), ``comm`` (tagged point-to-point messages), ``stage``
(forward / recompute / backward of one stage), ``program`` (per-shape stages), ``module``
(this rank's share under the original names, gradient rules), ``engine`` (PipelineEngine),
``tp`` (stages of a 1D or 2D tensor-parallel model), ``subpipe`` (sub-pipelined tensor
parallelism), ``head`` (an LM head sliced over the vocabulary, to spread it over stages),
``rows`` (stages reading a weight through row slices hold only those rows), ``kept``
(what autograd keeps, measured on fake tensors, for the partition's stage memory).
Design and figures: docs/pipeline.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from tessera.mesh import Mesh
from tessera.models.materialize import DeferredInit, has_meta, parameter_aliases
from tessera.parallel.pipeline.capture import CaptureError, ProxyGraph, capture, retarget
from tessera.parallel.pipeline.fidelity import warn_if_capture_differs
from tessera.parallel.pipeline.comm import Channel, stage_channels
from tessera.parallel.pipeline.cost import DeviceRates
from tessera.parallel.pipeline.engine import PipelineEngine
from tessera.parallel.pipeline.head import head_slices_for, slice_head, sliced_head_loss
from tessera.parallel.pipeline.kept import measured_under
from tessera.parallel.pipeline.module import (GradSync, StageModule, local_shard,
                                              persistent_buffers)
from tessera.parallel.pipeline.cost_table import CostTable, candidate_cuts
from tessera.parallel.pipeline.partition import Partition, PartitionError, partition
from tessera.parallel.pipeline.program import (PipelineProgram, capture_for_partition,
                                              nominal_seq_len)
from tessera.parallel.pipeline.recompute import stage_aware_ratios, strategy_text
from tessera.parallel.pipeline.rows import RowHolding, RowShare, find_row_shares
from tessera.parallel.pipeline.schedules import ScheduleError, build, check_sizes, chunks_for
from tessera.parallel.pipeline.split_points import cuts_at
from tessera.parallel.plan import Parallelized, lm_loss
from tessera.parallel.pipeline.tp import (carry_permutations, grid_inputs, stage_batch,
                                          tp_group_of, tp_loss)
from tessera.strategy import Strategy, StrategyError

__all__ = ["CaptureError", "PartitionError", "PipelineEngine", "ScheduleError",
           "apply_pipeline", "capture", "partition", "priced_under", "stage_aware_ratios"]


@dataclass
class Pipeline:
    """What the PipelineEngine needs on this rank (kept in ``Parallelized.pipeline``)."""

    program: PipelineProgram
    schedule: str
    pp_group: torch.distributed.ProcessGroup
    stage_rank: list[int]  # pp-group rank of each virtual stage
    local_stages: list[int]
    ratios: list[float]  # recomputation ratio per virtual stage
    grad_sync: GradSync
    partition: Partition
    module: StageModule
    # This rank's channels: one process group per directed pair of ranks (comm.py).
    channels: dict[tuple[int, int], Channel]
    # (logits, labels); (per-token loss, labels) when the LM head is sliced (head.py)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
    # Under sp > 1: shards each micro-batch and computes the loss (sequence/staged.py).
    inputs: Any = None
    # Weights this rank reads only through row slices, held as those rows (rows.py).
    rows: RowHolding | None = None
    # Under a stage memory budget: the tokens per sample the ratios were chosen at. Longer
    # steps keep more activations than the budget's estimate (the engine warns).
    budget_len: int | None = None

    def prepare(self, batch: dict[str, torch.Tensor], training: bool
                ) -> dict[str, torch.Tensor]:
        """The micro-batch as this rank's stages read it (this rank's tokens under sp), for
        the training graph or the evaluation one."""
        return batch if self.inputs is None else self.inputs.shard(batch, training)

    def local_len(self, length: int) -> int:
        """Tokens per sample this rank's stages run for a micro-batch of ``length``."""
        return rank_tokens(self.inputs, length)

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The last stage's loss of one (prepared) micro-batch; ``logits`` is the per-token
        loss when the LM head is sliced (head.py)."""
        if self.inputs is not None and self.program.graph.head_slices > 1:
            return self.inputs.loss(logits, batch, per_token=True)  # sp's StageInputs (no tp)
        if self.inputs is not None:
            return self.inputs.loss(logits, batch)
        return self.loss_fn(logits, batch["labels"])

    def kept(self, stage: int) -> int | None:
        """Micro-batches scp keeps whole on ``stage`` (the partition's, fit to 1F1B's memory)."""
        return self.partition.keep[stage] if self.partition.keep else None

    @property
    def n_stages(self) -> int:
        return len(self.stage_rank)

    def actions(self, micro_batches: int):
        pp_rank = self.stage_rank[self.local_stages[0]]
        return build(self.schedule, len(set(self.stage_rank)), micro_batches)[pp_rank]


def apply_pipeline(plan: Parallelized, strategy: Strategy, mesh: Mesh,
                   inputs: Any = None, deferred: DeferredInit | None = None,
                   budget: int | None = None, seq_len: int | None = None,
                   split_points: list[str] | None = None) -> Pipeline:
    """Partition ``plan.model`` into ``strategy.pp`` stages and keep this rank's share.

    A model on the meta device is captured and partitioned as it is; ``deferred`` then
    materialises only the parameters this rank's stages hold (the rest stay on meta) and every
    buffer. With ``budget`` (bytes), each stage recomputes the least share that keeps its
    estimated memory within it (the strategy's ``recompute`` must be left unset).

    The partition is made on a graph captured at the run's ``seq_len`` (each rank's share of
    it under sequence parallelism), so that its estimates are the run's and the training
    stages reuse that capture; without it, at the model's maximum length capped at 128.

    ``inputs`` (sequence parallelism's ``StageInputs``, sequence/staged.py) adds the batch
    inputs the captured model reads besides ``input_ids``, shards each micro-batch and
    computes the loss; gradients are then averaged over dp x sp. Under 2D tensor
    parallelism the grid's ``GridInputs`` (pipeline/tp.py) does the same for batch slices.

    Sets ``plan.module`` to the :class:`StageModule`, and plan hooks for the optimizer, the
    gradient norm and the engine. Data parallelism is done by the engine's gradient sync.

    Raises:
        StrategyError: for combinations not built yet (ZeRO memory without chunks)
            and for too few micro-batches or splittable blocks.
    """
    _refuse_unsupported(strategy, budget)
    inputs = inputs if inputs is not None else grid_inputs(strategy, mesh)  # 2D: batch slices
    model, pp = plan.model, strategy.pp
    micro_batches = strategy.grad_accum_steps
    try:
        check_sizes(strategy.schedule, pp, micro_batches)
    except ScheduleError as err:
        raise StrategyError(str(err)) from None
    n_virtual = pp * chunks_for(strategy.schedule)
    ratios = [strategy.stage_recompute(s % pp) for s in range(n_virtual)]
    model.train()
    extra = inputs.example if inputs is not None else None
    local_len = rank_tokens(inputs, seq_len) if seq_len else None
    # Sub-pipelined stages run the graph on each half of a micro-batch: captured at half of
    # it, the partition prices both halves (CostTable's batch_parts) and the stages reuse it.
    sub_batches = 2 if strategy.tp_overlap == "subpipe" else 1
    graph = capture_for_partition(model, stage_batch(strategy) // sub_batches, extra,
                                  local_len)
    if strategy.tp == 1 and extra is None and not has_meta(model):
        warn_if_capture_differs(graph, model)  # stages run the capture, not the forward
    loss_fn = tp_loss(strategy, mesh) or lm_loss
    # Whole logits per token (tp's are vocabulary-sharded) are sliceable; stages named by
    # split points hold whole modules, the head included.
    if strategy.tp == 1 and not split_points:
        graph = slice_head(graph, head_slices_for(graph, n_virtual))
        loss_fn = sliced_head_loss if graph.head_slices > 1 else lm_loss
    part = _cut(priced_under(graph, strategy, mesh.device_type), n_virtual, micro_batches,
                strategy, ratios, budget, split_points, sub_batches)
    if budget is not None:
        ratios = list(part.recompute)  # chosen per stage for the budget
    pp_rank = mesh.rank("pp")
    stage_rank = [s % pp for s in range(n_virtual)]
    local = [s for s in range(n_virtual) if stage_rank[s] == pp_rank]
    holders = _holders(model, graph, part, stage_rank)
    # Chunk memory keeps weights and gradients in dp-sharded chunks: rows are not built there.
    shares = [] if strategy.memory == "chunk" else _row_shares(model, graph, part, stage_rank)
    for share in shares:  # a row holder holds its rows, not the weight
        holders[share.name].discard(share.holder)
    on_meta = _materialise_share(model, graph, holders, pp_rank, deferred, plan.pending_shards)
    module, grad_sync = _ownership(model, holders, graph, part, stage_rank, pp_rank, mesh,
                                   strategy)
    carry_permutations(model, module)  # fused q|k|v shards keep saving unpermuted
    autocast = _autocast_factory(strategy, _device_of(model))
    program = PipelineProgram(model, graph, part, ratios, local, autocast, extra, sub_batches)
    if autocast is not contextlib.nullcontext:
        device_type = _device_of(model).type
        program.cast_cache = lambda: torch.autocast(device_type, enabled=False)
    if on_meta:
        program.run_device = deferred.device
    device = deferred.device if on_meta else _device_of(model)
    rows = None
    if shares:
        rows = _row_holding(model, shares, mesh, pp_rank, device)
        program.row_bindings = rows.bindings
        grad_sync.hold_back(rows.weights.values())  # holders' row gradients arrive after
    channels = stage_channels(mesh.groups_along("pp"), stage_rank, device)
    pipe = Pipeline(program, strategy.schedule, mesh.group("pp"), stage_rank, local, ratios,
                    grad_sync, part, module, channels, loss_fn, inputs, rows,
                    budget_len=(seq_len or nominal_seq_len(model)) if budget else None)
    plan.module, plan.pipeline = module, pipe
    plan.clip_grad_norm = lambda _model, max_norm: grad_sync.clip(max_norm)
    base = plan.build_optimizer  # tensor parallelism's, when it adds state-dict hooks
    plan.build_optimizer = lambda _model, *args: _stage_optimizer(module, base, *args)
    plan.features.append("pipeline")
    return pipe


def rank_tokens(inputs: Any, length: int) -> int:
    """Tokens per sample a rank's stages run for a ``length``-token micro-batch: its share
    of the sequence padded for the layout under sp (``StageInputs.local_len``), the whole
    sequence otherwise (2D tp's ``GridInputs`` slice batch rows, not tokens)."""
    share = getattr(inputs, "local_len", None)
    return share(length) if share is not None else length


def priced_under(graph: ProxyGraph, strategy: Strategy, device_type: str) -> ProxyGraph:
    """The graph whose bytes the partition estimates: measured on fake tensors on the run's
    device type, under autocast for ``precision=bf16`` / ``fp16`` (kept.py)."""
    from tessera.train.engine import _AUTOCAST_DTYPES  # tessera.train imports this package

    return measured_under(graph, device_type, _AUTOCAST_DTYPES.get(strategy.precision))


def _cut(graph: ProxyGraph, stages: int, micro_batches: int, strategy: Strategy,
         ratios: list[float], budget: int | None, split_points: list[str] | None = None,
         batch_parts: int = 1) -> Partition:
    """The partition into ``stages`` (with each stage's ratio chosen under ``budget``), at
    the modules ``split_points`` names when given; refused as a StrategyError naming pp, the
    schedule and, under a budget, its need. ``batch_parts``: as for ``partition``."""
    cuts = None
    if split_points:
        allowed = candidate_cuts(CostTable(graph, DeviceRates()))
        cuts = cuts_at(graph, list(split_points), allowed, stages)
    # The budget is a rank's; its virtual stages (interleaving) share it equally, so that
    # their estimates sum to it at most.
    limit = None if budget is None else budget / chunks_for(strategy.schedule)
    try:
        # Cuts inside attention / MLP: checked without tp and sp only (their stage graphs
        # carry collectives and sharded activations across such a cut untested).
        return partition(graph, stages, micro_batches, strategy.schedule,
                         memory_limit=limit,
                         recompute=None if budget is not None else tuple(ratios),
                         cuts=cuts, finer=strategy.tp == 1 and strategy.sp == 1,
                         batch_parts=batch_parts)
    except PartitionError as err:
        if err.max_stages is not None:  # too few cut points: say which pp would fit
            chunks = chunks_for(strategy.schedule)
            per = f" ({chunks} virtual stages per rank)" if chunks > 1 else ""
            fits = err.max_stages // chunks
            advice = (f"use pp <= {fits}" if fits > 1 else
                      f"the model cannot be cut into {chunks * 2} stages: use pp=1"
                      + (" or another schedule" if chunks > 1 else ""))
            raise StrategyError(f"pp={strategy.pp}, schedule={strategy.schedule}{per}: {err}; "
                                f"{advice}") from None
        raise StrategyError(f"pp={strategy.pp}, schedule={strategy.schedule}: {err}"
                            + _least_need(graph, stages, micro_batches, strategy, budget, cuts,
                                          batch_parts)) from None


def _materialise_share(model: nn.Module, graph: ProxyGraph, holders: dict[str, set[int]],
                       pp_rank: int, deferred: DeferredInit | None, pending=None) -> bool:
    """For a model on the meta device, give storage to the parameters this rank's stages
    hold (and every buffer) and point the graph captured on meta at the run's device.
    ``pending``: tensor parallelism's shards still on meta, filled instead (its buffers are
    materialised already). Returns whether the model was on meta."""
    if not has_meta(model):
        return False
    if deferred is None:
        raise ValueError("the model is on the meta device and no DeferredInit says how "
                         "to materialise this rank's stages")
    held = [name for name, ranks in holders.items() if pp_rank in ranks]
    if pending is not None:
        pending.fill(model, held)
    else:
        deferred(model, held)
    retarget(graph, deferred.device)  # captured on meta; its stages run on the device
    return True


def _stage_optimizer(module: StageModule, base, *args):
    # Imported here: tessera.train imports the pipeline engine (the Trainer picks it).
    from tessera.train.optim import build_optimizer

    return (base or build_optimizer)(module, *args)


def _least_need(graph: ProxyGraph, stages: int, micro_batches: int, strategy: Strategy,
                budget: int | None, cuts: list[int] | None = None, batch_parts: int = 1
                ) -> str:
    """What a refused budget would have to be: the fullest stage under full recomputation
    (at the split points' ``cuts`` when given)."""
    if budget is None:
        return ""
    try:
        full = partition(graph, stages, micro_batches, strategy.schedule, recompute=(1.0,),
                         cuts=cuts, batch_parts=batch_parts)
    except PartitionError:  # refused for another reason (too few cuts): said already
        return ""
    chunks = chunks_for(strategy.schedule)
    fullest = max(full.stage_memory)
    if chunks == 1:
        return (f" (train.stage_memory_budget={budget:,} bytes; with full recomputation "
                f"the fullest stage needs {fullest:,.0f})")
    return (f" (train.stage_memory_budget={budget:,} bytes, shared by {chunks} virtual "
            f"stages per rank; with full recomputation the fullest virtual stage needs "
            f"{fullest:,.0f}, so a budget of {chunks * fullest:,.0f})")


def _refuse_unsupported(strategy: Strategy, budget: int | None = None) -> None:
    if budget is not None and strategy.recompute != (0.0,):
        raise StrategyError(f"train.stage_memory_budget chooses each stage's recomputation: "
                            f"leave the strategy's recompute unset (it is "
                            f"recompute={strategy_text(strategy.recompute)})")
    if strategy.memory not in ("ddp", "chunk"):
        raise StrategyError(f"pp={strategy.pp} with memory={strategy.memory}: ZeRO memory "
                            "without chunks with pipeline stages is not built yet (issue #6, "
                            "docs/pipeline.md); use memory=chunk, pp=1 or memory=ddp")


def _holders(model: nn.Module, graph: ProxyGraph, part: Partition, stage_rank: list[int]
             ) -> dict[str, set[int]]:
    """The pp ranks holding each parameter, by its first name (``aliases``)."""
    names = parameter_aliases(model)
    stage_of = part.stage_of(graph)
    holders: dict[str, set[int]] = {}
    for pname, name in _first_names(model, graph).items():
        for i in graph.param_users[pname]:
            holders.setdefault(name, set()).add(stage_rank[stage_of[graph.compute[i]]])
    for pid in names:  # weights the graph never reads still need a home for checkpoints
        holders.setdefault(names[pid][0], {0})
    return holders


def _first_names(model: nn.Module, graph: ProxyGraph) -> dict[str, str]:
    """Each parameter placeholder of ``graph`` -> its weight's first name in ``model``."""
    names = parameter_aliases(model)
    return {p: names[id(model.get_parameter(graph.nodes[p].fqn))][0] for p in graph.param_users}


def _row_shares(model: nn.Module, graph: ProxyGraph, part: Partition, stage_rank: list[int]
                ) -> list[RowShare]:
    return find_row_shares(graph, part.stage_of(graph), stage_rank, _first_names(model, graph))


def _row_holding(model: nn.Module, shares: list[RowShare], mesh: Mesh, pp_rank: int,
                 device: torch.device) -> RowHolding:
    """This rank's rows of the row-shared weights, bound under every name of each."""
    aliases = {names[0]: names for names in parameter_aliases(model).values()}
    weights = {share.name: model.get_parameter(share.name) for share in shares}
    return RowHolding(shares, weights, aliases, mesh.group("pp"), pp_rank, device)


def _device_of(model: nn.Module) -> torch.device:
    """The device of the model's materialised parameters (some may stay on meta)."""
    return next((p.device for p in model.parameters() if not p.is_meta),
                next(model.parameters()).device)


def _ownership(model: nn.Module, by_name: dict[str, set[int]], graph: ProxyGraph,
               part: Partition, stage_rank: list[int], pp_rank: int, mesh: Mesh,
               strategy: Strategy) -> tuple[StageModule, GradSync]:
    """This rank's StageModule and gradient rules, from the pp ranks holding each weight."""
    names = parameter_aliases(model)
    by_id = {id(p): p for p in model.parameters()}
    holders = {pid: by_name[names[pid][0]] for pid in by_id}
    mine = [by_id[pid] for pid in by_id if pp_rank in holders[pid]]
    params = {name: param for name, param in model.named_parameters(remove_duplicate=False)
              if pp_rank in holders[id(param)]}
    buffers = _owned_buffers(model, graph, part, stage_rank, pp_rank)
    tied = [(names[pid][0], tuple(local_shard(by_id[pid]).shape)) for pid in by_id
            if len(holders[pid]) > 1]
    tied_local = {names[pid][0]: by_id[pid] for pid in by_id
                  if len(holders[pid]) > 1 and pp_rank in holders[pid]}
    norm_owned = [p for p in mine if min(holders[id(p)]) == pp_rank]
    device = _device_of(model)
    # Weights are replicated over dp (and sp): their gradients are averaged over both.
    replicas = mesh.flat_group("dp", "sp") if strategy.sp > 1 else mesh.group("dp")
    sync = GradSync(mine, norm_owned, mesh.group("pp"), replicas, tied, tied_local,
                    device, tp_group_of(strategy, mesh))
    return StageModule(params, buffers), sync


def _owned_buffers(model, graph, part, stage_rank, pp_rank) -> dict[str, torch.Tensor]:
    """Persistent buffers read by this rank's stages (unread ones live on rank 0)."""
    persistent = persistent_buffers(model)
    index, stage_of = graph.compute_index(), part.stage_of(graph)
    read: dict[str, set[int]] = {}
    for proxy in graph.nodes.values():
        if proxy.kind == "buffer" and proxy.fqn in persistent:
            ranks = {stage_rank[stage_of[u.name]] for u in proxy.node.users if u.name in index}
            read[proxy.fqn] = ranks or {0}
    return {name: buf for name, buf in persistent.items() if pp_rank in read.get(name, {0})}


def _autocast_factory(strategy: Strategy, device: torch.device):
    # Imported here: tessera.train imports the pipeline engine (the Trainer picks it).
    from tessera.train.engine import _AUTOCAST_DTYPES

    dtype = _AUTOCAST_DTYPES.get(strategy.precision)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)

