"""Device presets: peak FLOP/s per precision, memory, and the links devices talk over.

Numbers are vendor datasheet peaks (dense, no sparsity); the cost model scales them by the
efficiencies below, which are properties of the device class, not of a particular run. Sources:

- V100-32GB: NVIDIA Tesla V100 datasheet (SXM2: 15.7 TF fp32, 125 TF fp16 tensor, 900 GB/s
  HBM2, NVLink 2 at 300 GB/s total); DGX-1 datasheet (4x EDR 100 Gb/s InfiniBand per 8 GPUs).
- A100-40GB / A100-80GB: NVIDIA A100 datasheet (SXM4: 19.5 TF fp32, 156 TF tf32, 312 TF
  bf16/fp16; 1,555 / 2,039 GB/s; NVLink 3 at 600 GB/s total); DGX A100 datasheet (8x HDR
  200 Gb/s InfiniBand, one per GPU).
- H100-80GB: NVIDIA H100 datasheet (SXM5: 67 TF fp32, 494.5 TF tf32, 989.4 TF bf16/fp16 dense;
  3.35 TB/s HBM3; NVLink 4 at 900 GB/s total); DGX H100 datasheet (8x 400 Gb/s NDR, one per GPU).
- H200: NVIDIA H200 datasheet (SXM: H100 compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s).
- cpu: the local machine. The preset is a placeholder (one core ~ 50 GFLOP/s fp32, shared
  memory "links"); ``tessera profile`` measures the real figures and writes a cluster file.

Bandwidths here are per device and per direction, which is what ring collectives are bound by.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

GB = 1e9
GIB = 2**30
TF = 1e12


OVERHEAD_KEYS = ("layer_fwd", "layer_bwd", "model_fwd", "model_bwd", "optim_fixed",
                 "optim_layer", "trainer_step", "trainer_micro_batch", "chunk_layer",
                 "chunk_step_layer", "recompute_layer",
                 # a 1D / 2D tensor-parallel layer beyond a plain one (planner/profile_tp.py)
                 "tp_layer", "tp_optim_layer", "tp2d_layer", "tp2d_optim_layer",
                 # seconds per element of a layer's element-wise work (planner/calibrate.py)
                 "elem_fwd_gelu", "elem_bwd_gelu", "elem_fwd_swiglu", "elem_bwd_swiglu",
                 # explicit sequence-parallel attention: c per call + E (a + b * head size)
                 "attn_fwd_call", "attn_fwd_elem", "attn_fwd_elem_hs",
                 "attn_bwd_call", "attn_bwd_elem", "attn_bwd_elem_hs",
                 # the same with hashed attention dropout (sequence/dropout.py): explicit path
                 "attn_drop_fwd_call", "attn_drop_fwd_elem", "attn_drop_fwd_elem_hs",
                 "attn_drop_bwd_call", "attn_drop_bwd_elem", "attn_drop_bwd_elem_hs")


class HardwareError(ValueError):
    """A device or link description is malformed; the message names the field."""


@dataclass(frozen=True)
class Link:
    """A class of connection between devices (alpha-beta model).

    Attributes:
        name: e.g. "NVLink 3", "InfiniBand HDR".
        bandwidth: bytes/s per device per direction, as achieved by collectives.
        latency: seconds per message hop (the alpha of the alpha-beta model).
    """

    name: str
    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise HardwareError(f"link {self.name!r}: bandwidth must be > 0, got {self.bandwidth}")
        if not self.latency >= 0:
            raise HardwareError(f"link {self.name!r}: latency must be >= 0, got {self.latency}")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU worker) class.

    Attributes:
        name: preset name, e.g. "a100-80gb".
        peak_flops: dense peak FLOP/s per precision ("fp32", "bf16", "fp16", ...).
        memory_bytes: device memory.
        memory_bandwidth: device memory bytes/s (bounds element-wise kernels and optimizers).
        intra: link between devices of one node (NVLink/NVSwitch, shared memory on CPU).
        inter: link between nodes (InfiniBand/RoCE/Ethernet), per device.
        host_bandwidth: device <-> host bytes/s (PCIe), for offload.
        disk_bandwidth: host <-> NVMe bytes/s per device, for disk offload.
        devices_per_node: default node size for the ``name:N`` shorthand.
        matmul_efficiency: fraction of peak a large matmul reaches.
        attention_efficiency: fraction of peak fused attention reaches.
        attention_dropout_efficiency: the same with attention dropout (SDPA on CPU then leaves
            its fused kernel for the math path); None: ``attention_efficiency`` (CUDA's
            flash kernel drops inside the kernel).
        memory_efficiency: fraction of memory bandwidth element-wise kernels reach.
        kernel_overhead: fixed seconds per kernel (launch, tail), which small matmuls feel.
        overlap_efficiency: fraction of concurrent compute that communication can hide under.
        p2p_overlap_efficiency: the same for asynchronous send/recv rings (ring attention);
            None: ``overlap_efficiency``.
        reserved_bytes: memory not available to the model (runtime, allocator, comm buffers).
        flash_attention: fused attention that keeps no (s x s) scores.
        fused_elementwise: the norms, rotary embedding, residual adds and activation run as
            fused kernels (torch.compile, Megatron's fused kernels); False prices them as eager
            PyTorch runs them, one kernel and one pass over memory per op (tessera's runtime,
            ``planner/elementwise.py``). Ignored where ``overheads`` carry measured seconds
            per element.
        optimizer_bytes_per_param: memory traffic of one Adam update per parameter; a fused
            fp32 AdamW reads p, g, m, v and writes p, m, v (28 bytes); unfused kernels and
            mixed-precision copies make it larger, so the default is 48 and profile measures it.
        overheads: measured fixed seconds of the training step's Python and kernel launches,
            which dominate small models on a CPU (``tessera profile`` times a tiny reference
            transformer): ``layer_fwd``/``layer_bwd`` per transformer layer and micro-batch,
            ``model_fwd``/``model_bwd`` for embedding, head and loss per micro-batch,
            ``optim_fixed`` per step and ``optim_layer`` per layer per step (clipping and
            AdamW); ``trainer_step`` per step and ``trainer_micro_batch`` per micro-batch for
            what the tessera Trainer adds over a bare loop (collation, loss bookkeeping,
            clipping through the plan, the LR schedule); ``chunk_layer`` per layer and
            micro-batch for the memory=chunk runtime's hooks and copies, ``chunk_step_layer``
            per layer and step for its gradient reduction and chunked optimizer;
            ``recompute_layer`` per recomputed layer and micro-batch for the checkpoint's own
            work beyond the repeated forward; ``tp_layer`` / ``tp2d_layer`` per 1D / 2D
            tensor-parallel layer and micro-batch beyond a plain layer, ``tp_optim_layer`` /
            ``tp2d_optim_layer`` per such layer and step for clipping and AdamW over its
            shards (``planner/profile_tp.py``). Empty: ``kernel_overhead`` times a kernel
            count is used instead.
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: float
    memory_bandwidth: float
    intra: Link
    inter: Link
    host_bandwidth: float = 25 * GB
    disk_bandwidth: float = 3 * GB
    devices_per_node: int = 8
    matmul_efficiency: float = 0.8
    attention_efficiency: float = 0.5
    attention_dropout_efficiency: float | None = None
    memory_efficiency: float = 0.8
    kernel_overhead: float = 5e-6
    overlap_efficiency: float = 0.9
    p2p_overlap_efficiency: float | None = None
    reserved_bytes: float = 2 * GIB
    flash_attention: bool = True
    fused_elementwise: bool = False
    optimizer_bytes_per_param: float = 48.0
    overheads: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))
        object.__setattr__(self, "overheads", dict(self.overheads))
        unknown = sorted(set(self.overheads) - set(OVERHEAD_KEYS))
        if unknown or any(not v >= 0 for v in self.overheads.values()):
            raise HardwareError(f"device.overheads: keys must be among {', '.join(OVERHEAD_KEYS)} "
                                f"with values >= 0; got {dict(self.overheads)}")
        if not self.peak_flops or any(not v > 0 for v in self.peak_flops.values()):
            raise HardwareError(f"device {self.name!r}: peak_flops needs positive values")
        for name in ("memory_bytes", "memory_bandwidth", "host_bandwidth", "disk_bandwidth"):
            if not getattr(self, name) > 0:
                raise HardwareError(f"device.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("flash_attention", "fused_elementwise"):
            if not isinstance(getattr(self, name), bool):
                raise HardwareError(f"device.{name} must be true or false, got "
                                    f"{getattr(self, name)!r}")
        for name in ("matmul_efficiency", "attention_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise HardwareError(f"device.{name} must lie in (0, 1], got {getattr(self, name)}")
        dropping = self.attention_dropout_efficiency
        if dropping is not None and not 0 < dropping <= 1:
            raise HardwareError(f"device.attention_dropout_efficiency must lie in (0, 1], got "
                                f"{dropping!r}")
        for name in ("overlap_efficiency", "p2p_overlap_efficiency"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise HardwareError(f"device.{name} must lie in [0, 1], got {value!r}")

    @property
    def is_host(self) -> bool:
        """Whether the device is the host CPU itself (the local ``cpu`` preset and profiles):
        its memory is host memory and its optimizer runs on the host's cores, so offloading
        to ``cpu`` frees nothing and speeds nothing up."""
        return self.name == "cpu"

    @property
    def ring_overlap(self) -> float:
        """Fraction of a ring step's send/recv that hides under the step's compute."""
        if self.p2p_overlap_efficiency is None:
            return self.overlap_efficiency
        return self.p2p_overlap_efficiency

    def peak(self, precision: str) -> float:
        """Peak FLOP/s for a training precision.

        Raises:
            HardwareError: when the device has no rate for that precision (e.g. bf16 on V100).
        """
        if precision not in self.peak_flops:
            raise HardwareError(
                f"precision={precision} is not supported by device {self.name!r}; it supports "
                f"{', '.join(self.peak_flops)}")
        return self.peak_flops[precision]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "DeviceSpec":
        """Build from a YAML/JSON mapping; unknown keys are refused by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise HardwareError(f"unknown device field(s) {', '.join(unknown)}; "
                                f"known: {', '.join(sorted(known))}")
        kwargs = dict(values)
        for key in ("intra", "inter"):
            if isinstance(kwargs.get(key), Mapping):
                kwargs[key] = _link(key, kwargs[key])
        try:
            return cls(**kwargs)
        except TypeError as err:
            raise HardwareError(f"device description incomplete: {err}") from None


def _link(where: str, values: Mapping[str, Any]) -> Link:
    try:
        return Link(name=str(values.get("name", where)), bandwidth=float(values["bandwidth"]),
                    latency=float(values.get("latency", 0.0)))
    except KeyError as err:
        raise HardwareError(f"device.{where} needs {err.args[0]!r}") from None


def _gpu(name: str, fp32: float, half: dict[str, float], mem_gb: float, hbm: float,
         nvlink: Link, net: Link, **extra: Any) -> DeviceSpec:
    return DeviceSpec(name=name, peak_flops={"fp32": fp32 * TF, **{k: v * TF for k, v in
                                                                  half.items()}},
                      memory_bytes=mem_gb * GB, memory_bandwidth=hbm * GB, intra=nvlink,
                      inter=net, **extra)


# Collective bandwidths: ~80% of NVLink per-direction peak and ~90% of NIC line rate, which is
# what NCCL bus-bandwidth tests typically report on these systems.
_NVLINK2 = Link("NVLink 2 (hybrid cube mesh)", 0.8 * 150 * GB, 5e-6)
_NVLINK3 = Link("NVLink 3 / NVSwitch", 0.8 * 300 * GB, 4e-6)
_NVLINK4 = Link("NVLink 4 / NVSwitch", 0.8 * 450 * GB, 3e-6)
_EDR = Link("InfiniBand EDR 4x100 Gb/s per 8 GPUs", 0.9 * 6.25 * GB, 8e-6)
_HDR = Link("InfiniBand HDR 200 Gb/s per GPU", 0.9 * 25 * GB, 8e-6)
_NDR = Link("InfiniBand NDR / RoCE 400 Gb/s per GPU", 0.9 * 50 * GB, 8e-6)


# Sustained fractions of peak (recalled from public GEMM and FlashAttention-2 benchmarks, not
# fitted to the validation runs): large bf16 GEMMs reach ~80% of peak on A100 and ~65% on
# H100 SXM, whose clocks drop under its power limit; causal FlashAttention-2 forward+backward
# reaches ~55% (A100) and ~40% (H100) of peak. Kernel launches overlap execution on GPUs, so
# only ~1 us of tail per kernel is charged.
_AMPERE = dict(matmul_efficiency=0.8, attention_efficiency=0.55, kernel_overhead=1e-6)
_HOPPER = dict(matmul_efficiency=0.65, attention_efficiency=0.4, kernel_overhead=1e-6,
               host_bandwidth=50 * GB)


def device_presets() -> dict[str, DeviceSpec]:
    """All device presets by lower-case name (a fresh dict: callers may not mutate shared state)."""
    presets = {
        "v100-32gb": _gpu("v100-32gb", 15.7, {"fp16": 125}, 32, 900, _NVLINK2, _EDR,
                          host_bandwidth=12 * GB, matmul_efficiency=0.75,
                          attention_efficiency=0.35, flash_attention=False),
        "a100-40gb": _gpu("a100-40gb", 19.5, {"tf32": 156, "bf16": 312, "fp16": 312}, 40,
                          1555, _NVLINK3, _HDR, **_AMPERE),
        "a100-80gb": _gpu("a100-80gb", 19.5, {"tf32": 156, "bf16": 312, "fp16": 312}, 80,
                          2039, _NVLINK3, _HDR, **_AMPERE),
        "h100-80gb": _gpu("h100-80gb", 67, {"tf32": 494.5, "bf16": 989.4, "fp16": 989.4,
                                            "fp8": 1979}, 80, 3350, _NVLINK4, _NDR, **_HOPPER),
        "h200": _gpu("h200", 67, {"tf32": 494.5, "bf16": 989.4, "fp16": 989.4, "fp8": 1979},
                     141, 4800, _NVLINK4, _NDR, **_HOPPER),
        "cpu": local_cpu(),
    }
    return presets


def local_cpu(cores: int | None = None) -> DeviceSpec:
    """A placeholder description of this machine's CPU for ``cores`` workers (default: one
    per core), which share its memory.

    ``tessera profile`` replaces these guesses with measurements.
    """
    cores = cores or os.cpu_count() or 1
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        pages = 8 * GIB
    shm = Link("shared memory (gloo)", 2 * GB, 30e-6)
    # fp16 and bf16 priced at the fp32 rate: autocast on CPU runs both (the runtime trains
    # them there), and no CPU rate for them is measured; CPU fp16 matmuls are often slower,
    # so the planner's CPU fp16 times are optimistic.
    return DeviceSpec(name="cpu", peak_flops={"fp32": 50e9, "bf16": 50e9, "fp16": 50e9},
                      memory_bytes=pages / cores,
                      memory_bandwidth=10 * GB, intra=shm, inter=Link("Ethernet 10 Gb/s", 1.1 * GB,
                                                                       50e-6),
                      host_bandwidth=10 * GB, disk_bandwidth=1 * GB, devices_per_node=cores,
                      matmul_efficiency=1.0, attention_efficiency=0.5, memory_efficiency=1.0,
                      kernel_overhead=20e-6, overlap_efficiency=0.5, reserved_bytes=0.5 * GIB,
                      flash_attention=True,
                      # SDPA with dropout on CPU leaves the fused kernel for the math path:
                      # 1.2-2.8x slower in `measure_attention` on a 2-core host (2026-11-28)
                      attention_dropout_efficiency=0.2)


def get_device(name: str) -> DeviceSpec:
    """A device preset by name (case-insensitive; "_" and "-" are interchangeable).

    Raises:
        HardwareError: for an unknown name, listing the known ones.
    """
    presets = device_presets()
    key = name.strip().lower().replace("_", "-")
    if key not in presets:
        raise HardwareError(f"unknown device preset {name!r}; known: {', '.join(presets)}")
    return presets[key]
