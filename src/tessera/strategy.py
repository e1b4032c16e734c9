"""The `Strategy` type: how one training job is laid out over its devices.

Every part of tessera speaks this one language. The planner produces a Strategy, the runtime
executes it, the simulator prices it, the scheduler resizes it and checkpoints record it.

A Strategy checks itself when built (each field's own rule and the rules between fields), and
checks itself against a world size and a model with :meth:`Strategy.validate_for`. A bad value
is refused with :class:`StrategyError`, whose message names the field and the rule.

Text form (for the command line and logs)::

    dp=2,tp=1,pp=1,mbs=2,gbs=16
    dp=4,tp=4,tp_mode=2d,pp=2,mbs=1,gbs=64,schedule=scp,recompute=1/0.5,memory=zero1

``dp``, ``tp`` and ``pp`` always appear, ``sp`` when it is not 1, then ``mbs`` and ``gbs``, then
every other field that differs from its default, so ``format(parse(text)) == text`` for text
written in that canonical order.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from tessera.strategy_fields import (  # the Strategy's vocabulary, re-exported (__all__)
    CHOICES, FIELD_TO_TEXT, INT_FIELDS, MEMORY_MODES, OFFLOAD_TIERS, PRECISIONS, SCHEDULES,
    SP_MODES, TEXT_ALIASES, TP_MODES, TP_OVERLAPS, TP_SEQ, StrategyError, as_ratios, as_tiers,
    check_choice, check_count, field_label, field_text, format_value, parse_value,
    pipeline_size_problem, split_text, text_values)

__all__ = ["AVAILABLE", "MEMORY_MODES", "OFFLOAD_TIERS", "PRECISIONS", "SCHEDULES", "SP_MODES",
           "TEXT_ALIASES", "TP_MODES", "TP_OVERLAPS", "TP_SEQ", "ModelShape", "NotAvailableError",
           "Strategy", "StrategyError", "as_ratios", "blocks_to_recompute", "chunks_for",
           "field_label", "field_text", "fixed_fields", "pipeline_size_problem", "text_values"]


def blocks_to_recompute(ratio: float, n_blocks: int) -> int:
    """How many of ``n_blocks`` a recomputation ratio checkpoints: ``ratio * n_blocks`` to
    the nearest whole block, a half rounded down (the pipeline's cut nearest the ratio of a
    stage's time does the same on equal blocks). The runtime and the planner both use it."""
    if ratio <= 0:
        return 0
    return min(n_blocks, max(0, math.ceil(ratio * n_blocks - 0.5 - 1e-9)))

def chunks_for(schedule: str) -> int:
    """Virtual stages per rank: 2 under interleaving, else 1."""
    return 2 if schedule == "interleaved" else 1


class NotAvailableError(StrategyError):
    """A valid Strategy asks for a feature that this build of tessera does not run yet."""


class ModelShape(Protocol):
    """What :meth:`Strategy.validate_for` needs to know about a model."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    max_seq_len: int


@dataclass(frozen=True)
class Strategy:
    """How one training job runs: parallel degrees, batch sizes, schedule and memory.

    Attributes:
        dp: data-parallel degree.
        tp: tensor-parallel degree (for ``tp_mode="2d"`` a square q*q grid).
        tp_mode: "1d" (Megatron column/row) or "2d" (Optimus SUMMA on a q x q grid).
        tp_overlap: "none", or "subpipe" (sub-pipelined tensor parallelism, Merak: each
            micro-batch runs as two halves inside a pipeline stage, one half's all-reduces,
            forward and backward, overlapping the other half's compute; needs tp > 1,
            pp > 1, even mbs).
        tp_seq: "off", or "on" (Megatron sequence parallelism inside the 1d tp group: the
            norm, dropout and residual regions hold 1/tp of the sequence, all-gathered before
            attention and the MLP and reduce-scattered after them, in place of the all-reduce;
            the column layers keep their input's shard and gather it again in backward;
            needs tp > 1 with tp_mode=1d and a sequence length divisible by tp).
        pp: pipeline-parallel degree (number of stages).
        sp: sequence-parallel degree.
        sp_mode: "ring" (online softmax), "rsa" (paper-faithful) or "ulysses" (all-to-all).
        micro_batch_size: samples per micro-batch on one data-parallel rank (``mbs``).
        global_batch_size: samples per optimizer step over all ranks (``gbs``).
        schedule: pipeline schedule: "gpipe", "1f1b", "interleaved" or "scp" (shifted
            critical path).
        recompute: activation recomputation ratio per pipeline stage, each in [0, 1]; one value
            applies to every stage. Text form: ``none``, ``full``, ``0.5`` or ``1/0.5/0``.
        memory: "ddp" (replicated), "zero1", "zero2", "zero3" or "chunk" (PatrickStar).
        offload: tiers model data may be offloaded to: any of "cpu", "disk".
        precision: "fp32", "bf16" or "fp16" (the latter two as mixed precision).
    """

    dp: int = 1
    tp: int = 1
    tp_mode: str = "1d"
    tp_overlap: str = "none"
    tp_seq: str = "off"
    pp: int = 1
    sp: int = 1
    sp_mode: str = "ring"
    micro_batch_size: int = 1
    global_batch_size: int = 1
    schedule: str = "1f1b"
    recompute: tuple[float, ...] = (0.0,)
    memory: str = "ddp"
    offload: tuple[str, ...] = ()
    precision: str = "fp32"

    def __post_init__(self) -> None:
        # Normalise list-like inputs so that equal strategies compare and hash equal.
        object.__setattr__(self, "recompute", as_ratios(self.recompute))
        object.__setattr__(self, "offload", as_tiers(self.offload))
        self._check_fields()
        self._check_relations()

    # ----------------------------------------------------------------------------- checks
    def _check_fields(self) -> None:
        for name in INT_FIELDS:
            check_count(name, getattr(self, name))
        for name, choices in CHOICES.items():
            check_choice(name, getattr(self, name), choices)

    def _check_relations(self) -> None:
        if self.tp_mode == "2d" and (self.tp == 1 or math.isqrt(self.tp) ** 2 != self.tp):
            raise StrategyError(
                f"tp={self.tp} with tp_mode=2d: tp must be a square (q*q grid) above 1, e.g. "
                "4, 9, 16"
            )
        # A mode of a degree left at 1 would have nothing to act on: refused, not ignored.
        if self.sp == 1 and self.sp_mode != "ring":
            raise StrategyError(f"sp_mode={self.sp_mode} lays out sequence parallelism and "
                                "needs sp > 1 (at sp=1 leave it at ring)")
        if self.pp == 1 and self.schedule != "1f1b":
            raise StrategyError(f"schedule={self.schedule} orders pipeline stages and needs "
                                "pp >= 2 (at pp=1 leave it at 1f1b)")
        per_step = self.micro_batch_size * self.dp
        if self.global_batch_size % per_step:
            raise StrategyError(
                f"gbs={self.global_batch_size} must be a multiple of mbs*dp="
                f"{self.micro_batch_size}*{self.dp}={per_step}"
            )
        if len(self.recompute) not in (1, self.pp):
            raise StrategyError(
                f"recompute has {len(self.recompute)} ratios: give one for all stages or one "
                f"per pipeline stage (pp={self.pp})"
            )
        if self.tp_overlap == "subpipe" and (self.tp < 2 or self.pp < 2
                                             or self.micro_batch_size % 2):
            raise StrategyError(
                f"tp_overlap=subpipe splits each micro-batch in two inside pipeline stages: "
                f"needs tp > 1, pp > 1 and an even mbs; got tp={self.tp}, pp={self.pp}, "
                f"mbs={self.micro_batch_size}")
        if self.tp_seq == "on" and (self.tp < 2 or self.tp_mode != "1d"):
            raise StrategyError(
                f"tp_seq=on splits the sequence over a 1d tensor-parallel group: needs tp > 1 "
                f"and tp_mode=1d (2d already splits every activation); got tp={self.tp}, "
                f"tp_mode={self.tp_mode}")
        if self.offload and self.memory not in ("zero3", "chunk"):
            raise StrategyError(
                f"offload={'+'.join(self.offload)} needs memory=zero3 or memory=chunk, "
                f"got memory={self.memory}"
            )
        if self.memory != "ddp" and self.dp == 1 and self.memory != "chunk":
            raise StrategyError(f"memory={self.memory} shards over data parallelism: needs dp > 1")

    # ---------------------------------------------------------------------- derived values
    @property
    def world_size(self) -> int:
        """Number of devices this strategy occupies: dp * tp * pp * sp."""
        return self.dp * self.tp * self.pp * self.sp

    def check_split_points(self, names: list[str] | None) -> None:
        """Refuse pipeline split points (module names that start stages) this layout cannot
        take: one per boundary between its stages (virtual ones under interleaving), pp > 1.

        Raises:
            StrategyError: naming the rule.
        """
        if names is None:
            return
        if self.pp == 1:
            raise StrategyError("pipeline_split_points places pipeline stage boundaries and "
                                "needs pp > 1")
        chunks = chunks_for(self.schedule)
        stages = self.pp * chunks
        if len(names) != stages - 1:
            virtual = f" ({chunks} virtual stages per rank)" if chunks > 1 else ""
            raise StrategyError(f"pipeline_split_points has {len(names)} names for {stages} "
                                f"stages{virtual}: give {stages - 1} (each starts a stage)")

    def check_leaf_modules(self, names: list[str] | None) -> None:
        """Refuse pipeline leaf modules (modules captured as one opaque node, run eagerly;
        pipeline/leaves.py) where this layout cannot take them: they need pp > 1, and are
        not built with tensor or sequence parallelism.

        Raises:
            StrategyError: naming the rule.
        """
        if not names:
            return
        if self.pp == 1:
            raise StrategyError("pipeline_leaf_modules marks modules the pipeline capture "
                                "runs eagerly and needs pp > 1 (at pp=1 nothing is captured)")
        others = [f"{name}={value}" for name, value, plain in (
            ("tp", self.tp, 1), ("sp", self.sp, 1))
            if value != plain]
        if others:
            raise StrategyError(f"pipeline_leaf_modules with {', '.join(others)} is not built: "
                                "a leaf runs its module eagerly, outside the layers those "
                                "layouts rewrite; use them with dp x pp (chunk memory too)")

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def tp_grid(self) -> tuple[int, int]:
        """(rows, cols) of the tensor-parallel grid: (q, q) for 2d, (1, tp) for 1d."""
        if self.tp_mode == "2d":
            q = math.isqrt(self.tp)
            return (q, q)
        return (1, self.tp)

    def stage_recompute(self, stage: int) -> float:
        """Recomputation ratio of pipeline stage ``stage``."""
        if not 0 <= stage < self.pp:
            raise StrategyError(f"stage {stage} is outside 0..{self.pp - 1} (pp={self.pp})")
        return self.recompute[0] if len(self.recompute) == 1 else self.recompute[stage]

    def replace(self, **changes: Any) -> "Strategy":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ validate in context
    def validate_for(self, world_size: int | None = None, model: ModelShape | None = None,
                     seq_len: int | None = None) -> "Strategy":
        """Check this strategy against a world size and a model; returns self.

        Also checks what a run needs beyond the fields' own rules: enough micro-batches
        a step for the pipeline schedule.

        Raises:
            StrategyError: naming the field and the rule that does not hold.
        """
        problem = self.pp > 1 and pipeline_size_problem(self.schedule, self.pp,
                                                        self.grad_accum_steps)
        if problem:
            raise StrategyError(problem)
        if world_size is not None:
            self.check_world_size(world_size)
        if model is not None:
            self._check_model(model, seq_len or model.max_seq_len)
        return self

    def check_world_size(self, world_size: int) -> None:
        """Refuse degrees whose product is not ``world_size`` (what a mesh needs alone).

        Raises:
            StrategyError: naming the product and the world size.
        """
        if self.world_size != world_size:
            raise StrategyError(
                f"dp*tp*pp*sp = {self.dp}*{self.tp}*{self.pp}*{self.sp} = {self.world_size} "
                f"must equal the world size {world_size}"
            )

    def _check_model(self, model: ModelShape, seq_len: int) -> None:
        heads_split = math.isqrt(self.tp) if self.tp_mode == "2d" else self.tp
        if model.n_heads % heads_split:
            raise StrategyError(
                f"tp={self.tp} (tp_mode={self.tp_mode}) splits heads {heads_split} ways: "
                f"n_heads={model.n_heads} is not divisible by {heads_split}"
            )
        if self.tp_mode == "1d" and model.n_kv_heads % self.tp and self.tp % model.n_kv_heads:
            raise StrategyError(
                f"tp={self.tp}: n_kv_heads={model.n_kv_heads} must divide or be divisible by tp"
            )
        if self.tp_mode == "2d" and model.n_kv_heads % heads_split:
            # 2d gives each grid column whole kv heads; it does not replicate them (1d does).
            raise StrategyError(
                f"tp={self.tp} (tp_mode=2d) splits key/value heads {heads_split} ways: "
                f"n_kv_heads={model.n_kv_heads} is not divisible by {heads_split}"
            )
        if model.n_layers < self.pp:
            raise StrategyError(f"pp={self.pp} stages need n_layers >= pp, got {model.n_layers}")
        if seq_len % self.sp:
            raise StrategyError(f"sp={self.sp}: sequence length {seq_len} is not divisible by sp")
        if self.tp_seq == "on" and seq_len % (self.tp * self.sp):
            over = f"tp={self.tp}" if self.sp == 1 else f"tp={self.tp} within sp={self.sp}"
            raise StrategyError(f"tp_seq=on splits the sequence over {over}: sequence "
                                f"length {seq_len} is not divisible by "
                                f"{'tp' if self.sp == 1 else 'tp*sp'}")
        if self.sp > 1 and self.sp_mode == "ulysses" and model.n_heads % (self.sp * self.tp):
            raise StrategyError(
                f"sp_mode=ulysses: n_heads={model.n_heads} must be divisible by sp*tp="
                f"{self.sp * self.tp}"
            )
        kv_local = model.n_kv_heads // self.tp if model.n_kv_heads >= self.tp else 1
        if (self.sp > 1 and self.sp_mode == "ulysses" and kv_local % self.sp
                and self.sp % kv_local):
            raise StrategyError(
                f"sp_mode=ulysses: n_kv_heads per tp rank ({kv_local}) must divide or be "
                f"divisible by sp={self.sp}"
            )

    # -------------------------------------------------------------------------- text form
    def to_text(self) -> str:
        """The canonical short text form, e.g. ``dp=2,tp=1,pp=1,mbs=2,gbs=16``."""
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.sp != 1:
            parts.append(f"sp={self.sp}")
        parts += [f"mbs={self.micro_batch_size}", f"gbs={self.global_batch_size}"]
        default = _DEFAULT
        for name in ("tp_mode", "tp_overlap", "tp_seq", "sp_mode", "schedule", "recompute",
                     "memory", "offload", "precision"):
            value = getattr(self, name)
            if value != getattr(default, name):
                parts.append(f"{name}={format_value(name, value)}")
        return ",".join(parts)

    def __str__(self) -> str:
        return self.to_text()

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """Parse the text form; unknown keys, repeated keys and bad values are refused."""
        return cls.from_mapping(split_text(text))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "Strategy":
        """Build from a mapping of field names (or ``mbs``/``gbs``) to values or strings."""
        kwargs: dict[str, Any] = {}
        for key, raw in values.items():
            name = TEXT_ALIASES.get(key, key)
            if name not in _FIELD_NAMES:
                raise StrategyError(
                    f"unknown strategy field {key!r}; known: {', '.join(sorted(_TEXT_KEYS))}"
                )
            if name in kwargs:
                raise StrategyError(f"strategy field {key!r} given twice")
            kwargs[name] = parse_value(name, raw)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (lists for tuples)."""
        out = dataclasses.asdict(self)
        out["recompute"] = list(self.recompute)
        out["offload"] = list(self.offload)
        return out

    def require_available(self, features: "Mapping[str, bool] | None" = None) -> None:
        """Refuse fields whose runtime is not built yet, with a clear error.

        Args:
            features: which optional runtimes exist (defaults to :data:`AVAILABLE`).

        Raises:
            NotAvailableError: naming the field, its value and the issue that builds it.
        """
        features = AVAILABLE if features is None else features
        for feature, (test, issue) in _FEATURE_GATES.items():
            if test(self) and not features.get(feature, False):
                raise NotAvailableError(
                    f"{feature} ({_describe_gate(feature, self)}) is not available yet in this "
                    f"build of tessera (tracked in issue #{issue}); use "
                    f"{_FALLBACK[feature]}"
                )
        for test, what, issue in _COMBINATIONS_NOT_BUILT:
            if test(self):
                raise NotAvailableError(
                    f"{what} together is not available yet in this build of tessera (each "
                    f"runs alone; the composition is tracked in issue #{issue}): "
                    f"{self.to_text()}")

    def is_runnable(self, features: "Mapping[str, bool] | None" = None) -> bool:
        """Whether :meth:`require_available` accepts this strategy."""
        try:
            self.require_available(features)
        except NotAvailableError:
            return False
        return True


# Runtimes built so far. Each later parallelism flips its entry when it lands.
AVAILABLE: dict[str, bool] = {
    "tensor parallelism": True,
    "sequence parallelism": True,
    "pipeline parallelism": True,
    "ZeRO memory": False,
    "chunked memory": True,
    "offload": True,
}

_FEATURE_GATES = {
    "tensor parallelism": (lambda s: s.tp > 1, 4),
    "sequence parallelism": (lambda s: s.sp > 1, 5),
    "pipeline parallelism": (lambda s: s.pp > 1, 6),
    # zero1/2/3 as separate runtimes are not built; memory=chunk (ZeRO-sharded chunks) is.
    "ZeRO memory": (lambda s: s.memory in ("zero1", "zero2", "zero3"), 3),
    "chunked memory": (lambda s: s.memory == "chunk", 3),
    "offload": (lambda s: bool(s.offload), 3),
}
# Runtimes that exist alone but not yet together; refused before any worker starts, and
# skipped by the planner's `available_only` search.
_COMBINATIONS_NOT_BUILT = [
    (lambda s: s.tp > 1 and s.sp > 1 and s.tp_mode == "2d",
     "2d tensor (tp_mode=2d) and sequence (sp>1) parallelism", 5),
    # 2d x pp runs (SUMMA layers as custom ops, tensor/ops2d.py); sub-pipelining overlaps 1d
    # all-reduces only.
    (lambda s: s.tp > 1 and s.pp > 1 and s.tp_mode == "2d" and s.tp_overlap == "subpipe",
     "2d tensor parallelism (tp_mode=2d) and tp_overlap=subpipe", 6),
]

_FALLBACK = {
    "tensor parallelism": "tp=1",
    "sequence parallelism": "sp=1",
    "pipeline parallelism": "pp=1",
    "ZeRO memory": "memory=ddp, or memory=chunk (chunks sharded ZeRO-style over dp)",
    "chunked memory": "memory=ddp",
    "offload": "no offload",
}


def _describe_gate(feature: str, s: Strategy) -> str:
    return {
        "tensor parallelism": f"tp={s.tp}, tp_mode={s.tp_mode}",
        "sequence parallelism": f"sp={s.sp}, sp_mode={s.sp_mode}",
        "pipeline parallelism": f"pp={s.pp}, schedule={s.schedule}",
        "ZeRO memory": f"memory={s.memory}",
        "chunked memory": f"memory={s.memory}",
        "offload": f"offload={'+'.join(s.offload)}",
    }[feature]


# ------------------------------------------------------------------- fields held alone
_FIELD_NAMES = {f.name for f in dataclasses.fields(Strategy)}
_TEXT_KEYS = {FIELD_TO_TEXT.get(n, n) for n in _FIELD_NAMES}



def fixed_fields(text: str) -> dict[str, Any]:
    """Strategy text's fields, each parsed and checked on its own (a known name given once,
    an integer >= 1, one of its choices, ratios in [0, 1], offload tiers), leaving out the
    rules that tie fields together: what ``strategy=auto,...`` holds fixed while the planner
    chooses the rest.

    Raises:
        StrategyError: naming the field and its rule.
    """
    out: dict[str, Any] = {}
    for name, raw in text_values(text).items():
        if name not in _FIELD_NAMES:
            raise StrategyError(f"unknown strategy field {FIELD_TO_TEXT.get(name, name)!r}; "
                                f"known: {', '.join(sorted(_TEXT_KEYS))}")
        value = parse_value(name, raw)
        if name in INT_FIELDS:
            check_count(name, value)
        elif name == "recompute":
            value = as_ratios(value)
        elif name == "offload":
            value = as_tiers(value)
        else:
            check_choice(name, value, CHOICES[name])
        out[name] = value
    return out





_DEFAULT = Strategy()
