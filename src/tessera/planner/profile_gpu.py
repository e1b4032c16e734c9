"""``tessera profile`` on CUDA devices: measure the GPUs of this node (or, under torchrun,
of every node) and describe them as a cluster the planner reads.

Measured on the first device (rank 0's under torchrun), timed with device synchronisation:

- matmul throughput by shape in the training precision (bf16; fp16 before Ampere);
- fused causal attention (scaled_dot_product_attention) forward + backward as a fraction of
  the device's peak;
- device memory bandwidth (an out-of-place add), one fused AdamW update's traffic per
  parameter (the runtime's optimizer on CUDA), and the device's memory;

and between devices (``profile_links.py``, one process per device over NCCL): collective
latency and bandwidth by operation and group size inside the node, all_reduce across nodes
under torchrun, the overlap of communication with compute, and pinned host <-> device copies
(the offload link) with every device of the node copying at once (one device alone when it
is the only one).

Not measured on GPUs: the fixed host seconds of a step (Python, kernel launches; the CPU
profile times them, but on a GPU they overlap the device's work and the simulator has no
model of that overlap yet), the disk link, and the per-kernel tail: those keep the values of
the matching preset (H100, A100, ...); an unknown device keeps the A100 preset's, and its
cross-node link is assumed to be 100 Gb/s Ethernet unless a second node was measured.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import torch
import torch.nn.functional as F

from tessera.planner.cluster import Cluster
from tessera.planner.comm import link_from_fit
from tessera.planner.hardware import GB, DeviceSpec, Link, get_device
from tessera.planner.profile_links import (GPU_FULL, GPU_QUICK, LinkFigures, device_sync,
                                          figures_of, host_link_rate, measure_links,
                                          run_link_worker, time_on_device)

GPU_QUICK_SHAPES = [(512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048),
                    (4096, 4096, 4096), (8192, 8192, 8192)]
GPU_FULL_SHAPES = GPU_QUICK_SHAPES + [(256, 256, 256), (4096, 1024, 4096), (8192, 4096, 1024),
                                      (16384, 8192, 8192), (16384, 12288, 12288)]
# An unknown device's cross-node link when no second node was measured: 100 Gb/s Ethernet.
_ASSUMED_INTER = Link("not measured (assumed 100 Gb/s Ethernet)", 0.9 * 12.5 * GB, 10e-6)


class ProfileError(RuntimeError):
    """The machine cannot be profiled as asked; the message says why."""


def matmul_table(device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int, int]]
                 ) -> list[tuple[tuple[int, int, int], float]]:
    """FLOP/s of ``(m, k) x (k, n)`` in ``dtype`` on ``device`` for each ``(m, n, k)``."""
    sync, out = device_sync(device), []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out.append(((m, n, k), 2.0 * m * n * k / time_on_device(lambda: a @ b, sync)))
    return out


def attention_rate(device: torch.device, dtype: torch.dtype, batch: int = 2, heads: int = 16,
                   seq: int = 4096, head_dim: int = 128) -> float:
    """FLOP/s of causal SDPA forward + backward (the causal half of the scores; backward
    counted as 2.5 forwards, as the simulator prices it)."""
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

    def step():  # gradients returned, not accumulated into .grad (no extra kernels)
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                            (q, k, v), grad)

    flops = 4.0 * batch * seq * seq * heads * head_dim * 0.5 * (1 + 2.5)
    return flops / time_on_device(step, device_sync(device))


def memory_rates(device: torch.device, elements: int = 1 << 26) -> tuple[float, float]:
    """(element-wise bytes/s of an out-of-place fp32 add, bytes per parameter of one AdamW
    step at that rate), with the optimizer the runtime builds on this device (fused on
    CUDA)."""
    bandwidth = _add_rate(device, elements)
    return bandwidth, _adam_seconds(device, elements) * bandwidth / elements


def _add_rate(device: torch.device, elements: int) -> float:
    x, y = torch.randn(elements, device=device), torch.randn(elements, device=device)
    z = torch.empty_like(x)
    return 3 * 4 * elements / time_on_device(lambda: torch.add(x, y, out=z),
                                             device_sync(device))


def _adam_seconds(device: torch.device, elements: int) -> float:
    params = [torch.nn.Parameter(torch.randn(elements // 8, device=device)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=device.type == "cuda")
    return time_on_device(opt.step, device_sync(device))


def match_preset(device_name: str, memory_bytes: float) -> str | None:
    """The preset of a CUDA device by its reported name and memory, None when unknown."""
    name = device_name.upper()
    if "H200" in name:
        return "h200"
    if "H100" in name:
        return "h100-80gb"
    if "A100" in name:
        return "a100-80gb" if memory_bytes > 50 * 2**30 else "a100-40gb"
    if "V100" in name:
        return "v100-32gb"
    return None


def training_dtype() -> tuple[str, torch.dtype]:
    """The half precision this GPU trains in: bf16 where the hardware has it (Ampere and
    later), else fp16 (torch would otherwise report V100 and T4 as bf16-capable through
    emulation)."""
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return "bf16", torch.bfloat16
    return "fp16", torch.float16


@dataclasses.dataclass(frozen=True)
class DeviceFigures:
    """One device's measurements (:func:`measure_device`)."""

    name: str                 # torch.cuda.get_device_name
    memory_bytes: float
    precision: str            # the matmul table's precision
    table: list               # [((m, n, k), FLOP/s)]
    fp32_rate: float          # FLOP/s of the largest shape in fp32
    attention_rate: float
    memory_bandwidth: float
    adam_bytes: float
    host_bandwidth: float


def measure_device(index: int = 0, quick: bool = False,
                   log: Callable[[str], None] = lambda msg: None) -> DeviceFigures:
    """Measure CUDA device ``index``."""
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    precision, dtype = training_dtype()
    shapes = GPU_QUICK_SHAPES if quick else GPU_FULL_SHAPES
    log(f"matmul throughput by shape ({precision}) on {torch.cuda.get_device_name(device)} ...")
    table = matmul_table(device, dtype, shapes)
    fp32 = matmul_table(device, torch.float32, [max(shapes, key=lambda s: s[0] * s[1] * s[2])])
    log("attention, memory bandwidth, AdamW, host <-> device copies ...")
    attention = attention_rate(device, dtype)
    bandwidth, adam_bytes = memory_rates(device)
    return DeviceFigures(name=torch.cuda.get_device_name(device),
                         memory_bytes=float(torch.cuda.get_device_properties(device)
                                            .total_memory),
                         precision=precision, table=table, fp32_rate=fp32[0][1],
                         attention_rate=attention, memory_bandwidth=bandwidth,
                         adam_bytes=adam_bytes, host_bandwidth=host_link_rate(device))


def device_spec(figures: DeviceFigures, links: LinkFigures | None) -> DeviceSpec:
    """The profiled device: a matching preset's datasheet peaks and unmeasured fields, with
    every measured figure in place of the preset's; for an unknown device, the measured
    rates as its peaks."""
    preset_name = match_preset(figures.name, figures.memory_bytes)
    best = max(rate for _, rate in figures.table)
    if preset_name:
        base = get_device(preset_name)
        peaks = dict(base.peak_flops)
    else:
        # An unknown device keeps the A100 preset's unmeasured fields (reserved memory, disk
        # link, kernel tail); every measured field is replaced below.
        base = get_device("a100-80gb")
        peaks = {"fp32": figures.fp32_rate, figures.precision: best}
    intra, inter = base.intra, base.inter if preset_name else _ASSUMED_INTER
    if links and links.intra.get("all_reduce"):
        fits = links.intra["all_reduce"]
        g = max(fits)
        intra = link_from_fit(f"measured all_reduce over {g} devices", "all_reduce", g, fits[g])
    if links and links.nodes > 1 and "all_reduce" in links.cross:
        inter = link_from_fit(f"measured all_reduce across {links.nodes} nodes", "all_reduce",
                              links.nodes, links.cross["all_reduce"])
    overlap = {} if links is None else {"overlap_efficiency": links.overlap,
                                        "p2p_overlap_efficiency": links.ring_overlap}
    return dataclasses.replace(
        base, name=preset_name or "cuda", peak_flops=peaks, memory_bytes=figures.memory_bytes,
        memory_bandwidth=figures.memory_bandwidth, memory_efficiency=1.0,
        matmul_efficiency=min(1.0, best / peaks[figures.precision]),
        attention_efficiency=min(1.0, figures.attention_rate / peaks[figures.precision]),
        optimizer_bytes_per_param=figures.adam_bytes,
        # all of a node's devices copying at once where measured, else the one device alone
        host_bandwidth=(links.host_bandwidth if links and links.host_bandwidth
                        else figures.host_bandwidth),
        intra=intra, inter=inter, overheads={}, **overlap)


def torchrun_layout() -> tuple[int, int, int] | None:
    """(rank, world, processes per node) when started by torchrun, else None."""
    if not all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")):
        return None
    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
            int(os.environ["LOCAL_WORLD_SIZE"]))


def profile_gpu_cluster(quick: bool = False, log: Callable[[str], None] = lambda msg: None
                        ) -> Cluster | None:
    """Measure the CUDA devices and return the cluster (None on ranks other than 0 under
    torchrun, which only take part in the collectives).

    On its own it measures this node: one process per visible device. Under ``torchrun
    --nnodes N --nproc-per-node G`` every process measures with the others and rank 0 also
    fits the cross-node link.

    Raises:
        ProfileError: without CUDA devices.
    """
    if not torch.cuda.is_available():
        raise ProfileError("no CUDA device is visible: profile the CPU workers with "
                           "`tessera profile --device cpu`")
    sizes = GPU_QUICK if quick else GPU_FULL
    layout = torchrun_layout()
    links: LinkFigures | None = None
    if layout:
        rank, world, per_node = layout
        log(f"collectives over NCCL: {world} processes, {per_node} per node ...")
        data = run_link_worker(rank, world, per_node, "cuda", "nccl", sizes)
        if data is None:
            return None
        links = figures_of(data)
        per_node_devices, nodes = per_node, world // per_node
    else:
        per_node_devices, nodes = torch.cuda.device_count(), 1
        if per_node_devices > 1:
            log(f"collectives over NCCL between {per_node_devices} devices ...")
            links = measure_links(per_node_devices, "cuda", "nccl", sizes)
        else:
            log("one device: no collectives to measure; the preset's links are kept")
    figures = measure_device(torch.cuda.current_device() if layout else 0, quick, log)
    device = device_spec(figures, links)
    return Cluster(device=device, devices_per_node=per_node_devices, nodes=nodes,
                   name=f"{device.name}:{per_node_devices}x{nodes} (profiled)",
                   matmul_table=tuple(figures.table), matmul_precision=figures.precision,
                   collectives={} if links is None else links.intra)
