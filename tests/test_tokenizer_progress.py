import io

import numpy as np
from rich.console import Console

from tessera.data import BPETokenizer, list_text_files, resolve_corpus
from tessera.train.progress import ProgressReporter, format_record


def test_bpe_trains_locally_and_round_trips(tmp_path):
    files = list_text_files(resolve_corpus("stdlib"), (".py",))[:20]
    tok = BPETokenizer.train(files, vocab_size=600, save_to=tmp_path / "tok.json")
    text = "def main():\n    return 42\n"
    ids = tok.encode(text.encode())
    assert tok.decode(ids) == text
    assert 256 < tok.vocab_size <= 600 and len(ids) < len(text)  # merges shorten the text
    again = BPETokenizer.load(tmp_path / "tok.json")
    assert np.array_equal(again.encode(text.encode()), ids)


def test_bpe_trains_on_a_corpus_with_invalid_utf8(tmp_path):
    (tmp_path / "a.txt").write_bytes("caf\u00e9 def main(): return 42\n".encode("latin-1"))
    (tmp_path / "b.txt").write_text("def main():\n    return 42\n" * 20)
    tok = BPETokenizer.train(sorted(tmp_path.glob("*.txt")), vocab_size=300)
    text = "def main():\n    return 42\n"
    assert tok.decode(tok.encode(text.encode())) == text
    assert 256 < tok.vocab_size <= 300


def test_progress_lines_and_bar(capsys):
    lines = ProgressReporter(10, 0, "lines", enabled=True)
    lines.update(5, {"loss": 2.5, "tokens_per_s": 1500.0, "mfu": 0.25})
    assert "step 5/10 | loss 2.5000 | 1.5k tok/s | MFU 25.0%" in capsys.readouterr().out
    silent = ProgressReporter(10, 0, "lines", enabled=False)  # ranks other than 0
    silent.update(5, {"loss": 1.0})
    assert capsys.readouterr().out == ""
    bar = ProgressReporter(10, 2, "bar", enabled=True,
                           console=Console(file=io.StringIO(), force_terminal=True))
    bar.update(6, {"loss": 1.25})
    assert bar._progress.tasks[0].completed == 6
    assert "loss 1.2500" in bar._progress.tasks[0].fields["stats"]
    bar.close()
    assert format_record({"eval_loss": 1.5}) == "eval 1.5000"
