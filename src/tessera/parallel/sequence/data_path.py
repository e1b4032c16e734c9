"""The sequence-parallel data path: each sp rank runs the whole model on its own L/sp tokens.

Embeddings, norms and MLPs are local; only attention talks to the other ranks.
:class:`SequenceParallel` owns that:

- ``shard(batch)``: pads the sequence if needed, picks this rank's tokens (zigzag or
  contiguous, see layout.py), and gives their real position ids and attention metadata;
- ``forward_loss(module, batch)``: runs the model on the shard with its attention switched to
  the chosen mode, and returns a loss whose average over the sp ranks is the micro-batch's
  mean token loss (sum of local losses / the whole sequence's token count, times sp);
- ``attention(q, k, v)``: what the model's attention hook calls (policy.py installs it).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.parallel.plan import labels_without_padding
from tessera.parallel.sequence.compose import TokenLoss
from tessera.parallel.sequence.dropout import AttentionDropout
from tessera.parallel.sequence.layout import (SequenceParallelError, check_layout,
                                              length_multiple, local_indices,
                                              padded_length)
from tessera.parallel.sequence.ring import ring_attention
from tessera.parallel.sequence.rsa import rsa_attention
from tessera.parallel.sequence.ulysses import ulysses_attention

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
        token_ways: how many ways Megatron sequence parallelism (tp_seq=on) splits this
            rank's tokens again between the layers: each rank's tokens are padded to a
            multiple of it.

    Raises:
        SequenceParallelError: for an unknown mode or zigzag without a causal mask.
    """

    def __init__(self, group: dist.ProcessGroup, mode: str = "ring", causal: bool = True,
                 layout: str | None = None, pad: bool = True,
                 token_loss: TokenLoss | None = None, head_ways: int = 1,
                 head_rank: int = 0, token_ways: int = 1) -> None:
        if mode not in MODES:
            raise SequenceParallelError(f"sp_mode must be one of {', '.join(MODES)}; got {mode!r}")
        self.group, self.mode, self.causal, self.pad = group, mode, causal, pad
        self.token_loss, self.head_ways = token_loss or _cross_entropy_sum, head_ways
        self.head_rank, self.token_ways = head_rank, token_ways
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.layout = layout or ("zigzag" if mode == "ring" and causal else "contiguous")
        check_layout(self.layout, causal)
        self._meta: torch.Tensor | None = None
        self.exportable = False  # set by StageInputs (staged.py) when pp > 1
        self.dropouts: list[str] = []  # what draws dropout masks in the model (apply_policy)
        # position ids from the attention mask, as the model numbers them (POSITIONS_FROM_MASK)
        self.positions_from_mask = False
        # A Hugging Face model's config, where its masking reads packed documents from
        # restarting position_ids (_documents_from_positions); None: it does not
        self.packed_rows_config = None
        self._warned_packed = False
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
        padded = padded_length(T, self.size, self.layout, self.token_ways)
        if padded != T and not self.pad:
            raise SequenceParallelError(
                f"sequence length {T} must be divisible by {self._multiple()} "
                f"(sp={self.size}, layout={self.layout}{self._ways_text()}) when padding is "
                "disabled")
        index = torch.arange(padded, device=ids.device).expand(B, padded)  # (B, T')
        segment = self._documents(batch)
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

    def _documents(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each token's document (B, T), -1 on padding: ``document_ids`` when given; else,
        where the model is a Hugging Face one whose masking reads packed rows from their
        position ids (:meth:`_documents_from_positions`) and the batch has them without an
        attention_mask, those documents; else one document a row."""
        ids = batch["input_ids"]
        if "document_ids" in batch:
            segment = batch["document_ids"]
        elif "position_ids" in batch and "attention_mask" not in batch:
            segment = self._documents_from_positions(batch["position_ids"])
        else:
            segment = torch.zeros_like(ids)
        if "attention_mask" in batch:
            segment = segment.masked_fill(batch["attention_mask"] == 0, -1)
        return segment

    def _documents_from_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Documents (B, T) of rows packed as DataCollatorWithFlattening packs them: a new one
        wherever the position ids do not go up by one. Read as transformers' masking reads
        them on one device: only without a cache (``use_cache=False``: with a cache it masks
        causally across the whole row, and so does this, saying so once)."""
        config = self.packed_rows_config
        if config is None:
            return torch.zeros_like(positions)  # one document a row
        steps = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
        documents = (steps != 1).long().cumsum(dim=-1)
        if not bool((documents[:, -1] > 0).any()):
            return torch.zeros_like(documents)  # one document a row
        if not getattr(config, "use_cache", False):
            return documents
        if not self._warned_packed:
            self._warned_packed = True
            warnings.warn(
                "tessera: position_ids restart inside a row (packed documents, as "
                "DataCollatorWithFlattening makes them) but the model's config has "
                "use_cache=True, under which transformers attends across the documents (its "
                "masking reads them only without a cache); sequence parallelism does the "
                "same. Set model.config.use_cache = False, or give document_ids, to keep "
                "each document to itself", stacklevel=4)
        return torch.zeros_like(documents)

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
        return length_multiple(self.size, self.layout, self.token_ways)

    def _ways_text(self) -> str:
        return (f", each rank's tokens split {self.token_ways} ways again by tp_seq=on"
                if self.token_ways > 1 else "")


# Batch keys with one value per token, (B, T) as input_ids, which shard() splits alike.
PER_TOKEN_KEYS = ("labels", "position_ids", "attention_mask", "document_ids")


def _cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE, reduction="sum")
