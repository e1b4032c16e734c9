import numpy as np
import pytest

from tessera.data import (ByteTokenizer, DataError, GlobalBatchOrder, TokenDataset,
                          iter_text_files, list_text_files, read_corpus_bytes,
                          resolve_corpus)
from tessera.data.corpus import tokenize_corpus


def test_byte_tokenizer_round_trips():
    tok = ByteTokenizer()
    text = "héllo, wörld\n".encode()
    assert tok.decode(tok.encode(text)) == text.decode()


def test_stdlib_is_the_default_corpus():
    files = list_text_files(resolve_corpus("stdlib"), (".py",))
    assert len(files) > 100 and files == sorted(files)


def test_corpus_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match=f"folder {tmp_path / 'nope'} does not exist"):
        list_text_files(tmp_path / "nope")
    with pytest.raises(DataError, match="holds no non-empty file"):
        list_text_files(tmp_path)
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(DataError, match="holds no non-empty file"):
        list_text_files(tmp_path)


def test_files_come_in_sorted_path_order_found_lazily(tmp_path):
    # A folder's files come before a sibling whose name extends the folder's ("a/b.py" before
    # "a b/y.py" and "a.py"); hidden folders and upper case sort by code point; a link to a
    # folder is not entered (as rglob does not).
    for name in ["a/b.py", "a.py", "a-b/c.py", "A/x.py", "a b/y.py", "ab.py", ".h/z.py",
                 "a/b/c.txt", "skip.bin"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "a", target_is_directory=True)
    rglob = sorted(p for p in tmp_path.rglob("*")
                   if p.suffix in (".py", ".txt") and p.is_file() and p.stat().st_size > 0)
    assert list_text_files(tmp_path, (".py", ".txt")) == rglob
    assert [p.relative_to(tmp_path).as_posix() for p in rglob] == [
        ".h/z.py", "A/x.py", "a/b/c.txt", "a/b.py", "a b/y.py", "a-b/c.py", "a.py", "ab.py"]
    # Reading the first bytes walks no further than it reads.
    files = iter_text_files(tmp_path, (".py", ".txt"))
    assert next(files) == rglob[0]


def test_read_stops_at_max_bytes(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text("x" * 100)
    texts = read_corpus_bytes(list_text_files(tmp_path), max_bytes=250)
    assert [len(t) for t in texts] == [100, 100, 50]


def test_samples_are_shifted_windows():
    tokens = np.arange(21, dtype=np.int32)
    ds = TokenDataset(tokens, seq_len=5)
    assert len(ds) == 4
    sample = ds[1]
    assert sample["input_ids"].tolist() == [5, 6, 7, 8, 9]
    assert sample["labels"].tolist() == [6, 7, 8, 9, 10]
    train, val = ds.split(0.25)
    assert (len(train), len(val)) == (3, 1)
    assert val[0]["input_ids"].tolist() == ds[3]["input_ids"].tolist()


def test_batch_order_is_deterministic_and_covers_each_epoch():
    order = GlobalBatchOrder(num_samples=10, global_batch_size=4, seed=3)
    again = GlobalBatchOrder(num_samples=10, global_batch_size=4, seed=3)
    first = np.concatenate([order.global_batch(s) for s in range(5)])  # 20 = 2 epochs
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:]) == list(range(10))
    # Asking for step 3 directly (a resume) gives the same samples as running up to it.
    assert again.global_batch(3).tolist() == first[12:16].tolist()
    assert not np.array_equal(first[:10], first[10:])  # epochs are reshuffled


def test_dp_ranks_partition_the_global_batch():
    order = GlobalBatchOrder(num_samples=50, global_batch_size=8, seed=0)
    for dp in (1, 2, 4, 8):
        parts = [order.rank_batch(6, r, dp) for r in range(dp)]
        assert np.concatenate(parts).tolist() == order.global_batch(6).tolist()


def test_tokenize_corpus_separates_documents():
    tokens = tokenize_corpus([b"ab", b"cd"], ByteTokenizer())
    assert bytes(tokens.tolist()) == b"ab\n\ncd\n\n"


def test_batch_order_continues_at_the_sample_when_gbs_changes():
    before = GlobalBatchOrder(num_samples=50, global_batch_size=4, seed=1)
    stream = np.concatenate([before.global_batch(s) for s in range(10)])  # 40 samples
    # Two steps at gbs=4 (8 samples), then a resume at step 2 with gbs=8.
    after = GlobalBatchOrder(50, 8, 1, start_step=2, start_sample=8)
    assert after.samples_before(2) == 8 and after.samples_before(4) == 24
    assert after.global_batch(2).tolist() == stream[8:16].tolist()
    assert after.global_batch(3).tolist() == stream[16:24].tolist()
