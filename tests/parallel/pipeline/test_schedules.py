"""Schedules as action lists: completeness, order, deadlock freedom, memory, refusals."""

from __future__ import annotations

import pytest

from tessera.parallel.pipeline.schedules import (ScheduleError, build, chunks_for, recomputes,
                                                 recompute_early)

CASES = [(name, pp, m) for name in ("gpipe", "1f1b", "interleaved", "scp")
         for pp in (2, 4) for m in (4, 8)]


def _simulate(actions: list[list]) -> int:
    """Run every rank's list with blocking waits for the neighbour's message; returns rounds.

    A forward of stage s > 0 waits for the forward of s-1; a backward waits for the backward
    of s+1 (or the forward of the last stage). Sends never block. Raises on deadlock.
    """
    n_stages = 1 + max(a.stage for rank in actions for a in rank)
    done, pos, rounds = set(), [0] * len(actions), 0
    while any(p < len(a) for p, a in zip(pos, actions)):
        progressed, seen = False, set(done)  # messages sent this round arrive next round
        for r, rank in enumerate(actions):
            if pos[r] == len(rank):
                continue
            a = rank[pos[r]]
            if a.kind == "F":
                ready = a.stage == 0 or ("F", a.stage - 1, a.mb) in seen
            else:
                ready = ("F", a.stage, a.mb) in done and (
                    a.stage == n_stages - 1 or ("B", a.stage + 1, a.mb) in seen)
            if ready:
                done.add((a.kind, a.stage, a.mb))
                pos[r] += 1
                progressed = True
        if not progressed:
            raise AssertionError(f"deadlock at {[rank[p] for rank, p in zip(actions, pos)]}")
        rounds += 1
    return rounds


@pytest.mark.parametrize("name,pp,m", CASES)
def test_every_forward_and_backward_once_and_no_deadlock(name, pp, m):
    actions = build(name, pp, m)
    n_stages = pp * chunks_for(name)
    for rank, rank_actions in enumerate(actions):
        want = {(k, s, mb) for k in "FB" for s in range(rank, n_stages, pp) for mb in range(m)}
        got = [(a.kind, a.stage, a.mb) for a in rank_actions]
        assert sorted(got) == sorted(want)
        for s, mb in {(s, mb) for _, s, mb in got}:
            assert got.index(("F", s, mb)) < got.index(("B", s, mb))
    _simulate(actions)


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8)])
def test_1f1b_holds_at_most_pp_minus_rank_micro_batches(pp, m):
    for rank, actions in enumerate(build("1f1b", pp, m)):
        live = peak = 0
        for a in actions:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        assert peak == pp - rank
    gpipe = build("gpipe", pp, m)[0]
    assert [a.kind for a in gpipe[:m]] == ["F"] * m  # GPipe holds all m


def test_bubble_shrinks_with_interleaving():
    # Rounds of the lock-step simulation approximate the step time in units of one action.
    # Rounds of the lock-step simulation approximate step time in actions; an interleaved
    # action is half a stage. 1F1B: 2 (m + pp - 1) rounds.
    one_f_one_b = _simulate(build("1f1b", 4, 8))
    assert one_f_one_b == 2 * (8 + 4 - 1)
    assert _simulate(build("interleaved", 4, 8)) / 2 < one_f_one_b


def test_too_few_micro_batches_are_refused_with_the_rule():
    with pytest.raises(ScheduleError, match="schedule=1f1b with pp=4 needs at least 4"):
        build("1f1b", 4, 2)
    with pytest.raises(ScheduleError, match="multiple of pp=4"):
        build("interleaved", 4, 6)
    assert build("gpipe", 4, 2)  # GPipe runs any count


def test_scp_recomputation_placement():
    s_count, m = 4, 8
    for stage in range(s_count):
        kept = [mb for mb in range(m) if not recomputes("scp", stage, s_count, mb, m, 1.0)]
        if stage == s_count - 1:
            assert kept == list(range(m))  # the last stage never recomputes
        else:
            assert kept == list(range(m - (s_count - 1 - stage), m))
        assert all(recomputes("1f1b", stage, s_count, mb, m, 1.0) for mb in range(m))
    assert recompute_early("scp") and not recompute_early("1f1b")
    # Stage S-2 runs its third forward before its first backward; others are plain 1F1B.
    scp, plain = build("scp", s_count, m), build("1f1b", s_count, m)
    swapped, unswapped = ([str(a) for a in acts[s_count - 2]] for acts in (scp, plain))
    assert swapped.index("2F2") < swapped.index("2B0")
    assert unswapped.index("2B0") < unswapped.index("2F2")
    assert scp[0] == plain[0] and scp[s_count - 1] == plain[s_count - 1]
    assert not recomputes("scp", 0, s_count, 0, m, 0.0)
    # Fewer kept when the partitioner says only that many fit 1F1B's memory.
    assert [recomputes("scp", 1, s_count, mb, m, 1.0, keep=1) for mb in range(m)] == [
        True] * 7 + [False]
    assert all(recomputes("scp", 0, s_count, mb, m, 1.0, keep=0) for mb in range(m))


def test_unbuilt_compositions_are_refused_by_name():
    from tessera.parallel.pipeline import _refuse_unsupported
    from tessera.strategy import Strategy, StrategyError

    with pytest.raises(StrategyError, match="pp=2 with memory=zero2: .* not built yet"):
        _refuse_unsupported(Strategy.parse("dp=2,pp=2,mbs=2,gbs=8,memory=zero2"))
    _refuse_unsupported(Strategy.parse("pp=2,precision=bf16"))  # accepted
    _refuse_unsupported(Strategy.parse("pp=2,precision=fp16"))  # one loss scale, all stages
    _refuse_unsupported(Strategy.parse("dp=2,pp=2,mbs=2,gbs=8,memory=chunk"))  # dp x pp x chunk
    # chunks in tensor- and sequence-parallel stages (tests/memory/test_chunk_pipeline_tp_sp.py)
    _refuse_unsupported(Strategy.parse("pp=2,tp=2,mbs=2,gbs=4,memory=chunk"))
    _refuse_unsupported(Strategy.parse("pp=2,sp=2,mbs=2,gbs=4,memory=chunk"))
