"""Build a run from its config: model, tokenizer, datasets, trainer; then train.

This is what each worker does under ``tessera train``, and what the Python API calls.
"""

from __future__ import annotations

import contextlib
import json

import os
from pathlib import Path

import torch
from torch import nn

from tessera.config import RunConfig
from tessera.data import (BPETokenizer, ByteTokenizer, TokenDataset, iter_text_files,
                          list_text_files, read_corpus_bytes, resolve_corpus)
from tessera.data.corpus import STDLIB, DataError, tokenize_corpus
from tessera.data.dataset import Subset
from tessera.models import Transformer
from tessera.models.hf import build_hf_model, hf_config_from_reference
from tessera.train.trainer import Trainer, TrainResult


def build_model(config: RunConfig, vocab_size: int | None = None) -> nn.Module:
    """The model the config names, seeded by ``train.seed`` so every rank builds the same one;
    on the meta device with ``model.on_meta`` (the Trainer materialises it)."""
    model_config = config.model.build_config()
    if vocab_size is not None and vocab_size != model_config.vocab_size:
        model_config = model_config.replace(vocab_size=vocab_size)
    torch.manual_seed(config.train.seed)
    with torch.device("meta") if config.model.on_meta else contextlib.nullcontext():
        if config.model.hf is None:
            return Transformer(model_config)
        return build_hf_model(config.model.hf, **hf_config_from_reference(config.model.hf,
                                                                           model_config))


def tokenizer_path(config: RunConfig) -> Path:
    return Path(config.train.output_dir) / "tokenizer.json"


def build_tokenizer(config: RunConfig, files: list[Path] | None = None):
    """Bytes, or the run's BPE tokenizer (trained on the corpus once, then reused).

    The recipe it was trained by (vocabulary size, corpus, extensions) is written beside it;
    a run asking for another is refused rather than given the old tokenizer.

    Raises:
        DataError: naming the settings that differ from the saved tokenizer's.
    """
    if config.data.tokenizer == "byte":
        return ByteTokenizer()
    path = tokenizer_path(config)
    recipe = _tokenizer_recipe(config)
    recipe_file = path.with_name("tokenizer_recipe.json")
    if path.is_file():
        _check_recipe(recipe_file, recipe, path)
        return BPETokenizer.load(path)
    files = files or list_text_files(resolve_corpus(config.data.corpus), config.data.extensions)
    tokenizer = BPETokenizer.train(files, config.data.bpe_vocab_size, save_to=path)
    recipe_file.write_text(json.dumps(recipe, indent=2, sort_keys=True))
    return tokenizer


def _tokenizer_recipe(config: RunConfig) -> dict:
    corpus = config.data.corpus
    # A named corpus by its name: "stdlib" moves with the interpreter, its text does not.
    return {"bpe_vocab_size": config.data.bpe_vocab_size,
            "corpus": corpus if corpus == STDLIB else str(resolve_corpus(corpus).resolve()),
            "extensions": sorted(config.data.extensions)}


def _check_recipe(recipe_file: Path, recipe: dict, path: Path) -> None:
    """Refuse a saved tokenizer trained by another recipe (one saved before recipes were
    written, 2026-11-28, is taken as it is)."""
    if not recipe_file.is_file():
        return
    saved = json.loads(recipe_file.read_text())
    diffs = [f"data.{k}: saved {saved.get(k)!r} vs now {v!r}" for k, v in recipe.items()
             if saved.get(k) != v]
    if diffs:
        raise DataError(f"{path} was trained with other settings ({'; '.join(diffs)}): a run "
                        "in this output_dir uses its tokenizer (a checkpoint's vocabulary "
                        "depends on it); set them back, or use another train.output_dir")


def build_datasets(config: RunConfig, tokenizer) -> tuple[Subset, Subset | None]:
    """(train, eval) datasets over the configured corpus.

    Raises:
        DataError: naming the corpus when it is missing, empty or too small for one batch.
    """
    folder = resolve_corpus(config.data.corpus)
    texts = read_corpus_bytes(iter_text_files(folder, config.data.extensions),
                              config.data.max_bytes)
    dataset = TokenDataset(tokenize_corpus(texts, tokenizer), config.data.seq_len)
    train, val = dataset.split(config.data.val_fraction)
    if len(train) < config.strategy.global_batch_size:
        raise DataError(f"data.corpus {folder} gives {len(train)} training samples of "
                        f"seq_len={config.data.seq_len}: fewer than one global batch "
                        f"(gbs={config.strategy.global_batch_size})")
    return train, (val if len(val) else None)


def run_training(config: RunConfig) -> TrainResult:
    """Train as the config says (call in every worker).

    When torchrun restarts failed workers (``--max-restarts``), the restarted workers resume
    from the newest complete checkpoint instead of starting over.
    """
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and not config.train.resume:
        config = config.model_copy(update={
            "train": config.train.model_copy(update={"resume": True})})
    tokenizer = build_tokenizer(config)
    train, val = build_datasets(config, tokenizer)
    model = build_model(config, vocab_size=max(tokenizer.vocab_size,
                                               config.model.build_config().vocab_size))
    trainer = Trainer(model, config.train, train, val, strategy=config.strategy,
                      run_info={"config": config.to_dict()}, memory=config.memory)
    return trainer.train()
