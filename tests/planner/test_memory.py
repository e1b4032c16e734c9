"""Memory model: exact parameter counts, sharding, recomputation and pipeline in-flight rules."""

import pytest

from tessera.models.config import preset
from tessera.planner.activations import matrix_params
from tessera.planner.memory import device_memory, local_params, stage_memory, stage_params
from tessera.strategy import Strategy


@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "gpt2", "llama-7b", "gpt3-175b"])
def test_stage_params_sum_to_num_params(name):
    config = preset(name)
    assert sum(p.total for p in stage_params(config, 1)) == config.num_params()
    if config.n_layers >= 4:
        stages = stage_params(config, 4)
        extra = config.vocab_size * config.d_model if config.tie_embeddings else 0
        assert sum(p.total for p in stages) == config.num_params() + extra


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_ddp_model_states_are_16_bytes_per_parameter(precision):
    config = preset("gpt2")
    mem = device_memory(config, Strategy(precision=precision), config.max_seq_len)
    assert mem.weights + mem.gradients + mem.optimizer == 16 * config.num_params()


def test_zero_stages_shard_what_they_promise():
    config = preset("llama-7b")
    p = config.num_params()
    base = dict(dp=8, micro_batch_size=1, global_batch_size=8, precision="bf16")
    z1 = device_memory(config, Strategy(memory="zero1", **base), 4096)
    z2 = device_memory(config, Strategy(memory="zero2", **base), 4096)
    z3 = device_memory(config, Strategy(memory="zero3", **base), 4096)
    assert z1.weights == 2 * p and z1.gradients == 2 * p and z1.optimizer == 12 * p / 8
    assert z2.gradients == 2 * p / 8
    assert z3.weights == 2 * p / 8
    off = device_memory(config, Strategy(memory="zero3", offload="cpu", **base), 4096)
    assert off.optimizer == 0 and off.host == 12 * p / 8


def test_recomputation_and_tp_reduce_activations():
    config = preset("gpt3-175b")
    s = Strategy(dp=2, tp=8, pp=1, micro_batch_size=1, global_batch_size=2, precision="bf16",
                 memory="zero1")  # 16-bit parameters: no autocast weight copies
    none = device_memory(config, s, 2048).activations
    full = device_memory(config, s.replace(recompute="full"), 2048).activations
    assert full < none / 5
    tp1 = device_memory(config, s.replace(tp=1), 2048).activations
    # tessera's 1d tp keeps the norms and the layer's input whole on every rank (no Megatron
    # sequence parallelism); Megatron's runs (published rows) split all of it.
    assert 2 * none < tp1 < 8 * none
    megatron = [device_memory(config, st, 2048, tessera=False).activations
                for st in (s, s.replace(tp=1))]
    assert megatron[1] == pytest.approx(8 * megatron[0], rel=0.05)
    # Autocast over fp32 weights (memory=ddp) caches a 16-bit copy of every weight during the
    # forward, recomputed or not: 2 bytes per matrix parameter stay after full recomputation.
    # A tensor-parallel shard is no leaf, so autocast caches none of it.
    ddp = s.replace(memory="ddp", tp=1, dp=1, global_batch_size=1)
    copies = 2 * matrix_params(config) * config.n_layers
    ddp_none = device_memory(config, ddp, 2048).activations
    ddp_full = device_memory(config, ddp.replace(recompute="full"), 2048).activations
    assert copies < ddp_full and ddp_full - copies < (ddp_none - copies) / 5
    tp_ddp = ddp.replace(tp=8)  # each layer's fp32 input stays whole on every rank
    assert device_memory(config, tp_ddp.replace(recompute="full"), 2048).activations < (
        device_memory(config, tp_ddp, 2048).activations / 4)


def test_pipeline_in_flight_rules():
    config = preset("llama-7b")
    s = Strategy(dp=1, pp=4, micro_batch_size=1, global_batch_size=16, precision="bf16")
    one_f_one_b = [m.activations for m in stage_memory(config, s, 4096)]
    gpipe = [m.activations for m in stage_memory(config, s.replace(schedule="gpipe"), 4096)]
    assert one_f_one_b[0] > one_f_one_b[1] > one_f_one_b[2]  # stage i holds pp - i
    assert gpipe[0] > one_f_one_b[0]


def test_tp_splits_matrices_not_norms():
    config = preset("gpt2")
    stage = stage_params(config, 1)[0]
    assert local_params(config, stage, 1) == config.num_params()
    assert local_params(config, stage, 4) < config.num_params() / 3.9
