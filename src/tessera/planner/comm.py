"""Communication cost: collectives on the device mesh, in the alpha-beta model.

Ring algorithms (the cost NCCL and gloo approach for large messages), for a group of g
devices and a buffer of S bytes per device:

==============  =====================  =================
collective      bytes on the wire      latency terms
==============  =====================  =================
all_reduce      2 (g-1)/g * S          2 (g-1) alpha
all_gather      (g-1)/g * S (output)   (g-1) alpha
reduce_scatter  (g-1)/g * S (input)    (g-1) alpha
all_to_all      (g-1)/g * S            (g-1) alpha
p2p             S                      alpha
==============  =====================  =================

divided by the link bandwidth: the intra-node link when the whole group sits in one node, the
per-device inter-node link otherwise (every device has its own NIC in DGX-like nodes, so ring
bandwidth per device is the NIC's). A profiled cluster's measured fits replace this formula
for groups inside a node; for a group size that was not measured, the measured bus bandwidth
of the nearest size is used (bus bandwidth = algorithm bandwidth x wire factor, NCCL-tests).

On a profiled CPU cluster every blocking collective inside the node also pays the measured
sync penalty of its group size (:meth:`Cluster.sync_seconds`): with more workers than cores, a
collective completes only once every member has been scheduled again.

Rank order on the mesh is tp (fastest), sp, dp, pp (slowest), as in Megatron-LM, so tensor
parallel groups are the most local.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

from tessera.planner.cluster import Cluster, CollectiveFit
from tessera.planner.hardware import Link

_WIRE = {"all_reduce": lambda g: 2 * (g - 1) / g, "all_gather": lambda g: (g - 1) / g,
         "reduce_scatter": lambda g: (g - 1) / g, "all_to_all": lambda g: (g - 1) / g,
         "p2p": lambda g: 1.0, "ring_step": lambda g: 1.0, "broadcast": lambda g: 1.0}
_STEPS = {"all_reduce": lambda g: 2 * (g - 1), "all_gather": lambda g: g - 1,
          "reduce_scatter": lambda g: g - 1, "all_to_all": lambda g: g - 1, "p2p": lambda g: 1,
          "ring_step": lambda g: 1, "broadcast": lambda g: max(1, math.ceil(math.log2(g)))}


@dataclass(frozen=True)
class Group:
    """A process group on the mesh: its size and the rank stride between members."""

    size: int
    stride: int

    def inside_node(self, devices_per_node: int) -> bool:
        """True when every member shares a node (members are ``stride`` ranks apart)."""
        return self.size == 1 or self.stride * self.size <= devices_per_node


def mesh_groups(tp: int, sp: int, dp: int, pp: int) -> dict[str, Group]:
    """Groups of each axis under the rank order tp, sp, dp, pp (fastest first).

    ``dp_sp`` is the gradient group: sequence-parallel ranks hold the same parameters.
    """
    return {"tp": Group(tp, 1), "sp": Group(sp, tp), "dp": Group(dp, tp * sp),
            "dp_sp": Group(dp * sp, tp), "pp": Group(pp, tp * sp * dp)}


def collective_time(cluster: Cluster, op: str, nbytes: float, group: Group) -> float:
    """Seconds for one collective of ``nbytes`` per device over ``group``.

    Args:
        cluster: devices and, optionally, measured fits.
        op: one of all_reduce, all_gather, reduce_scatter, all_to_all, p2p, ring_step,
            broadcast.
        nbytes: the buffer per device (all_gather: the gathered output; p2p: the message).
        group: the process group; for p2p, the ring or pair the message travels in (a pair
            of neighbouring pipeline stages is ``Group(2, pp_stride)``).
    """
    g = group.size
    if nbytes <= 0 or g <= 1:
        return 0.0
    inside = group.inside_node(cluster.devices_per_node)
    fits = cluster.collectives.get(op, {})
    if inside and fits:
        return _from_fits(fits, op, nbytes, g) + cluster.sync_seconds(g)
    link = cluster.device.intra if inside else cluster.device.inter
    return _STEPS[op](g) * link.latency + _WIRE[op](g) * nbytes / link.bandwidth


def link_from_fit(name: str, op: str, g: int, fit: CollectiveFit) -> Link:
    """The per-device link (alpha-beta) that a measured fit of ``op`` over ``g`` devices
    implies: bus bandwidth = algorithm bandwidth x wire factor, latency per ring step. The
    inverse of :func:`collective_time`'s formula, so the link prices ``op`` at ``g`` as
    measured and other ops and sizes by the ring model."""
    return Link(name, bandwidth=fit.bandwidth * _WIRE[op](g),
                latency=fit.latency / max(_STEPS[op](g), 1))


def _from_fits(fits, op: str, nbytes: float, g: int) -> float:
    if g in fits:
        return fits[g].time(nbytes)
    nearest = min(fits, key=lambda size: (abs(size - g), size))
    fit = fits[nearest]
    bus_bw = fit.bandwidth * _WIRE[op](nearest)
    alpha = fit.latency / max(_STEPS[op](nearest), 1)
    return _STEPS[op](g) * alpha + _WIRE[op](g) * nbytes / bus_bw


def summa_time(cluster: Cluster, m: float, n: float, k: float, count: int, q: int,
               nbytes_el: int, group: Group) -> float:
    """Communication of ``count`` SUMMA products ``(m,k) x (k,n)`` on a q x q grid (Optimus).

    Each of the q steps broadcasts an ``(m/q, k/q)`` block along the row and a ``(k/q, n/q)``
    block along the column; a pipelined broadcast costs about an all-gather of the same data,
    so each device moves ``(m k + k n) / q`` elements per product. The runtime issues it as
    q broadcasts per operand, so each product pays 2 q collective latencies, not 2. A profiled
    cluster prices exactly those broadcasts (of ``(m/q, k/q)`` and ``(k/q, n/q)`` blocks) from
    its measured broadcast fits; backward's reduces are priced like broadcasts.
    """
    if q <= 1:
        return 0.0
    row = Group(q, group.stride)
    col = Group(q, group.stride * q)
    if "broadcast" in cluster.collectives:  # profiled: the runtime's q broadcasts per operand
        a_block, b_block = m * k / q / q * nbytes_el, k * n / q / q * nbytes_el
        return count * q * (collective_time(cluster, "broadcast", a_block, row)
                            + collective_time(cluster, "broadcast", b_block, col))
    a_bytes = m * k / q * nbytes_el
    b_bytes = k * n / q * nbytes_el
    per = collective_time(cluster, "all_gather", a_bytes, row) + collective_time(
        cluster, "all_gather", b_bytes, col)
    per += (q - 1) * (call_time(cluster, row) + call_time(cluster, col))
    return count * per


def call_time(cluster: Cluster, group: Group) -> float:
    """Seconds of one tiny blocking collective (latency, and the sync penalty if measured)."""
    return collective_time(cluster, "all_reduce", 4.0, group)
