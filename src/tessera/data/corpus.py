"""Text corpora on disk: any folder of text files, read in a fixed order.

The default corpus is the Python standard library's own sources, which every machine with
Python has, so the main job trains on real text without downloading anything.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from tessera.data.tokenizer import Tokenizer

DEFAULT_EXTENSIONS = (".py", ".txt", ".md", ".rst")
STDLIB = "stdlib"


class DataError(ValueError):
    """The corpus or dataset cannot be used; the message names the path or field and the rule."""


def resolve_corpus(corpus: str | Path) -> Path:
    """The folder a corpus name points at ("stdlib" is the Python standard library)."""
    if str(corpus) == STDLIB:
        return Path(sysconfig.get_paths()["stdlib"])
    return Path(corpus).expanduser()


def list_text_files(folder: Path, extensions: tuple[str, ...] = DEFAULT_EXTENSIONS
                    ) -> list[Path]:
    """Text files under ``folder`` with one of ``extensions``, in a stable sorted order.

    Raises:
        DataError: if the folder is missing, is not a folder, or holds no such non-empty file.
    """
    if not folder.exists():
        raise DataError(f"data.corpus: folder {folder} does not exist")
    if not folder.is_dir():
        raise DataError(f"data.corpus: {folder} is not a folder")
    files = sorted(p for p in folder.rglob("*")
                   if p.suffix in extensions and p.is_file() and p.stat().st_size > 0)
    if not files:
        raise DataError(f"data.corpus: folder {folder} holds no non-empty file ending in "
                        f"{', '.join(extensions)}")
    return files


def read_corpus_bytes(files: list[Path], max_bytes: int | None) -> list[bytes]:
    """Contents of ``files`` in order, stopping once ``max_bytes`` have been read."""
    texts, total = [], 0
    for path in files:
        data = path.read_bytes()
        if max_bytes is not None and total + len(data) > max_bytes:
            data = data[: max_bytes - total]
        texts.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    return texts


def tokenize_corpus(texts: list[bytes], tokenizer: Tokenizer) -> np.ndarray:
    """One flat token array: each document's tokens, documents separated by a blank line."""
    separator = tokenizer.encode(b"\n\n")
    parts = []
    for text in texts:
        parts += [tokenizer.encode(text), separator]
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return tokens.astype(np.int32 if tokenizer.vocab_size > 255 else np.uint8, copy=False)
