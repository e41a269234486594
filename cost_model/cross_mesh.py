"""Cross-mesh resharding between pipeline stages, priced as it runs.

A value moves from the sender's submesh to the receiver's (an activation
forward, its gradient backward).  Sent naively, every receiver device fetches
its own shard over the slow link between the two submeshes, so a value
replicated over ``r`` receiver devices crosses that link ``r`` times.  Alpa
(Zheng et al., OSDI'22, section 6, "local all-gather") sends each distinct
piece once instead: the receiver's replicas of a shard each take a ``1/r``
slice of it over the slow link, then all-gather the slices over the fast
links inside the receiver's mesh.  :mod:`meshplan.runtime.pipeline_transport`
runs exactly that (:func:`meshplan.runtime.pipeline_transport.send_once_hop`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CrossMeshCost:
    """One cross-mesh transfer of a value, send-once."""
    slow_bytes: float     # bytes over the busiest device's share of the slow link
    gather_bytes: float   # bytes each receiver device takes in during the all-gather
    seconds: float


def cross_mesh_cost(nbytes: float, senders: int, receivers: int, replication: float,
                    slow_bw: float, slow_lat: float, fast_bw: float, fast_lat: float
                    ) -> CrossMeshCost:
    """A value of ``nbytes`` from ``senders`` devices to ``receivers``
    devices whose layout holds each byte on ``replication`` of them.

    Slow hop: every byte crosses once, the value cut into one piece per
    receiver device; each piece leaves from a sender device that holds it,
    the holders taking turns, so the busiest link carries
    ``nbytes / min(senders, receivers)`` at ``slow_bw`` (one device's share
    of the links between the submeshes), after one ``slow_lat``.  Gather: each
    receiver shard (``nbytes * replication / receivers``) is all-gathered
    over its ``replication`` holders, a ring on the fast links:
    ``(r - 1)`` steps each moving ``1/r`` of the shard."""
    if nbytes <= 0:
        return CrossMeshCost(0.0, 0.0, 0.0)
    links = max(1, min(senders, receivers))
    slow = nbytes / links
    r = max(1.0, min(float(replication), float(receivers)))
    shard = nbytes * r / receivers
    gathered = shard * (r - 1) / r
    t = slow_lat + slow / slow_bw
    if gathered > 0:
        t += (r - 1) * fast_lat + gathered / fast_bw
    return CrossMeshCost(slow, gathered, t)


def per_replica_bytes(nbytes: float, senders: int, receivers: int, replication: float) -> float:
    """[for comparison] the busiest slow link's bytes when every receiver
    device fetches its own shard: ``replication`` times the send-once figure."""
    return nbytes * max(1.0, replication) / max(1, min(senders, receivers))
