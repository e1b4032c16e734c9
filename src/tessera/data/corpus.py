"""Text corpora on disk: any folder of text files, read in a fixed order.

The default corpus is the Python standard library's own sources, which every machine with
Python has, so the main job trains on real text without downloading anything.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Iterator
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
    return list(iter_text_files(folder, extensions))


def iter_text_files(folder: Path, extensions: tuple[str, ...] = DEFAULT_EXTENSIONS
                    ) -> Iterator[Path]:
    """The files of :func:`list_text_files`, in the same order, found as they are read.

    A run reading only its first ``max_bytes`` then lists only the folders it reads from
    (the standard library corpus holds ~60k entries; listing them all took 2 s per worker).

    Raises:
        DataError: as :func:`list_text_files`, once the walk ends with no file found.
    """
    if not folder.exists():
        raise DataError(f"data.corpus: folder {folder} does not exist")
    if not folder.is_dir():
        raise DataError(f"data.corpus: {folder} is not a folder")
    found = False
    for path in _walk_sorted(folder):
        if path.suffix in extensions and path.is_file() and path.stat().st_size > 0:
            found = True
            yield path
    if not found:
        raise DataError(f"data.corpus: folder {folder} holds no non-empty file ending in "
                        f"{', '.join(extensions)}")


def _walk_sorted(folder: Path) -> Iterator[Path]:
    """Every path under ``folder`` in ``sorted(folder.rglob("*"))`` order: a depth-first walk
    with each folder's entries sorted by name gives the order of sorted path parts.
    Symbolic links to folders are listed but not entered, as rglob does."""
    try:
        with os.scandir(folder) as entries:
            names = sorted((entry.name, entry.is_dir(follow_symlinks=False))
                           for entry in entries)
    except PermissionError:
        return
    for name, is_dir in names:
        path = folder / name
        yield path
        if is_dir:
            yield from _walk_sorted(path)


def read_corpus_bytes(files: Iterable[Path], max_bytes: int | None) -> list[bytes]:
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
