"""Whether a capture computes what the model computes: pipeline stages run the captured
graph, not the model's forward, so a model that takes another code path under
``torch.export`` (transformers' ``is_torchdynamo_exporting()`` branches; OLMo-Hybrid swaps
a triangular solve for a loop) would train that path's numerics without a word.

One micro-batch of random tokens runs through both, from the same random state (dropout
draws alike when the ops come in the same order), without gradients; logits that differ
beyond rounding are reported.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from tessera.parallel.pipeline.capture import ProxyGraph
from tessera.parallel.plan import causal_lm_logits

# fp32 sums in another order differ by ~1e-6 relative; a different code path by far more
# (OLMo-Hybrid: 2e-4 in the loss, more in single logits).
TOLERANCE = 1e-4


class CaptureMismatchWarning(UserWarning):
    """The captured graph's logits are not the model's eager forward's."""


def eager_gap(graph: ProxyGraph, model: nn.Module) -> float:
    """Largest logit difference between the capture and the model, relative to the largest
    logit, on one micro-batch of random tokens (the model's weights must be real)."""
    vocab = graph.nodes[graph.output].node.meta["val"].shape[-1]
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, graph.input_shape(),  # (B, T) the capture ran at
                        generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad(), torch.random.fork_rng(devices=[] if device.type == "cpu"
                                                else [device]):
        torch.manual_seed(0)
        captured = causal_lm_logits(graph.program.module(), ids)
        torch.manual_seed(0)
        eager = causal_lm_logits(model, ids)
    scale = eager.abs().max().clamp_min(1e-12)
    return float((captured.float() - eager.float()).abs().max() / scale)


def warn_if_capture_differs(graph: ProxyGraph, model: nn.Module) -> float:
    """:func:`eager_gap`, with a warning naming the way out when it exceeds TOLERANCE."""
    gap = eager_gap(graph, model)
    if gap > TOLERANCE:
        warnings.warn(
            f"{type(model).__name__}: the graph torch.export captured computes other logits "
            f"than the model's own forward ({gap:.1e} of the largest logit, over the "
            f"{TOLERANCE:g} rounding allows): the model takes another code path when "
            "exported, and pipeline stages run the captured one. Compare its losses with "
            "pp=1, run the differing module eagerly (pipeline_leaf_modules), or train with "
            "pp=1", CaptureMismatchWarning, stacklevel=2)
    return gap
