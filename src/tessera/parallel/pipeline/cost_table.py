"""Stage pricing for the partitioner: a CostTable prices any run of compute nodes [a, b).

Time (forward, backward, recomputation, the boundary send or the loss), weights with their
gradients and AdamW states (a tied or row-sliced weight priced by where it is read), and
activation bytes kept for backward (measured by a fake run, kept.py) all come from prefix
sums, so the partitioner's dynamic program asks for thousands of stages cheaply.
``candidate_cuts`` names the cuts it may choose: those the fewest activations cross.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch

from tessera.parallel.pipeline.capture import ProxyGraph
from tessera.parallel.pipeline.cost import DeviceRates, value_bytes
from tessera.parallel.pipeline.kept import kept_bytes
from tessera.parallel.pipeline.rows import row_reads

FINER_BYTES = 5  # a finer cut's crossing: at most this many times the residual stream's bytes
STATE_FACTOR = 4  # fp32 AdamW: weight + gradient + two moments, in bytes of the weight
ROWS_FACTOR = 2  # rows held for row-slice reads: the rows and their gradient (rows.py)


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
    runtime's) never run it.

    ``batch_parts``: how many times a micro-batch runs the graph (2 for sub-pipelined
    stages, whose graph is captured at half the micro-batch and run on both halves). Time,
    crossings, logits and activations count every part; weights and their states once, and
    so do autocast's 16-bit weight copies, which the parts share (shard_casts.py)."""

    def __init__(self, graph: ProxyGraph, rates: DeviceRates, batch_parts: int = 1) -> None:
        self.graph, self.rates, self.parts = graph, rates, batch_parts
        n = len(graph.compute)
        self.fwd, self.bwd = [0.0] * (n + 1), [0.0] * (n + 1)
        for i, name in enumerate(graph.compute):
            cost = graph.nodes[name].cost
            self.fwd[i + 1] = self.fwd[i] + batch_parts * cost.fwd_time(rates)
            self.bwd[i + 1] = self.bwd[i] + batch_parts * cost.bwd_time(rates)
        # Crossings and logits in the captured dtypes: the cuts do not depend on precision,
        # a residual stream crossing a cut stays fp32 under autocast, and the loss upcasts
        # the logits to fp32 (lm_loss) whatever the head's output dtype.
        self.cross_count, cross_bytes, self.cross_non_tensor = _crossings(graph)
        self.cross_bytes = [batch_parts * nbytes for nbytes in cross_bytes]
        self.block_bounds = _block_bounds(graph)
        self._activations: dict[tuple[int, int], float] = {}
        self._bytes: dict[tuple[int, int], tuple[float, ...]] = {}  # _stage_bytes
        self._spread_from: dict[int, tuple[list[int], list[float]]] = {}  # _spread_bytes
        self.logits_bytes = batch_parts * value_bytes(
            graph.nodes[graph.output].node.meta.get("val"))
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
            part = (kept.prefix[b] - kept.prefix[a] + self._spread_bytes(a, b)
                    - kept.shared_cast_bytes(a, b))
            # the parts of a micro-batch share one 16-bit copy of each weight
            self._activations[key] = (self.parts * part
                                      - (self.parts - 1) * self.weight_copies(a, b))
        return self._activations[key]

    def _spread_bytes(self, a: int, b: int) -> float:
        """Bytes of the spread storages (saved on both sides of a cut) that some node of
        [a, b) saves: those whose first saver at or after a comes before b."""
        if a not in self._spread_from:
            # (first saver at or after a, bytes) of each spread storage, by that saver
            firsts = sorted((at[i], nbytes) for nbytes, at in self._kept.spread
                            if (i := bisect.bisect_left(at, a)) < len(at))
            self._spread_from[a] = ([f for f, _ in firsts],
                                    _prefix_sums([nbytes for _, nbytes in firsts]))
        firsts, total = self._spread_from[a]
        return total[bisect.bisect_left(firsts, b)]

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
        full, inputs, copies, shared_casts, largest, state = self._stage_bytes(a, b)
        dropped = full * (1 - ratio) + ratio * inputs
        recomputing = in_flight - keep
        act = recomputing * dropped + keep * full
        if casts_shared and ratio <= 0 and in_flight > 1 and copies > 0:
            act += in_flight * shared_casts - (in_flight - 1) * copies
        if recomputing > 0 and ratio > 0:  # one block at a time (stage.py's segments)
            act += min(ratio * full, largest)
        if last:
            act += self.logits_bytes
        return state + act

    def _stage_bytes(self, a: int, b: int) -> tuple[float, ...]:
        """What ``memory`` reads of stage [a, b), once per stage: the search asks again for
        each stage position and recomputation ratio."""
        key = (a, b)
        if key not in self._bytes:
            self._bytes[key] = (self.activations(a, b), self.segment_inputs(a, b),
                                self.weight_copies(a, b),
                                self.parts * self._kept.shared_cast_bytes(a, b),
                                self.largest_block(a, b), self.state_bytes(a, b))
        return self._bytes[key]


    def largest_block(self, a: int, b: int) -> float:
        """Saved bytes of the largest block (or run of nodes outside blocks) in [a, b)."""
        return max((size for lo, hi, size in self.blocks if lo < b and hi > a), default=0.0)

    def segment_inputs(self, a: int, b: int) -> float:
        """Bytes a fully recomputed stage [a, b) keeps per micro-batch: the input of each of
        its blocks (program.head_segments recomputes block by block): the stage's own input,
        then the input of each block starting inside it."""
        if a >= b:
            return 0.0
        starts, inputs = self._block_inputs
        first = bisect.bisect_right(starts, a)  # blocks starting after a...
        end = bisect.bisect_left(starts, b)  # ...and before b
        return self.cross_bytes[a] + inputs[end] - inputs[first]

    @functools.cached_property
    def _block_inputs(self) -> tuple[list[int], list[float]]:
        """(each block's first compute index, prefix sums of the bytes crossing into it)."""
        starts = [lo for lo, _ in self.block_bounds]
        return starts, _prefix_sums([float(self.cross_bytes[lo]) for lo in starts])


def _prefix_sums(values: list[float]) -> list[float]:
    out = [0.0] * (len(values) + 1)
    for i, v in enumerate(values):
        out[i + 1] = out[i] + v
    return out


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
