"""Graph sharding: cut the compute nodes into pp stages of balanced estimated time.

Worked example (GPT-2 with 2 blocks, pp=2): the compute nodes run embed, block 0 (attention,
residual add, MLP, add), block 1, final norm, LM head. A cut between two nodes is a candidate
when as few activations cross it as anywhere (one here: the residual stream), so a stage ends
at a block boundary *or* between a block's attention and its MLP. A vocabulary-sliced LM
head (head.py) adds the cuts between its slices. When those cuts are too coarse to balance
(the slowest stage over FINER_BALANCE x the mean, e.g. Llama-3-8B's shape at pp=8), the
search is repeated with cuts that one wider tensor crosses beside the residual: before
attention's output projection and before the MLP's down projection.
Among candidates a dynamic program picks the S - 1 cuts minimising the slowest stage's
estimated time (forward + backward + recomputation + sending its boundary), subject to each
stage's memory (weights, gradients and Adam states, plus in-flight activations) fitting the
limit; ties go to fewer bytes crossing. With a large vocabulary the LM head is heavy, so the
last stage gets fewer blocks than an equal-layer split would give it.

Stage-aware recomputation: with a memory limit and ``recompute=None``, each stage takes the
smallest ratio in ``RATIO_GRID`` that fits. Under 1F1B stage s holds S - s micro-batches in
flight, so earlier stages end up recomputing more (Merak, section 4.3).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from tessera.parallel.pipeline.capture import ProxyGraph
from tessera.parallel.pipeline.cost import DeviceRates
from tessera.parallel.pipeline.cost_table import CostTable, candidate_cuts
from tessera.parallel.pipeline.schedules import chunks_for, interleaved_actions, max_kept

RATIO_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
# Finer cuts (inside attention and MLP, cost_table.candidate_cuts) are searched when the
# block-level split leaves the slowest stage this far over the mean, and kept when they make
# it FINER_GAIN faster.
FINER_BALANCE, FINER_GAIN = 1.05, 0.01


class PartitionError(ValueError):
    """No partition satisfies the request; the message names the rule. ``max_stages``: the
    most stages the graph's cut points allow, when too few of them were the reason."""

    def __init__(self, message: str, max_stages: int | None = None) -> None:
        super().__init__(message)
        self.max_stages = max_stages


@dataclass
class Partition:
    """Stage boundaries over ``graph.compute`` and each stage's estimates.

    Attributes:
        bounds: S + 1 compute indices; stage s runs ``compute[bounds[s]:bounds[s+1]]``.
        recompute: per-stage recomputation ratio the estimates assume.
        stage_time: estimated seconds of forward + backward (+ recompute) per micro-batch.
        stage_memory: estimated peak bytes per stage.
        crossing_bytes: bytes sent forward at each of the S - 1 boundaries per micro-batch.
        keep: per stage, how many of its last micro-batches keep their activations instead of
            recomputing (scp only, where memory allows; all of them on a last stage that skips
            recomputation; 0 elsewhere).
    """

    bounds: list[int]
    recompute: tuple[float, ...]
    stage_time: list[float]
    stage_memory: list[float]
    crossing_bytes: list[int]
    keep: tuple[int, ...] = ()

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def balance(self) -> float:
        """Max over mean estimated stage time (1.0 is perfect balance)."""
        return max(self.stage_time) / (sum(self.stage_time) / len(self.stage_time))

    def stage_of(self, graph: ProxyGraph) -> dict[str, int]:
        """Stage index of every compute node."""
        out = {}
        for s in range(self.stages):
            for name in graph.compute[self.bounds[s]:self.bounds[s + 1]]:
                out[name] = s
        return out


def in_flight(stage: int, stages: int, micro_batches: int, schedule: str) -> int:
    """Micro-batches whose activations stage ``stage`` holds at its peak."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "interleaved":
        return _interleaved_in_flight(stage, stages, micro_batches)
    held = min(micro_batches, stages - stage)
    if schedule == "scp" and stage == stages - 2 and micro_batches >= 3:
        return held + 1  # its third forward runs before its first backward (scp's swap)
    return held


@functools.lru_cache(maxsize=None)  # the partitioner's search asks for every cut it tries
def _interleaved_in_flight(stage: int, stages: int, micro_batches: int) -> int:
    """The most micro-batches virtual stage ``stage`` holds in Megatron's interleaved order,
    counted on its rank's action list: a middle rank's chunks hold more than 1F1B's
    ``stages - stage`` (pp=4, m=8: rank 1 holds 8 and 4, not 7 and 3)."""
    chunks = chunks_for("interleaved")
    pp = stages // chunks
    live = peak = 0
    for action in interleaved_actions(stage % pp, pp, micro_batches, chunks):
        if action.stage == stage:
            live += 1 if action.kind == "F" else -1
            peak = max(peak, live)
    return peak


def partition(graph: ProxyGraph, stages: int, micro_batches: int = 1, schedule: str = "1f1b",
              memory_limit: float | None = None, recompute: tuple[float, ...] | None = (0.0,),
              rates: DeviceRates = DeviceRates(), cuts: list[int] | None = None,
              finer: bool = False, batch_parts: int = 1) -> Partition:
    """Split ``graph`` into ``stages`` stages of balanced estimated time.

    Args:
        graph: the captured model.
        stages: number of pipeline stages (virtual stages under interleaving).
        micro_batches: micro-batches per step (sets the in-flight activations).
        schedule: "gpipe", "1f1b", "interleaved" or "scp".
        memory_limit: bytes each stage may hold; None for no limit, except under scp, where
            None means what 1F1B with the same recomputation peaks at (the last stage skips
            recomputation, and other stages keep micro-batches, only within that), or scp's
            own peak keeping nothing where that is higher (its swap holds one more
            micro-batch on stage S-2).
        recompute: one ratio for every stage or one per stage; None chooses per stage the
            smallest ratio that fits ``memory_limit`` (stage-aware recomputation).
        rates: device speeds for turning FLOPs and bytes into seconds.
        cuts: fixed interior cut positions (manual split points) instead of the search.
        finer: when the split at block and attention/MLP boundaries leaves the slowest stage
            over FINER_BALANCE x the mean, also try cuts inside attention and the MLP, where
            a second, wider tensor crosses (its send is priced), and keep that split if its
            slowest stage is faster.
        batch_parts: how many parts of a micro-batch run ``graph`` (2 when it was captured
            at half the micro-batch for sub-pipelined stages; CostTable).

    Raises:
        PartitionError: when the model has fewer candidate cuts than stages - 1, or no split
            fits the memory limit.
    """
    table = CostTable(graph, rates, batch_parts)
    options = candidate_cuts(table) if cuts is None else sorted(cuts)
    if len(options) < stages - 1:
        raise PartitionError(f"{stages} stages need {stages - 1} cuts, but the graph has only "
                             f"{len(options)} places where few activations cross; use at most "
                             f"{len(options) + 1} stages", max_stages=len(options) + 1)
    if recompute is None and memory_limit is None:
        raise PartitionError("recompute=None (stage-aware) needs a memory_limit to choose from")
    points = [0] + options + [len(graph.compute)]
    if schedule == "scp" and memory_limit is None and recompute is not None:
        # Merak's premise: scp costs no memory over 1F1B with the same recomputation, but
        # for the one more micro-batch its swap puts in flight on stage S-2.
        same = _evaluate if cuts is not None else _search
        base = same(table, points, stages, micro_batches, "1f1b", None, recompute)
        memory_limit = max(*base.stage_memory,
                           *_keeping_none(table, base.bounds, micro_batches, recompute))
    if cuts is not None:
        return _evaluate(table, points, stages, micro_batches, schedule, memory_limit, recompute)
    part = _search(table, points, stages, micro_batches, schedule, memory_limit, recompute)
    if finer and part.balance > FINER_BALANCE:
        finer_points = [0] + candidate_cuts(table, finer=True) + [len(graph.compute)]
        alt = _search(table, finer_points, stages, micro_batches, schedule, memory_limit,
                      recompute)
        if max(alt.stage_time) < (1 - FINER_GAIN) * max(part.stage_time):
            part = alt
    return part


def _stage_cost(table: CostTable, a: int, b: int, s: int, stages: int, micro_batches: int,
                schedule: str, limit: float | None, recompute) -> tuple[float, float, float, int]:
    """(time, memory, ratio, kept micro-batches) of stage s over [a, b); time is inf when
    nothing fits."""
    last = s == stages - 1
    flight = in_flight(s, stages, micro_batches, schedule)
    shared = chunks_for(schedule) == 1  # weight casts shared by the micro-batches in flight
    if recompute is None:
        choices = RATIO_GRID
    else:
        choices = (recompute[0] if len(recompute) == 1 else recompute[s],)
    for ratio in choices:
        keep = _scp_keep(table, a, b, s, stages, micro_batches, schedule, limit, ratio, flight)
        mem = table.memory(a, b, ratio, flight, last, min(keep, flight), shared)
        if limit is None or mem <= limit:
            share = ratio * (micro_batches - keep) / micro_batches
            return table.time(a, b, share, last), mem, ratio, keep
    return (math.inf, table.memory(a, b, choices[-1], flight, last, casts_shared=shared),
            choices[-1], 0)


def _keeping_none(table: CostTable, bounds: list[int], micro_batches: int,
                  recompute: tuple[float, ...]) -> list[float]:
    """Each scp stage's memory over ``bounds`` when it keeps no micro-batch whole."""
    stages = len(bounds) - 1
    return [table.memory(bounds[s], bounds[s + 1], recompute[0] if len(recompute) == 1
                         else recompute[s], in_flight(s, stages, micro_batches, "scp"),
                         s == stages - 1) for s in range(stages)]


def _scp_keep(table: CostTable, a: int, b: int, s: int, stages: int, micro_batches: int,
              schedule: str, limit: float | None, ratio: float, flight: int) -> int:
    """How many last micro-batches an scp stage keeps whole: the most that fit ``limit``
    (on the last stage all or none: it holds one micro-batch at a time)."""
    if schedule != "scp" or ratio <= 0:
        return 0
    keep, last = max_kept(s, stages, micro_batches), s == stages - 1
    while keep > 0 and limit is not None and table.memory(a, b, ratio, flight, last,
                                                          min(keep, flight)) > limit:
        keep = min(keep, flight) - 1
    return keep


def _stage_time(table: CostTable, a: int, b: int, s: int, stages: int, micro_batches: int,
                schedule: str, limit: float | None, recompute) -> float:
    """``_stage_cost``'s time alone: without a memory limit, priced without the memory
    estimate (which the choice then does not need)."""
    if limit is not None:
        return _stage_cost(table, a, b, s, stages, micro_batches, schedule, limit,
                           recompute)[0]
    ratio = recompute[0] if len(recompute) == 1 else recompute[s]
    flight = in_flight(s, stages, micro_batches, schedule)
    keep = _scp_keep(table, a, b, s, stages, micro_batches, schedule, None, ratio, flight)
    return table.time(a, b, ratio * (micro_batches - keep) / micro_batches, s == stages - 1)


def _search(table, points, stages, micro_batches, schedule, limit, recompute) -> Partition:
    k = len(points)
    # best[s][j]: (slowest stage, bytes crossed, previous point) covering points[0..j] in s+1
    best = [[(math.inf, math.inf, -1)] * k for _ in range(stages)]
    for j in range(1, k):
        t = _stage_time(table, 0, points[j], 0, stages, micro_batches, schedule, limit,
                        recompute)
        best[0][j] = (t, 0, 0)
    for s in range(1, stages):
        last = s == stages - 1
        for j in range(s + 1, k):
            for i in range(j - 1, s - 1, -1):  # the last stage [points[i], points[j]) grows
                # Its time without recomputation bounds it below and only grows as i falls:
                # once over the best slowest stage, no earlier start can win (time is
                # compared first; a tie of times is still priced, for its bytes).
                if table.time(points[i], points[j], 0.0, last) > best[s][j][0]:
                    break
                prev = best[s - 1][i]
                if math.isinf(prev[0]) or prev[0] > best[s][j][0]:  # no fit, or slower
                    continue
                t = _stage_time(table, points[i], points[j], s, stages, micro_batches,
                                schedule, limit, recompute)
                cand = (max(prev[0], t), prev[1] + table.cross_bytes[points[i]], i)
                if cand[:2] <= best[s][j][:2]:  # a full tie goes to the earliest cut
                    best[s][j] = cand
    if math.isinf(best[stages - 1][k - 1][0]):
        # Stage-aware choice (recompute=None) has tried full recomputation already.
        fix = ("raise the limit or use more stages (full recomputation does not fit either)"
               if recompute is None else "raise the limit, recompute more, or use more stages")
        raise PartitionError(f"no split into pp={stages} stages fits memory_limit="
                             f"{limit:.3g} bytes per stage; {fix}")
    chosen, j = [], k - 1
    for s in range(stages - 1, -1, -1):
        chosen.append(points[j])
        j = best[s][j][2]
    chosen.append(0)
    return _evaluate(table, chosen[::-1], stages, micro_batches, schedule, limit, recompute)


def _evaluate(table, bounds, stages, micro_batches, schedule, limit, recompute) -> Partition:
    if len(bounds) != stages + 1:
        raise PartitionError(f"{len(bounds) - 2} split points give {len(bounds) - 1} stages, "
                             f"pp={stages} needs {stages - 1}")
    times, mems, ratios, keeps = [], [], [], []
    for s in range(stages):
        t, m, r, k = _stage_cost(table, bounds[s], bounds[s + 1], s, stages, micro_batches,
                                 schedule, limit, recompute)
        if math.isinf(t):
            raise PartitionError(f"stage {s} needs {m:.3g} bytes, over memory_limit={limit:.3g}")
        times.append(t)
        mems.append(m)
        ratios.append(r)
        keeps.append(k)
    crossing = [table.cross_bytes[c] for c in bounds[1:-1]]
    return Partition(list(bounds), tuple(ratios), times, mems, crossing, tuple(keeps))


def layer_bounds(graph: ProxyGraph, stages: int) -> list[int]:
    """Equal-layer split (the baseline): block boundaries at multiples of n_blocks / stages,
    the embedding in the first stage and the head in the last."""
    first: dict[int, int] = {}
    for i, name in enumerate(graph.compute):
        block = graph.nodes[name].block
        if block is not None and block not in first:
            first[block] = i
    n_blocks = len(first)
    if n_blocks < stages:
        raise PartitionError(f"pp={stages} needs at least {stages} blocks, found {n_blocks}")
    starts = [first[round(s * n_blocks / stages)] for s in range(1, stages)]
    return [0] + starts + [len(graph.compute)]


def evaluate_bounds(graph: ProxyGraph, bounds: list[int], micro_batches: int = 1,
                    schedule: str = "1f1b", rates: DeviceRates = DeviceRates()) -> Partition:
    """Estimates of a given split (e.g. :func:`layer_bounds`) without recomputation."""
    table = CostTable(graph, rates)
    return _evaluate(table, bounds, len(bounds) - 1, micro_batches, schedule, None, (0.0,))
