"""Published measurements of large training runs, for validating the simulator at scale.

Each row gives the model, the cluster (a shorthand or a YAML-style mapping), the strategy as
published, and the measured model TFLOP/s per GPU, with its source. Where a run reports tokens
per second or seconds per step instead, the TFLOP/s figure is derived with
``ModelConfig.flops_per_token`` (6 N + 12 l h s), and the derivation is noted. Fields a paper does
not state are filled with the common default and noted ("assumed").

Sources:

- MCORE: NVIDIA/Megatron-LM README, Megatron-Core r0.8.0 weak-scaling table on H100
  (``images/model_table.png``): seq 4096, vocab 131,072, DP overlap and TP comm overlap on.
  Micro-batch 1, distributed optimizer and no recomputation are assumed.
- BLOOM: bigscience-workshop/bigscience, ``train/tr11-176B-ml/README.md``: 384 A100-80GB in
  48 nodes, 4x 100 Gb/s Omni-Path per node, TP4 PP12 DP8, MBS 2, GBS 2048, ZeRO-1, full
  recomputation, 104.70 s per iteration (model TFLOP/s derived from the step time).
- LLAMA3: Dubey et al., "The Llama 3 Herd of Models", arXiv 2407.21783, Table 4 (BF16 MFU and
  TFLOP/s per GPU at 8K context; TP8 CP1 PP16, DP64 on 8,192 and DP128 on 16,384 H100, RoCE
  400 Gb/s; 16M tokens per batch; section 3.3.2: interleaved pipeline schedule). Micro-batch 1
  and no recomputation assumed.
- TITAN: pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``: H100 96 GB HBM2e at
  2.4 TB/s (the preset's HBM3 has 3.35) and 500 W, Llama 3.1 8B, FSDP, local batch 2, seq 8192,
  selective activation checkpointing (priced as recompute=0.5), Tables 1 and 3: eager
  ("FSDP") and with torch.compile; tokens/s/GPU converted to model TFLOP/s.

``fused_elementwise`` says how each run's element-wise work is priced: Megatron-Core and
Megatron-DeepSpeed (BLOOM) run fused norm, bias-activation and softmax kernels; Llama 3's
kernels are not described and are assumed fused; torchtitan's rows say whether torch.compile
ran (its eager Llama writes RMSNorm and rotary embeddings op by op, as ``elementwise.py``
counts).
"""

from __future__ import annotations

import dataclasses
from typing import Any

_MCORE = "seq=4096,vocab=131072,style=gpt2"
_LLAMA3_405B = ("layers=126,hidden=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,"
                "seq=8192,style=llama")
_LLAMA31_8B = ("layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,seq=8192,"
               "style=llama")


# The source's H100s: 96 GB of HBM2e at 2.4 TB/s. Their peak FLOP/s lies between SXM and NVL
# at the 500 W cap, "exact value unknown" (the source): the preset's SXM peak is kept.
_TITAN_H100 = {"memory_bytes": 96e9, "memory_bandwidth": 2.4e12}


def _titan(nodes: int, compiled: bool, tokens_per_s: float) -> dict[str, Any]:
    dp = 8 * nodes
    return dict(name=f"torchtitan-llama3.1-8b-fsdp{dp}" + ("-compile" if compiled else ""),
                source="TITAN", model=_LLAMA31_8B,
                cluster={"device": "h100-80gb", "devices_per_node": 8, "nodes": nodes,
                         "device_overrides": _TITAN_H100},
                strategy=f"dp={dp},tp=1,pp=1,mbs=2,gbs={2 * dp},recompute=0.5,memory=zero3,"
                         "precision=bf16",
                tokens_per_s_per_gpu=tokens_per_s, tflops_per_gpu=None,
                fused_elementwise=compiled)


def _mcore(name: str, heads: int, hidden: int, layers: int, tp: int, pp: int, dp: int,
           gbs: int, tflops: float) -> dict[str, Any]:
    return dict(name=f"megatron-core-{name}", source="MCORE",
                model=f"layers={layers},hidden={hidden},heads={heads},{_MCORE}",
                cluster=f"h100-80gb:8x{tp * pp * dp // 8}",
                strategy=f"dp={dp},tp={tp},pp={pp},mbs=1,gbs={gbs},memory=zero1,precision=bf16",
                tflops_per_gpu=tflops, tp_overlap=1.0, fused_elementwise=True)


PUBLISHED: list[dict[str, Any]] = [
    _mcore("1.7b", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _mcore("7.1b", 32, 4096, 30, 2, 1, 48, 192, 465.9),
    _mcore("16b", 48, 6144, 32, 4, 1, 48, 192, 489.1),
    _mcore("32b", 56, 7168, 48, 8, 1, 48, 192, 459.6),
    _mcore("70b", 64, 8192, 84, 8, 2, 48, 384, 419.7),
    _mcore("119b", 80, 10240, 92, 8, 4, 48, 768, 420.5),
    _mcore("177b", 96, 12288, 96, 8, 6, 48, 1152, 432.8),
    _mcore("314b", 128, 16384, 96, 8, 8, 48, 1536, 474.4),
    _mcore("462b", 144, 18432, 112, 8, 16, 48, 3072, 459.9),
    dict(name="bloom-176b", source="BLOOM",
         model="layers=70,hidden=14336,heads=112,seq=2048,vocab=250880,style=gpt2",
         cluster={"device": "a100-80gb", "devices_per_node": 8, "nodes": 48,
                  "device_overrides": {"inter": {"name": "Omni-Path 4x100 Gb/s per 8 GPUs",
                                                 "bandwidth": 0.9 * 6.25e9}}},
         strategy="dp=8,tp=4,pp=12,mbs=2,gbs=2048,recompute=full,memory=zero1,precision=bf16",
         step_time_s=104.70, tflops_per_gpu=None, fused_elementwise=True),
    dict(name="llama3-405b-8k-8192gpu", source="LLAMA3", model=_LLAMA3_405B,
         cluster="h100-80gb:8x1024",
         strategy="dp=64,tp=8,pp=16,mbs=1,gbs=2048,schedule=interleaved,memory=zero1,"
                  "precision=bf16",
         tflops_per_gpu=430.0, fused_elementwise=True),
    dict(name="llama3-405b-8k-16384gpu", source="LLAMA3", model=_LLAMA3_405B,
         cluster="h100-80gb:8x2048",
         strategy="dp=128,tp=8,pp=16,mbs=1,gbs=2048,schedule=interleaved,memory=zero1,"
                  "precision=bf16",
         tflops_per_gpu=400.0, fused_elementwise=True),
    *(_titan(nodes, compiled, tps) for nodes, compiled, tps in
      ((1, False, 5762.0), (16, False, 5605.0), (1, True, 6667.0), (16, True, 6514.0))),
]

SOURCES = {
    "MCORE": "NVIDIA/Megatron-LM README, Megatron-Core r0.8.0 H100 table (images/model_table.png)",
    "BLOOM": "bigscience-workshop/bigscience train/tr11-176B-ml/README.md",
    "LLAMA3": "Dubey et al. 2024, The Llama 3 Herd of Models, arXiv 2407.21783, Table 4",
    "TITAN": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md",
}


def measured_tflops(row: dict[str, Any], model) -> float:
    """The row's measured model TFLOP/s per GPU, derived when the run reports time or tokens."""
    if row.get("tflops_per_gpu"):
        return row["tflops_per_gpu"]
    seq = model.max_seq_len
    if row.get("tokens_per_s_per_gpu"):
        return row["tokens_per_s_per_gpu"] * model.flops_per_token(seq) / 1e12
    from tessera.strategy import Strategy

    s = Strategy.parse(row["strategy"])
    tokens = s.global_batch_size * seq
    return model.flops_per_token(seq) * tokens / row["step_time_s"] / s.world_size / 1e12


def validate_published() -> list[dict[str, Any]]:
    """Predicted against measured TFLOP/s per GPU for every row of :data:`PUBLISHED`."""
    from tessera.planner.cluster import Cluster, parse_cluster
    from tessera.planner.model_spec import describe_model
    from tessera.planner.simulator import SimOptions, estimate
    from tessera.strategy import Strategy

    out = []
    for row in PUBLISHED:
        model = describe_model(row["model"])
        spec = row["cluster"]
        cluster = parse_cluster(spec) if isinstance(spec, str) else Cluster.from_mapping(spec)
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(
            cluster.device, fused_elementwise=row["fused_elementwise"]))
        est = estimate(model, cluster, Strategy.parse(row["strategy"]),
                       # Megatron-LM (and the other published runs) split layers equally.
                       SimOptions(tp_overlap=row.get("tp_overlap", 0.0),
                                  tessera_runtime=False))
        measured = measured_tflops(row, model)
        out.append(dict(name=row["name"], source=row["source"], strategy=row["strategy"],
                        gpus=est.strategy.world_size, measured=measured,
                        predicted=est.tflops_per_device,
                        error=(est.tflops_per_device - measured) / measured, fits=est.fits,
                        memory_gib=est.memory.total / 2**30, breakdown=est.breakdown))
    return out
