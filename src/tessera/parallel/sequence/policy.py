"""The sequence-parallel data path, and policies that put its attention into models.

Each sp rank runs the whole model on its own L/sp tokens: embeddings, norms and MLPs are
local, only attention talks to the other ranks. :class:`SequenceParallel` owns that:

- ``shard(batch)``: pads the sequence if needed, picks this rank's tokens (zigzag or
  contiguous, see layout.py), and gives their real position ids and attention metadata;
- ``forward_loss(module, batch)``: runs the model on the shard with its attention switched to
  the chosen mode, and returns a loss whose average over the sp ranks is the micro-batch's
  mean token loss (sum of local losses / the whole sequence's token count, times sp);
- ``attention(q, k, v)``: what the model's attention hook calls.

Policies install ``attention`` into a model: the reference Transformer through its
``Attention.attention_fn`` hook, Hugging Face models through transformers' AttentionInterface
registry (``set_attn_implementation``), so their code is not edited.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.parallel.plan import labels_without_padding
from tessera.parallel.sequence.compose import TokenLoss
from tessera.parallel.sequence.dropout import AttentionDropout
from tessera.parallel.sequence.hf_positions import position_limit
from tessera.parallel.sequence.layout import (SequenceParallelError, check_layout,
                                              local_indices, padded_length)
from tessera.parallel.sequence.ring import ring_attention
from tessera.parallel.sequence.rsa import rsa_attention
from tessera.parallel.sequence.ulysses import check_heads, ulysses_attention

MODES = ("ring", "rsa", "ulysses")
HF_ATTENTION_NAME = "tessera_sequence_parallel"
IGNORE = -100
# Hugging Face models whose decoder numbers positions from the attention mask when given no
# position_ids (OPT's learned positions: cumsum(mask) * mask - 1, so left padding shifts
# them); the others number them 0..T-1, as shard() does (RoBERTa-style tables, counted
# from their padding index, are refused: hf_positions.py).
POSITIONS_FROM_MASK = frozenset({"opt"})


class SequenceParallel:
    """One job's sequence-parallel layout and attention, over the mesh's sp group.

    Args:
        group: the sequence-parallel process group.
        mode: "ring", "rsa" or "ulysses".
        causal: causal language modelling (False: bidirectional attention).
        layout: "zigzag" or "contiguous"; default zigzag for causal ring, else contiguous.
        pad: pad sequences whose length the layout cannot split evenly (False: refuse them).
        token_loss: ``(logits, labels) -> summed token loss`` of this rank's tokens; default
            cross-entropy over whole-vocabulary logits (tensor parallelism passes its
            vocabulary-parallel one, see compose.py).
        head_ways: how many ways another parallelism already split the heads (tp), so the
            Ulysses head rules are checked on the heads one rank holds.
        head_rank: this rank's share of those heads (its tp rank): attention dropout masks
            the layer's heads, not the same local heads on every tp rank.

    Raises:
        SequenceParallelError: for an unknown mode or zigzag without a causal mask.
    """

    def __init__(self, group: dist.ProcessGroup, mode: str = "ring", causal: bool = True,
                 layout: str | None = None, pad: bool = True,
                 token_loss: TokenLoss | None = None, head_ways: int = 1,
                 head_rank: int = 0) -> None:
        if mode not in MODES:
            raise SequenceParallelError(f"sp_mode must be one of {', '.join(MODES)}; got {mode!r}")
        self.group, self.mode, self.causal, self.pad = group, mode, causal, pad
        self.token_loss, self.head_ways = token_loss or _cross_entropy_sum, head_ways
        self.head_rank = head_rank
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.layout = layout or ("zigzag" if mode == "ring" and causal else "contiguous")
        check_layout(self.layout, causal)
        self._meta: torch.Tensor | None = None
        self.exportable = False  # set by StageInputs (staged.py) when pp > 1
        self.dropouts: list[str] = []  # what draws dropout masks in the model (apply_policy)
        # position ids from the attention mask, as the model numbers them (POSITIONS_FROM_MASK)
        self.positions_from_mask = False
        # The model's limit on tokens per row (set by the policies): (limit, what sets it,
        # whether it bounds rows with their own position ids too)
        self.max_len: tuple[int, str, bool] | None = None
        self.row_length: int | None = None  # tokens per row of the last shard, before padding

    # ------------------------------------------------------------------------ data path
    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tokens of a (B, T) batch.

        Optional batch keys: ``document_ids`` (B, T) for packed documents (no attention
        across ids), ``attention_mask`` (B, T) with 0 on padding, ``position_ids`` (B, T).

        Returns:
            input_ids, labels, position_ids (B, T'/sp) and meta (B, T'/sp, 2): [index,
            segment] with segment -1 on padding; T' is T padded for the layout.

        Raises:
            SequenceParallelError: when T does not split evenly and padding is disabled.
        """
        ids = batch["input_ids"]
        B, T = ids.shape
        for key in PER_TOKEN_KEYS:  # each rank pads and takes columns: a misfit goes unseen
            if key in batch and tuple(batch[key].shape[:2]) != (B, T):
                raise SequenceParallelError(
                    f"batch {key} has shape {tuple(batch[key].shape)}, but input_ids is "
                    f"({B}, {T}): sequence parallelism splits every per-token key along the "
                    "same tokens")
        self._check_length(T, batch.get("position_ids"))
        self.row_length = T
        padded = padded_length(T, self.size, self.layout)
        if padded != T and not self.pad:
            raise SequenceParallelError(
                f"sequence length {T} must be divisible by {self._multiple()} "
                f"(sp={self.size}, layout={self.layout}) when padding is disabled")
        index = torch.arange(padded, device=ids.device).expand(B, padded)  # (B, T')
        segment = batch.get("document_ids", torch.zeros_like(ids))
        if "attention_mask" in batch:
            segment = segment.masked_fill(batch["attention_mask"] == 0, -1)
        positions = batch.get("position_ids", self._default_positions(batch, index[:, :T]))
        cols = local_indices(padded, self.size, self.rank, self.layout).to(ids.device)

        def take(x: torch.Tensor, fill: int) -> torch.Tensor:  # pad, then this rank's tokens
            return F.pad(x, (0, padded - T), value=fill)[:, cols]

        return {"input_ids": take(ids, 0), "labels": take(labels_without_padding(batch), IGNORE),
                "position_ids": take(positions, 0),
                "meta": torch.stack((index[:, cols], take(segment, -1)), dim=-1)}

    def _check_length(self, length: int, own_positions: torch.Tensor | None) -> None:
        """Refuse rows longer than the model's position table, on every rank alike (each
        rank's shard is shorter: the model's own check cannot see it, and an index past the
        table fails on some ranks only). Hugging Face models index their table by the
        batch's own position ids when it has them: then the largest id is checked (every
        rank holds the whole batch, so every rank decides alike)."""
        if self.max_len is None:
            return
        limit, source, always = self.max_len
        if own_positions is not None and not always:  # the table is indexed by these ids
            length = int(own_positions.max()) + 1 if own_positions.numel() else 0
        if length > limit:
            raise SequenceParallelError(
                f"sequence length {length} exceeds the model's {limit} positions ({source}): "
                "shorten the rows (or their position_ids), build the model with more "
                "positions, or train it with sp=1")

    def _default_positions(self, batch: dict[str, torch.Tensor], index: torch.Tensor
                           ) -> torch.Tensor:
        """Positions (B, T) for a batch without position_ids: 0..T-1, or counted over the
        attention mask where the model itself would (-1 on padding, as it gives them)."""
        if not self.positions_from_mask or "attention_mask" not in batch:
            return index
        mask = batch["attention_mask"].long()
        return mask.cumsum(dim=1) * mask - 1

    def forward_loss(self, module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's share of the micro-batch's mean next-token loss (see module doc)."""
        if module.training:
            self.refuse_dropout()
        local = self.shard(batch)
        self.set_tokens(local["meta"])
        out = module(local["input_ids"], position_ids=local["position_ids"])
        logits = out if isinstance(out, torch.Tensor) else out.logits  # (B, T/sp, V or V/tp)
        return self.scale_loss(self.token_loss(logits, local["labels"]), self.token_count(batch))

    def refuse_dropout(self) -> None:
        """Refuse training with dropout outside :func:`tessera.parallel.rank_rng.rank_stream`:
        there every sp rank would draw the same mask at the same local position, so masks
        would repeat along the sequence. The Trainer runs every step inside one.

        Raises:
            SequenceParallelError: naming the dropout modules and config fields.
        """
        from tessera.parallel.rank_rng import in_rank_stream

        if self.dropouts and not in_rank_stream():
            raise SequenceParallelError(
                f"dropout ({', '.join(self.dropouts[:3])}) under sequence parallelism needs "
                "a random stream per sp rank, or every rank draws the same mask at the same "
                "local position: run the step inside tessera.parallel.rank_rng.rank_stream "
                "(tessera's Trainer does), or set the model's dropout to 0")

    @staticmethod
    def token_count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Labels counted by the loss in the *whole* micro-batch (at least 1).

        Every sp rank has the whole batch, so this needs no communication; a rank whose tokens
        are all padding then returns a loss of 0, not 0/0.
        """
        return (labels_without_padding(batch) != IGNORE).sum().clamp_min(1)

    def scale_loss(self, loss_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """This rank's summed token loss -> its share of the micro-batch's mean (x sp)."""
        return loss_sum * self.size / count

    def stage_inputs(self, model: nn.Module):
        """Prepare ``model`` for pipeline capture; returns the pipeline's StageInputs."""
        from tessera.parallel.sequence.staged import StageInputs

        return StageInputs(self, model)

    def set_tokens(self, meta: torch.Tensor) -> None:
        """Make ``meta`` (B, T/sp, 2), this rank's token metadata, visible to :meth:`attention`.

        It stays set until the next call: activation recomputation re-runs attention during
        backward, after the forward has returned. ``meta`` must be in this object's layout,
        as :meth:`shard` makes it (it is not checked here: under pipeline capture it is a
        graph input without values).
        """
        self._meta = meta

    # ------------------------------------------------------------------------ attention
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
        """Sequence-parallel attention of local q (B, nh, T/sp, hs), k, v (B, nkv, T/sp, hs).

        With ``dropout_p`` > 0 the probabilities are dropped by a mask hashed from a seed drawn
        here from torch's generator (dropout.py): a recomputation that restores the
        generator's state draws the same seed, so the same mask.

        Raises:
            SequenceParallelError: before :meth:`set_tokens`.
        """
        if self._meta is None:
            raise SequenceParallelError(
                "sequence-parallel attention ran without token metadata: run the model through "
                "SequenceParallel.forward_loss (or call set_tokens first)")
        if not q.shape[-1] == k.shape[-1] == v.shape[-1]:  # every rank alike, before sends
            raise SequenceParallelError(
                f"sequence-parallel attention got head sizes q {q.shape[-1]}, k {k.shape[-1]}, "
                f"v {v.shape[-1]}: the ring, RSA and Ulysses pass blocks of one head size "
                "(multi-head latent attention, as in DeepSeek-V2/V3, gives values their own). "
                "Train this model with sp=1")
        if not self.exportable:  # (under capture meta is a graph input of the same shape)
            self._check_tokens(q)
        seed = torch.randint(0, 2 ** 62, (), dtype=torch.int64) if dropout_p > 0 else None
        heads = self.head_rank * q.shape[1]  # the layer's index of this rank's first head
        if self.exportable:  # inside pipeline stages: one custom op that export keeps
            from tessera.parallel.sequence.staged import sp_attention

            scale = q.shape[-1] ** -0.5 if scale is None else scale
            return sp_attention(q, k, v, self._meta, self.group, self.mode, self.causal, scale,
                                self.layout, dropout_p, seed, heads)
        dropout = AttentionDropout(dropout_p, int(seed), heads) if seed is not None else None
        if self.mode == "ring":
            # shard() and staged inputs lay tokens out in self.layout already
            return ring_attention(q, k, v, self._meta, self.group, self.causal, scale,
                                  self.layout, verify_layout=False, dropout=dropout)
        if self.mode == "rsa":
            return rsa_attention(q, k, v, self._meta, self.group, self.causal, scale, dropout)
        return ulysses_attention(q, k, v, self._meta, self.group, self.causal, scale, dropout)

    def _check_tokens(self, q: torch.Tensor) -> None:
        """Refuse queries (B, nh, T/sp, hs) other than the (B, T/sp) tokens the metadata
        describes: the model called directly, after a forward_loss set it for another batch."""
        expected = tuple(self._meta.shape[:2])
        if (q.shape[0], q.shape[2]) != expected:
            raise SequenceParallelError(
                f"sequence-parallel attention got {q.shape[0]} x {q.shape[2]} tokens, but the "
                f"token metadata is for this rank's {expected[0]} x {expected[1]} of the last "
                "micro-batch: this model's attention is routed to sequence parallelism "
                f"(sp={self.size}). Run it through SequenceParallel.forward_loss (tessera's "
                "Trainer does), or save it (trainer.save_model) and load it back for a plain "
                "forward")

    def _multiple(self) -> int:
        return self.size * (2 if self.layout == "zigzag" else 1)


# Batch keys with one value per token, (B, T) as input_ids, which shard() splits alike.
PER_TOKEN_KEYS = ("labels", "position_ids", "attention_mask", "document_ids")


def _cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE, reduction="sum")


# ------------------------------------------------------------------------------ policies
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
