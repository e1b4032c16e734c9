"""Unit checks of chunk memory that need no training run: states, size search, refusals."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from tessera.config import ConfigError, config_from_dict
from tessera.memory import (LEGAL_TRANSITIONS, ChunkManager, DiskTierError,
                            IllegalTransitionError, MemoryBudgetError, MemoryOptions,
                            TensorState)
from tessera.memory.chunk import (Kind, pack, rank_peak_elements, search_chunk_size,
                                  wasted_elements)
from tessera.memory.tiers import Tier, parse_bytes
from tessera.memory.tracer import MemoryTracer

S = TensorState


def _manager(**options) -> ChunkManager:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    return ChunkManager(model, MemoryOptions(**options), torch.device("cpu"))


def test_every_legal_transition_runs_and_an_illegal_one_raises():
    manager = _manager(chunk_size=1024)
    slot = manager.chunks[0].slots[0]
    assert slot.state is S.HOLD
    # A walk that takes each of the 13 legal edges at least once.
    walk = [S.COMPUTE, S.HOLD_AFTER_FWD, S.COMPUTE, S.HOLD_AFTER_BWD, S.COMPUTE, S.HOLD,
            S.FREE, S.COMPUTE, S.HOLD_AFTER_FWD, S.FREE, S.HOLD, S.COMPUTE, S.HOLD_AFTER_FWD,
            S.HOLD, S.COMPUTE, S.HOLD_AFTER_BWD, S.HOLD, S.COMPUTE, S.HOLD_AFTER_BWD, S.FREE]
    for state in walk:
        manager._set_state(slot, state)
    assert set(manager.log.seen) == set(LEGAL_TRANSITIONS)
    manager._set_state(slot, S.COMPUTE)
    with pytest.raises(IllegalTransitionError, match="COMPUTE -> FREE"):
        manager._set_state(slot, S.FREE)  # releasing a tensor in use would corrupt compute
    assert slot.state is S.COMPUTE
    illegal = [(a, b) for a in S for b in S if a is not b and (a, b) not in LEGAL_TRANSITIONS]
    assert len(illegal) == 7  # 20 ordered pairs, 13 legal


def test_parameters_are_views_into_chunks():
    manager = _manager(chunk_size=1024)
    chunk = manager.chunks[0]
    payload = chunk.payload[Kind.PARAM]
    for slot in chunk.slots:
        assert slot.param.data.untyped_storage().data_ptr() == \
            payload.untyped_storage().data_ptr()


def test_size_search_minimises_the_rank_peak_and_big_tensors_get_their_own_chunk():
    rng = random.Random(3)
    numels = [rng.choice([64, 4096, 16384, 300, 12288]) for _ in range(40)]
    largest = -(-max(numels) // 64) * 64
    sizes = range(largest, largest + 64 * 64, 64)
    # One rank: the least padding.
    best = search_chunk_size(numels, world=1, align=64)
    assert wasted_elements(numels, best, 1, 64) <= min(wasted_elements(numels, c, 1, 64)
                                                       for c in sizes)
    # ZeRO over 2 ranks: padding in every kind plus the gathered group, least of the
    # candidates (64 steps of 1/16 of the largest tensor).
    best = search_chunk_size(numels, world=2, align=64)
    candidates = range(largest, largest + 64 * 1024, 1024)
    assert rank_peak_elements(numels, best, 2, 64) == min(rank_peak_elements(numels, c, 2, 64)
                                                          for c in candidates)
    # A larger chunk wasting less padding can still hold more at the peak (a bigger group).
    assert rank_peak_elements(numels, largest * 4, 2, 64) > rank_peak_elements(numels, best, 2, 64)
    chunks = pack([100, 5000, 100], capacity=1000, align=256)
    assert chunks == [(1000, [0]), (5120, [1]), (1000, [2])]


def test_budget_too_small_for_one_chunk_is_refused_naming_the_minimum():
    with pytest.raises(MemoryBudgetError, match=r"needs at least \d+ bytes"):
        _manager(chunk_size=1024, device_budget=1000)


def test_tier_budget_is_enforced_and_accounted():
    tier = Tier("device", torch.device("cpu"), budget=4096)
    a = tier.allocate(512, torch.float32)
    tier.nonmodel = 1024
    with pytest.raises(MemoryBudgetError, match="exceed its budget of 4096"):
        tier.allocate(512, torch.float32)
    tier.free(a)
    tier.allocate(512, torch.float32)
    assert tier.peak <= 4096 and tier.used == 2048


def test_a_payload_handed_out_for_use_waits_for_its_prefetch(monkeypatch):
    """On CUDA a prefetch copies a chunk in on a side stream; a later place() of the same
    chunk to the same tier (the ZeRO all-gather, the optimizer) must join that copy before
    the payload is read, or NCCL sends a half-copied buffer. CPU copies are synchronous, so
    this checks the call the join rides on: place() waits unless it is itself a prefetch."""
    manager = _manager()
    chunk = manager.chunks[0]
    waited = []
    monkeypatch.setattr(manager, "wait", lambda c, kind: waited.append((c.index, kind)))
    here = chunk.tier[Kind.PARAM]
    manager.place(chunk, Kind.PARAM, here, set(), prefetch=True)
    assert waited == []  # a prefetch does not block on another
    assert manager.place(chunk, Kind.PARAM, here, set()) is chunk.payload[Kind.PARAM]
    assert waited == [(chunk.index, Kind.PARAM)]


def test_disk_dir_missing_read_only_or_too_small_is_refused(tmp_path):
    for directory, message in [(tmp_path / "missing", "does not exist"),
                               (Path("/proc"), "not writable")]:
        with pytest.raises(DiskTierError, match=message):
            ChunkManager(nn.Linear(2, 2), MemoryOptions(disk_dir=str(directory)),
                         torch.device("cpu"), offload=("cpu", "disk"))
    from tessera.memory.tiers import check_disk_dir
    with pytest.raises(DiskTierError, match="bytes free"):
        check_disk_dir(tmp_path, need_bytes=10 ** 18)


def test_tracer_next_use_and_reserve():
    tracer = MemoryTracer(torch.device("cpu"))
    for label, key, saved in [("a", 1, 100), ("b", 2, 300), ("c", 1, 50)]:
        tracer.tick(label, 0)
        tracer.access(key)
        tracer.grow(id(label), saved)
    tracer.end_iteration()
    assert tracer.period == 3
    assert tracer.next_use(1, 0) == 2 and tracer.next_use(1, 2) == 1  # wraps to next iteration
    assert tracer.next_use(2, 1) == 3 and tracer.next_use(99, 0) == float("inf")
    assert tracer.reserve(0) == 400  # moments 0 and 1: peak live 400 at moment 1


def test_memory_config_section_is_checked():
    base = {"strategy": "dp=1,mbs=1,gbs=1,memory=chunk,offload=cpu"}
    config = config_from_dict({**base, "memory": {"device_budget": "2MiB"}})
    assert config.memory.device_budget == 2 * 2 ** 20 and parse_bytes("1.5kb") == 1500
    for raw, message in [
        ({"memory": {"placement": "static"}}, "apply to strategy memory=chunk"),
        ({"strategy": "dp=1,mbs=1,gbs=1,memory=chunk", "memory": {"placement": "static"}},
         "needs offload=cpu"),
        ({"strategy": "dp=1,mbs=1,gbs=1,memory=chunk,offload=cpu+disk"}, "needs memory.disk_dir"),
        ({**base, "memory": {"device_budget": "lots"}}, "device_budget: must be bytes"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config_from_dict(raw)


def test_reduce_scatter_reads_back_a_gradient_chunk_evicted_to_disk(tmp_path):
    # A rank's own gradient chunk may be spilled to disk between its last gradient and the
    # reduce-scatter (host budget full); it must be read back, not taken as zeros.
    manager = ChunkManager(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)),
                           MemoryOptions(disk_dir=str(tmp_path)), torch.device("cpu"),
                           offload=("cpu", "disk"))
    chunk = manager.chunks[0]
    grad = manager.alloc(chunk, Kind.GRAD, "host", set())
    grad.copy_(torch.arange(chunk.capacity, dtype=grad.dtype))
    manager.place(chunk, Kind.GRAD, "disk", set())
    assert Kind.GRAD not in chunk.payload  # on disk only
    manager.zero.reduce_scatter(manager, chunk.index)  # one rank: the mean is the gradient
    assert torch.equal(chunk.payload[Kind.GRAD],
                       torch.arange(chunk.capacity, dtype=grad.dtype))
    assert chunk.tier[Kind.GRAD] == "host"  # read back, not a fresh zeroed payload


def test_a_full_host_with_a_disk_tier_names_the_bytes_in_use_not_a_missing_tier(tmp_path):
    from tessera.memory.manager import HOST

    manager = ChunkManager(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)),
                           MemoryOptions(chunk_size=256, host_budget=4096,
                                         disk_dir=str(tmp_path)),
                           torch.device("cpu"), offload=("cpu", "disk"))
    chunk = manager.chunks[0]
    manager.place(chunk, Kind.PARAM, HOST, set())
    held = manager.host.used
    in_use = {(chunk.index, Kind.PARAM)}  # being computed: it may not spill
    with pytest.raises(MemoryBudgetError, match=rf"host_budget=4096 bytes is full: its {held} "
                                                rf"bytes of chunks in use now cannot spill to "
                                                rf"disk and 4000 more are needed; raise it to "
                                                rf"at least {held + 4000}"):
        manager._make_room(HOST, 4000, in_use)
    manager._make_room(HOST, 4000, set())  # not in use: it spills to disk
    assert chunk.tier[Kind.PARAM] == "disk"
    without_disk = ChunkManager(nn.Linear(8, 16), MemoryOptions(host_budget=64),
                                torch.device("cpu"), offload=("cpu",))
    with pytest.raises(MemoryBudgetError, match="no disk tier to spill to"):
        without_disk._make_room(HOST, 4000, set())
