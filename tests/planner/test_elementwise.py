"""Element-wise traffic of eager PyTorch against fused kernels (planner/elementwise.py)."""

import dataclasses

import pytest

from tessera.models.config import ModelConfig
from tessera.planner import parse_cluster
from tessera.planner.compute import elementwise_time, layer_elements
from tessera.planner.elementwise import eager_bytes_per_token
from tessera.planner.hardware import HardwareError
from tessera.planner.published import PUBLISHED, validate_published

LLAMA = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=160, vocab_size=256,
                    max_seq_len=32, norm="rmsnorm", activation="swiglu", position="rope",
                    tie_embeddings=False, bias=False)
GPT2 = ModelConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=256, max_seq_len=32)


def test_eager_counts_follow_the_ops_of_each_block_style():
    h, f, kv = 64, 160, 32
    # bf16: rmsnorm 2*6 + 20 + 4 = 36 per element (x2), output copy 4, residuals 2*6;
    # rope 2*6 + 36 = 48 on q and k; silu then multiply 10 per MLP element.
    assert eager_bytes_per_token(LLAMA, 2) == 88 * h + 48 * (h + kv) + 10 * f
    # fp32: no casts (x.float() and type_as are no-ops).
    assert eager_bytes_per_token(LLAMA, 4) == (2 * 28 + 8 + 24) * h + 36 * (h + kv) + 20 * f
    # LayerNorm and gelu are single kernels; no rope; dropout adds a pass and a mask byte.
    assert eager_bytes_per_token(GPT2, 2) == (8 + 4 + 12) * h + 4 * 4 * h
    dropped = dataclasses.replace(GPT2, dropout=0.1)
    assert eager_bytes_per_token(dropped, 2) - eager_bytes_per_token(GPT2, 2) == 2 * 5 * h


def _gpu(fused: bool):
    cluster = parse_cluster("h100-80gb:8x1")
    return dataclasses.replace(cluster, device=dataclasses.replace(
        cluster.device, fused_elementwise=fused))


def test_eager_prices_llama_blocks_above_fused_kernels_and_never_below():
    n, tp = 4096, 2
    bw = _gpu(False).device.memory_bandwidth * _gpu(False).device.memory_efficiency
    eager = elementwise_time(_gpu(False), LLAMA, n, tp, "bf16")
    fused = elementwise_time(_gpu(True), LLAMA, n, tp, "bf16")
    assert eager.forward == pytest.approx(n / tp * eager_bytes_per_token(LLAMA, 2) / bw)
    assert fused.forward == pytest.approx(layer_elements(LLAMA, n, tp) * 2 / bw)
    assert eager.forward > 1.5 * fused.forward
    assert eager.backward == pytest.approx(2 * eager.forward)
    # GPT-2 blocks: the op count lies below the coarse fused estimate; eager keeps the latter.
    assert elementwise_time(_gpu(False), GPT2, n, tp, "bf16") == elementwise_time(
        _gpu(True), GPT2, n, tp, "bf16")


def test_profiled_seconds_per_element_ignore_the_flag():
    cluster = _gpu(False)
    device = dataclasses.replace(cluster.device, overheads={"elem_fwd_swiglu": 1e-9})
    t = elementwise_time(dataclasses.replace(cluster, device=device), LLAMA, 100, 1, "bf16")
    assert t.forward == pytest.approx(layer_elements(LLAMA, 100, 1) * 1e-9)


def test_device_flags_must_be_booleans():
    base = parse_cluster("a100-80gb:8x1").device
    for name in ("fused_elementwise", "flash_attention"):
        with pytest.raises(HardwareError, match=f"device.{name} must be true or false"):
            dataclasses.replace(base, **{name: "yes"})


def test_published_rows_state_their_kernels_and_eager_runs_price_slower():
    assert all(isinstance(row["fused_elementwise"], bool) for row in PUBLISHED)
    rows = {r["name"]: r for r in validate_published()}
    for dp in (8, 128):
        eager = rows[f"torchtitan-llama3.1-8b-fsdp{dp}"]
        compiled = rows[f"torchtitan-llama3.1-8b-fsdp{dp}-compile"]
        assert eager["measured"] < compiled["measured"]  # the source's own ordering
        assert eager["predicted"] < compiled["predicted"]
