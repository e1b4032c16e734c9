"""Data: tokenizers, corpora on disk, fixed-length samples, deterministic batch order."""

from tessera.data.corpus import (DataError, iter_text_files, list_text_files, read_corpus_bytes,
                                 resolve_corpus)
from tessera.data.dataset import GlobalBatchOrder, Subset, TokenDataset, collate
from tessera.data.tokenizer import BPETokenizer, ByteTokenizer, TokenizerError

__all__ = ["BPETokenizer", "ByteTokenizer", "DataError", "GlobalBatchOrder", "Subset",
           "TokenDataset", "TokenizerError", "collate", "iter_text_files", "list_text_files",
           "read_corpus_bytes", "resolve_corpus"]
