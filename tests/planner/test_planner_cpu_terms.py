"""Simulator terms that matter for CPU workers sharing cores (what `tessera profile` measures):
profiled element-wise cost, blocking chunk collectives, DDP buckets, the end-of-step sync."""

import dataclasses

import pytest

from tessera.models.config import ModelConfig
from tessera.planner import estimate, parse_cluster
from tessera.planner.cluster import CollectiveFit
from tessera.planner.compute import (elementwise_time, fused_causal_share, layer_elements,
                                     sp_attention_time, sp_causal_fraction)
from tessera.strategy import Strategy

MODEL = ModelConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=256, max_seq_len=128)


def _cpu_cluster(share: float, overheads: dict | None = None):
    """A 4-worker CPU node with loaded collective fits, as a profile writes it."""
    base = parse_cluster("cpu:4x1")
    fits = {op: {2: CollectiveFit(1e-3, 1e9), 4: CollectiveFit(2e-3, 5e8)}
            for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}
    device = dataclasses.replace(base.device, overheads=overheads or {})
    return dataclasses.replace(base, device=device, collectives=fits, concurrency={4: share})


def test_profiled_elementwise_cost_is_used_per_activation_style():
    cluster = _cpu_cluster(0.5, {"elem_fwd_gelu": 1e-9, "elem_bwd_gelu": 3e-9,
                                 "elem_fwd_swiglu": 2e-9, "elem_bwd_swiglu": 5e-9})
    elements = layer_elements(MODEL, 256, 1)
    t = elementwise_time(cluster, MODEL, 256, 1, "fp32")
    assert (t.forward, t.backward) == pytest.approx((elements * 1e-9, elements * 3e-9))
    llama = dataclasses.replace(MODEL, activation="swiglu", norm="rmsnorm", position="rope")
    t = elementwise_time(cluster, llama, 256, 1, "fp32")
    assert t.forward == pytest.approx(layer_elements(llama, 256, 1) * 2e-9)
    # Without a profile: bytes over memory bandwidth, twice that backward.
    plain = elementwise_time(_cpu_cluster(0.5), MODEL, 256, 1, "fp32")
    assert plain.backward == pytest.approx(2 * plain.forward) and plain.forward > 0


def test_chunk_collectives_are_blocking_and_counted_per_gather_group():
    cluster = _cpu_cluster(0.5)
    ddp = estimate(MODEL, cluster, Strategy.parse("dp=4,mbs=2,gbs=8"))
    chunk = estimate(MODEL, cluster, Strategy.parse("dp=4,mbs=2,gbs=8,memory=chunk"))
    # Nothing is hidden: two gathers and a reduce-scatter per micro-batch, each paying one
    # latency per group of dp chunks (842,496 parameters in ~13 chunks of the 65,536-element
    # largest tensor: 4 groups of 4), so at least 3 x 4 latencies of 2 ms.
    assert chunk.breakdown["dp_comm"] >= 12 * 2e-3
    assert chunk.breakdown["dp_comm"] > ddp.breakdown["dp_comm"]
    # Two micro-batches gather twice as often; gradients are reduce-scattered once per step
    # (the runtime accumulates locally under no_sync), so the second adds gathers only.
    two = estimate(MODEL, cluster, Strategy.parse("dp=4,mbs=1,gbs=8,memory=chunk"))
    reduce_scatters = 2 * chunk.breakdown["dp_comm"] - two.breakdown["dp_comm"]
    gathers = two.breakdown["dp_comm"] - chunk.breakdown["dp_comm"]  # 2 per micro-batch
    assert reduce_scatters >= 4 * 2e-3 and gathers >= 8 * 2e-3


def test_chunk_under_pipeline_gathers_stage_pieces_and_keeps_remote_gradients():
    from tessera.planner.memory import local_params, stage_memory, stage_params

    cluster = _cpu_cluster(0.5)
    plain = Strategy.parse("dp=2,pp=2,mbs=2,gbs=8,schedule=1f1b,memory=chunk")
    half = plain.replace(recompute=0.5)
    # A recomputed head is a piece of its own: gathered again for its recomputation, once per
    # micro-batch (2 micro-batches per step), on top of the forward and backward gathers.
    extra = (estimate(MODEL, cluster, half).breakdown["dp_comm"]
             - estimate(MODEL, cluster, plain).breakdown["dp_comm"])
    assert extra > 0
    base_ag = estimate(MODEL, cluster, plain).breakdown["dp_comm"]
    assert extra < base_ag  # half a gather per micro-batch, less than 2 gathers + a scatter
    # Memory: the whole stage is gathered (beyond the own half of it), and remote gradients
    # stay on the device through the schedule (no_sync), so gradients count whole.
    for i, (stage, mem) in enumerate(zip(stage_params(MODEL, 2), stage_memory(MODEL, plain,
                                                                             128))):
        p = local_params(MODEL, stage, 1)
        assert mem.gradients == pytest.approx(p * 4)
        assert mem.weights == pytest.approx(p * 4 / 2)
        ddp_pp = stage_memory(MODEL, plain.replace(memory="ddp"), 128)[i]
        # ddp's buffers add a bucket copy of the gradients (dp > 1); chunk's the gathered half.
        assert mem.buffers - ddp_pp.buffers == pytest.approx(p * 4 / 2 - p * 4)


def test_step_sync_only_when_workers_share_cores():
    s = Strategy.parse("dp=4,mbs=2,gbs=8")
    shared = estimate(MODEL, _cpu_cluster(0.45), s)
    assert shared.breakdown["step_sync"] == pytest.approx(2e-3 + 4 / 5e8)  # one 4-byte call
    alone = estimate(MODEL, _cpu_cluster(1.0), s)
    assert alone.breakdown["step_sync"] == 0.0
    gpu = estimate(MODEL, parse_cluster("a100-80gb:8x1"), s)
    assert gpu.breakdown["step_sync"] == 0.0
    for est in (shared, alone, gpu):
        assert sum(est.breakdown.values()) == pytest.approx(est.step_time, rel=1e-9)


def test_sequence_parallel_attention_is_the_runtimes_block_kernel():
    overheads = {"attn_fwd_call": 1e-4, "attn_fwd_elem": 2e-9, "attn_fwd_elem_hs": 1e-11,
                 "attn_bwd_call": 2e-4, "attn_bwd_elem": 3e-9, "attn_bwd_elem_hs": 2e-11}
    cluster = _cpu_cluster(1.0, overheads)
    ring = sp_attention_time(cluster, MODEL, 2, 128, 1, "1d", 4, "ring")
    # 2 x 4 heads x 32 rows x 128 keys, 5/8 of it computed by the causal zigzag ring (half
    # blocks off the diagonal; a 32-token diagonal block is one tile of the fused CPU kernel,
    # computed whole), in 4 calls (one per ring step); head size 32.
    elements = 2 * 4 * 32 * 128 * 5 / 8
    assert ring.forward == pytest.approx(4 * 1e-4 + elements * (2e-9 + 32 * 1e-11))
    assert ring.backward == pytest.approx(4 * 2e-4 + elements * (3e-9 + 32 * 2e-11))
    ulysses = sp_attention_time(cluster, MODEL, 2, 128, 1, "1d", 4, "ulysses")
    assert ulysses.forward == pytest.approx(1e-4 + elements * 8 / 5 * (2e-9 + 32 * 1e-11))
    rsa = sp_attention_time(cluster, MODEL, 2, 128, 1, "1d", 4, "rsa")  # full rows, 2 sp calls
    assert rsa.forward == pytest.approx(8 * 1e-4 + elements * 8 / 5 * (2e-9 + 32 * 1e-11))


def test_fused_cpu_kernel_skips_future_tiles_of_long_causal_blocks():
    # An 8192-token sequence on sp=4: the ring's 2048-token diagonal block computes
    # (2048 + 512) / 4096 of its scores on CPU, in full with the explicit (GPU) kernel.
    assert sp_causal_fraction("cpu", 8192, 4, "ring") == pytest.approx((0.625 + 1.5) / 4)
    assert sp_causal_fraction("h100-80gb", 8192, 4, "ring") == pytest.approx(5 / 8)
    assert sp_causal_fraction("cpu", 8192, 4, "ulysses") == pytest.approx(8704 / 16384)
    assert sp_causal_fraction("h100-80gb", 8192, 4, "ulysses") == 1.0
    assert sp_causal_fraction("cpu", 8192, 4, "rsa") == 1.0
    assert fused_causal_share(512) == 1.0  # one key tile: nothing to skip


def test_tp_sums_each_block_input_gradient_once():
    cluster = _cpu_cluster(0.5)
    s = Strategy.parse("dp=1,tp=4,mbs=8,gbs=8")
    tp_comm = estimate(MODEL, cluster, s).breakdown["tp_comm"]
    # Forward 2 all-reduces per layer (after attention and MLP), backward 2 (each block's
    # input, however many column layers read it): 4 of the (8 x 128, 128) fp32 activation
    # per layer at the g=4 fit (one micro-batch per step), and 2 tiny ones for the row
    # layers' bias gradients. Outside the layers: the vocab-parallel embedding's forward
    # all-reduce, the head's input gradient, and the loss's 2 tiny all-reduces (the max;
    # the sum of exponentials with the target logit).
    all_reduce, tiny = 2e-3 + 8 * 128 * 128 * 4 / 5e8, 2e-3 + 4 / 5e8
    expected = MODEL.n_layers * (4 * all_reduce + 2 * tiny) + 2 * all_reduce + 2 * tiny
    assert tp_comm == pytest.approx(expected, rel=1e-9)
    # A swiglu MLP (gate and up read the block input) costs the same: one sum per block.
    llama = dataclasses.replace(MODEL, activation="swiglu", norm="rmsnorm", bias=False)
    llama_comm = estimate(llama, cluster, s).breakdown["tp_comm"]
    assert llama_comm == pytest.approx(expected - MODEL.n_layers * 2 * tiny, rel=1e-9)


def test_measured_straggler_fraction_prices_the_wait_for_the_slowest_worker():
    cluster = dataclasses.replace(_cpu_cluster(0.45), straggler={2: 0.03, 4: 0.1})
    est = estimate(MODEL, cluster, Strategy.parse("dp=4,mbs=2,gbs=8"))
    # The fraction of the rest of the step replaces the one-call estimate.
    rest = est.step_time - est.breakdown["step_sync"]
    assert est.breakdown["step_sync"] == pytest.approx(0.1 * rest)
    assert sum(est.breakdown.values()) == pytest.approx(est.step_time, rel=1e-9)
    alone = dataclasses.replace(cluster, concurrency={4: 1.0})
    assert estimate(MODEL, alone, Strategy.parse("dp=4,mbs=2,gbs=8")
                    ).breakdown["step_sync"] == 0.0


def test_profiled_recompute_overhead_is_charged_per_recomputed_layer():
    s = Strategy.parse("dp=4,mbs=2,gbs=8,recompute=full")
    free, hooked = (_cpu_cluster(0.5, {"recompute_layer": t}) for t in (0.0, 1e-3))
    # Four recomputed layers, one micro-batch, at half a core: 4 x 1 ms / 0.5 more.
    extra = (estimate(MODEL, hooked, s).breakdown["recompute"]
             - estimate(MODEL, free, s).breakdown["recompute"])
    assert extra == pytest.approx(4 * 1e-3 / 0.5)
    none = Strategy.parse("dp=4,mbs=2,gbs=8")
    assert (estimate(MODEL, hooked, none).step_time
            == pytest.approx(estimate(MODEL, free, none).step_time))


def test_trainer_overhead_is_charged_per_step_and_per_micro_batch():
    cluster = _cpu_cluster(0.5, {"trainer_step": 1e-3, "trainer_micro_batch": 2e-4})
    # A profiled device with the same (zero) per-layer figures, so only the Trainer differs.
    bare = _cpu_cluster(0.5, {"trainer_step": 0.0, "trainer_micro_batch": 0.0})
    for mbs, micro_batches in ((2, 1), (1, 2)):
        s = Strategy.parse(f"dp=4,mbs={mbs},gbs=8")
        with_trainer, without = estimate(MODEL, cluster, s), estimate(MODEL, bare, s)
        # (1 ms + m x 0.2 ms) of host work at half a core, added to the step and nowhere else.
        expected = (1e-3 + micro_batches * 2e-4) / 0.5
        assert with_trainer.breakdown["trainer"] == pytest.approx(expected)
        assert without.breakdown["trainer"] == 0.0
        assert with_trainer.step_time - without.step_time == pytest.approx(expected)


def test_chunk_runtime_overhead_splits_per_micro_batch_and_per_step():
    cluster = _cpu_cluster(0.5, {"chunk_layer": 1e-3, "chunk_step_layer": 2e-3})
    one, two = (estimate(MODEL, cluster, Strategy.parse(f"dp=4,mbs={mbs},gbs=8,memory=chunk"))
                for mbs in (2, 1))
    # Four layers at half a core: (m x 1 ms + 2 ms) x 4 / 0.5.
    assert one.breakdown["chunk_runtime"] == pytest.approx((1e-3 + 2e-3) * 4 / 0.5)
    assert two.breakdown["chunk_runtime"] == pytest.approx((2e-3 + 2e-3) * 4 / 0.5)


def test_an_unprofiled_host_counts_the_chunk_runtime_in_kernel_overheads():
    from tessera.planner.step_outside import CHUNK_OPS_PER_LAYER

    cluster = _cpu_cluster(0.5)  # no overheads: the cpu preset's guesses
    two = estimate(MODEL, cluster, Strategy.parse("dp=4,mbs=1,gbs=8,memory=chunk"))
    # 2 micro-batches x 4 layers x 48 operations x 20 us, at half a core: 15.4 ms.
    per_layer = CHUNK_OPS_PER_LAYER * cluster.device.kernel_overhead
    assert two.breakdown["chunk_runtime"] == pytest.approx(2 * 4 * per_layer / 0.5)
    # An accelerator without a profile: this host work runs ahead of its kernels.
    gpu = parse_cluster("a100-80gb:4x1")
    assert estimate(MODEL, gpu, Strategy.parse("dp=4,mbs=1,gbs=8,memory=chunk")
                    ).breakdown["chunk_runtime"] == 0.0


def test_tensor_parallel_layer_overhead_is_charged_per_layer_micro_batch_and_step():
    """1D and 2D layers each pay their own profiled figure; plain layers neither."""
    fixed = {"layer_fwd": 1e-4, "layer_bwd": 3e-4}
    cluster = _cpu_cluster(0.5, {**fixed, "tp_layer": 2e-3, "tp_optim_layer": 1e-4})
    bare = _cpu_cluster(0.5, fixed)
    for text in ("dp=2,tp=2,mbs=4,gbs=8", "dp=2,tp=2,mbs=2,gbs=8"):
        s = Strategy.parse(text)
        got, base = estimate(MODEL, cluster, s), estimate(MODEL, bare, s)
        m = s.grad_accum_steps
        # 2 ms per 1D tp layer and micro-batch (a quarter forward, as the plain layer's fixed
        # cost splits), 0.1 ms per layer and step for AdamW over DTensors; 4 layers at half
        # a core.
        assert (got.breakdown["compute"] - base.breakdown["compute"]
                == pytest.approx(m * 4 * 2e-3 / 0.5))
        assert (got.breakdown["optimizer"] - base.breakdown["optimizer"]
                == pytest.approx(4 * 1e-4 / 0.5))
    # A 2D layer pays its own figures (5 ms per layer and micro-batch, 0.3 ms per layer and
    # step), never the 1D ones; a 1D layer never pays the 2D ones.
    only_2d = _cpu_cluster(0.5, {**fixed, "tp2d_layer": 5e-3, "tp2d_optim_layer": 3e-4})
    two_d = Strategy.parse("tp=4,mbs=2,gbs=8,tp_mode=2d")
    got, base = estimate(MODEL, only_2d, two_d), estimate(MODEL, bare, two_d)
    assert (got.breakdown["compute"] - base.breakdown["compute"]
            == pytest.approx(two_d.grad_accum_steps * 4 * 5e-3 / 0.5))
    assert (got.breakdown["optimizer"] - base.breakdown["optimizer"]
            == pytest.approx(4 * 3e-4 / 0.5))
    assert (estimate(MODEL, cluster, two_d).step_time
            == pytest.approx(estimate(MODEL, bare, two_d).step_time))
    one_d = Strategy.parse("dp=2,tp=2,mbs=4,gbs=8")
    assert (estimate(MODEL, only_2d, one_d).step_time
            == pytest.approx(estimate(MODEL, bare, one_d).step_time))
    for text in ("dp=4,mbs=2,gbs=8", "tp=4,mbs=2,gbs=8,tp_mode=2d",
                 "dp=2,tp=2,mbs=4,gbs=8,memory=chunk"):
        s = Strategy.parse(text)
        # Plain layers and 2D layers are not 1D tp layers; chunk memory steps its own Adam.
        assert (estimate(MODEL, cluster, s).breakdown["optimizer"]
                == pytest.approx(estimate(MODEL, bare, s).breakdown["optimizer"]))
    plain = Strategy.parse("dp=4,mbs=2,gbs=8")
    assert estimate(MODEL, cluster, plain).step_time == pytest.approx(
        estimate(MODEL, bare, plain).step_time)


def test_attention_dropout_is_priced_on_the_path_each_layout_runs():
    """With attention dropout, sp and 1D tp run the hashed explicit blocks (profiled as
    attn_drop_*, computed in full: no fused causal skipping), other layouts SDPA at its
    dropping efficiency; without dropout nothing changes."""
    from tessera.planner.compute import MASK_BYTES, layer_core_time

    plain = {"attn_fwd_call": 1e-4, "attn_fwd_elem": 2e-9, "attn_fwd_elem_hs": 1e-11,
             "attn_bwd_call": 2e-4, "attn_bwd_elem": 3e-9, "attn_bwd_elem_hs": 2e-11}
    dropping = {k.replace("attn_", "attn_drop_"): 10 * v for k, v in plain.items()}
    cluster = _cpu_cluster(1.0, {**plain, **dropping})
    drops = dataclasses.replace(MODEL, dropout=0.1)
    ring = sp_attention_time(cluster, drops, 2, 128, 1, "1d", 4, "ring", dropout=True)
    elements = 2 * 4 * 32 * 128 * 5 / 8  # the explicit ring's causal share, (sp + 1) / 2 sp
    assert ring.forward == pytest.approx(4 * 1e-3 + elements * (2e-8 + 32 * 1e-10))
    # 1D tp at sp = 1: one call on the whole sequence, its heads split over tp.
    tp = layer_core_time(cluster, drops, 2, 128, 2, "1d", 1, "fp32")
    tp_plain = layer_core_time(cluster, MODEL, 2, 128, 2, "1d", 1, "fp32")
    call = sp_attention_time(cluster, drops, 2, 128, 2, "1d", 1, "ulysses", dropout=True)
    assert call.forward == pytest.approx(1e-3 + 2 * 2 * 128 * 128 * (2e-8 + 32 * 1e-10))
    assert tp.forward > tp_plain.forward
    # dp: SDPA at the device's dropping efficiency, when it has one.
    half = dataclasses.replace(cluster.device, attention_efficiency=0.5,
                               attention_dropout_efficiency=0.25)
    slower = dataclasses.replace(cluster, device=half)
    dp, dp_plain = (layer_core_time(slower, m, 2, 128, 1, "1d", 1, "fp32") for m in (drops, MODEL))
    # Half the efficiency: the attention term doubles (causal FLOPs 4 b s s h / 2).
    attention = 4 * 2 * 128 * 128 * 128 * 0.5 / (half.peak("fp32") * 0.5)
    assert dp.forward - dp_plain.forward == pytest.approx(attention)
    unprofiled = _cpu_cluster(1.0)  # analytic: the mask's int64 passes added each way
    without = sp_attention_time(unprofiled, drops, 2, 128, 1, "1d", 4, "ulysses")
    with_mask = sp_attention_time(unprofiled, drops, 2, 128, 1, "1d", 4, "ulysses",
                                  dropout=True)
    bw = unprofiled.device.memory_bandwidth * unprofiled.device.memory_efficiency
    full = 2 * 4 * 32 * 128  # no fused causal skipping under dropout
    explicit = dataclasses.replace(unprofiled.device, name="explicit")  # not the fused CPU
    fused_off = sp_attention_time(dataclasses.replace(unprofiled, device=explicit), drops, 2,
                                  128, 1, "1d", 4, "ulysses")
    assert with_mask.forward == pytest.approx(fused_off.forward + MASK_BYTES * full / bw)
    assert with_mask.forward > without.forward
    # The unprofiled CPU preset: SDPA with dropout leaves the fused kernel there, so dp's
    # attention is dearer with dropout too (not priced as the fused kernel).
    cpu = unprofiled.device
    assert cpu.attention_dropout_efficiency < cpu.attention_efficiency
    dp, dp_plain = (layer_core_time(unprofiled, m, 2, 128, 1, "1d", 1, "fp32")
                    for m in (drops, MODEL))
    assert dp.forward > dp_plain.forward


def test_hugging_face_configs_are_described_with_their_dropout():
    from tessera.planner.model_spec import from_hf_dict

    gpt2 = dict(model_type="gpt2", vocab_size=256, n_layer=2, n_embd=64, n_head=4,
                n_positions=128)
    assert from_hf_dict(gpt2).dropout == 0.1  # GPT2Config's default where the dict has none
    assert from_hf_dict({**gpt2, "attn_pdrop": 0.0, "resid_pdrop": 0.0,
                         "embd_pdrop": 0.0}).dropout == 0.0
    llama = dict(model_type="llama", vocab_size=256, num_hidden_layers=2, hidden_size=64,
                 num_attention_heads=4, intermediate_size=128, max_position_embeddings=128)
    assert from_hf_dict(llama).dropout == 0.0
    # Llama drops attention probabilities only; GPT-2's attn_pdrop is apart from the rest.
    dropping = from_hf_dict({**llama, "attention_dropout": 0.2})
    assert (dropping.attention_p, dropping.dropout) == (0.2, 0.0)
    mixed = from_hf_dict({**gpt2, "attn_pdrop": 0.0, "resid_pdrop": 0.2})
    assert (mixed.attention_p, mixed.dropout) == (0.0, 0.2)
