"""How a model's layers and LM head are dealt to pipeline stages, as the runtime deals them.

Two rules:

- ``equal``: layers as even as possible (extra ones on the earliest stages), the whole head on
  the last stage: Megatron-LM's default split, used to price the published runs.
- ``balanced``: tessera's partitioner (parallel/pipeline/partition.py) balances estimated
  stage time, so a heavy head gets fewer layers beside it; and without tensor parallelism a
  head heavier than half a mean stage is sliced over the vocabulary and spread over the last
  stages (parallel/pipeline/head.py). Work is counted in layer-equivalents of
  training FLOPs per token: a layer 6 x its parameters plus attention's 12 x d x seq, the head
  6 x vocab x d.

Each stage is ``(layers, head_share)``: whole layers, and the fraction of the head's work it
runs (0 for stages without a slice). A stage holding any slice holds the whole head weight.
"""

from __future__ import annotations

import math
from functools import lru_cache

from tessera.models.config import ModelConfig
from tessera.strategy import Strategy

Split = tuple[tuple[int, float], ...]


def stage_split(model: ModelConfig, s: Strategy, balanced: bool = True) -> Split:
    """(layers, head share) of each of ``s.pp`` stages under the chosen rule."""
    if not balanced or s.pp == 1:
        return equal_split(model.n_layers, s.pp)
    weight = _head_weight(model)
    return _balanced(model.n_layers, s.pp, round(weight, 6), head_is_sliced(model, s))


def head_is_sliced(model: ModelConfig, s: Strategy) -> bool:
    """Whether the balanced rule slices the LM head over the vocabulary: without tensor
    parallelism, when it weighs more than half a mean stage. The stages then read rows of
    its weight (views), even where one stage holds every slice."""
    weight = _head_weight(model)
    return s.pp > 1 and s.tp == 1 and weight > (model.n_layers + weight) / (2 * s.pp)


def _head_weight(model: ModelConfig) -> float:
    """The head's training work in layer-equivalents."""
    head = 6.0 * model.vocab_size * model.d_model
    layer = (6.0 * (model.num_params(include_embedding=False) / model.n_layers)
             + 12.0 * model.d_model * model.max_seq_len)
    return head / layer


def equal_split(n_layers: int, pp: int) -> Split:
    """Layers as even as possible, the extra ones first; the whole head on the last stage."""
    base, extra = divmod(n_layers, pp)
    return tuple((base + (1 if i < extra else 0), 1.0 if i == pp - 1 else 0.0)
                 for i in range(pp))


@lru_cache(maxsize=4096)
def _balanced(n_layers: int, pp: int, weight: float, sliced: bool) -> Split:
    """The split with the smallest slowest stage: bisection on the stage-time limit (whether
    front-to-back dealing fits grows with the limit); the equal split when the best one would
    leave a stage empty."""
    lo, hi = (n_layers + weight) / pp, float(n_layers + weight)
    best = _fill(hi, n_layers, pp, weight, sliced)
    for _ in range(50):
        mid = (lo + hi) / 2
        split = _fill(mid, n_layers, pp, weight, sliced)
        if split is None:
            lo = mid
        else:
            hi, best = mid, split
    if best is None or any(layers == 0 and share == 0 for layers, share in best):
        return equal_split(n_layers, pp)
    return best


def _fill(limit: float, n_layers: int, pp: int, weight: float, sliced: bool) -> Split | None:
    """Deal layers front to back, each stage up to ``limit`` layer-equivalents, then the head
    (in slices over the stages that have room, or whole on the last); None if it does not
    fit."""
    layers_left, head_left, out = n_layers, weight, []
    for i in range(pp):
        if not sliced and i == pp - 1:
            if layers_left + weight > limit + 1e-9:
                return None
            out.append((layers_left, 1.0))
            return tuple(out)
        # Unsliced, leave a layer for each later stage but the last (it has the head).
        reserve = 0 if sliced else pp - 2 - i
        take = min(math.floor(limit + 1e-9), max(layers_left - reserve, 0))
        layers_left -= take
        share = min(limit - take, head_left) if sliced and layers_left == 0 else 0.0
        head_left -= share
        out.append((take, share / weight if weight else 0.0))
    if layers_left or head_left > 1e-9 * max(weight, 1.0):
        return None
    return tuple(out)
