"""The stage-budget length warning compares what each rank runs, not whole samples.

Under sequence parallelism a sample longer than the budget's planning length may pad to the
same share of tokens per rank (zigzag pads to a multiple of 2 x sp): its stages keep no
more than the budget's estimate, so no warning.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

from torch import nn

from tessera.parallel.pipeline.engine import PipelineEngine
from tessera.parallel.sequence.staged import StageInputs


def _warnings_at(lengths: list[int], planned: int, inputs) -> list[str]:
    local_len = inputs.local_len if inputs is not None else (lambda n: n)
    engine = SimpleNamespace(pipe=SimpleNamespace(budget_len=planned, local_len=local_len),
                             _warned_length=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for length in lengths:
            PipelineEngine._check_budget_length(engine, length)
    return [str(w.message) for w in caught]


def test_zigzag_shares_count_per_rank_and_warn_once():
    inputs = StageInputs(SimpleNamespace(size=2, layout="zigzag", token_ways=1),
                         nn.Linear(1, 1))
    assert [inputs.local_len(n) for n in (125, 128, 129)] == [64, 64, 66]
    # tp_seq=on over tp=4 within each sp rank: 129 pads to 136 (68 a rank, 17 a tp rank)
    split = StageInputs(SimpleNamespace(size=2, layout="zigzag", token_ways=4), nn.Linear(1, 1))
    assert [split.local_len(n) for n in (125, 128, 129)] == [64, 64, 68]
    assert _warnings_at([126, 128], planned=126, inputs=inputs) == []  # both 64 per rank
    warned = _warnings_at([129, 200], planned=126, inputs=inputs)
    assert len(warned) == 1 and "129 tokens per sample" in warned[0]


def test_without_sp_any_longer_sample_warns():
    assert _warnings_at([12], planned=12, inputs=None) == []
    assert len(_warnings_at([13], planned=12, inputs=None)) == 1
