"""Configuration of the reference decoder-only transformer, and named presets.

Presets span tiny models for tests up to 70B for planning. GPT-2 style presets use layernorm,
gelu, learned positions and tied embeddings; Llama style presets use rmsnorm, swiglu, rotary
positions and grouped-query attention.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")


_INT_FIELDS = ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff",
               "max_seq_len")


class ModelConfigError(ValueError):
    """A model configuration breaks a rule; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and style of the reference transformer.

    Attributes:
        vocab_size: number of token ids.
        n_layers: transformer blocks.
        d_model: hidden size.
        n_heads: attention (query) heads.
        n_kv_heads: key/value heads (grouped-query attention when < n_heads); 0 means n_heads.
        d_ff: MLP inner size; 0 means 4*d_model for gelu and the Llama rule for swiglu.
        max_seq_len: longest sequence (size of learned position table, RoPE cache).
        norm: "layernorm" or "rmsnorm".
        activation: "gelu" or "swiglu".
        position: "learned" or "rope".
        tie_embeddings: share the token embedding with the output head.
        bias: biases in linear layers and norms.
        dropout: dropout probability (0 keeps runs deterministic): of the embedding, the
            residual branches and, unless ``attention_dropout`` is set, the attention
            probabilities.
        attention_dropout: dropout probability of the attention probabilities; None: as
            ``dropout`` (GPT-2's ``attn_pdrop`` apart from ``resid_pdrop``).
        norm_eps: epsilon of the norms.
        rope_theta: base of the rotary frequencies.
        init_std: standard deviation of the weight initialisation.
    """

    vocab_size: int = 256
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 0
    d_ff: int = 0
    max_seq_len: int = 128
    norm: str = "layernorm"
    activation: str = "gelu"
    position: str = "learned"
    tie_embeddings: bool = True
    bias: bool = True
    dropout: float = 0.0
    attention_dropout: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:  # types first: the defaults below compute with them
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ModelConfigError(f"model.{name} must be an integer, got {value!r}")
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", _default_ffn(self.d_model, self.activation))
        self._check()

    def _check(self) -> None:
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff",
                     "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"model.{name} must be a positive integer, got {value!r}")
        for name, choices in (("norm", NORMS), ("activation", ACTIVATIONS),
                              ("position", POSITIONS)):
            if getattr(self, name) not in choices:
                raise ModelConfigError(
                    f"model.{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}"
                )
        if self.d_model % self.n_heads:
            raise ModelConfigError(
                f"model.d_model={self.d_model} must be divisible by n_heads={self.n_heads}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(
                f"model.n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.position == "rope" and self.head_dim % 2:
            raise ModelConfigError(f"model: rope needs an even head_dim, got {self.head_dim}")
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ModelConfigError(f"model.{name} must lie in [0, 1), got {value}")

    @property
    def attention_p(self) -> float:
        """The attention probabilities' dropout (``attention_dropout``, else ``dropout``)."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of :class:`tessera.models.Transformer` with this config."""
        d, f, kv = self.d_model, self.d_ff, self.n_kv_heads * self.head_dim
        b = 1 if self.bias else 0
        norm = d * (2 if self.norm == "layernorm" and self.bias else 1)
        attn = d * (d + 2 * kv) + b * (d + 2 * kv) + d * d + b * d
        mlp_in = 2 * d * f if self.activation == "swiglu" else d * f + b * f
        mlp = mlp_in + f * d + b * d
        block = attn + mlp + 2 * norm
        total = self.n_layers * block + norm
        embed = self.vocab_size * d + (self.max_seq_len * d if self.position == "learned" else 0)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        if include_embedding:
            total += embed + head
        return total

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward, no recomputation).

        6 * non-embedding parameters (plus the output head's matmul), plus attention's
        score and value products, 12 * n_layers * d_model * seq_len (PaLM, appendix B).
        """
        seq = seq_len or self.max_seq_len
        dense = self.num_params(include_embedding=False) + self.vocab_size * self.d_model
        return 6.0 * dense + 12.0 * self.n_layers * self.d_model * seq

    def replace(self, **changes: Any) -> "ModelConfig":
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """Build from a mapping, naming any unknown key."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ModelConfigError(
                f"unknown model field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**dict(values))


def _default_ffn(d_model: int, activation: str) -> int:
    if activation == "gelu":
        return 4 * d_model
    # Llama: 2/3 of 4*d, rounded up to a multiple of 64 (keeps matmuls aligned).
    hidden = int(2 * 4 * d_model / 3)
    return 64 * ((hidden + 63) // 64)


_GPT2 = dict(norm="layernorm", activation="gelu", position="learned", tie_embeddings=True,
             bias=True, vocab_size=50257, max_seq_len=1024)
_LLAMA = dict(norm="rmsnorm", activation="swiglu", position="rope", tie_embeddings=False,
              bias=False, vocab_size=32000, max_seq_len=4096, norm_eps=1e-5)

# Keyword arguments, not built configs: overriding d_model or activation then re-derives the
# defaulted d_ff and n_kv_heads instead of keeping the preset's.
PRESETS: dict[str, dict[str, Any]] = {
    # Byte-level models that train on a CPU in tests and the demo.
    "tiny": dict(vocab_size=256, n_layers=2, d_model=64, n_heads=4, max_seq_len=64),
    "tiny-llama": dict(vocab_size=256, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                      max_seq_len=64, norm="rmsnorm", activation="swiglu",
                      position="rope", tie_embeddings=False, bias=False),
    "small": dict(vocab_size=256, n_layers=4, d_model=256, n_heads=8, max_seq_len=256),
    "small-llama": dict(vocab_size=256, n_layers=4, d_model=256, n_heads=8, n_kv_heads=4,
                       max_seq_len=256, norm="rmsnorm", activation="swiglu",
                       position="rope", tie_embeddings=False, bias=False),
    # Published architectures, for planning and for GPUs.
    "gpt2": dict(n_layers=12, d_model=768, n_heads=12, **_GPT2),
    "gpt2-medium": dict(n_layers=24, d_model=1024, n_heads=16, **_GPT2),
    "gpt2-large": dict(n_layers=36, d_model=1280, n_heads=20, **_GPT2),
    "gpt2-xl": dict(n_layers=48, d_model=1600, n_heads=25, **_GPT2),
    "gpt3-175b": dict(n_layers=96, d_model=12288, n_heads=96,
                 **{**_GPT2, "max_seq_len": 2048}),
    "llama-7b": dict(n_layers=32, d_model=4096, n_heads=32, d_ff=11008, **_LLAMA),
    "llama-13b": dict(n_layers=40, d_model=5120, n_heads=40, d_ff=13824, **_LLAMA),
    "llama-70b": dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
                 **{**_LLAMA, "vocab_size": 32000}),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named preset, optionally with fields overridden.

    Raises:
        ModelConfigError: for an unknown preset name (the message lists the known ones).
    """
    if name not in PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
