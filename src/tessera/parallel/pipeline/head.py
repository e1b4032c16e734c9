"""A vocabulary-sliced LM head, so a head heavier than a stage can be spread over stages.

With a large vocabulary the LM head matmul alone can outweigh a mean pipeline stage (GPT-2
small: 77 MFLOP per token against 15 per block), and no cut between graph nodes splits one
matmul. This rewrite replaces the captured graph's final ``logits = linear(h, W)`` by k
matmuls over row slices of W and folds the cross-entropy in, slice by slice, with an online
log-sum-exp:

    lse_i = logsumexp(h @ W[a_i:b_i]^T)          # (B, T), fp32
    lse   = logaddexp(lse, lse_i)                 # running over slices
    tgt  += logit of the label, where it falls in [a_i, b_i)
    nll   = lse - tgt                             # (B, T): the graph's output

Between two slices only ``h``, ``lse`` and ``tgt`` are live (the residual stream plus two
(B, T) rows), so the partitioner may cut there and give each of the last stages a share of
the head. The loss is then the mean of ``nll`` over tokens whose label is not -100
(:func:`sliced_head_loss`), the same value as ``F.cross_entropy`` on the whole logits.

The labels become a batch input of the graph. Used without tensor parallelism, whose loss
reads vocabulary-sharded logits; under sequence parallelism each rank's graph returns the
loss of its own tokens, which the sequence-parallel loss sums and scales as it would the
cross-entropy of its logits. A rank reading the weight only through slices holds just
their rows (rows.py); the weight's home holds it whole and receives the rows' gradients.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from tessera.parallel.pipeline.capture import ProxyGraph, build_proxy
from tessera.parallel.pipeline.cost import DeviceRates, op_name, value_bytes
from tessera.parallel.tensor.loss import IGNORE_INDEX

aten = torch.ops.aten
LABELS = "labels"
MIN_SLICE_ROWS = 512  # narrower slices would run the matmul at poor efficiency
SLICE_OF_STAGE = 0.125  # each slice at most this share of a mean stage's time


def head_slices_for(graph: ProxyGraph, stages: int, rates: DeviceRates = DeviceRates()) -> int:
    """Vocabulary slices of at most an eighth of a mean stage each (1: leave the head whole).

    The head is left whole when it is no heavier than half a mean stage: the partitioner
    balances such a head with whole blocks.
    """
    head = graph.nodes[graph.output]
    if stages < 2 or not _is_sliceable(graph, head.node):
        return 1
    loss = 3 * value_bytes(head.node.meta.get("val")) / rates.memory_bw
    head_time = head.cost.fwd_time(rates) + head.cost.bwd_time(rates) + loss
    total = sum(graph.nodes[n].cost.fwd_time(rates) + graph.nodes[n].cost.bwd_time(rates)
                for n in graph.compute) + loss
    mean = total / stages
    if head_time <= mean / 2:
        return 1
    rows = head.node.args[1].meta["val"].shape[0]
    return max(1, min(math.ceil(head_time / (SLICE_OF_STAGE * mean)), rows // MIN_SLICE_ROWS))


def slice_head(graph: ProxyGraph, slices: int) -> ProxyGraph:
    """Rewrite ``graph`` (in place) so its output is the per-token loss over ``slices``
    vocabulary slices; returns the re-classified graph. ``slices`` <= 1 returns it as is."""
    if slices <= 1:
        return graph
    fx_graph = graph.program.graph
    logits = graph.nodes[graph.output].node
    if not _is_sliceable(graph, logits):
        raise ValueError(f"the graph's output {logits.name} is not a linear layer over a weight "
                         "read by nothing but the output, or the graph already reads "
                         f"{LABELS!r}; the LM head cannot be sliced")
    hidden, weight, bias = (list(logits.args) + [None])[:3]
    rows = weight.meta["val"].shape[0]
    build = _Builder(fx_graph, logits.meta["val"])
    labels = build.labels(hidden.meta["val"], _last_placeholder(fx_graph))
    lse = tgt = None
    cut_after = []
    with fx_graph.inserting_before(logits):
        for i in range(slices):
            lo, hi = i * rows // slices, (i + 1) * rows // slices
            part_lse, part_tgt = build.slice_terms(hidden, weight, bias, labels, lo, hi)
            lse = part_lse if lse is None else build.call(aten.logaddexp.default, lse, part_lse)
            tgt = part_tgt if tgt is None else build.call(aten.add.Tensor, tgt, part_tgt)
            cut_after.append(tgt.name)  # the slice's last node: h, lse and tgt cross here
        nll = build.call(aten.sub.Tensor, lse, tgt)  # (B, T)
    logits.replace_all_uses_with(nll)
    fx_graph.erase_node(logits)
    out = build_proxy(graph.program, more_inputs=(labels.name,), output=nll.name)
    out.cut_after = frozenset(cut_after[:-1])
    out.head_slices = slices
    return out


def sliced_head_loss(nll: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean of the per-token loss over labels that are not -100 (as
    :func:`tessera.parallel.plan.lm_loss`: 0 when there are none)."""
    valid = labels != IGNORE_INDEX
    return (nll * valid).sum() / valid.sum().clamp_min(1)


def _is_sliceable(graph: ProxyGraph, logits: fx.Node) -> bool:
    """``logits = linear(h, W[, b])`` with W a 2-D parameter, used only as the output (any
    other reader would need the whole logits), in a graph without a ``labels`` input."""
    if op_name(logits) != "linear" or LABELS in graph.nodes:
        return False
    weight = logits.args[1]
    return (isinstance(weight, fx.Node) and graph.nodes[weight.name].kind == "param"
            and weight.meta["val"].dim() == 2
            and all(user.op == "output" for user in logits.users))


def _last_placeholder(fx_graph: fx.Graph) -> fx.Node:
    return [n for n in fx_graph.nodes if n.op == "placeholder"][-1]


class _Builder:
    """Adds aten nodes to a graph with fake values, as torch.export would have recorded."""

    def __init__(self, fx_graph: fx.Graph, example: torch.Tensor) -> None:
        self.graph, self.fake_mode = fx_graph, example.fake_mode

    def labels(self, hidden: torch.Tensor, after: fx.Node) -> fx.Node:
        """A (B, T) token-id placeholder beside ``hidden`` (B, T, C)."""
        with self.graph.inserting_after(after):
            node = self.graph.placeholder(LABELS)
        with self.fake_mode:
            node.meta["val"] = torch.empty(tuple(hidden.shape[:-1]), dtype=torch.long,
                                           device=hidden.device)
        return node

    def call(self, op, *args) -> fx.Node:
        node = self.graph.call_function(op, args)
        vals = fx.node.map_arg(args, lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = op(*vals)
        return node

    def slice_terms(self, hidden, weight, bias, labels, lo: int, hi: int
                    ) -> tuple[fx.Node, fx.Node]:
        """(logsumexp over rows [lo, hi), the label's logit where it falls there, else 0)."""
        w = self.call(aten.slice.Tensor, weight, 0, lo, hi)  # (hi - lo, C)
        args = (hidden, w) if bias is None else (
            hidden, w, self.call(aten.slice.Tensor, bias, 0, lo, hi))
        part = self.call(aten.linear.default, *args)  # (B, T, hi - lo)
        part = self.call(aten.to.dtype, part, torch.float32)  # fp32 softmax, as lm_loss
        lse = self.call(aten.logsumexp.default, part, [-1])  # (B, T)
        inside = self.call(aten.bitwise_and.Tensor, self.call(aten.ge.Scalar, labels, lo),
                           self.call(aten.lt.Scalar, labels, hi))
        index = self.call(aten.clamp.default, self.call(aten.sub.Scalar, labels, lo), 0,
                          hi - lo - 1)
        picked = self.call(aten.gather.default, part, -1,
                           self.call(aten.unsqueeze.default, index, -1))  # (B, T, 1)
        picked = self.call(aten.squeeze.dim, picked, -1)
        # where, not a 0/1 product: an inf logit outside the label's slice must not give nan
        return lse, self.call(aten.where.ScalarOther, inside, picked, 0.0)
