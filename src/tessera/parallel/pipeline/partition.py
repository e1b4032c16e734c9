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

import bisect
import functools
import math
from dataclasses import dataclass

import torch

from tessera.parallel.pipeline.capture import ProxyGraph
from tessera.parallel.pipeline.cost import DeviceRates, value_bytes
from tessera.parallel.pipeline.kept import kept_bytes
from tessera.parallel.pipeline.rows import row_reads
from tessera.parallel.pipeline.schedules import chunks_for, interleaved_actions, max_kept

RATIO_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
# Finer cuts (inside attention and MLP) are searched when the block-level split leaves the
# slowest stage this far over the mean, and kept when they make it FINER_GAIN faster.
FINER_BALANCE, FINER_GAIN, FINER_BYTES = 1.05, 0.01, 5
STATE_FACTOR = 4  # fp32 AdamW: weight + gradient + two moments, in bytes of the weight
ROWS_FACTOR = 2  # rows held for row-slice reads: the rows and their gradient (rows.py)


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


@dataclass
class _WeightUse:
    """Where a weight is read: whole (by compute index) or as row slices (index, lo, hi).

    Its home (the first whole reader, else the first slice) holds it with gradient and AdamW
    states; a stage reading it whole holds it so too (tied weights); a stage reading it only
    through row slices holds just the rows it spans and their gradient (rows.py)."""

    size: int
    rows: int
    whole: list[int]
    slices: list[tuple[int, int, int]]

    @classmethod
    def of(cls, graph: ProxyGraph, pname: str, users: list[int]) -> "_WeightUse":
        reads = row_reads(graph, users)
        val = graph.nodes[pname].node.meta["val"]
        return cls(graph.param_bytes(pname), val.shape[0] if val.dim() else 1,
                   [i for i, span in reads if span is None],
                   [(i, *span) for i, span in reads if span is not None])

    def state_bytes(self, a: int, b: int) -> float:
        home = self.whole[0] if self.whole else self.slices[0][0]
        if a <= home < b or any(a <= i < b for i in self.whole):
            return STATE_FACTOR * self.size
        read = [(lo, hi) for i, lo, hi in self.slices if a <= i < b]
        if not read:
            return 0.0
        span = min(max(hi for _, hi in read), self.rows) - max(min(lo for lo, _ in read), 0)
        return ROWS_FACTOR * self.size * span / self.rows


@dataclass(frozen=True)
class _Kept:
    """A CostTable's activation bytes, as measured (kept.py).

    Attributes:
        prefix: prefix sums of the bytes charged to one node (its first saver).
        spread: (bytes, savers' indices) of storages saved on both sides of a possible cut.
        shared: (node index, sorted (saver index, bytes) of its 16-bit copies) for each value
            autocast copied more than once: a later stage receives it as a leaf, whose copy
            autocast makes once for all that stage's readers.
        weight_copies: prefix sums, like ``prefix``, of the part of those bytes that is
            autocast's 16-bit copies of (leaf) weights.
    """

    prefix: list[float]
    spread: list[tuple[float, tuple[int, ...]]]
    shared: list[tuple[int, list[tuple[int, float]]]]
    weight_copies: list[float]

    def shared_cast_bytes(self, a: int, b: int) -> float:
        """Bytes of the copies stage [a, b) does not make: all but one per input value."""
        total = 0.0
        for source, copies in self.shared:
            if source >= a:
                break  # sorted: the rest are made inside or after the stage
            inside = [nbytes for saver, nbytes in copies if a <= saver < b]
            if len(inside) > 1:
                total += sum(inside) - max(inside)
        return total


class CostTable:
    """Prefix sums over the compute nodes, so a stage [a, b) is priced in O(params).

    Activation bytes (``activations``) are measured lazily, on the first memory
    question, by a fake run of the graph (kept.py): tables that only cut and time a graph (the
    runtime's) never run it."""

    def __init__(self, graph: ProxyGraph, rates: DeviceRates) -> None:
        self.graph, self.rates = graph, rates
        n = len(graph.compute)
        self.fwd, self.bwd = [0.0] * (n + 1), [0.0] * (n + 1)
        for i, name in enumerate(graph.compute):
            cost = graph.nodes[name].cost
            self.fwd[i + 1] = self.fwd[i] + cost.fwd_time(rates)
            self.bwd[i + 1] = self.bwd[i] + cost.bwd_time(rates)
        # Crossings and logits in the captured dtypes: the cuts do not depend on precision,
        # a residual stream crossing a cut stays fp32 under autocast, and the loss upcasts
        # the logits to fp32 (lm_loss) whatever the head's output dtype.
        self.cross_count, self.cross_bytes, self.cross_non_tensor = _crossings(graph)
        self.block_bounds = _block_bounds(graph)
        self._activations: dict[tuple[int, int], float] = {}
        self.logits_bytes = value_bytes(graph.nodes[graph.output].node.meta.get("val"))
        self.weights = [_WeightUse.of(graph, p, users)
                        for p, users in graph.param_users.items() if users]
        # Most weights are read by one node: their states are prefix sums over the nodes, so
        # the search prices a stage in O(weights read by several nodes).
        self.point_state = [0.0] * (n + 1)
        self.shared: list[_WeightUse] = []
        for w in self.weights:
            if len(w.whole) == 1 and not w.slices:
                self.point_state[w.whole[0] + 1] += STATE_FACTOR * w.size
            else:
                self.shared.append(w)
        for i in range(n):
            self.point_state[i + 1] += self.point_state[i]

    @functools.cached_property
    def _kept(self) -> _Kept:
        """Activation bytes as the fake run (kept.py) measured them, else each node's output
        (when the graph cannot run there)."""
        graph, n = self.graph, len(self.graph.compute)
        index = graph.compute_index()
        point, spread, casts, copies = [0.0] * n, [], {}, [0.0] * n
        kept = kept_bytes(graph)
        if kept is None:
            for i, name in enumerate(graph.compute):
                point[i] = graph.nodes[name].cost.saved_bytes
        else:
            # Cuts the partitioner may choose (equal-layer bounds elsewhere may undercount
            # a tensor saved on both sides of them, charged to its first saver).
            cuts = set(candidate_cuts(self, finer=True))
            for k, (nbytes, savers) in enumerate(kept.storages):
                at = sorted(index[name] for name in savers if name in index)
                if not at:
                    continue
                # One saver, or all on one side of every cut: charged to the first saver. A
                # tensor saved on both sides of a cut (a sliced head's hidden state, RoPE
                # tables) is held again by each stage that saves it.
                if any(at[0] < c <= at[-1] for c in cuts):
                    spread.append((float(nbytes), tuple(at)))
                else:
                    point[at[0]] += nbytes
                    if kept.cast_of.get(k) in graph.param_users:  # a weight's 16-bit copy
                        copies[at[0]] += nbytes
                source = index.get(kept.cast_of.get(k, ""))
                if source is not None:
                    casts.setdefault(source, []).append((at[0], float(nbytes)))
        shared = [(source, sorted(made)) for source, made in sorted(casts.items())
                  if len(made) > 1]
        return _Kept(_prefix_sums(point), spread, shared, _prefix_sums(copies))

    def activations(self, a: int, b: int) -> float:
        """Bytes stage [a, b) keeps for backward per micro-batch, recomputing nothing."""
        key = (a, b)
        if key not in self._activations:  # the search asks again for each ratio
            kept = self._kept
            self._activations[key] = (
                kept.prefix[b] - kept.prefix[a]
                + sum(nbytes for nbytes, at in kept.spread if _saved_within(at, a, b))
                - kept.shared_cast_bytes(a, b))
        return self._activations[key]

    def weight_copies(self, a: int, b: int) -> float:
        """Bytes of autocast's 16-bit weight copies among ``activations(a, b)``."""
        return self._kept.weight_copies[b] - self._kept.weight_copies[a]

    @functools.cached_property
    def blocks(self) -> list[tuple[int, int, float]]:
        """(first, end, kept bytes) of each run of compute nodes of one block."""
        return [(lo, hi, self.activations(lo, hi)) for lo, hi in self.block_bounds]

    def state_bytes(self, a: int, b: int) -> float:
        """Weights, gradients and AdamW states held by a stage of compute nodes [a, b)."""
        return (self.point_state[b] - self.point_state[a]
                + sum(w.state_bytes(a, b) for w in self.shared))

    def time(self, a: int, b: int, ratio: float, last: bool) -> float:
        fwd = self.fwd[b] - self.fwd[a]
        total = fwd * (1 + ratio) + self.bwd[b] - self.bwd[a]
        if last:  # the loss: softmax over the logits, forward and backward
            total += 3 * self.logits_bytes / self.rates.memory_bw
        else:
            total += self.cross_bytes[b] / self.rates.p2p_bw
        return total

    def memory(self, a: int, b: int, ratio: float, in_flight: int, last: bool,
               keep: int = 0, casts_shared: bool = True) -> float:
        """Peak bytes: weights and AdamW states, ``in_flight`` micro-batches of which
        ``keep`` hold all their activations and the rest drop the recomputed share, and
        while one of those runs its backward, that share rematerialised.

        ``casts_shared``: a stage that recomputes nothing, with several micro-batches in
        flight, keeps one 16-bit copy of its weights for all of them (one virtual stage per
        rank), not one each; its inputs are then read as views, each reader casting its own
        copy of them (PipelineProgram.step_casts); not where it makes no weight copy
        (16-bit parameters)."""
        full = self.activations(a, b)
        dropped = full * (1 - ratio) + ratio * self.segment_inputs(a, b)
        recomputing = in_flight - keep
        act = recomputing * dropped + keep * full
        copies = self.weight_copies(a, b)
        if casts_shared and ratio <= 0 and in_flight > 1 and copies > 0:
            act += in_flight * self._kept.shared_cast_bytes(a, b) - (in_flight - 1) * copies
        if recomputing > 0 and ratio > 0:  # one block at a time (stage.py's segments)
            act += min(ratio * full, self.largest_block(a, b))
        if last:
            act += self.logits_bytes
        return self.state_bytes(a, b) + act


    def largest_block(self, a: int, b: int) -> float:
        """Saved bytes of the largest block (or run of nodes outside blocks) in [a, b)."""
        return max((size for lo, hi, size in self.blocks if lo < b and hi > a), default=0.0)

    def segment_inputs(self, a: int, b: int) -> float:
        """Bytes a fully recomputed stage [a, b) keeps per micro-batch: the input of each of
        its blocks (program.head_segments recomputes block by block)."""
        return sum(self.cross_bytes[max(lo, a)] for lo, hi in self.block_bounds
                   if lo < b and hi > a)


def _prefix_sums(values: list[float]) -> list[float]:
    out = [0.0] * (len(values) + 1)
    for i, v in enumerate(values):
        out[i + 1] = out[i] + v
    return out


def _saved_within(savers: tuple[int, ...], a: int, b: int) -> bool:
    """Whether any of the sorted saver indices lies in [a, b)."""
    i = bisect.bisect_left(savers, a)
    return i < len(savers) and savers[i] < b


def _block_bounds(graph: ProxyGraph) -> list[tuple[int, int]]:
    """(first, end) of each run of compute nodes of one block."""
    spans, start = [], 0
    blocks = [graph.nodes[name].block for name in graph.compute]
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[start]:
            spans.append((start, i))
            start = i
    return spans


def _crossings(graph: ProxyGraph) -> tuple[list[int], list[int], list[int]]:
    """Number and bytes of activations crossing each cut c (between compute c-1 and c), and
    how many of them are not one tensor (a tuple: a leaf module's call, leaves.py, or a
    split, before its last item is taken), which no message can carry."""
    n = len(graph.compute)
    index = graph.compute_index()
    count, size, untensored = [0] * (n + 2), [0] * (n + 2), [0] * (n + 2)
    for name in graph.compute:
        node = graph.nodes[name].node
        uses = [index[u.name] for u in node.users if u.name in index]
        last = n if name == graph.output or any(u.op == "output" for u in node.users) else max(
            uses, default=index[name])
        lo, hi = index[name] + 1, last  # crosses cuts lo..hi
        if hi >= lo:
            nbytes = value_bytes(node.meta.get("val"))
            count[lo] += 1
            count[hi + 1] -= 1
            size[lo] += nbytes
            size[hi + 1] -= nbytes
            if not isinstance(node.meta.get("val"), torch.Tensor):
                untensored[lo] += 1
                untensored[hi + 1] -= 1
    for c in range(1, n + 1):
        count[c] += count[c - 1]
        size[c] += size[c - 1]
        untensored[c] += untensored[c - 1]
    return count[:n + 1], size[:n + 1], untensored[:n + 1]


def candidate_cuts(table: CostTable, finer: bool = False) -> list[int]:
    """Interior cuts crossed by the fewest activations, of no more bytes than the least
    between two blocks (the residual stream), or than the least anywhere when the model has
    no blocks: an embedding narrower than the blocks (OPT-350m projects 512 up to 1024) must
    not rule out every block boundary.

    ``finer`` adds cuts crossed by one activation more, of at most FINER_BYTES times those
    bytes: inside attention (after its core, before the output projection) and inside
    the MLP (before the down projection), where a wider tensor crosses beside the residual.
    """
    n = len(table.graph.compute)
    interior = range(1, n)
    if not interior:
        return []
    fewest = min(table.cross_count[c] for c in interior)
    blocks = [table.graph.nodes[name].block for name in table.graph.compute]
    between = [c for c in interior if table.cross_count[c] == fewest
               and blocks[c - 1] is not None and blocks[c] is not None
               and blocks[c - 1] != blocks[c]]
    least = min(table.cross_bytes[c] for c in (between or [
        c for c in interior if table.cross_count[c] == fewest]))
    allowed = table.graph.cut_after  # between LM head slices (head.py)
    count, size = (fewest + 1, FINER_BYTES * least) if finer else (fewest, least)
    return [c for c in interior if table.cross_non_tensor[c] == 0 and (
            (table.cross_count[c] <= count and table.cross_bytes[c] <= size)
            or table.graph.compute[c - 1] in allowed)]


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
              finer: bool = False) -> Partition:
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

    Raises:
        PartitionError: when the model has fewer candidate cuts than stages - 1, or no split
            fits the memory limit.
    """
    table = CostTable(graph, rates)
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


def _search(table, points, stages, micro_batches, schedule, limit, recompute) -> Partition:
    k = len(points)
    # best[s][j]: (slowest stage, bytes crossed, previous point) covering points[0..j] in s+1
    best = [[(math.inf, math.inf, -1)] * k for _ in range(stages)]
    for j in range(1, k):
        t = _stage_cost(table, 0, points[j], 0, stages, micro_batches, schedule, limit,
                        recompute)[0]
        best[0][j] = (t, 0, 0)
    for s in range(1, stages):
        for j in range(s + 1, k):
            for i in range(s, j):
                prev = best[s - 1][i]
                if math.isinf(prev[0]):
                    continue
                t = _stage_cost(table, points[i], points[j], s, stages, micro_batches,
                                schedule, limit, recompute)[0]
                cand = (max(prev[0], t), prev[1] + table.cross_bytes[points[i]], i)
                if cand[:2] < best[s][j][:2]:
                    best[s][j] = cand
    if math.isinf(best[stages - 1][k - 1][0]):
        raise PartitionError(f"no split into pp={stages} stages fits memory_limit="
                             f"{limit:.3g} bytes per stage; raise the limit, recompute more, "
                             "or use more stages")
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
