"""Pipeline stage splits in the planner: Megatron's equal split and tessera's balanced one."""

from __future__ import annotations

import pytest

from tessera.models.config import preset
from tessera.planner import estimate
from tessera.planner.cluster import parse_cluster
from tessera.planner import comm
from tessera.planner.memory import (holds_head_rows, pipeline_stage_params, stage_memory,
                                     stage_params)
from tessera.planner.simulator import SimOptions
from tessera.planner.split import equal_split, stage_split
from tessera.strategy import Strategy

GPT2 = preset("gpt2", max_seq_len=1024)  # its head: about 4.5 layers of training FLOPs


def _work(split, head: float) -> list[float]:
    return [layers + share * head for layers, share in split]


def test_equal_split_puts_extra_layers_first_and_the_head_last():
    assert equal_split(10, 4) == ((3, 0.0), (3, 0.0), (2, 0.0), (2, 1.0))
    assert stage_split(GPT2, Strategy(pp=4), balanced=False) == equal_split(12, 4)


def test_a_heavy_head_is_sliced_over_the_last_stages_without_tp():
    split = stage_split(GPT2, Strategy(pp=4))
    assert sum(layers for layers, _ in split) == 12
    assert abs(sum(share for _, share in split) - 1) < 1e-6
    assert sum(share > 0 for _, share in split) >= 2  # the head spans stages
    head = 6 * GPT2.vocab_size * GPT2.d_model / (
        6 * GPT2.num_params(include_embedding=False) / 12 + 12 * GPT2.d_model * 1024)
    work, equal = _work(split, head), _work(equal_split(12, 4), head)
    mean = sum(work) / 4
    assert max(work) < max(equal) and max(work) <= mean + 1  # within one layer of the mean
    # Megatron-LM's rule: each stage running a slice holds the whole (tied) head weight.
    holders = [p for p in stage_params(GPT2, 4, split) if p.head_share > 0]
    assert all(p.head_params == GPT2.vocab_size * GPT2.d_model for p in holders)
    # tessera's runtime (pipeline/rows.py): the tied weight's home is the first stage; the
    # head stages hold their share of its rows, which together are the whole weight once.
    assert holds_head_rows(Strategy(pp=4), split)
    stages = stage_params(GPT2, 4, split, rows=True)
    assert stages[0].embed_params >= GPT2.vocab_size * GPT2.d_model
    assert all(p.head_params == 0 for p in stages)
    assert sum(p.head_rows for p in stages) == pytest.approx(GPT2.vocab_size * GPT2.d_model)
    assert not holds_head_rows(Strategy(pp=4, memory="chunk"), split)  # chunks: whole
    # fp32: weights 4 bytes and AdamW moments 8 per parameter, but no moments for the rows.
    last = stage_memory(GPT2, Strategy(pp=4, micro_batch_size=1, global_batch_size=4), 1024)[-1]
    assert stages[-1].head_rows > 0
    assert last.weights - last.optimizer / 2 == pytest.approx(4 * stages[-1].head_rows)
    assert last.gradients == last.weights


def test_with_tensor_parallelism_the_head_stays_whole_with_fewer_layers_beside_it():
    split = stage_split(GPT2, Strategy(tp=2, pp=2, micro_batch_size=1, global_batch_size=2))
    assert [share for _, share in split] == [0.0, 1.0]
    assert split[1][0] < split[0][0]


def test_tessera_runtime_price_faster_pipelines_and_published_runs_stay_equal():
    cluster = parse_cluster("a100-80gb:8x1")
    s = Strategy.parse("dp=2,pp=4,mbs=1,gbs=64")
    balanced = estimate(GPT2, cluster, s)
    equal = estimate(GPT2, cluster, s, SimOptions(tessera_runtime=False))
    assert balanced.step_time < 0.8 * equal.step_time
    flat = Strategy.parse("dp=8,mbs=1,gbs=64")  # pp=1: nothing to split
    assert estimate(GPT2, cluster, flat).step_time == estimate(
        GPT2, cluster, flat, SimOptions(tessera_runtime=False)).step_time


def test_head_rows_are_priced_as_messages_to_and_from_their_home():
    # pp=4 without dp: the only step-level communication is the head's rows (rows.py), sent
    # by the home before the step and their gradients back after it (fp32: 4 bytes each).
    cluster = parse_cluster("a100-80gb:8x1")
    s = Strategy.parse("pp=4,mbs=1,gbs=8")
    rows = sum(p.head_rows for p in pipeline_stage_params(GPT2, s))
    pair = comm.Group(2, comm.mesh_groups(1, 1, 1, 4)["pp"].stride)
    want = 2 * comm.collective_time(cluster, "p2p", rows * 4, pair)
    assert rows > 0 and estimate(GPT2, cluster, s).breakdown["dp_comm"] == pytest.approx(want)
    # Chunk memory keeps the head whole on its stages: the tied all-reduce is priced instead.
    chunk = s.replace(memory="chunk")
    assert sum(p.head_rows for p in pipeline_stage_params(GPT2, chunk)) == 0
