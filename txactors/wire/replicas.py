"""When a JetStream replica group is current, read from the cluster info the server sends.

Pure, so both sides ask it the same way: recovery before it reads a stream
(`nats.current.wait_current`) and the embedded cluster before it calls itself ready
(`embedded.cluster`). On a single server the info has no replicas, and the group is current
as soon as it answers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from nats.js.api import ClusterInfo, PeerInfo

HEARD_WITHIN: Final = 3.0
"""Seconds: a live replica is heard from about every second (raft heartbeats)."""


def reachable(peer: PeerInfo) -> bool:
    """A replica the leader has heard from within `HEARD_WITHIN`. One that is offline, silent
    for longer, or never heard from since this leader was elected (`active` 0: the old
    leader, killed) serves no read and must not hold one up; a killed server is never
    marked offline."""
    silent = (peer.active or 0) / 1e9  # nanoseconds since the leader last heard from it
    return not peer.offline and 0 < silent < HEARD_WITHIN


def why_not_current(
    what: str, cluster: ClusterInfo | None, counted: Callable[[PeerInfo], bool] = reachable
) -> str | None:
    """Why the replica group of `what` is not current (no leader, a `counted` replica
    behind), or None when it is. No cluster info: a single server's stream, current."""
    if cluster is None:
        return None
    if not cluster.leader:
        return f"{what} has no leader"
    behind = sorted(
        peer.name or "?" for peer in cluster.replicas or () if counted(peer) and not peer.current
    )
    return f"{what}: {', '.join(behind)} not current" if behind else None
