"""The reference decoder-only transformer: single-device, readable, GPT-2 or Llama style.

The model knows nothing of parallelism: `tessera.parallel.parallelize` rewrites it from the
outside. It returns logits; the loss lives in the trainer, so Hugging Face models (which return
an output object with ``.logits``) go through the same code path.

Shapes in comments: B batch, T sequence, C d_model, nh query heads, nkv key/value heads,
hs head size, V vocabulary.

Two hooks let parallelism work from the outside without changing the single-device path:
``Transformer.forward(input_ids, position_ids)`` takes each token's position (a
sequence-parallel rank holds a slice of the sequence, possibly reordered), and each
``Attention.attention_fn`` can be swapped for another function with the signature of
:func:`sdpa_attention` (e.g. ring attention over a process group).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama): x / rms(x) * weight, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


def rope_tables(head_dim: int, seq_len: int, theta: float,
                device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of rotary embeddings, each (seq_len, head_dim // 2), fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head: x is (B, T, n, hs).

    cos and sin are (T, hs/2) shared by the batch, or (B, T, hs/2) per sample.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]  # (1, T, hs/2)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B or 1, T, 1, hs/2)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.type_as(x)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   dropout_p: float = 0.0) -> torch.Tensor:
    """The default attention function: causal softmax attention on one device.

    Args:
        q: (B, nh, T, hs); k, v: (B, nkv, T, hs), nh divisible by nkv.
        dropout_p: attention dropout probability.

    Returns:
        (B, nh, T, hs).
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                          enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    """Causal self-attention with optional grouped-query key/value heads and RoPE.

    ``attention_fn`` (default :func:`sdpa_attention`) computes softmax(q k^T) v; replacing it
    is how sequence parallelism swaps in ring attention without editing this class.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads, config.n_kv_heads, config.head_dim)
        kv_dim = config.n_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.k_proj = nn.Linear(config.d_model, kv_dim, bias=config.bias)
        self.v_proj = nn.Linear(config.d_model, kv_dim, bias=config.bias)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.dropout = config.attention_p
        self.attention_fn = sdpa_attention

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
                ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim)  # (B, T, nh, hs)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)  # (B, T, nkv, hs)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)  # (B, T, nkv, hs)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, n, T, hs)
        y = self.attention_fn(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        # y: (B, nh, T, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SiluMul(torch.autograd.Function):
    """``silu(gate) * up`` that keeps only ``gate`` and ``up`` for backward.

    Autograd would also keep ``silu(gate)`` (an input of the product): one more (B, T, d_ff)
    tensor per layer. Recomputing it in backward is one sigmoid. The MLP hidden is the widest
    activation of a block, so this is a saving for every layout: one device, tensor parallel
    (d_ff/tp per rank) and sequence parallel (T/sp per rank) alike.
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        d_up = gate * sig * grad  # silu(gate) * grad
        # d silu(g) / dg = sig * (1 + g * (1 - sig)); built in place to keep temporaries few.
        d_gate = grad * up
        d_gate.mul_(sig)
        d_gate.mul_(sig.neg_().add_(1).mul_(gate).add_(1))
        return d_gate, d_up


class MLP(nn.Module):
    """gelu MLP (GPT-2) or gated swiglu MLP (Llama)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gated = config.activation == "swiglu"
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        if self.gated:
            self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            h = SiluMul.apply(self.gate_proj(x), self.up_proj(x))  # (B, T, d_ff)
        else:
            h = F.gelu(self.up_proj(x), approximate="tanh")
        return self.down_proj(h)  # (B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = Attention(config)
        self.mlp_norm = make_norm(config)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), rope))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Transformer(nn.Module):
    """Decoder-only language model returning logits (B, T, V) for token ids (B, T).

    Build on the meta device for planning models larger than memory::

        with torch.device("meta"):
            model = Transformer(preset("llama-70b"))
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_embed = (nn.Embedding(config.max_seq_len, config.d_model)
                          if config.position == "learned" else None)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # RoPE tables are derived, not learned: kept out of state dicts (persistent=False).
        if config.position == "rope":
            cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: normal(0, std), residual projections scaled by 1/sqrt(2L)."""
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith(("o_proj", "down_proj"))
                nn.init.normal_(module.weight, 0.0, residual_std if is_residual else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        if self.config.position == "rope":
            cos, sin = rope_tables(self.config.head_dim, self.config.max_seq_len,
                                   self.config.rope_theta, device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Logits (B, T, V) of token ids (B, T).

        Args:
            input_ids: (B, T) token ids.
            position_ids: (B, T) position of each token; default 0..T-1. A sequence-parallel
                rank passes the positions of the slice it holds.
        """
        B, T = input_ids.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}")
        x = self.embed(input_ids)  # (B, T, C)
        rope = None
        if position_ids is None:
            positions = torch.arange(T, device=input_ids.device)  # (T,)
            rope_at = slice(0, T)
        else:
            positions = rope_at = position_ids  # (B, T)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        else:
            rope = (self.rope_cos[rope_at], self.rope_sin[rope_at])  # (T or B x T, hs/2)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, rope)
        return self.lm_head(self.norm(x))  # (B, T, V)
