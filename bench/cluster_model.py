"""The paper model of `bench cluster`: what 3, 5 and 9 nodes of 8 cores would commit, from the
CPU one committed transaction cost each role in the measured run.

It rests on these assumptions (docs/benchmarks.md repeats them under the table):

1. CPU per transaction stays what was measured: the coordinators' and the nats-servers' (all
   three together: an R3 stream writes each record on three nodes whatever the cluster's
   size). Batches grow with load, so at a higher rate it is rather less (the estimate is
   conservative there), but no more.
2. The cluster's nodes run nats-server and the coordinators; producers run on the
   application's own hosts (their cores are given apart, not charged to the nodes).
3. Partitions' streams and their leaders, and the coordinators, are spread evenly over the
   nodes, with more partitions than nodes (issue 32, items 1 and 2): every node carries
   1/N of the work. With one log for every partition (the layout before item 1), the node
   leading it carries the busiest node's measured share whatever N is: the "one log leader"
   column, an upper bound.
4. A node gives `UTILIZATION` of its cores to this work (headroom for bursts, GC, fsync).
5. A coordinator process is one Python event loop: at most one core each, so a node runs as
   many as its share needs (the column says how many in all).
6. Latency does not bind: producers keep enough transactions in flight (Little's law:
   rate times the measured commit p50) and the disks take the fsyncs (one per batch).

Raw JetStream is modelled the same way (R3 acked publishes: the nats-servers' CPU per message
measured in the same run), so every figure is also a ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NODES = (3, 5, 9)
CORES = 8
UTILIZATION = 0.7


@dataclass(frozen=True)
class PerTransaction:
    """CPU seconds per committed transaction (raw: per acked message), measured."""

    coordinator: float
    """All coordinator processes together."""
    producer: float
    servers: float
    """All nats-servers together."""
    busiest_server: float
    """The nats-server of the busiest node alone."""
    raw_servers: float
    """All nats-servers together, per raw acked R3 publish."""
    commit_p50: float
    """Seconds: a commit's median latency, for Little's law."""


@dataclass(frozen=True)
class Estimate:
    nodes: int
    commits: float
    """Commits per second with leaders spread (assumption 3)."""
    raw: float
    """Raw R3 acked publishes per second on the same nodes."""
    one_log_leader: float
    """Commits per second at most with one log for every partition."""
    coordinator_processes: int
    producer_cores: float
    """Application cores the producers need for `commits`."""
    in_flight: int
    """Transactions in flight needed for `commits` (Little's law)."""

    @property
    def ratio(self) -> float:
        return self.commits / self.raw


def estimate(
    per: PerTransaction, nodes: int, *, cores: int = CORES, utilization: float = UTILIZATION
) -> Estimate:
    """What `nodes` nodes of `cores` cores would do, by the assumptions of this module."""
    if min(per.coordinator, per.servers, per.busiest_server, per.raw_servers) <= 0:
        raise ValueError(f"every measured CPU cost must be positive: {per}")
    budget = nodes * cores * utilization
    """Core-seconds per second the cluster gives to the work."""
    commits = budget / (per.coordinator + per.servers)
    return Estimate(
        nodes=nodes,
        commits=commits,
        raw=budget / per.raw_servers,
        one_log_leader=min(commits, cores * utilization / per.busiest_server),
        coordinator_processes=math.ceil(commits * per.coordinator / utilization),
        producer_cores=commits * per.producer / utilization,
        in_flight=math.ceil(commits * per.commit_p50),
    )
