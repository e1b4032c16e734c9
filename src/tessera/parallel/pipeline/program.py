"""The pipeline as planned for one rank: partition, ownership, and runnable stages per shape.

The partition is decided once, when the model is parallelised, on a graph captured at a
nominal shape; it is kept as "which stage runs each graph node". Exported graphs bake in their
shapes, so the runnable pieces are built (captured again, split by the same node names) the
first time each micro-batch shape or train/eval mode is met, and cached.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from tessera.models.materialize import shapes_on_meta
from tessera.parallel.pipeline.capture import ProxyGraph, capture, module_of, retarget
from tessera.parallel.pipeline.comm import TensorSpec
from tessera.parallel.pipeline.cost_table import CostTable, candidate_cuts
from tessera.parallel.pipeline.partition import Partition
from tessera.parallel.pipeline.shard_casts import shared_shard_casts
from tessera.parallel.pipeline.cost import DeviceRates
from tessera.parallel.pipeline.split import boundaries, spec_of, split_graph
from tessera.parallel.pipeline.stage import StageRunner
from tessera.parallel.pipeline.subpipe import subpipeline


@dataclass
class Built:
    """Runnable stages of this rank for one shape, and the boundary specs of every stage."""

    graph: ProxyGraph
    runners: dict[int, StageRunner]
    in_specs: list[list[TensorSpec]]  # per virtual stage: what it receives
    out_specs: list[list[TensorSpec]]  # per virtual stage: what it sends on


def stage_groups(graph: ProxyGraph, seed: ProxyGraph, partition: Partition
                 ) -> list[list[str]]:
    """Compute-node names of each stage of ``graph``, in graph order, as ``partition`` cut
    ``seed`` (the graph it was made on).

    Nodes are matched by name where the name means the same op in the same module in both;
    where a capture at another shape names them otherwise (export drops an ``expand`` that
    is a no-op at batch 1, and every later ``expand`` is numbered one lower; a model's
    shape-dependent branch numbers its ``to`` nodes otherwise), by position, if both graphs
    run the same ops in the same modules in the same order.
    """
    stage_of = partition.stage_of(seed)
    missing = [n for n in graph.compute if n not in stage_of or not _same_node(graph, seed, n)]
    if missing and _same_compute(graph, seed):
        stage_of, missing = partition.stage_of(graph), []
    if missing:
        raise RuntimeError(f"the graph captured at this shape has nodes the partition does not "
                           f"know ({', '.join(missing[:3])}...): the model's graph depends on "
                           f"the input shape, and this batch is {graph.input_shape()} "
                           f"where the stages were cut at {seed.input_shape()}: pad every "
                           "batch to that shape (or give samples of one length)")
    groups: list[list[str]] = [[] for _ in range(partition.stages)]
    for name in graph.compute:
        groups[stage_of[name]].append(name)
    return groups


def _same_compute(graph: ProxyGraph, seed: ProxyGraph) -> bool:
    """Whether both graphs' compute nodes run the same ops in the same modules, in order."""
    return len(graph.compute) == len(seed.compute) and all(
        _same_node(graph, seed, a, b) for a, b in zip(graph.compute, seed.compute))


def _same_node(graph: ProxyGraph, seed: ProxyGraph, name: str, seed_name: str | None = None
               ) -> bool:
    """Whether ``graph``'s node ``name`` runs the op of ``seed``'s ``seed_name`` (default:
    the same name), in the same module."""
    a, b = graph.nodes[name].node, seed.nodes[seed_name or name].node
    return a.target == b.target and module_of(a) == module_of(b)


def head_tail(graph: ProxyGraph, group: list[str], ratio: float,
              table: CostTable | None = None) -> tuple[list[str], list[str]]:
    """Split a stage's nodes so the head holds about ``ratio`` of its forward time.

    The cut falls at a candidate cut (few activations crossing) nearest that fraction; with no
    candidate inside the stage, any ratio > 0 recomputes the whole stage. ``table``: the
    graph's CostTable, when the caller has one.
    """
    if ratio <= 0 or not group:
        return [], group
    if ratio >= 1:
        return group, []
    table = table or CostTable(graph, DeviceRates())
    index = graph.compute_index()
    a, b = index[group[0]], index[group[-1]] + 1
    inside = [c for c in candidate_cuts(table) if a < c < b]
    if not inside:
        return group, []
    target = table.fwd[a] + ratio * (table.fwd[b] - table.fwd[a])
    cut = min(inside, key=lambda c: abs(table.fwd[c] - target))
    return group[:cut - a], group[cut - a:]


def head_segments(graph: ProxyGraph, head: list[str],
                  table: CostTable | None = None) -> list[list[str]]:
    """The head cut at its block boundaries (candidate cuts between nodes of different
    blocks): each segment is recomputed on its own in the backward, so one block's
    activations are rematerialised at a time. ``table`` as for :func:`head_tail`."""
    if not head:
        return []
    index = graph.compute_index()
    a, b = index[head[0]], index[head[-1]] + 1
    table = table or CostTable(graph, DeviceRates())
    block = [graph.nodes[name].block for name in graph.compute]
    cuts = [c for c in candidate_cuts(table) if a < c < b and block[c - 1] != block[c]]
    edges = [a] + cuts + [b]
    return [head[lo - a:hi - a] for lo, hi in zip(edges, edges[1:])]


def _casts_weights(runner: StageRunner) -> bool:
    """Whether the stage holds fp32 weights, which autocast casts to 16 bits."""
    return any(p.dtype == torch.float32 for _, piece in runner.pieces()
               for p in piece.module.parameters())


class PipelineProgram:
    """Partition + this rank's stages, built lazily per micro-batch shape.

    Args:
        model: the user's model (its parameters are the stages' parameters).
        graph: the graph the partition was made on.
        partition: stage bounds over ``graph.compute`` (virtual stages).
        ratios: recomputation ratio of each virtual stage.
        local_stages: the virtual stages this rank runs.
        autocast: context factory for mixed precision.
        extra_inputs: keyword inputs for capture (see :func:`capture`), or None.
        sub_batches: 2 runs every stage as two interleaved halves of the micro-batch
            (sub-pipelined tensor parallelism, ``subpipe.py``); 1 runs it whole.
    """

    def __init__(self, model: nn.Module, graph: ProxyGraph, partition: Partition,
                 ratios: list[float], local_stages: list[int], autocast,
                 extra_inputs=None, sub_batches: int = 1) -> None:
        self.model, self.ratios, self.local = model, ratios, local_stages
        self.extra_inputs = extra_inputs
        self.n_stages, self.partition = partition.stages, partition
        self.autocast, self.sub_batches = autocast, sub_batches
        self._cache: dict[tuple, Built] = {}
        self._seed_graph = graph
        # Called with each local StageRunner when it is built (chunk memory hooks its pieces).
        self.on_stage_built: Callable[[StageRunner], None] | None = None
        # Entered around a capture at a new shape (chunk memory gives its released parameters
        # their shapes back for it).
        self.capture_context: Callable[[], contextlib.AbstractContextManager] = (
            contextlib.nullcontext)
        # Set when the model was built on the meta device and this rank materialised only its
        # share: captures then run on meta stand-ins and their ops are pointed at this device.
        self.run_device: torch.device | None = None
        # Weights this rank holds only as rows: name -> (rows, first row) (rows.py).
        self.row_bindings: dict[str, tuple[torch.Tensor, int]] = {}
        # Under autocast: a context that keeps autocast's cache of 16-bit weight copies for a
        # whole step (see step_casts); None without autocast.
        self.cast_cache: Callable[[], contextlib.AbstractContextManager] | None = None

    @property
    def graph(self) -> ProxyGraph:
        """The graph the partition was made on (node names of every stage)."""
        return self._seed_graph

    def param_use_order(self) -> list[str]:
        """Parameter names in the order the graph first reads them (stage by stage)."""
        graph = self._seed_graph
        first = {graph.nodes[p].fqn: min(users) for p, users in graph.param_users.items()
                 if users}
        return sorted(first, key=first.__getitem__)

    @contextlib.contextmanager
    def step_casts(self, built: Built, in_flight: int):
        """Entered around a training step: the ``in_flight`` micro-batches this rank's stage
        holds at once share one 16-bit copy of each fp32 weight, instead of each forward
        making (and keeping for its backward) its own.

        autocast caches its casts of leaf weights until the outermost autocast context
        exits; the step's disabled outer context keeps the stage forwards' inner ones from
        clearing the cache, while backward runs outside autocast as before. Only where more
        than one micro-batch is in flight, no local stage recomputes (a recomputation would
        keep its segments' copies for the rest of the step, where now one segment's are
        held at a time) and with one virtual stage per rank (the partition's estimate prices
        it so, CostTable.memory). The stage's received inputs are leaves too: its pieces then
        read views of them, whose casts are not cached (each reader makes its own copy, as
        in the whole graph), or every micro-batch's input would stay alive with its cached
        copy until the step ends. Not where the stage has no fp32 weight to cast (16-bit
        parameters, memory=chunk): nothing to share, and the views would cost each reader a
        copy of its input.

        Tensor-parallel shards are not leaves, so autocast's cache does not hold their
        copies: shard_casts.py shares those (both halves of a sub-pipelined micro-batch too).
        """
        runners = built.runners.values()
        if (self.cast_cache is None or len(self.local) > 1 or in_flight < 2
                or any(runner.head for runner in runners)
                or not any(_casts_weights(runner) for runner in runners)):
            yield
            return
        for runner in runners:
            runner.view_inputs = True
        try:
            with self.cast_cache(), shared_shard_casts():
                yield
        finally:
            for runner in runners:
                runner.view_inputs = False

    def get(self, shape: tuple[int, int], training: bool) -> Built:
        """Stages for micro-batches of ``shape`` (batch, seq) in train or eval mode."""
        key = (tuple(shape), training)
        if key not in self._cache:
            start = time.perf_counter()
            self._cache[key] = self._build(shape, training)
            if training:
                self._warn_recapture(key[0], time.perf_counter() - start)
        return self._cache[key]

    def _warn_recapture(self, shape: tuple[int, ...], seconds: float) -> None:
        """Warn when training shapes keep changing (a collator padding each batch to its own
        longest sample): each costs a capture and split, and the cache keeps them all. At the
        2nd, 4th, 8th, ... shape, so a run that keeps changing hears of it a few times."""
        shapes = sum(1 for _, training in self._cache if training)
        if shapes < 2 or shapes & (shapes - 1):
            return
        warnings.warn(
            f"tessera: the pipeline was captured again for training micro-batches of shape "
            f"{tuple(shape)} ({seconds:.1f} s; {shapes} training shapes so far): each new "
            "length costs a torch.export capture and split. Pad samples to a fixed length "
            "(padding='max_length') to capture once (docs/pipeline.md)", stacklevel=3)

    def _build(self, shape: tuple[int, int], training: bool) -> Built:
        seed = self._seed_graph
        seed_shape = seed.input_shape()
        # Sub-pipelined stages run a graph captured at half the micro-batch on both halves.
        parts = self.sub_batches if shape[0] % self.sub_batches == 0 else 1
        traced = (shape[0] // parts, shape[1])
        if training and traced == seed_shape:
            graph = seed  # the partitioning capture already has this shape (train mode)
        else:
            graph = self._capture(traced, training)
        groups = stage_groups(graph, seed, self.partition)
        # Each stage becomes its pieces: [head segments (recomputed)..., tail], none empty.
        table = CostTable(graph, DeviceRates())  # one for every stage's cuts
        halves = [head_tail(graph, g, self.ratios[s] if training else 0.0, table)
                  for s, g in enumerate(groups)]
        segments = [head_segments(graph, head, table) for head, _ in halves]
        piece_groups, first_piece = [], []
        for segs, (_, tail) in zip(segments, halves):
            first_piece.append(len(piece_groups))
            piece_groups += segs + ([tail] if tail else [])
        mine = {first_piece[s] + i for s in self.local
                for i in range(len(segments[s]) + bool(halves[s][1]))}
        pieces = split_graph(graph, piece_groups, self.model, self.row_bindings, only=mine)
        if parts > 1:
            pieces = [p and subpipeline(p) for p in pieces]
        entering = boundaries(graph, piece_groups)
        runners = {}
        for s in self.local:
            n_head = len(segments[s])
            own = pieces[first_piece[s]:first_piece[s] + n_head + bool(halves[s][1])]
            runners[s] = StageRunner(s, own[:n_head], own[n_head] if halves[s][1] else None,
                                     self.autocast)
            if self.on_stage_built is not None:
                self.on_stage_built(runners[s])
        in_specs = [[_whole(spec_of(graph, n), traced[0], parts, n)
                     for n in entering[first_piece[s]]]
                    for s in range(self.n_stages)]
        out_specs = in_specs[1:] + [[]]
        return Built(graph, runners, in_specs, out_specs)

    def _capture(self, shape: tuple[int, int], training: bool) -> ProxyGraph:
        was_training = self.model.training
        self.model.train(training)  # dropout is baked into the export by mode
        try:
            with self.capture_context(), self._on_meta():
                graph = capture(self.model, *shape, self.extra_inputs,
                                head_slices=self._seed_graph.head_slices)
        finally:
            self.model.train(was_training)
        return graph if self.run_device is None else retarget(graph, self.run_device)

    def _on_meta(self) -> contextlib.AbstractContextManager:
        return (contextlib.nullcontext() if self.run_device is None
                else shapes_on_meta(self.model))


def _whole(spec: TensorSpec, batch: int, parts: int, name: str) -> TensorSpec:
    """The message of a whole micro-batch from a value traced at 1/parts of it (``batch``)."""
    if parts == 1:
        return spec
    if not spec.shape or spec.shape[0] != batch:
        raise RuntimeError(f"sub-pipelined stages (tp_overlap=subpipe) need the batch as the "
                           f"first dimension of every value crossing a stage boundary; {name} "
                           f"has shape {tuple(spec.shape)} at a half micro-batch of {batch}")
    return TensorSpec((spec.shape[0] * parts, *spec.shape[1:]), spec.dtype)


def nominal_seq_len(model: nn.Module, cap: int = 128) -> int:
    """A sequence length for the partitioning capture: the model's maximum, capped."""
    config = getattr(model, "config", None)
    for name in ("max_seq_len", "n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return min(value, cap)
    return cap


def capture_for_partition(model: nn.Module, micro_batch: int, extra_inputs=None,
                          seq_len: int | None = None) -> ProxyGraph:
    """The graph the partition is made on, at ``seq_len`` tokens (default: the model's
    maximum, capped). Captured in training mode like the runtime graphs, so the node names
    the partition refers to are the same."""
    return capture(model, micro_batch, seq_len or nominal_seq_len(model), extra_inputs)
