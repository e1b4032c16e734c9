"""Check, when a module is replaced, that tessera's layer computes what the module computed.

A policy matches modules by path, and a norm or embedding named like Llama's may compute
something else (Gemma's RMSNorm multiplies by ``1 + weight``, Cohere's LayerNorm is not an
``nn.LayerNorm``, Gemma's embedding is scaled): replacing it with the plain layer would train
another model without a word. Before a norm or token embedding is replaced, its own forward
runs on a small probe input with its real weights, against the math of the layer that
replaces it (modules.normalize, a plain lookup times the scale read off the module); a
difference is refused, naming the class and the styles there are. Modules on the meta device
(no weights yet) are not probed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.parallel.tensor.modules import normalize
from tessera.parallel.tensor.policy import PolicyError

NORM_STYLES = ("norm (nn.LayerNorm, or RMSNorm x_hat * w in fp32 as Llama's), layernorm "
               "(mean subtracted, any class), rmsnorm_1p (x_hat * (1 + w), Gemma's), "
               "head_norm (a LayerNorm weight per head, Cohere's q/k norms), head_rmsnorm "
               "(x_hat * w over each head, Qwen 3's q/k norms), head_rmsnorm_1p (Gemma 3's)")


def check_norm(module: nn.Module, style: str, eps: float, rms: bool,
               unit_offset: bool = False) -> None:
    """Refuse ``module`` when :func:`modules.normalize` with these settings is not its math.

    Raises:
        PolicyError: naming the class, the style, the largest difference and the styles.
    """
    weight = module.weight
    if weight.is_meta:
        return
    bias = getattr(module, "bias", None)
    gen = torch.Generator().manual_seed(0)
    width = weight.shape[-1]
    heads = weight.shape[:-1]  # () for a norm over the features, (H,) for one per head
    x = torch.randn(2, 3, *heads, width, generator=gen) * 2 + 0.5  # nonzero mean and scale
    x = x.to(weight.device, weight.dtype)
    with torch.no_grad():
        expected = module(x)
        got = normalize(x, weight, bias, eps, rms, unit_offset)
    _compare(module, style, "norm", expected, got, NORM_STYLES)


def check_embedding(module: nn.Module, style: str, scale: float | None) -> None:
    """Refuse a token embedding whose forward is not a lookup times ``scale`` (None: 1).

    Raises:
        PolicyError: naming the class, the style and the largest difference.
    """
    weight = module.weight
    if weight.is_meta:
        return
    ids = torch.arange(min(8, weight.shape[0]), device=weight.device).view(2, -1)
    with torch.no_grad():
        expected = module(ids)
        got = F.embedding(ids, weight)
        if scale is not None:  # rounded as modules.VocabEmbedding rounds it
            got = got * torch.tensor(scale, dtype=torch.float32).to(weight.device, weight.dtype)
    _compare(module, style, "token embedding", expected, got,
             "vocab_embed (a lookup, times the module's scalar_embed_scale when it has one)")


def _compare(module: nn.Module, style: str, what: str, expected: torch.Tensor,
             got: torch.Tensor, styles: str) -> None:
    exact = expected.dtype == torch.float32 or expected.dtype == torch.float64
    tol = 1e-5 if exact else 2e-2  # 16-bit: one rounding of the output apart
    if expected.shape == got.shape and torch.allclose(expected.float(), got.float(), rtol=tol,
                                                      atol=tol):
        return
    gap = ((expected.float() - got.float()).abs().max().item()
           if expected.shape == got.shape else float("nan"))
    raise PolicyError(
        f"{type(module).__name__} under style {style!r} computes another {what} than the "
        f"layer that would replace it (largest difference {gap:.3g} on a probe input): give "
        f"it the style that matches its forward ({styles}; docs/tensor_parallel.md), or "
        "train with tp=1")
