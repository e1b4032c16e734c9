"""Hugging Face-style samples into tessera batches: the next-token shift, unused columns
dropped, and whether a dataset's labels are shifted already (tessera's own datasets)."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset

from tessera.data.dataset import collate
from tessera.data.stream import StreamList, StreamSamples, is_stream


def shift_for_next_token(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Turn a Hugging Face-style batch into tessera's: inputs t predict labels t+1.

    (B, T) input_ids and labels (or input_ids as labels) become (B, T-1) inputs and the
    labels one position later; positions masked out by ``attention_mask`` are ignored (-100).
    Other per-token keys (the mask, position ids) keep the inputs' positions; the layout then
    reads them or refuses them (``plan.fit_batch``), never drops them silently.

    Raises:
        ValueError: naming batch values that are not tensors (a collator's Python numbers,
            such as DataCollatorWithFlattening's flash-attention lengths).
    """
    loose = sorted(k for k, v in batch.items() if not isinstance(v, torch.Tensor))
    if loose:
        raise ValueError(
            f"the collator's batch holds {loose} as {[type(batch[k]).__name__ for k in loose]}"
            ", not tensors: tessera batches are tensors of input_ids, labels and what marks "
            "padding and documents. Drop those keys (DataCollatorWithFlattening: leave "
            "return_flash_attn_kwargs and return_seq_idx off; packed documents are kept apart "
            "from position_ids or document_ids, docs/sequence_parallel.md)")
    input_ids = batch["input_ids"]
    labels = batch.get("labels", input_ids).clone()
    if "attention_mask" in batch:
        labels[batch["attention_mask"] == 0] = -100
    out = {k: (v[:, :-1] if v.dim() >= 2 and v.shape[:2] == input_ids.shape else v)
           for k, v in batch.items()}
    out["labels"] = labels[:, 1:]
    return out


def hf_collator(user_collator: Callable[[list], dict] | None, shift: bool,
                columns: frozenset[str] | None = None) -> Callable[[list], dict]:
    """The user's collator (or tensor stacking), then the next-token shift when ``shift``.

    ``columns``: the sample keys to keep (Hugging Face's ``remove_unused_columns``: what the
    model's forward takes, and labels); the rest (a ``text`` column) are dropped first."""
    def collate_and_shift(samples: list) -> dict[str, torch.Tensor]:
        samples = [{k: torch.as_tensor(v) for k, v in s.items()
                    if columns is None or k in columns} for s in samples]
        batch = dict(user_collator(samples) if user_collator else collate(samples))
        return shift_for_next_token(batch) if shift else batch
    return collate_and_shift


def model_columns(model: nn.Module) -> frozenset[str]:
    """Sample keys a model can use, as Hugging Face's Trainer keeps them: the named
    parameters of its forward, labels, and what marks padding and documents for the loss
    (attention_mask, tessera's document_ids) whether the forward takes them or not."""
    names = inspect.signature(model.forward).parameters
    return frozenset(names) | {"labels", "input_ids", "attention_mask", "document_ids"}


def labels_shifted(train: Dataset, eval_dataset: Dataset | None = None) -> bool:
    """Whether the datasets hold labels already shifted (tessera's own), looking through
    torch's Subset and ConcatDataset wrappers.

    Raises:
        ValueError: when the two datasets (or a ConcatDataset's parts) disagree.
    """
    kinds = {_shifted(train)} | ({_shifted(eval_dataset)} if eval_dataset is not None else set())
    if len(kinds) > 1:
        raise ValueError("the datasets mix labels already shifted for the next token "
                         "(tessera's datasets) with Hugging Face-style ones (labels at the "
                         "input positions): give train and eval data of one kind")
    return kinds.pop()


def _shifted(dataset: Any) -> bool:
    if hasattr(dataset, "labels_shifted"):
        return bool(dataset.labels_shifted)
    if hasattr(dataset, "datasets"):  # ConcatDataset
        kinds = {_shifted(d) for d in dataset.datasets}
        if len(kinds) > 1:
            raise ValueError("a ConcatDataset mixes labels already shifted for the next token "
                             "with Hugging Face-style ones: concatenate data of one kind")
        return kinds.pop() if kinds else False
    if hasattr(dataset, "dataset"):  # Subset, random_split
        return _shifted(dataset.dataset)
    return False


def check_readable(name: str, dataset: Any) -> None:
    """Refuse what tessera cannot read: a dataset with ``len()`` and ``[i]`` (its sample order
    reads ``dataset[i]``, each dp rank its share) or an iterable one (read in order,
    :func:`readable`).

    Raises:
        ValueError: naming the argument, what it got and what to give instead.
    """
    if dataset is None or is_stream(dataset):  # a dict has len and [i]: not a stream
        return
    if isinstance(dataset, dict):
        way = ("training takes one set: give one split (e.g. dataset['train'])"
               if name == "train_dataset" else "give one set of samples here")
        raise ValueError(f"{name} is a dict of datasets ({', '.join(map(str, dataset))}): "
                         + way)
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ValueError(
            f"{name} is a {type(dataset).__name__}, which has no length and index and is not "
            "iterable: give a map-style dataset (len() and [i]; a datasets.Dataset, a list of "
            "samples, a torch Dataset) or an iterable one (a torch IterableDataset)")


def readable(name: str, dataset: Any, training: bool = False) -> Any:
    """``dataset`` as the trainer reads it: a map-style one as it is; an iterable training
    set as a stream read in order (``data/stream.py``); an iterable evaluation set read once
    into a list (each evaluation reads it whole, as Hugging Face's does; compared across
    ranks when first evaluated).

    Raises:
        ValueError: as :func:`check_readable`.
    """
    check_readable(name, dataset)
    if dataset is None or not is_stream(dataset):
        return dataset
    return StreamSamples(dataset) if training else StreamList(dataset)
