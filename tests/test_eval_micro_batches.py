"""Which evaluation samples each data-parallel rank reads (train/evaluation.py)."""

from collections import Counter

import pytest

from tessera.train.evaluation import eval_micro_batches


@pytest.mark.parametrize("n, gbs, dp, mbs", [(10, 8, 2, 4), (7, 4, 1, 2), (16, 8, 2, 2),
                                             (3, 8, 4, 2)])
def test_the_whole_set_counts_each_sample_once(n, gbs, dp, mbs):
    counted = Counter()
    for rank in range(dp):
        for indices, real in eval_micro_batches(n, gbs, dp, rank, mbs, batches=0):
            assert len(indices) == mbs and 0 <= real <= mbs  # every micro-batch full-shaped
            counted.update(indices[:real])
    assert counted == Counter(range(n))


def test_a_fixed_number_of_batches_wraps_and_counts_everything():
    parts = [list(eval_micro_batches(5, 4, 2, rank, 1, batches=2)) for rank in range(2)]
    assert [i for i, _ in parts[0]] == [[0], [1], [4], [0]]  # batch 1 wraps: 4, 5 -> 0, ...
    assert [i for i, _ in parts[1]] == [[2], [3], [1], [2]]
    assert all(real == 1 for rank in parts for _, real in rank)
