"""Policies that put the sequence-parallel attention (data_path.SequenceParallel) into models.

The reference Transformer takes it through its ``Attention.attention_fn`` hook, Hugging Face
models through transformers' AttentionInterface registry (``set_attn_implementation``), so
their code is not edited. Attention variants the ring cannot compute, and token mixers other
than attention, are refused by name.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import nn

from tessera.parallel.sequence.data_path import (HF_ATTENTION_NAME, POSITIONS_FROM_MASK,
                                                 SequenceParallel)
from tessera.parallel.sequence.hf_positions import position_limit
from tessera.parallel.sequence.layout import SequenceParallelError
from tessera.parallel.sequence.ulysses import check_heads


def _local_heads(heads: int, kv_heads: int, ways: int) -> tuple[int, int]:
    """Heads one tp rank holds; kv heads fewer than tp ranks are replicated (one each)."""
    return heads // ways, (kv_heads // ways if kv_heads >= ways else 1)


def _is_reference(model: nn.Module) -> bool:
    from tessera.models.transformer import Transformer

    return isinstance(model, Transformer)


def _apply_reference(model: nn.Module, sp: SequenceParallel) -> None:
    config = model.config
    if sp.mode == "ulysses":
        _check_ulysses_heads(config.n_heads, config.n_kv_heads, sp)
    sp.max_len = (config.max_seq_len, "max_seq_len", True)  # as one device refuses them
    for block in model.blocks:
        block.attn.attention_fn = sp.attention


def _is_hugging_face(model: nn.Module) -> bool:
    return hasattr(model, "set_attn_implementation") and hasattr(model, "config")


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                 scaling: float | None = None, dropout: float = 0.0, **kwargs
                 ) -> tuple[torch.Tensor, None]:
    """transformers AttentionInterface entry: (B, nh, T, hs) in, (B, T, nh, hs) out.

    Attention that differs from full causal softmax attention (a sliding window, logit
    soft-capping, attention sinks, a non-causal module) is refused, not approximated."""
    sp = module.tessera_sequence_parallel
    for name, size in getattr(module, "tessera_mask_only", {}).items():
        if kwargs.get(name) is None:  # applied through the mask only: named here
            kwargs = {**kwargs, name: size}
    # A window covering the real tokens covers them all (padding attends to nothing). A
    # pipeline stage's capture serves rows of any length up to its padded one: that one.
    real = None if sp.exportable else sp.row_length
    _refuse_attention_variants(module, kwargs, real or query.shape[2] * sp.size)
    if attention_mask is not None:
        raise SequenceParallelError(
            f"{type(module).__name__} received a 4D attention mask or bias: one passed to the "
            "model, or one the model builds itself (e.g. Doge's dynamic mask). Sequence "
            "parallelism builds its own masks from the batch's attention_mask / document_ids "
            "and cannot apply another: pass masks in the batch, or train this model with sp=1")
    out = sp.attention(query, key, value, dropout, scaling)
    # (B, T, nh, hs) laid out contiguously, as transformers' own attention functions return
    # it: models .view() it (JetMoE).
    return out.transpose(1, 2).contiguous(), None


# Keyword arguments transformers passes to an attention function for variants the ring,
# RSA and Ulysses do not compute (Mistral / Qwen2 / Gemma2 windows, Gemma2's soft-capping,
# gpt-oss's sinks), each with what it would change.
_VARIANTS = {"sliding_window": "a sliding attention window", "softcap": "logit soft-capping",
             "s_aux": "attention sinks", "sinks": "attention sinks",
             "attention_chunk_size": "chunked attention"}
_SPANS = ("sliding_window", "attention_chunk_size")  # no change when they cover the sequence


def _refuse_attention_variants(module: nn.Module, kwargs: dict, length: int) -> None:
    """``length``: tokens of the whole (padded) sequence; a window at least that long
    changes nothing (Mistral passes its window, 4096 by default, on every call)."""
    for name, what in _VARIANTS.items():
        value = kwargs.get(name)
        if name in _SPANS and value is not None and value >= length:
            continue
        if value is not None:
            shown = (f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value)
                     else repr(value))
            raise SequenceParallelError(
                f"{type(module).__name__} uses {what} ({name}={shown}) over a sequence of "
                f"{length} tokens, which sequence parallelism does not compute: its "
                "attention is full causal softmax attention. Train this model with sp=1")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise SequenceParallelError(
            f"{type(module).__name__} is not causal (is_causal=False): sequence "
            "parallelism's Hugging Face policy covers causal language models only")


def _reads_packed_positions() -> bool:
    """Whether this transformers masks packed rows by their position ids when given no
    attention_mask and no cache (5.x: ``masking_utils.find_packed_sequence_indices``); its
    one-device run then keeps each document to itself, and so must sequence parallelism."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices")


def _apply_hugging_face(model: nn.Module, sp: SequenceParallel) -> None:
    from transformers import AttentionInterface

    config = model.config
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if sp.mode == "ulysses":
        _check_ulysses_heads(heads, kv_heads, sp)
    _refuse_other_token_mixers(model)
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise SequenceParallelError(
            f"{type(model).__name__}.forward takes no position_ids (its decoder numbers "
            "positions or position biases itself, from each call's tokens: ALiBi in BLOOM "
            "and MPT, a table in BART-style decoders): each sp rank would place its tokens "
            "at positions 0.. of its own shard. Train this model with sp=1")
    sp.positions_from_mask = getattr(config, "model_type", None) in POSITIONS_FROM_MASK
    sp.packed_rows_config = config if _reads_packed_positions() else None
    sp.max_len = position_limit(model)
    AttentionInterface.register(HF_ATTENTION_NAME, hf_attention)
    tagged = 0
    for module in model.modules():
        # The attention modules are the ones transformers hands to the interface function.
        if type(module).__name__.endswith("Attention"):
            module.tessera_sequence_parallel = sp
            module.tessera_mask_only = _mask_only_spans(module, config)
            tagged += 1
    if not tagged:
        raise SequenceParallelError(
            f"{type(model).__name__} has no module named *Attention for sequence "
            "parallelism's Hugging Face policy to route: train this model with sp=1")
    model.set_attn_implementation(HF_ATTENTION_NAME)
    # (Not ``_supports_attention_backend``: StableLM and BioGPT leave it False, yet call
    # the interface.)
    used = getattr(config, "_attn_implementation", None)
    if used != HF_ATTENTION_NAME:
        raise SequenceParallelError(
            f"{type(model).__name__} computes attention in its own code, not through "
            f"transformers' AttentionInterface (its attention implementation stays {used!r}), "
            "so sequence parallelism cannot route it: each rank would attend to its own "
            "tokens only. Train this model with sp=1")


def _check_ulysses_heads(heads: int, kv_heads: int, sp: SequenceParallel) -> None:
    """Ulysses' head rules on the heads one tp rank holds, named with the model's counts."""
    local_heads, local_kv = _local_heads(heads, kv_heads, sp.head_ways)
    if sp.head_ways > 1 and local_heads % sp.size:
        raise SequenceParallelError(
            f"sp_mode=ulysses: the model's n_heads={heads} (n_kv_heads={kv_heads}) split over "
            f"tp={sp.head_ways} leave {local_heads} heads per tp rank, which must be "
            f"divisible by sp={sp.size}: n_heads must be divisible by sp x tp = "
            f"{sp.size * sp.head_ways}")
    if sp.head_ways > 1 and local_kv % sp.size and sp.size % local_kv:
        raise SequenceParallelError(
            f"sp_mode=ulysses: the model's n_kv_heads={kv_heads} split over tp={sp.head_ways} "
            f"leave {local_kv} kv heads per tp rank, which must divide or be divisible by "
            f"sp={sp.size}")
    check_heads(local_heads, local_kv, sp.size)  # one rank's heads (tp=1)


# Layer kinds the ring, RSA and Ulysses compute: every token mixer must be one of them.
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
# Module class names of token mixers other than attention (state-space models, linear
# attention, short convolutions): they would run on each rank's tokens alone.
_OTHER_MIXERS = ("Mamba", "SSM", "DeltaNet", "LinearAttention", "ShortConv", "RWKV",
                 "Recurrent", "Retention")


def _refuse_other_token_mixers(model: nn.Module) -> None:
    """Refuse models that mix tokens outside attention (hybrids: LFM2's convolutions, Jamba's
    Mamba layers, Qwen3-Next's linear attention), which sequence parallelism would run on
    each rank's shard alone."""
    config = model.config
    other = sorted(set(getattr(config, "layer_types", None) or ()) - _ATTENTION_LAYER_TYPES)
    mixers = [name for name, m in model.named_modules()
              if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
              or any(word in type(m).__name__ for word in _OTHER_MIXERS)]
    if other or mixers:
        found = f"layer types {other}" if other else f"modules {', '.join(mixers[:3])}"
        raise SequenceParallelError(
            f"{type(model).__name__} mixes tokens outside attention ({found}), which "
            "sequence parallelism would run on each rank's tokens alone: train this model "
            "with sp=1")


def _mask_only_spans(module: nn.Module, config) -> dict[str, int]:
    """The sliding window and attention chunk the module's attention applies through the
    mask transformers builds, which it may not pass to the attention function (Qwen2-MoE's
    sliding layers, Llama 4's chunked layers), by _VARIANTS name; empty when it attends to
    everything."""
    window = getattr(module, "sliding_window", None)
    types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    kind = types[index] if types and index is not None else None
    if window is None and kind == "sliding_attention":
        window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    if kind not in (None, "chunked_attention"):
        chunk = None  # a full or sliding layer of a model with chunked ones
    spans = {"sliding_window": window, "attention_chunk_size": chunk}
    return {name: size for name, size in spans.items() if size is not None}


POLICIES: list[tuple[str, Callable[[nn.Module], bool],
                     Callable[[nn.Module, SequenceParallel], None]]] = [
    ("tessera Transformer", _is_reference, _apply_reference),
    ("Hugging Face (AttentionInterface)", _is_hugging_face, _apply_hugging_face),
]


def active_dropout(model: nn.Module) -> list[str]:
    """What in ``model`` draws dropout masks while training: dropout modules with p > 0, and
    modules' dropout probabilities above 0 (OPT's layers and tessera's attention call
    ``F.dropout`` with ``self.dropout``). The modules' values, not the config's: they are
    what runs (a model whose dropout modules were zeroed after it was built trains without)."""
    found = []
    for name, module in model.named_modules():
        where = name or type(model).__name__
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p > 0:
                found.append(f"{where} (p={module.p})")
            continue
        found += [f"{where}.{k}={v}" for k, v in vars(module).items()
                  if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0]
    return found


def apply_policy(model: nn.Module, sp: SequenceParallel) -> str:
    """Route ``model``'s attention through ``sp``; returns the policy's name.

    Raises:
        SequenceParallelError: when no policy knows the model's class.
    """
    if not sp.causal:
        raise SequenceParallelError(
            "the sequence-parallel policies cover causal language models: a bidirectional "
            "SequenceParallel (causal=False) would let each token see the ones it predicts")
    for name, matches, apply in POLICIES:
        if matches(model):
            apply(model, sp)
            sp.dropouts = active_dropout(model)
            return name
    known = ", ".join(name for name, _, _ in POLICIES)
    raise SequenceParallelError(
        f"no sequence-parallel policy for {type(model).__name__}; known: {known}")
