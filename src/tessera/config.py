"""Run configuration: YAML file + ``key=value`` overrides, validated before any work starts.

A config has four sections::

    model:    {preset: small, n_layers: 6, hf: null}   # any ModelConfig field overrides
    strategy: "dp=2,tp=1,pp=1,mbs=4,gbs=32"            # or a mapping of Strategy fields
    data:     {corpus: stdlib, seq_len: 128, tokenizer: byte}
    train:    {max_steps: 300, learning_rate: 3e-3, output_dir: runs/demo}

Unknown keys and wrong types are refused with :class:`ConfigError`, naming the dotted key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from tessera.models.config import ModelConfig, ModelConfigError, preset
from tessera.strategy import Strategy, StrategyError


class ConfigError(ValueError):
    """The run configuration is invalid; the message names the key and the rule."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(BaseModel):
    """Which model: a reference preset, its field overrides, optionally as a HF architecture."""

    model_config = ConfigDict(extra="allow")

    preset: str = "tiny"
    hf: Literal[None, "gpt2", "llama"] = None
    # Build on the meta device; the layout materialises it (under pp only each rank's stages,
    # under tp only its shards, one transformer block at a time) with weights seeded per name
    # (docs/pipeline.md, models larger than memory).
    on_meta: bool = False

    @model_validator(mode="after")
    def _build(self) -> "ModelSection":
        self.build_config()  # raises on a bad preset or field, before work starts
        return self

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def build_config(self) -> ModelConfig:
        """The reference ModelConfig (also the shape of a HF model built from it)."""
        unknown = sorted(set(self.overrides) - set(ModelConfig.__dataclass_fields__))
        if unknown:
            known = ", ".join(sorted(ModelConfig.__dataclass_fields__))
            raise ValueError(f"unknown key(s) model.{', model.'.join(unknown)}; known: preset, "
                             f"hf, on_meta, {known}")
        try:
            return preset(self.preset, **self.overrides)
        except ModelConfigError as err:
            raise ValueError(str(err)) from None


class DataSection(_Section):
    """Where the text comes from and how it becomes samples."""

    corpus: str = "stdlib"
    extensions: tuple[str, ...] = (".py", ".txt", ".md", ".rst")
    max_bytes: int | None = 8_000_000
    seq_len: int = 64
    tokenizer: Literal["byte", "bpe"] = "byte"
    bpe_vocab_size: int = 4096
    val_fraction: float = 0.01

    @field_validator("seq_len", "bpe_vocab_size")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be >= 1")
        return value

    @field_validator("val_fraction")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0.0 <= value < 0.5:
            raise ValueError("must lie in [0, 0.5)")
        return value


class TrainingArguments(_Section):
    """Optimisation, logging and checkpointing (names follow Hugging Face where they overlap)."""

    output_dir: str = "runs/default"
    max_steps: int = 100
    learning_rate: float = 1e-3
    min_lr_ratio: float = 0.1
    lr_scheduler_type: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 10
    # The warm-up's first step at lr 0 (Hugging Face's schedules), not at peak / warmup_steps.
    warmup_from_zero: bool = False
    # After a resume whose learning_rate differs from the checkpoint's (a batch-size change),
    # move the peak there linearly over this many steps; 0: at once.
    lr_rescale_warmup_steps: int = 0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    # A step's loss: the mean over the labels of all dp ranks' micro-batches (True), or each
    # rank's own token mean averaged over ranks (False, no collective); as Hugging Face's.
    average_tokens_across_devices: bool = True
    collective_timeout_s: float = 600.0  # a collective waiting longer fails, naming itself
    nonfinite: Literal["stop", "skip"] = "stop"  # on NaN/inf gradients: stop the run or skip
    logging_steps: int = 10
    eval_steps: int = 0
    eval_batches: int = 4  # global batches per evaluation; 0: the whole set, each sample once
    # Samples per evaluation micro-batch (0: the training mbs; another value needs pp=1).
    eval_micro_batch_size: int = 0
    save_steps: int = 0
    save_total_limit: int = 3  # newest checkpoints kept; 0 keeps all
    save_final: bool = True  # a checkpoint when training ends (stopping early always writes one)
    write_metrics: bool = True  # metrics.jsonl in output_dir
    seed: int = 1234
    resume: bool = False
    resume_from: str | None = None  # a checkpoint folder; default: the newest in output_dir
    init_from: str | None = None  # a safetensors folder (save_model's layout) to start from
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # strategy=auto plans for the devices this cluster YAML describes (`tessera profile
    # --out FILE` measures them) instead of the local preset's guesses.
    planner_cluster: str | None = None
    progress: Literal["auto", "bar", "lines", "off"] = "auto"
    # Bytes one pipeline rank may hold (weights, AdamW states, activations; estimated from
    # the graph captured at the run's shape): each stage then recomputes the least that fits
    # (stage-aware recomputation), so leave the strategy's recompute unset. Under
    # schedule=interleaved each of a rank's virtual stages gets an equal share. pp > 1 only.
    stage_memory_budget: int | None = None
    # pp > 1: module names that each start a stage (e.g. [blocks.4, blocks.8]), instead of the
    # partitioner's search; one per stage boundary (pp - 1, or 2pp - 1 under interleaving).
    pipeline_split_points: list[str] | None = None
    # pp > 1: modules captured as one opaque node each and run eagerly in their stage (names
    # or fnmatch patterns, e.g. [blocks.*.moe]): the way to pipeline a model torch.export
    # cannot capture whole (pipeline/leaves.py).
    pipeline_leaf_modules: list[str] | None = None

    @field_validator("stage_memory_budget", mode="before")
    @classmethod
    def _stage_budget(cls, value: Any) -> Any:
        return parse_budget(value)

    @field_validator("progress", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as False.
        return "off" if value is False else value

    @field_validator("max_steps", "logging_steps")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be >= 1")
        return value

    @field_validator("warmup_steps", "lr_rescale_warmup_steps", "eval_steps", "eval_batches",
                     "save_steps", "save_total_limit", "eval_micro_batch_size")
    @classmethod
    def _non_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be >= 0")
        return value

    @field_validator("learning_rate", "adam_epsilon")
    @classmethod
    def _positive_float(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be > 0")
        return value


def parse_budget(value: Any) -> int | None:
    """Bytes from an integer or text such as ``64MiB`` or ``1.5GB``; None stays None."""
    from tessera.memory.tiers import parse_bytes

    try:
        parsed = parse_bytes(value)
    except ValueError:
        raise ValueError(f"must be bytes, e.g. 67108864 or 64MiB; got {value!r}") from None
    if parsed is not None and parsed < 1:
        raise ValueError("must be >= 1 byte")
    return parsed


class MemorySection(_Section):
    """Chunk memory (strategy memory=chunk): placement policy, budgets, disk, chunk size.

    Budgets are bytes, as integers or text such as ``64MiB`` or ``1.5GB``.
    """

    placement: Literal["auto", "static"] = "auto"
    device_budget: int | None = None
    host_budget: int | None = None
    disk_dir: str | None = None
    chunk_size: int | None = None

    @field_validator("device_budget", "host_budget", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        return parse_budget(value)

    @field_validator("chunk_size")
    @classmethod
    def _chunk_size(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be >= 1 element")
        return value


class RunConfig(_Section):
    """A whole training run: model, strategy, data, training arguments and chunk memory."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model: ModelSection = ModelSection()
    strategy: Strategy = Strategy()
    data: DataSection = DataSection()
    train: TrainingArguments = TrainingArguments()
    memory: MemorySection = MemorySection()

    @field_validator("strategy", mode="before")
    @classmethod
    def _parse_strategy(cls, value: Any) -> Strategy:
        try:
            if isinstance(value, str):
                return Strategy.parse(value)
            if isinstance(value, Mapping):
                return Strategy.from_mapping(value)
        except StrategyError as err:
            raise ValueError(str(err)) from None
        if isinstance(value, Strategy):
            return value
        raise ValueError("must be text like 'dp=2,mbs=2,gbs=16' or a mapping of fields")

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        model = self.model.build_config()
        if self.data.seq_len > model.max_seq_len:
            raise ValueError(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len="
                             f"{model.max_seq_len}")
        if self.data.tokenizer == "byte" and model.vocab_size < 256:
            raise ValueError(f"tokenizer=byte needs model.vocab_size >= 256, got "
                             f"{model.vocab_size}")
        try:
            self.strategy.validate_for(model=model, seq_len=self.data.seq_len)
            self.strategy.check_split_points(self.train.pipeline_split_points)
            self.strategy.check_leaf_modules(self.train.pipeline_leaf_modules)
        except StrategyError as err:
            raise ValueError(f"strategy: {err}") from None
        self._check_memory()
        return self

    def _check_memory(self) -> None:
        memory, strategy = self.memory, self.strategy
        if strategy.memory != "chunk":
            if memory != MemorySection():
                raise ValueError(f"memory.* settings apply to strategy memory=chunk, got "
                                 f"memory={strategy.memory}")
            return
        if memory.placement == "static" and "cpu" not in strategy.offload:
            raise ValueError("memory.placement=static offloads optimizer states to the host: "
                             "it needs offload=cpu in the strategy")
        if "disk" in strategy.offload:
            if memory.disk_dir is None:
                raise ValueError("offload=disk needs memory.disk_dir")
            from tessera.memory.tiers import check_disk_dir

            check_disk_dir(Path(memory.disk_dir))  # missing or read-only: refused up front
        elif memory.disk_dir is not None:
            raise ValueError("memory.disk_dir is set but the strategy has no offload=disk")
        if memory.host_budget is not None and "cpu" not in strategy.offload:
            raise ValueError("memory.host_budget needs offload=cpu in the strategy")

    def to_dict(self) -> dict[str, Any]:
        """Plain data, with the strategy in its text form (round-trips through load)."""
        out = self.model_dump(mode="python", exclude={"strategy"})
        out["strategy"] = self.strategy.to_text()
        out["data"]["extensions"] = list(self.data.extensions)
        return out




def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                world_size: int | None = None) -> RunConfig:
    """Read a YAML config (or the defaults), apply ``key=value`` overrides, validate.

    A strategy of ``auto,gbs=N[,field=value...]`` is planned for ``world_size`` devices.

    Raises:
        ConfigError: for a missing file, bad YAML, an unknown key, a wrong type or a rule
            broken; the message names the key.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
    for item in overrides:
        _apply_override(raw, item)
    text = raw.get("strategy")
    if isinstance(text, str) and text.split(",")[0].strip() == "auto":
        raw["strategy"] = _plan(raw, text, world_size)
        # Planning read it: the resolved config (the workers', a rerun's) holds its outcome.
        (raw.get("train") or {}).pop("planner_cluster", None)
    elif (raw.get("train") or {}).get("planner_cluster"):
        raise ConfigError("train.planner_cluster is what strategy=auto plans for; with "
                          f"strategy {text!r} nothing reads it: use strategy=auto,gbs=N or "
                          "leave it out")
    return config_from_dict(raw)


def _plan(raw: dict[str, Any], text: str, world_size: int | None) -> str:
    from tessera.train.auto import PIPELINE_ONLY_KEYS, resolve_auto_text

    if world_size is None:
        raise ConfigError("strategy=auto needs the number of workers (tessera train --nproc N)")
    for key in PIPELINE_ONLY_KEYS:
        if (raw.get("train") or {}).get(key):
            raise ConfigError(f"train.{key} shapes the pipeline of a pp the strategy fixes: "
                              "give strategy text with pp > 1, not auto")
    probe = config_from_dict({**raw, "strategy": "dp=1,mbs=1,gbs=1"})  # validates the rest
    try:
        return resolve_auto_text(text, probe.model.build_config(), world_size,
                                 probe.train.device, seq_len=probe.data.seq_len,
                                 cluster_file=probe.train.planner_cluster).to_text()
    except StrategyError as err:
        raise ConfigError(f"strategy: {err}") from None


def config_from_dict(raw: Mapping[str, Any]) -> RunConfig:
    """Validate a config mapping, turning pydantic's errors into one named ConfigError."""
    try:
        return RunConfig.model_validate(dict(raw))
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value (e.g. train.max_steps=50)")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: the key {key!r} is empty or has an empty part")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node = child
    # The strategy keeps its own text form; everything else is read as a YAML scalar, except
    # YAML 1.1's yes/no/on/off, which stay words (progress=off is not progress=False).
    literal = parts == ["strategy"] or text.strip().lower() in _YAML_BOOL_WORDS
    try:
        node[parts[-1]] = text if literal else yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(f"override {item!r}: the value {text!r} is not a valid YAML "
                          "scalar (quote it)") from None


_YAML_BOOL_WORDS = {"yes", "no", "on", "off", "y", "n"}


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(lines)
