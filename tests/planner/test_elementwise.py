"""Element-wise traffic of eager PyTorch against fused kernels (planner/elementwise.py)."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.models.config import ModelConfig
from tessera.models.transformer import Block, rope_tables
from tessera.planner import parse_cluster
from tessera.planner.activations import layout
from tessera.planner.compute import elementwise_time, layer_elements
from tessera.planner.elementwise import eager_bytes_per_token
from tessera.planner.hardware import HardwareError
from tessera.planner.published import PUBLISHED, validate_published

LLAMA = ModelConfig(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, d_ff=352, vocab_size=256,
                    max_seq_len=96, norm="rmsnorm", activation="swiglu", position="rope",
                    tie_embeddings=False, bias=False)
GPT2 = ModelConfig(n_layers=2, d_model=128, n_heads=4, vocab_size=256, max_seq_len=96)
B, T = 2, 96
# Not element-wise: priced as matmuls and fused attention; and _unsafe_view, a view of the
# matmul's output that its schema does not mark as one.
SKIPPED_OPS = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
               "_unsafe_view"}


class _Traffic(TorchDispatchMode):
    """Bytes every non-view, non-matmul op reads and writes, counting only per-token tensors
    (leading dimension B or B*T): weights and rope's (T, hs/2) tables are read once and
    stay in cache, so they are left out, as the count leaves them out."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        aliases = any(r.alias_info is not None for r in func._schema.returns)
        if name not in SKIPPED_OPS and not aliases:
            flat = []
            for a in (*args, *(kwargs or {}).values(), out):
                flat += a if isinstance(a, (list, tuple)) else [a]  # cat takes a list
            self.bytes += sum(t.numel() * t.element_size() for t in flat
                              if isinstance(t, torch.Tensor) and t.dim()
                              and t.shape[0] in (B, B * T))
        return out


def _measured(config: ModelConfig, dtype: torch.dtype, autocast: bool) -> float:
    block = Block(config).to(dtype)
    x = torch.randn(B, T, config.d_model, dtype=dtype, requires_grad=True)
    rope = rope_tables(config.head_dim, T, config.rope_theta) if config.position == "rope" else None
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast), _Traffic() as traffic:
        block(x, rope)
    return traffic.bytes / (B * T)


# The runtime's three layouts: fp32, bf16 autocast over fp32 weights, 16-bit parameters.
RUNS = {"fp32": (torch.float32, False, "fp32", "ddp"),
        "autocast": (torch.float32, True, "bf16", "ddp"),
        "chunk": (torch.bfloat16, True, "bf16", "chunk")}


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("run", list(RUNS))
def test_eager_count_matches_the_bytes_each_op_moves(config, run):
    dtype, autocast, precision, memory = RUNS[run]
    counted = eager_bytes_per_token(config, layout(precision, memory))
    # Left out of the count: the norms' per-token statistics (a few 4-byte reads and writes
    # per token: 0.16-0.20% of these small layers, less at real widths).
    assert counted == pytest.approx(_measured(config, dtype, autocast), rel=0.003)


def _gpu(fused: bool):
    cluster = parse_cluster("h100-80gb:8x1")
    return dataclasses.replace(cluster, device=dataclasses.replace(
        cluster.device, fused_elementwise=fused))


def test_eager_prices_llama_blocks_above_fused_kernels_and_never_below():
    n, tp = 4096, 2
    bw = _gpu(False).device.memory_bandwidth * _gpu(False).device.memory_efficiency
    eager = elementwise_time(_gpu(False), LLAMA, n, tp, "bf16", "chunk")
    fused = elementwise_time(_gpu(True), LLAMA, n, tp, "bf16", "chunk")
    lay = layout("bf16", "chunk")
    counted = eager_bytes_per_token(LLAMA, lay, tp, "1d")
    assert eager.forward == pytest.approx(n * counted / bw)
    # 1d tp runs the norms, casts and residual adds whole on every rank; 2d splits all of it
    assert eager_bytes_per_token(LLAMA, lay) / tp < counted < eager_bytes_per_token(LLAMA, lay)
    assert eager_bytes_per_token(LLAMA, lay, tp, "2d") == eager_bytes_per_token(LLAMA, lay) / tp
    assert fused.forward == pytest.approx(layer_elements(LLAMA, n, tp) * 2 / bw)
    assert eager.forward > 1.5 * fused.forward
    assert eager.backward == pytest.approx(2 * eager.forward)
    # autocast's input casts and fp32 residual stream cost more than 16-bit parameters
    assert elementwise_time(_gpu(False), LLAMA, n, tp, "bf16", "ddp").forward > eager.forward
    # fp32 GPT-2 blocks: the op count lies below the coarse fused estimate; eager keeps it.
    assert elementwise_time(_gpu(False), GPT2, n, 1, "fp32") == elementwise_time(
        _gpu(True), GPT2, n, 1, "fp32")


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
