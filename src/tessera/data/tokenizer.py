"""Tokenizers that need nothing from a hub: bytes, or a BPE trained locally.

Byte-level tokenization maps each UTF-8 byte to its value (vocabulary 256) and works on any
text. A BPE tokenizer can be trained on the corpus itself with the `tokenizers` package (the
optional "hf" extra) and saved beside the run, so a resumed run reads the same ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Protocol

import numpy as np


class TokenizerError(ValueError):
    """A tokenizer could not be built or loaded; the message names the reason."""


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int

    def encode(self, text: bytes) -> np.ndarray:  # pragma: no cover - protocol
        """Token ids of raw text bytes, as a 1-D integer array."""

    def decode(self, ids: Iterable[int]) -> str:  # pragma: no cover - protocol
        """Text of token ids."""


class ByteTokenizer:
    """Each byte is a token: vocabulary 256, lossless, no training."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE trained locally with the `tokenizers` package."""

    name = "bpe"

    def __init__(self, backend) -> None:
        self._backend = backend
        self.vocab_size = backend.get_vocab_size()

    @classmethod
    def train(cls, files: list[Path], vocab_size: int, save_to: Path | None = None
              ) -> "BPETokenizer":
        """Train on text files; optionally save the tokenizer as JSON.

        Files are read as bytes and decoded as :meth:`encode` decodes them (invalid UTF-8
        replaced), so a corpus with a Latin-1 file trains instead of failing.
        """
        tokenizers = _import_tokenizers()
        backend = tokenizers.Tokenizer(tokenizers.models.BPE())
        backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size, show_progress=False,
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
        texts = (Path(f).read_bytes().decode("utf-8", errors="replace") for f in files)
        backend.train_from_iterator(texts, trainer)
        if save_to is not None:
            save_to.parent.mkdir(parents=True, exist_ok=True)
            backend.save(str(save_to))
        return cls(backend)

    @classmethod
    def load(cls, path: Path) -> "BPETokenizer":
        if not Path(path).is_file():
            raise TokenizerError(f"BPE tokenizer file {path} does not exist")
        return cls(_import_tokenizers().Tokenizer.from_file(str(path)))

    def encode(self, text: bytes) -> np.ndarray:
        ids = self._backend.encode(text.decode("utf-8", errors="replace")).ids
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return self._backend.decode([int(i) for i in ids])


def _import_tokenizers():
    try:
        import tokenizers
        import tokenizers.decoders  # noqa: F401  (submodules used above)
        import tokenizers.models  # noqa: F401
        import tokenizers.pre_tokenizers  # noqa: F401
        import tokenizers.trainers  # noqa: F401
    except ImportError as err:
        raise TokenizerError(
            "tokenizer=bpe needs the 'tokenizers' package: pip install 'tessera[hf]'") from err
    return tokenizers
