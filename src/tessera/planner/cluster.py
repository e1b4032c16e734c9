"""Cluster description: a device class, how many per node, how many nodes, and measurements.

Three ways in: a preset shorthand (``a100-80gb:8x128`` is 8 devices per node, 128 nodes, with
the preset's interconnect), a YAML file (anything else, including what ``tessera profile``
writes), or a :class:`Cluster` built in Python.

A profiled cluster carries measured tables: matmul throughput by shape and collective latency
and bandwidth by operation and group size. The cost model prefers a measurement to a preset
formula whenever one covers the case.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from tessera.planner.hardware import DeviceSpec, HardwareError, get_device, local_cpu

# ring_step: every member sends to the next and receives from the previous at once (a ring
# attention step: K, V and token metadata, three messages in one batch); broadcast: from one member to the others (SUMMA's block exchange). Both are
# measured by `tessera profile` only.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p", "ring_step",
               "broadcast")


class ClusterError(ValueError):
    """A cluster description is malformed; the message names the field or token."""


@dataclass(frozen=True)
class CollectiveFit:
    """Measured alpha-beta fit of one collective at one group size: t = latency + bytes/bw."""

    latency: float
    bandwidth: float

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Cluster:
    """Devices of one class arranged in nodes.

    Attributes:
        device: the device class.
        devices_per_node: devices sharing the intra-node link.
        nodes: number of nodes.
        name: label for reports.
        matmul_table: measured ((m, n, k), FLOP/s) pairs; empty means use the device preset.
        matmul_precision: the precision the table was measured in (fp32 for CPU workers,
            bf16 or fp16 for GPUs); other precisions scale it by the ratio of their peaks.
        collectives: measured fits, ``{op: {group_size: CollectiveFit}}`` for groups inside a
            node; empty means alpha-beta from the device's links.
        compute_slots: cores that a node's workers share (CPU); None when each device computes
            on its own. More workers than slots slows each one down proportionally.
        concurrency: measured fraction of a lone worker's training-step rate that each of g workers
            gets when all run at once, ``{g: fraction}`` (profile; it sees other load on the
            machine too). Preferred over ``compute_slots`` when present.
        sync_penalty: measured extra seconds of one blocking collective in a group of g
            workers while every worker computes between collectives, ``{g: seconds}``
            (profile). With more workers than cores, a collective waits until each member
            has been scheduled again; idle-machine fits (``collectives``) do not see this.
        straggler: measured fraction by which the slowest of g workers sharing cores trails
            their median on the same work, ``{g: fraction}`` (profile).
    """

    device: DeviceSpec
    devices_per_node: int
    nodes: int = 1
    name: str = ""
    matmul_table: tuple[tuple[tuple[int, int, int], float], ...] = ()
    matmul_precision: str = "fp32"
    collectives: Mapping[str, Mapping[int, CollectiveFit]] = field(default_factory=dict)
    compute_slots: int | None = None
    concurrency: Mapping[int, float] = field(default_factory=dict)
    sync_penalty: Mapping[int, float] = field(default_factory=dict)
    straggler: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("devices_per_node", "nodes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ClusterError(f"cluster.{key} must be a positive integer, got {value!r}")
        if not self.name:
            object.__setattr__(self, "name",
                               f"{self.device.name}:{self.devices_per_node}x{self.nodes}")
        if self.matmul_table and self.matmul_precision not in self.device.peak_flops:
            raise ClusterError(f"cluster.matmul_precision {self.matmul_precision!r} has no peak "
                               f"on device {self.device.name!r} (it has "
                               f"{', '.join(self.device.peak_flops)})")
        unknown = sorted(set(self.collectives) - set(COLLECTIVES))
        if unknown:
            raise ClusterError(f"cluster.collectives: unknown operation(s) {', '.join(unknown)}; "
                               f"known: {', '.join(COLLECTIVES)}")

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.nodes

    def with_devices(self, devices_per_node: int, nodes: int = 1) -> "Cluster":
        """The same devices and measurements in another arrangement."""
        return dataclasses.replace(self, devices_per_node=devices_per_node, nodes=nodes, name="")

    def compute_share(self, workers_per_node: int | None = None) -> float:
        """Fraction of one device's compute each worker gets when workers share cores."""
        workers = workers_per_node or self.devices_per_node
        if self.concurrency:
            return self.concurrency[_nearest(self.concurrency, workers)]
        if self.compute_slots is None or workers <= self.compute_slots:
            return 1.0
        return self.compute_slots / workers

    def straggler_fraction(self, workers: int) -> float | None:
        """Measured straggler fraction for ``workers`` workers, None without a measurement."""
        if not self.straggler:
            return None
        return self.straggler[_nearest(self.straggler, workers)]

    def sync_seconds(self, group_size: int) -> float:
        """Measured extra seconds of one blocking collective of ``group_size`` workers under
        load (0 without a measurement, or for a group of one)."""
        if group_size <= 1 or not self.sync_penalty:
            return 0.0
        return self.sync_penalty[_nearest(self.sync_penalty, group_size)]

    # --------------------------------------------------------------------------- serialise
    def to_dict(self) -> dict[str, Any]:
        """Plain dict for YAML (the format :func:`load_cluster` reads)."""
        out: dict[str, Any] = {"name": self.name, "devices_per_node": self.devices_per_node,
                               "nodes": self.nodes, "device": self.device.to_dict()}
        if self.compute_slots is not None:
            out["compute_slots"] = self.compute_slots
        if self.concurrency:
            out["concurrency"] = {int(g): float(v) for g, v in self.concurrency.items()}
        if self.sync_penalty:
            out["sync_penalty"] = {int(g): float(v) for g, v in self.sync_penalty.items()}
        if self.straggler:
            out["straggler"] = {int(g): float(v) for g, v in self.straggler.items()}
        if self.matmul_table:
            out["matmul"] = [{"m": m, "n": n, "k": k, "flops_per_s": float(v)}
                             for (m, n, k), v in self.matmul_table]
            out["matmul_precision"] = self.matmul_precision
        if self.collectives:
            out["collectives"] = {op: {int(g): {"latency": f.latency, "bandwidth": f.bandwidth}
                                       for g, f in fits.items()}
                                  for op, fits in self.collectives.items()}
        return out

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "Cluster":
        """Build from a YAML mapping. ``device`` is a preset name or a full device mapping,
        optionally with ``device_overrides`` applied on top of a preset."""
        known = {"name", "devices_per_node", "nodes", "device", "device_overrides", "matmul",
                 "matmul_precision", "collectives", "compute_slots", "concurrency",
                 "sync_penalty", "straggler"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ClusterError(f"unknown cluster field(s) {', '.join(unknown)}; "
                               f"known: {', '.join(sorted(known))}")
        if "device" not in values:
            raise ClusterError("cluster.device is required (a preset name or a mapping)")
        overrides = values.get("device_overrides") or {}
        device = _device(values["device"], overrides)
        per = values.get("devices_per_node", device.devices_per_node)
        if (isinstance(values["device"], str) and device.is_host and isinstance(per, int)
                and per >= 1 and "memory_bytes" not in overrides):
            device = _host_shared(device, per)  # the preset's workers share the host
        try:
            matmul = tuple(((int(r["m"]), int(r["n"]), int(r["k"])), float(r["flops_per_s"]))
                           for r in values.get("matmul") or ())
            collectives = {op: {int(g): CollectiveFit(float(f["latency"]), float(f["bandwidth"]))
                                for g, f in fits.items()}
                           for op, fits in (values.get("collectives") or {}).items()}
        except (KeyError, TypeError, ValueError) as err:
            raise ClusterError(f"cluster measurement table malformed: {err!r}") from None
        return cls(device=device,
                   devices_per_node=values.get("devices_per_node", device.devices_per_node),
                   nodes=values.get("nodes", 1), name=values.get("name", ""),
                   matmul_table=matmul,
                   matmul_precision=str(values.get("matmul_precision", "fp32")),
                   collectives=collectives,
                   compute_slots=values.get("compute_slots"),
                   concurrency=_by_size(values, "concurrency"),
                   sync_penalty=_by_size(values, "sync_penalty"),
                   straggler=_by_size(values, "straggler"))


def _nearest(table: Mapping[int, float], size: int) -> int:
    """The measured group size closest to ``size`` (the larger one on a tie)."""
    return min(table, key=lambda g: (abs(g - size), -g))


def _by_size(values: Mapping[str, Any], key: str) -> dict[int, float]:
    """A ``{group size: number}`` table of a cluster mapping, checked."""
    try:
        return {int(g): float(v) for g, v in (values.get(key) or {}).items()}
    except (AttributeError, TypeError, ValueError) as err:
        raise ClusterError(f"cluster.{key} must map group sizes to numbers: {err}") from None


def _host_shared(device: DeviceSpec, workers: int) -> DeviceSpec:
    """The ``cpu`` preset for ``workers`` workers per node: they share the host's memory, so
    8 workers on 2 cores get 1/8 of it each, not the 1/2 the preset (per core) gives."""
    return dataclasses.replace(device, memory_bytes=local_cpu(workers).memory_bytes)


def _device(spec: Any, overrides: Mapping[str, Any]) -> DeviceSpec:
    try:
        if isinstance(spec, str):
            device = get_device(spec)
            if overrides:
                merged = {**device.to_dict(), **overrides}
                for key in ("intra", "inter"):
                    if isinstance(overrides.get(key), Mapping):
                        merged[key] = {**device.to_dict()[key], **overrides[key]}
                device = DeviceSpec.from_mapping(merged)
            return device
        if isinstance(spec, Mapping):
            return DeviceSpec.from_mapping(spec)
    except HardwareError as err:
        raise ClusterError(f"cluster.device: {err}") from None
    raise ClusterError(f"cluster.device must be a preset name or a mapping, got {spec!r}")


_SHORTHAND = re.compile(r"^(?P<dev>[A-Za-z0-9_.-]+)(?::(?P<per>\d+)(?:x(?P<nodes>\d+))?)?$")


def parse_cluster(text: str) -> Cluster:
    """A cluster from ``device[:per_node[xnodes]]`` shorthand or a YAML file path.

    Examples: ``a100-80gb:8x128``, ``h100-80gb:8`` (one node of 8), ``cpu:4x1``,
    ``my_cluster.yaml``.

    Raises:
        ClusterError: naming the bad token or the unknown preset.
    """
    if not isinstance(text, str) or not text.strip():
        raise ClusterError("cluster is empty; expected e.g. 'a100-80gb:8x128' or a YAML file")
    text = text.strip()
    if text.endswith((".yaml", ".yml", ".json")) or os.path.sep in text:
        return load_cluster(text)
    match = _SHORTHAND.match(text)
    if not match:
        raise ClusterError(f"cluster shorthand {text!r} is malformed; expected "
                           "DEVICE:PER_NODExNODES, e.g. 'a100-80gb:8x128'")
    try:
        device = get_device(match["dev"])
    except HardwareError as err:
        raise ClusterError(str(err)) from None
    per = int(match["per"]) if match["per"] else device.devices_per_node
    nodes = int(match["nodes"]) if match["nodes"] else 1
    if per < 1 or nodes < 1:
        raise ClusterError(f"cluster {text!r}: devices per node and nodes must be >= 1")
    if device.is_host:
        device = _host_shared(device, per)
    slots = (os.cpu_count() or 1) if device.is_host else None
    return Cluster(device=device, devices_per_node=per, nodes=nodes, compute_slots=slots)


def load_cluster(path: str) -> Cluster:
    """Read a cluster YAML file (as written by ``tessera profile`` or by hand)."""
    try:
        with open(path, encoding="utf-8") as handle:
            values = yaml.safe_load(handle)
    except (OSError, ValueError) as err:  # ValueError: e.g. a NUL byte in the path
        raise ClusterError(f"cannot read cluster file {path!r}: "
                           f"{getattr(err, 'strerror', None) or err}") from None
    except yaml.YAMLError as err:
        raise ClusterError(f"cluster file {path!r} is not valid YAML: {err}") from None
    if not isinstance(values, Mapping):
        raise ClusterError(f"cluster file {path!r} must hold a mapping")
    return Cluster.from_mapping(values)


def save_cluster(cluster: Cluster, path: str) -> None:
    """Write a cluster YAML file that :func:`load_cluster` reads back."""
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(cluster.to_dict(), handle, sort_keys=False)
