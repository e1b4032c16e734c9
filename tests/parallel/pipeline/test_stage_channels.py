"""Pipeline messages under NCCL's rules, simulated: every schedule completes on channels.

NCCL ignores tags: the n-th send between two ranks on a communicator meets the n-th receive
there, and one communicator's operations run in order on one stream, where an operation
blocks everything queued after it until its partner arrives. gloo (the CPU tests) matches by
tag and never blocks a queue, so a run on CPU cannot show an ordering fault; this simulation
replays the engine's own message plan (comm.message_plan) under NCCL's rules:

- each rank's compute runs its actions in order, an action once its message has arrived;
- each rank queues its operations per communicator in the order the engine posts them;
- the heads of a communicator's two queues complete together when one is a send whose data
  is computed and the other the receive of the same message (different messages: the data
  would land in the wrong buffer, a failure); two sends or two receives facing each other
  never complete, so the run deadlocks if nothing else can move.

On one channel per directed pair (what the engine uses) every schedule completes; on one
communicator per pair in both directions (what a single pp process group gives) 1F1B
deadlocks already at pp = 2, which is the fault the channels remove.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from tessera.parallel.pipeline.comm import channel_pairs, message_plan, source_stage
from tessera.parallel.pipeline.schedules import SCHEDULE_NAMES, build, chunks_for


def _queues(schedule: str, pp: int, m: int, shared: bool):
    """Per-rank actions, and per (rank, communicator) the queued (op, message, action index)."""
    actions = build(schedule, pp, m)
    n_stages = pp * chunks_for(schedule)
    stage_rank = [s % pp for s in range(n_stages)]

    def communicator(src: int, dst: int):
        return frozenset((src, dst)) if shared else (src, dst)

    queues = defaultdict(list)
    for rank, acts in enumerate(actions):
        for i, step in enumerate(message_plan(acts, n_stages)):
            for key in step.receives:
                src = stage_rank[source_stage(key, n_stages)]
                queues[(rank, communicator(src, rank))].append(("recv", key, i))
            if step.send is not None:
                dst = stage_rank[step.send[1]]
                queues[(rank, communicator(rank, dst))].append(("send", step.send, i))
    return actions, queues, stage_rank


def _run(schedule: str, pp: int, m: int, shared: bool) -> str:
    """'done', or what stopped the run ('deadlock' or 'mismatch: ...')."""
    actions, queues, _ = _queues(schedule, pp, m, shared)
    computed = [0] * pp  # actions finished per rank
    arrived: set = set()  # (rank, message) received
    heads = {q: 0 for q in queues}
    while True:
        moved = False
        for rank, acts in enumerate(actions):  # compute, as far as messages allow
            while computed[rank] < len(acts):
                a = acts[computed[rank]]
                needs = (a.kind, a.stage, a.mb)
                if any(op == "recv" and key == needs for (r, _), q in queues.items() if r == rank
                       for op, key, _ in q) and (rank, needs) not in arrived:
                    break
                computed[rank] += 1
                moved = True
        for (rank, comm), queue in queues.items():  # communicators, one pair at a time
            peer = next(r for r, c in queues if c == comm and r != rank)
            mine, theirs = queue, queues[(peer, comm)]
            if heads[(rank, comm)] == len(mine) or heads[(peer, comm)] == len(theirs):
                continue
            op, key, i = mine[heads[(rank, comm)]]
            peer_op, peer_key, j = theirs[heads[(peer, comm)]]
            if op != "send" or peer_op != "recv":
                continue  # the other orientation is visited from the peer's side
            if key != peer_key:
                return f"mismatch: {key} met {peer_key}"
            if computed[rank] > i:  # the send's data exists
                heads[(rank, comm)] += 1
                heads[(peer, comm)] += 1
                arrived.add((peer, key))
                moved = True
        if all(c == len(a) for c, a in zip(computed, actions)):
            return "done" if all(heads[q] == len(queues[q]) for q in queues) else "deadlock"
        if not moved:
            return "deadlock"


def _cases():
    """Every schedule at pp 2-5 over micro-batch counts it accepts (interleaving: multiples
    of pp; gpipe also fewer than pp)."""
    for name in SCHEDULE_NAMES:
        for pp in (2, 3, 4, 5):
            counts = {pp, 2 * pp, 3 * pp} if name == "interleaved" else {pp, pp + 1, 2 * pp, 8}
            counts |= {1} if name == "gpipe" else set()
            yield from ((name, pp, m) for m in sorted(counts))


CASES = list(_cases())


@pytest.mark.parametrize("schedule, pp, m", CASES)
def test_every_schedule_completes_on_directed_channels(schedule, pp, m):
    assert _run(schedule, pp, m, shared=False) == "done"


@pytest.mark.parametrize("schedule, pp, m", CASES)
def test_each_channel_carries_messages_in_the_order_its_receiver_posts_them(schedule, pp, m):
    _, queues, stage_rank = _queues(schedule, pp, m, shared=False)
    sent, received = defaultdict(list), defaultdict(list)
    for (rank, pair), queue in queues.items():
        for op, key, _ in queue:
            (sent if op == "send" else received)[pair].append(key)
    assert set(sent) == set(received) == set(channel_pairs(stage_rank))
    for pair in sent:
        assert sent[pair] == received[pair], pair


def test_one_communicator_per_pair_deadlocks_1f1b():
    """The fault the channels remove: at pp = 2 the first stage posts its first backward's
    receive before its second forward's send, and the last stage its second forward's
    receive before its first backward's send; on one stream each waits on the other."""
    assert _run("1f1b", 2, 4, shared=True) == "deadlock"
    assert _run("gpipe", 2, 4, shared=True) == "deadlock"
