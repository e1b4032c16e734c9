"""Throughput, model FLOPs utilisation (MFU) and the metrics JSON-lines file."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

# Dense peak FLOP/s per device by (name fragment, precision), from the vendors' data sheets.
_GPU_PEAKS = {
    ("H200", "bf16"): 989e12, ("H100", "bf16"): 989e12, ("A100", "bf16"): 312e12,
    ("H200", "fp16"): 989e12, ("H100", "fp16"): 989e12, ("A100", "fp16"): 312e12,
    ("H200", "fp32"): 67e12, ("H100", "fp32"): 67e12, ("A100", "fp32"): 19.5e12,
    ("V100", "fp16"): 125e12, ("V100", "fp32"): 15.7e12, ("V100", "bf16"): 15.7e12,
}


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32,
                         size: int = 256, repeats: int = 32) -> float:
    """Achieved FLOP/s of a square matmul on ``device``: the CPU's practical peak."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(3):  # best of three: the first trials often run before clocks ramp up
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 * repeats / best


def peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for (fragment, prec), value in _GPU_PEAKS.items():
            if fragment in name and prec == precision:
                return value, f"data sheet ({fragment} {prec})"
    measured = measure_matmul_flops(device)
    return measured, "measured fp32 matmul on this device"


class MetricsWriter:
    """Appends one JSON object per line to ``metrics.jsonl`` (rank 0 only)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


class Throughput:
    """Tokens per second and MFU over the steps since the last report."""

    def __init__(self, flops_per_token: float, peak_flops_per_device: float, world_size: int
                 ) -> None:
        self.flops_per_token = flops_per_token
        self.peak_total = peak_flops_per_device * world_size
        self._start, self._tokens = time.perf_counter(), 0

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def report(self) -> tuple[float, float]:
        """(tokens/s, MFU) since the last report, then restart the window."""
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        tokens_per_s = self._tokens / elapsed
        mfu = tokens_per_s * self.flops_per_token / self.peak_total
        self._start, self._tokens = time.perf_counter(), 0
        return tokens_per_s, mfu
