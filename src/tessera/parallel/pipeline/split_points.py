"""Manual split points: stage boundaries named by module, instead of the partitioner's search.

``train.pipeline_split_points: [blocks.4, blocks.8]`` starts a stage at each named module:
the cut goes before the first graph node the module computes (torch.export records each
node's module path). The cuts must be places where the partitioner's search may cut (the
fewest activations cross, cost_table.candidate_cuts; not its finer cuts inside attention and
the MLP), so that stages exchange what they exchange under the automatic partition; a name
that lands elsewhere is refused with the nearest modules that would do. Stages named this
way hold whole modules: the LM head is not sliced over the last stages (head.py).
"""

from __future__ import annotations

from tessera.parallel.pipeline.capture import ProxyGraph, module_of
from tessera.strategy import StrategyError


def module_path(graph: ProxyGraph, index: int) -> str:
    """The innermost module that computes compute node ``index`` ("" for the model's own
    forward)."""
    return module_of(graph.nodes[graph.compute[index]].node)


def _inside(path: str, name: str) -> bool:
    return path == name or path.startswith(name + ".")


def cuts_at(graph: ProxyGraph, names: list[str], allowed: list[int], stages: int
            ) -> list[int]:
    """Compute indices of the cuts before the modules ``names`` (one per stage boundary).

    Args:
        graph: the captured model (the partition's graph).
        names: module paths, in model order, e.g. ``["blocks.4"]`` or ``["transformer.h.6"]``.
        allowed: cut positions the partitioner accepts (cost_table.candidate_cuts).
        stages: stages of the run (pp, times 2 under interleaving).

    Raises:
        StrategyError: naming the split point and what is wrong with it.
    """
    if len(names) != stages - 1:  # Strategy.check_split_points refuses this first
        raise StrategyError(f"pipeline_split_points has {len(names)} names for {stages} "
                            f"stages: give {stages - 1} (each starts a stage)")
    paths = [module_path(graph, i) for i in range(len(graph.compute))]
    cuts = []
    for name in names:
        index = _first(paths, name)
        if index is None:
            known = list(dict.fromkeys(p for p in paths if p))  # model order
            shown = known[:6] + ["..."] + known[-6:] if len(known) > 12 else known
            raise StrategyError(f"pipeline split point {name!r} names no module the captured "
                                f"model computes; modules include {', '.join(shown)}")
        if index not in allowed:
            raise StrategyError(
                f"pipeline split point {name!r} would cut where more activations cross than "
                f"at the model's narrowest points; start the stage at "
                f"{_nearest_names(paths, allowed, index)} instead")
        if cuts and index <= cuts[-1]:
            raise StrategyError(f"pipeline split points must follow the model's order: "
                                f"{name!r} does not come after {names[len(cuts) - 1]!r}")
        cuts.append(index)
    return cuts


def _first(paths: list[str], name: str) -> int | None:
    """The first compute node inside module ``name`` (None: none)."""
    return next((i for i, path in enumerate(paths) if _inside(path, name)), None)


def _nearest_names(paths: list[str], allowed: list[int], index: int) -> str:
    """Module names that start a stage at the allowed cuts nearest ``index``, one before and
    one after, each a name that resolves back to its cut."""
    names = []
    for cuts in ([c for c in allowed if c < index][::-1], [c for c in allowed if c > index]):
        for cut in cuts:
            if paths[cut] and _first(paths, paths[cut]) == cut:
                names.append(repr(paths[cut]))
                break
    return " or ".join(names) or "a block boundary"
