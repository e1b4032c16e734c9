"""The strategy search space, and the rules that cut it down before anything is simulated.

Raw space for N devices and global batch B: every (tp, pp, sp, dp) with tp pp sp dp = N, both
tensor modes and all three sequence modes, every micro-batch size dividing B/dp, four schedules,
the recomputation choices and seven memory settings. Structural rules (Narayanan et al. 2021
takeaways plus the Strategy's own checks) remove most of it:

- tensor parallelism stays inside a node (tp <= devices per node) and divides the heads (2d: a
  square grid whose side divides the heads);
- pp <= layers; sp divides the sequence; ulysses needs heads divisible by sp * tp;
- B divisible by mbs * dp, and at least pp micro-batches per step when pp > 1 (fewer leaves
  stages idle for most of the step);
- sharded memory needs dp * sp > 1, offload needs zero3 or chunk;
- interleaving needs layers divisible by 2 pp; SCP needs recomputation and >= 4 micro-batches
  (Merak's own requirement).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from tessera.models.config import ModelConfig
from tessera.strategy import SCHEDULES

MEMORY_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ddp", ()), ("zero1", ()), ("zero2", ()), ("zero3", ()), ("chunk", ()),
    ("zero3", ("cpu",)), ("chunk", ("cpu",)))
DISK_OPTION = ("chunk", ("cpu", "disk"))


@dataclass(frozen=True)
class Layout:
    """Parallel degrees of one candidate."""

    dp: int
    tp: int
    tp_mode: str
    pp: int
    sp: int
    sp_mode: str
    tp_seq: str = "off"


def divisors(n: int) -> list[int]:
    """All positive divisors of n, ascending."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def recompute_options(pp: int) -> list[tuple[float, ...]]:
    """Recomputation choices, least recomputation (least time, most memory) first.

    Besides none, half and full, pipelines get Merak's stage-aware ratios: stage i recomputes
    ``1 - (1 - r0)(S - 1)/(S - 1 - i)`` of its layers and the last stage none, since stage i
    holds S - i micro-batches in flight and later stages have memory to spare.
    """
    options: list[tuple[float, ...]] = [(0.0,), (0.5,)]
    if pp > 1:
        options.append(stage_aware(1.0, pp))
    options.append((1.0,))
    return options


def stage_aware(r0: float, pp: int) -> tuple[float, ...]:
    """Merak's stage-aware recomputation ratios for ``pp`` stages from the first one's."""
    ratios = []
    for i in range(pp):
        if i == pp - 1:
            ratios.append(0.0)
        else:
            ratios.append(max(0.0, min(1.0, 1 - (1 - r0) * (pp - 1) / (pp - 1 - i))))
    return tuple(ratios)


def layouts(model: ModelConfig, n_devices: int, per_node: int, gbs: int, fixed: dict
            ) -> Iterator[Layout]:
    """Every layout that passes the structural rules (and the fixed fields)."""
    seq, heads = model.max_seq_len, model.n_heads
    for tp in divisors(n_devices):
        for tp_mode in ("1d", "2d"):
            if not _tp_ok(model, tp, tp_mode, per_node):
                continue
            for pp in divisors(n_devices // tp):
                if pp > model.n_layers:
                    continue
                for sp in divisors(n_devices // (tp * pp)):
                    dp = n_devices // (tp * pp * sp)
                    if seq % sp or gbs % dp:
                        continue
                    for sp_mode in (("ring", "ulysses", "rsa") if sp > 1 else ("ring",)):
                        if sp_mode == "ulysses" and heads % (sp * tp):
                            continue
                        for tp_seq in _tp_seq_options(tp, tp_mode, sp, seq):
                            layout = Layout(dp, tp, tp_mode, pp, sp, sp_mode, tp_seq)
                            if _matches(layout, fixed):
                                yield layout


def _tp_seq_options(tp: int, tp_mode: str, sp: int, seq: int) -> tuple[str, ...]:
    """Megatron sequence parallelism is a choice for a 1d tp group that divides each sp
    rank's tokens."""
    if tp > 1 and tp_mode == "1d" and seq % (tp * sp) == 0:
        return ("off", "on")
    return ("off",)


def _tp_ok(model: ModelConfig, tp: int, tp_mode: str, per_node: int) -> bool:
    if tp > per_node:
        return False
    if tp_mode == "2d":
        q = int(round(tp ** 0.5))
        return tp > 1 and q * q == tp and model.n_heads % q == 0
    return model.n_heads % tp == 0 and (model.n_kv_heads % tp == 0 or tp % model.n_kv_heads == 0)


def _matches(layout: Layout, fixed: dict) -> bool:
    return all(getattr(layout, k) == v for k, v in fixed.items() if hasattr(layout, k))


def micro_batch_sizes(gbs: int, dp: int, pp: int, max_mbs: int) -> list[int]:
    """Micro-batch sizes that divide the per-rank batch, leaving >= pp micro-batches."""
    per_rank = gbs // dp
    return [b for b in divisors(per_rank) if b <= max_mbs and (pp == 1 or per_rank // b >= pp)]


def schedules(model: ModelConfig, pp: int, micro_batches: int, exhaustive: bool,
              wanted: str | None = None) -> list[str]:
    """Schedules worth pricing. With one stage they all run the same way, so only 1f1b.

    GPipe costs the same time as 1F1B in the simulator and holds more activations, so it is
    dominated and only priced in exhaustive mode, or when ``wanted`` (a schedule the user
    holds fixed; scp is then priced from pp micro-batches, what the runtime needs).
    """
    if pp == 1:
        return ["1f1b"]
    out = ["1f1b", "scp"] + (["gpipe"] if exhaustive or wanted == "gpipe" else [])
    if model.n_layers % (2 * pp) == 0:
        out.append("interleaved")
    if micro_batches < 4 and wanted != "scp":
        out.remove("scp")
    return [s for s in SCHEDULES if s in out]


def structural_reasons(model: ModelConfig, n_devices: int, gbs: int, fixed: dict
                       ) -> list[str]:
    """Why no layout passes the structural rules, naming the fields held fixed that break
    them (a general hint when none does alone)."""
    degrees = {k: fixed[k] for k in ("dp", "tp", "pp", "sp") if k in fixed}
    product = math.prod(degrees.values())
    reasons = []
    if n_devices % product:
        held = "*".join(f"{k}={v}" for k, v in degrees.items())
        held = held if len(degrees) == 1 else f"{held} = {product}"
        reasons.append(f"the fixed {held} does not divide the {n_devices} devices")
    if fixed.get("pp", 1) > model.n_layers:
        reasons.append(f"pp={fixed['pp']} exceeds the model's {model.n_layers} layers")
    if model.max_seq_len % fixed.get("sp", 1):
        reasons.append(f"sp={fixed['sp']} does not divide the sequence length "
                       f"{model.max_seq_len}")
    if gbs % fixed.get("dp", 1):
        reasons.append(f"dp={fixed['dp']} does not divide gbs={gbs}")
    if gbs % fixed.get("micro_batch_size", 1):
        reasons.append(f"mbs={fixed['micro_batch_size']} does not divide gbs={gbs}")
    schedule, pp = fixed.get("schedule", "1f1b"), fixed.get("pp")
    if schedule != "1f1b" and (pp == 1 or n_devices == 1):
        reasons.append(f"schedule={schedule} needs pp >= 2")
    if schedule == "interleaved" and pp and model.n_layers % (2 * pp):
        reasons.append(f"schedule=interleaved needs the {model.n_layers} layers divisible by "
                       f"2 x pp = {2 * pp}")
    ratios = fixed.get("recompute", ())
    if len(ratios) > 1 and (pp not in (None, len(ratios)) or n_devices % len(ratios)):
        reasons.append(f"recompute gives {len(ratios)} per-stage ratios: pp must be "
                       f"{len(ratios)}" + (f", not {pp}" if pp else ""))
    return reasons or [f"check that gbs={gbs} leaves every pipeline stage micro-batches on "
                       f"the data-parallel degrees possible on {n_devices} devices, and that "
                       "the fixed fields suit each other and the model"]


def raw_space_size(n_devices: int, gbs: int) -> int:
    """Candidates before any pruning: every degree factorisation, both tp modes (and 1d's
    Megatron sequence parallelism on or off), three sp modes, every micro-batch size dividing
    the per-rank batch, four schedules, four recomputation choices and seven memory
    settings."""
    total = 0
    for tp in divisors(n_devices):
        for pp in divisors(n_devices // tp):
            for sp in divisors(n_devices // (tp * pp)):
                dp = n_devices // (tp * pp * sp)
                mbs = len(divisors(gbs // dp)) if gbs % dp == 0 else 1
                total += 3 * 3 * mbs * len(SCHEDULES) * 4 * len(MEMORY_OPTIONS)
    return total
