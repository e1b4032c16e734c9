"""Memory tiers: the compute device under a byte budget, host memory, and files on disk.

On a CPU-only machine the compute device is the CPU itself: its tier is ordinary CPU memory
whose model data the manager counts and caps, so the placement logic (and its tests) run the
same as on a GPU. On CUDA the device tier is GPU memory, the host tier is pinned, and moves go
on a side stream so prefetches overlap compute. Every move is counted in bytes per direction.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

DEVICE, HOST, DISK = "device", "host", "disk"


class MemoryBudgetError(RuntimeError):
    """A budget is too small for what must be resident; the message names the minimum."""


class DiskTierError(ValueError):
    """The disk directory is missing, read-only or too small."""


class DiskFullError(DiskTierError):
    """A write to the disk tier found no space; names the directory and the bytes needed."""


# Test-only fault injection (docs/training.md): the disk directory behaves as a filesystem of
# this many bytes, all its files counted, so a test fills it by writing a file there. Unset in
# normal runs, where free space is the filesystem's own.
FAULT_CAPACITY_ENV = "TESSERA_FAULT_DISK_CAPACITY"


@dataclass
class TransferStats:
    """Bytes moved between tiers, per direction, e.g. ``{("device", "host"): 1024}``."""

    moved: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, src: str, dst: str, nbytes: int) -> None:
        self.moved[(src, dst)] = self.moved.get((src, dst), 0) + nbytes

    def between(self, a: str, b: str) -> int:
        """Bytes moved either way between tiers ``a`` and ``b``."""
        return self.moved.get((a, b), 0) + self.moved.get((b, a), 0)

    def snapshot(self) -> dict[str, int]:
        return {f"{s}->{d}": n for (s, d), n in sorted(self.moved.items())}


class Tier:
    """A place for chunk payloads with an optional byte budget that allocation enforces.

    Args:
        name: "device" or "host".
        device: where tensors of this tier live.
        budget: bytes of chunk payload (plus non-model bytes for the device) allowed, or None.
        pin: allocate pinned host memory (host tier on CUDA machines).
    """

    def __init__(self, name: str, device: torch.device, budget: int | None = None,
                 pin: bool = False) -> None:
        self.name, self.device, self.budget, self.pin = name, device, budget, pin
        self.used = 0  # chunk payload bytes held
        self.nonmodel = 0  # non-model bytes in use (device tier; set by the tracer)
        self.peak = 0  # highest used + nonmodel seen

    @property
    def accounted(self) -> int:
        return self.used + self.nonmodel

    def room(self, reserve: int = 0) -> float:
        """Bytes still free for chunks, keeping ``reserve`` for non-model data."""
        if self.budget is None:
            return float("inf")
        return self.budget - self.used - max(reserve, self.nonmodel)

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed flat buffer; raises MemoryBudgetError if it would break the budget."""
        nbytes = numel * _itemsize(dtype)
        if self.budget is not None and self.accounted + nbytes > self.budget:
            raise MemoryBudgetError(
                f"{self.name} tier: {nbytes} more bytes would exceed its budget of "
                f"{self.budget} bytes ({self.used} in chunks, {self.nonmodel} non-model)")
        self.used += nbytes
        self.note_peak()
        return torch.zeros(numel, dtype=dtype, device=self.device, pin_memory=self.pin)

    def free(self, tensor: torch.Tensor) -> None:
        self.used -= tensor.numel() * tensor.element_size()

    def note_peak(self) -> None:
        self.peak = max(self.peak, self.accounted)


class DiskTier:
    """Chunk payloads as raw files in one directory (model data beyond host memory).

    Raises:
        DiskTierError: at construction when the directory is missing, not writable, or has
            less free space than ``need_bytes``.
    """

    def __init__(self, directory: str | os.PathLike, need_bytes: int = 0) -> None:
        self.dir = Path(directory)
        check_disk_dir(self.dir, need_bytes)
        self.files: dict[str, tuple[torch.dtype, int]] = {}

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Store a payload as ``<dir>/<key>.bin``.

        Raises:
            DiskFullError: the filesystem (or an injected capacity) has no room; the partial
                file is removed and the payload stays where it was.
        """
        path = self.dir / f"{key}.bin"
        # Raw bytes (uint8 view) so bf16, which numpy lacks, round-trips too.
        data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy()
        try:
            if os.environ.get(FAULT_CAPACITY_ENV) and free_bytes(self.dir) < data.nbytes:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            # Not numpy's tofile: it can miss an ENOSPC that only shows when the buffer is
            # flushed; closing a Python file raises it.
            with open(path, "wb") as handle:
                handle.write(data.data)
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            path.unlink(missing_ok=True)  # a torn chunk file must never be read back
            raise self._full(key, data.nbytes, err) from None
        self.files[key] = (tensor.dtype, tensor.numel())

    def _full(self, key: str, nbytes: int, err: OSError) -> DiskFullError:
        held = sum(numel * _itemsize(dtype) for dtype, numel in self.files.values())
        return DiskFullError(
            f"memory.disk_dir {self.dir} is full ({err.strerror}): writing {key} needs "
            f"{nbytes} bytes, {free_bytes(self.dir)} are free; this disk tier holds {held} "
            f"bytes in {len(self.files)} files. Free space there (or set memory.disk_dir to "
            f"a larger disk) and resume from the last checkpoint with --resume")

    def read(self, key: str) -> torch.Tensor:
        dtype, numel = self.files.pop(key)
        path = self.dir / f"{key}.bin"
        raw = torch.from_file(str(path), shared=False, size=numel * _itemsize(dtype),
                              dtype=torch.uint8)
        path.unlink()
        return raw.view(dtype)

    def cleanup(self) -> None:
        for key in list(self.files):
            (self.dir / f"{key}.bin").unlink(missing_ok=True)
        self.files.clear()


def check_disk_dir(directory: Path, need_bytes: int = 0) -> None:
    """Refuse a disk directory that is missing, read-only or too small (up front)."""
    if not directory.is_dir():
        raise DiskTierError(f"memory.disk_dir {directory} does not exist or is not a directory")
    # Probe with a real file: permission bits say nothing for root or read-only mounts.
    probe = directory / f".tessera_probe_{os.getpid()}"
    try:
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as err:
        raise DiskTierError(f"memory.disk_dir {directory} is not writable ({err.strerror})"
                            ) from None
    free = free_bytes(directory)
    if need_bytes and free < need_bytes:
        raise DiskTierError(f"memory.disk_dir {directory} has {free} bytes free; the model data "
                            f"that may spill to disk needs {need_bytes}")


def free_bytes(directory: Path) -> int:
    """Free bytes for the disk tier: the filesystem's, or what an injected capacity leaves."""
    capacity = os.environ.get(FAULT_CAPACITY_ENV)
    if not capacity:
        return shutil.disk_usage(directory).free
    used = 0
    for entry in os.scandir(directory):
        try:
            used += entry.stat().st_size if entry.is_file() else 0
        except FileNotFoundError:  # another rank's tier removed it meanwhile
            pass
    return max(0, parse_bytes(capacity) - used)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def parse_bytes(value: int | str | None) -> int | None:
    """Bytes from an int or text like ``64MiB``, ``1.5GB``, ``200k``; None stays None."""
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(float(text))
