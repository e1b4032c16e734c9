"""Strategy fields one at a time: their choices, their text form (parsing, each field's own
rule, formatting) and the schedule's micro-batch rule. The :class:`~tessera.strategy.Strategy`
builds on these; the rules that tie fields together live there."""

from __future__ import annotations

from typing import Any

TP_MODES = ("1d", "2d")
TP_OVERLAPS = ("none", "subpipe")
TP_SEQ = ("off", "on")
SP_MODES = ("ring", "rsa", "ulysses")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "scp")
MEMORY_MODES = ("ddp", "zero1", "zero2", "zero3", "chunk")
OFFLOAD_TIERS = ("cpu", "disk")
PRECISIONS = ("fp32", "bf16", "fp16")

# Short names used by the text form, and the dataclass field each one stands for.
TEXT_ALIASES = {"mbs": "micro_batch_size", "gbs": "global_batch_size"}
FIELD_TO_TEXT = {v: k for k, v in TEXT_ALIASES.items()}


class StrategyError(ValueError):
    """A Strategy value (or its text form) breaks a rule; the message names field and rule."""


INT_FIELDS = ("dp", "tp", "pp", "sp", "micro_batch_size", "global_batch_size")
CHOICES = {"tp_mode": TP_MODES, "tp_overlap": TP_OVERLAPS, "tp_seq": TP_SEQ,
           "sp_mode": SP_MODES, "schedule": SCHEDULES, "memory": MEMORY_MODES,
           "precision": PRECISIONS}


def pipeline_size_problem(schedule: str, pp: int, micro_batches: int) -> str | None:
    """Why ``schedule`` cannot run ``micro_batches`` a step over ``pp`` stages (None: it
    can): 1F1B-style schedules fill every stage, interleaving walks groups of pp."""
    if schedule != "gpipe" and micro_batches < pp:
        return (f"schedule={schedule} with pp={pp} needs at least {pp} micro-batches per step, "
                f"got {micro_batches} (raise gbs or lower mbs, or use schedule=gpipe)")
    if schedule == "interleaved" and micro_batches % pp:
        return (f"schedule=interleaved needs the micro-batches per step ({micro_batches}) to "
                f"be a multiple of pp={pp}")
    return None


def check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise StrategyError(f"{field_label(name)} must be an integer, got {value!r}")
    if value < 1:
        raise StrategyError(f"{field_label(name)} must be >= 1, got {value}")


def field_label(name: str) -> str:
    short = FIELD_TO_TEXT.get(name)
    return f"{short} ({name})" if short else name


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise StrategyError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def text_values(text: str) -> dict[str, str]:
    """Strategy ``text`` as field name -> value text (``mbs``/``gbs`` by their full names;
    a field given under both names is refused), values unchecked: :meth:`Strategy.from_mapping`
    checks them."""
    values: dict[str, str] = {}
    for key, value in split_text(text).items():
        name = TEXT_ALIASES.get(key, key)
        if name in values:
            raise StrategyError(f"strategy field {key!r} given twice in {text!r}")
        values[name] = value
    return values


def split_text(text: str) -> dict[str, str]:
    if not isinstance(text, str) or not text.strip():
        raise StrategyError("strategy text is empty; expected e.g. 'dp=2,tp=1,pp=1,mbs=2,gbs=16'")
    pairs: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if "=" not in item:
            raise StrategyError(f"strategy item {item!r} is not key=value (in {text!r})")
        key, value = (part.strip() for part in item.split("=", 1))
        if key in pairs:
            raise StrategyError(f"strategy field {key!r} given twice in {text!r}")
        pairs[key] = value
    return pairs


def parse_value(name: str, raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    if name in INT_FIELDS:
        try:
            return int(raw)
        except ValueError:
            raise StrategyError(f"{field_label(name)} must be an integer, got {raw!r}") from None
    if name == "recompute":
        return parse_recompute(raw)
    if name == "offload":
        return () if raw in ("", "none") else tuple(raw.split("+"))
    return raw


def parse_recompute(raw: str) -> tuple[float, ...]:
    named = {"none": (0.0,), "full": (1.0,)}
    if raw in named:
        return named[raw]
    try:
        return tuple(float(part) for part in raw.split("/"))
    except ValueError:
        raise StrategyError(
            f"recompute must be none, full, a ratio or per-stage ratios like 1/0.5; got {raw!r}"
        ) from None


def as_ratios(value: Any) -> tuple[float, ...]:
    """Recomputation ratios from text, a number or a sequence, each checked in [0, 1]."""
    if isinstance(value, str):
        value = parse_recompute(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = (value,)
    try:
        ratios = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise StrategyError(f"recompute must be ratios in [0, 1], got {value!r}") from None
    if not ratios or any(not 0.0 <= r <= 1.0 for r in ratios):
        raise StrategyError(f"recompute ratios must each lie in [0, 1], got {value!r}")
    return ratios


def as_tiers(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = () if value in ("", "none") else tuple(value.split("+"))
    tiers = tuple(value)
    for tier in tiers:
        check_choice("offload", tier, OFFLOAD_TIERS)
    if len(set(tiers)) != len(tiers):
        raise StrategyError(f"offload lists a tier twice: {'+'.join(tiers)}")
    return tiers


def field_text(name: str, value: Any) -> str:
    """One field as strategy text writes it, e.g. ``mbs=2`` or ``recompute=1/0.5``."""
    return f"{FIELD_TO_TEXT.get(name, name)}={format_value(name, value)}"


def format_value(name: str, value: Any) -> str:
    if name == "recompute":
        if value == (0.0,):
            return "none"
        if value == (1.0,):
            return "full"
        return "/".join(f"{r:g}" for r in value)
    if name == "offload":
        return "+".join(value) if value else "none"
    return str(value)
