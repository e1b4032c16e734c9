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


def test_a_saved_bpe_tokenizer_of_other_settings_is_refused_not_reused(tmp_path):
    import pytest

    from tessera.config import load_config
    from tessera.data import DataError
    from tessera.run import build_tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def main():\n    return 42\n" * 50)

    def config(vocab):
        return load_config(None, [f"train.output_dir={tmp_path / 'out'}",
                                  f"data.corpus={corpus}", "data.tokenizer=bpe",
                                  f"data.bpe_vocab_size={vocab}"])

    first = build_tokenizer(config(300))
    assert build_tokenizer(config(300)).vocab_size == first.vocab_size  # reused as trained
    # Until 2026-11-28 the 300-token tokenizer was reused for a run asking for 600, while
    # the run's config said 600.
    with pytest.raises(DataError, match="data.bpe_vocab_size: saved 300 vs now 600"):
        build_tokenizer(config(600))


def test_the_stdlib_corpus_is_recorded_by_name_not_by_the_interpreter_s_path():
    from tessera.config import load_config
    from tessera.run import _tokenizer_recipe

    recipe = _tokenizer_recipe(load_config(None, ["data.corpus=stdlib"]))
    assert recipe["corpus"] == "stdlib"  # a new venv or Python patch release moves the path
