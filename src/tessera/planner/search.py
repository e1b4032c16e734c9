"""Pruned search for the fastest strategy that fits, and what to do when none fits.

Three kinds of pruning, on top of the structural rules of :mod:`tessera.planner.space`:

1. Dominance. GPipe prices like 1F1B with more memory; RSA moves what ring attention moves
   without overlapping it; for one memory setting, more recomputation is never faster, so only
   the least recomputation that fits is kept; an offloaded variant is skipped when the same
   memory setting fits without offload.
2. Memory. The memory model runs first (it is cheaper than the time model); a candidate that
   does not fit is never timed.
3. Bound. Every (layout, micro-batch, schedule) gets a lower bound on its step time (its
   pipeline without recomputation, gradient sync or optimizer); candidates are visited in
   bound order and the search stops once the bound exceeds the k-th best time found.

``exhaustive=True`` turns 1 and 3 off (tests use it to check that pruning keeps the optimum).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from tessera.models.config import ModelConfig
from tessera.planner.cluster import Cluster, parse_cluster
from tessera.planner.memory import device_memory, keeps_no_scores
from tessera.planner.model_spec import describe_model
from tessera.planner.simulator import Estimate, SimOptions, estimate, lower_bound
from tessera.planner.space import (DISK_OPTION, MEMORY_OPTIONS, layouts, micro_batch_sizes,
                                   structural_reasons,
                                   raw_space_size, recompute_options, schedules)
from tessera.strategy import NotAvailableError, Strategy, StrategyError, as_ratios

FIXABLE = ("dp", "tp", "tp_mode", "tp_seq", "pp", "sp", "sp_mode", "micro_batch_size",
           "schedule", "recompute", "memory", "offload")


class PlannerError(ValueError):
    """Planner input is refused; the message names the argument."""


@dataclass
class Infeasible:
    """Why nothing fits, and what would."""

    shortfall_bytes: float
    closest: Strategy | None
    suggestions: list[str] = field(default_factory=list)

    def message(self) -> str:
        if self.closest is None:  # nothing to price: the rules left no candidate
            head = "no strategy satisfies the structural rules"
        else:
            head = (f"no strategy fits in device memory; the closest "
                    f"({self.closest.to_text()}) is short by "
                    f"{self.shortfall_bytes / 2**30:.2f} GiB per device")
        return head + "".join(f"\n  - {s}" for s in self.suggestions)


@dataclass
class SearchResult:
    """Ranked strategies (fastest first) and how the search got there."""

    results: list[Estimate]
    candidates_total: int
    candidates_evaluated: int
    pruned: dict[str, int]
    elapsed_s: float
    infeasible: Infeasible | None = None

    @property
    def best(self) -> Estimate | None:
        return self.results[0] if self.results else None

    def to_dict(self) -> dict[str, Any]:
        return {"results": [e.to_dict() for e in self.results],
                "candidates_total": self.candidates_total,
                "candidates_evaluated": self.candidates_evaluated, "pruned": dict(self.pruned),
                "elapsed_s": self.elapsed_s,
                "infeasible": None if self.infeasible is None else {
                    "shortfall_bytes": self.infeasible.shortfall_bytes,
                    "closest": (self.infeasible.closest.to_text()
                                if self.infeasible.closest else None),
                    "suggestions": self.infeasible.suggestions}}


def default_precision(cluster: Cluster) -> str:
    """bf16 on accelerators that have it, fp16 on those that only have that, fp32 on CPUs."""
    peaks = cluster.device.peak_flops
    if cluster.device.is_host:
        return "fp32"
    return "bf16" if "bf16" in peaks else ("fp16" if "fp16" in peaks else "fp32")


def search(model: Any, cluster: Cluster | str, global_batch_size: int, *,
           devices: int | None = None, top_k: int = 10, precision: str | None = None,
           fixed: Mapping[str, Any] | None = None, available_only: bool = False,
           max_mbs: int = 64, allow_disk: bool = False, options: SimOptions | None = None,
           exhaustive: bool = False, explain: bool = True) -> SearchResult:
    """Rank strategies for training ``model`` on ``cluster`` with a global batch size.

    Args:
        model: a ModelConfig, preset name, shorthand or Hugging Face config.
        cluster: a Cluster or its shorthand / YAML path.
        global_batch_size: samples per optimizer step.
        devices: devices to use (default: the whole cluster).
        top_k: how many strategies to return.
        precision: training precision (default: :func:`default_precision`).
        fixed: Strategy fields to hold fixed, e.g. ``{"tp": 1, "memory": "ddp"}``.
        available_only: only strategies the runtime of this build can run
            (:data:`tessera.strategy.AVAILABLE`); what ``strategy: auto`` uses.
        max_mbs: largest micro-batch size considered.
        allow_disk: also consider offloading to NVMe.
        options: runtime knobs of the simulator.
        exhaustive: no dominance or bound pruning (for checking the pruning).
        explain: when nothing fits, search larger device counts for a suggestion.

    Raises:
        PlannerError: for a bad batch size, device count or fixed field, naming it.
    """
    start = time.perf_counter()
    model = describe_model(model)
    cluster = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    n = cluster.num_devices if devices is None else devices
    _check_args(global_batch_size, n, cluster, top_k)
    precision = precision or default_precision(cluster)
    cluster.device.peak(precision)  # refuses an unsupported precision early, by name
    constraints = _constraints(fixed)
    state = _Search(model, cluster, global_batch_size, precision, constraints, options,
                    exhaustive, allow_disk, top_k, runnable_only=available_only)
    state.run(n, max_mbs)
    results = sorted(state.best, key=lambda e: e.step_time)
    infeasible = None
    if not results:
        infeasible = _explain(state, model, cluster, global_batch_size, n, precision,
                              constraints, allow_disk, explain)
    return SearchResult(results, raw_space_size(n, global_batch_size), state.evaluated,
                        state.pruned, time.perf_counter() - start, infeasible)


def _check_args(gbs: int, n: int, cluster: Cluster, top_k: int) -> None:
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
        raise PlannerError(f"global_batch_size must be a positive integer, got {gbs!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PlannerError(f"devices must be a positive integer, got {n!r}")
    if n > cluster.num_devices:
        raise PlannerError(f"devices={n} exceeds the cluster's {cluster.num_devices}")
    if top_k < 1:
        raise PlannerError(f"top_k must be >= 1, got {top_k}")


def _constraints(fixed: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (fixed or {}).items():
        name = {"mbs": "micro_batch_size"}.get(key, key)
        if name not in FIXABLE:
            raise PlannerError(f"cannot fix strategy field {key!r}; fixable: {', '.join(FIXABLE)}")
        out[name] = value
    if "recompute" in out:  # per-stage ratios are checked against pp in each candidate
        out["recompute"] = as_ratios(out["recompute"])
    if "offload" in out:
        out["offload"] = Strategy(memory="chunk", offload=out["offload"]).offload
    return out


class _Search:
    """One search's mutable state (kept off the module, per the style guide)."""

    def __init__(self, model: ModelConfig, cluster: Cluster, gbs: int, precision: str,
                 fixed: dict, options: SimOptions | None, exhaustive: bool, allow_disk: bool,
                 top_k: int, runnable_only: bool = False) -> None:
        self.model, self.cluster, self.gbs, self.precision = model, cluster, gbs, precision
        self.fixed, self.options, self.exhaustive, self.top_k = fixed, options, exhaustive, top_k
        self.memory_options = list(MEMORY_OPTIONS) + ([DISK_OPTION] if allow_disk else [])
        self.runnable_only = runnable_only  # keep what Strategy.require_available accepts
        self.cache: dict = {}
        self.seen: set[tuple[float, float]] = set()
        self.heap: list[tuple[float, int, Estimate]] = []
        self.evaluated = 0
        self.pruned = {"dominated": 0, "memory": 0, "bound": 0, "invalid": 0, "not built": 0}
        self.shortfall: tuple[float, Strategy | None] = (float("inf"), None)
        self.not_built = ""  # why the first candidate this build cannot run was skipped

    @property
    def best(self) -> list[Estimate]:
        return [e for _, _, e in self.heap]

    def run(self, n: int, max_mbs: int) -> None:
        frontier = self._frontier(n, max_mbs)
        frontier.sort(key=lambda item: item[0])
        for index, (bound, base) in enumerate(frontier):
            if not self.exhaustive and len(self.heap) >= self.top_k and bound >= self._kth():
                self.pruned["bound"] += len(frontier) - index
                break
            self._expand(base)

    def _frontier(self, n: int, max_mbs: int) -> list[tuple[float, Strategy]]:
        out = []
        layout_fixed = {k: v for k, v in self.fixed.items()
                        if k in ("dp", "tp", "tp_mode", "tp_seq", "pp", "sp", "sp_mode")}
        for lay in layouts(self.model, n, min(self.cluster.devices_per_node, n), self.gbs,
                           layout_fixed):
            if lay.sp_mode == "rsa" and not self.exhaustive and "sp_mode" not in self.fixed:
                self.pruned["dominated"] += 1
                continue
            for mbs in micro_batch_sizes(self.gbs, lay.dp, lay.pp, max_mbs):
                if self.fixed.get("micro_batch_size", mbs) != mbs:
                    continue
                m = self.gbs // (mbs * lay.dp)
                for sched in schedules(self.model, lay.pp, m, self.exhaustive,
                                       self.fixed.get("schedule")):
                    if self.fixed.get("schedule", sched) != sched:
                        continue
                    try:  # the Strategy's own model rules have the last word
                        base = Strategy(dp=lay.dp, tp=lay.tp, tp_mode=lay.tp_mode,
                                        tp_seq=lay.tp_seq, pp=lay.pp, sp=lay.sp,
                                        sp_mode=lay.sp_mode, micro_batch_size=mbs,
                                        global_batch_size=self.gbs, schedule=sched,
                                        precision=self.precision).validate_for(model=self.model)
                    except StrategyError:
                        self.pruned["invalid"] += 1
                        continue
                    bound = lower_bound(self.model, self.cluster, base, self.options, self.cache)
                    out.append((bound, base))
        return out

    def _kth(self) -> float:
        return -self.heap[0][0]

    def _expand(self, base: Strategy) -> None:
        fitted_modes: set[str] = set()
        for memory, offload in self.memory_options:
            if not self._allowed("memory", memory) or not self._allowed("offload", offload):
                continue
            if offload and memory in fitted_modes and not self.exhaustive:
                self.pruned["dominated"] += 1
                continue
            held = self.fixed.get("recompute")  # any ratios the user gives, not only ours
            for ratios in [held] if held is not None else recompute_options(base.pp):
                if base.schedule == "scp" and max(ratios) == 0.0 and held is None:
                    continue
                try:
                    s = base.replace(memory=memory, offload=offload, recompute=ratios)
                except StrategyError:
                    self.pruned["invalid"] += 1
                    break
                if self._try(s):
                    fitted_modes.add(memory)
                    if not self.exhaustive:
                        break

    def _allowed(self, name: str, value: Any) -> bool:
        return name not in self.fixed or self.fixed[name] == value

    def _try(self, s: Strategy) -> bool:
        self.evaluated += 1
        if self.runnable_only:
            try:
                s.require_available()
            except NotAvailableError as err:
                self.pruned["not built"] += 1  # the runtime of this build would refuse it
                self.not_built = self.not_built or str(err)  # the first, for the message
                return False
        dev = self.cluster.device
        mem = device_memory(self.model, s, self.model.max_seq_len, dev.reserved_bytes,
                            keeps_no_scores(dev, self.model, s),
                            (self.options or SimOptions()).tessera_runtime,
                            host_is_device=dev.is_host).total
        if mem > dev.memory_bytes:
            self.pruned["memory"] += 1
            short = mem - dev.memory_bytes
            if short < self.shortfall[0]:
                self.shortfall = (short, s)
            return False
        est = estimate(self.model, self.cluster, s, self.options, self.cache)
        key = (round(est.step_time, 12), round(est.memory.total))
        if key in self.seen and not self.exhaustive:
            # Priced identically to one already kept (e.g. zero3 and chunk): not a new choice.
            self.pruned["dominated"] += 1
            return True
        self.seen.add(key)
        item = (-est.step_time, self.evaluated, est)
        if len(self.heap) < self.top_k:
            heapq.heappush(self.heap, item)
        elif est.step_time < self._kth():
            heapq.heapreplace(self.heap, item)
        return True


def _explain(state: _Search, model: ModelConfig, cluster: Cluster, gbs: int, n: int,
             precision: str, constraints: dict, allow_disk: bool, explain: bool) -> Infeasible:
    short, closest = state.shortfall
    if closest is None:
        if state.not_built:  # candidates existed, but this build runs none of them
            return Infeasible(0.0, None, [f"every candidate needs what this build does not "
                                          f"run, e.g.: {state.not_built}"])
        return Infeasible(0.0, None, structural_reasons(model, n, gbs, constraints))
    tips = []
    if explain:
        for factor in (2, 4, 8, 16, 32, 64):
            bigger = cluster.with_devices(cluster.devices_per_node,
                                          max(cluster.nodes * factor,
                                              -(-n * factor // cluster.devices_per_node)))
            # As runnable as the search asked: no tip this build would refuse (zero3).
            found = search(model, bigger, gbs, devices=n * factor, top_k=1,
                           precision=precision, fixed=constraints, allow_disk=allow_disk,
                           explain=False, available_only=state.runnable_only)
            if found.results:
                tips.append(f"use at least {n * factor} devices, e.g. "
                            f"{found.best.strategy.to_text()}")
                break
        if not allow_disk and "offload" not in constraints:
            found = search(model, cluster, gbs, devices=n, top_k=1, precision=precision,
                           fixed=constraints, allow_disk=True, explain=False,
                           available_only=state.runnable_only)
            if found.results:
                tips.append(f"offload to disk: {found.best.strategy.to_text()}")
    for name, what in (("memory", "sharded memory (zero3 or chunk)"),
                       ("offload", "offload to cpu"), ("recompute", "recompute=full"),
                       ("tp", "tensor parallelism"), ("pp", "pipeline parallelism")):
        if name == "offload" and cluster.device.is_host:
            continue  # a CPU worker's host memory is its own: offload to cpu frees nothing
        if name in constraints:
            tips.append(f"allow {what}: it is held fixed at {constraints[name]!r} now")
    if not tips:
        tips.append("a device with more memory, or a smaller model / sequence")
    return Infeasible(short, closest, tips)
