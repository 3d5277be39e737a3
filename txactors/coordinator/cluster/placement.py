"""Where the partitions' logs live on a cluster, and moving their leaders so the nodes share them.

`read_placement` reads each `TXN_LOG_<p>`'s cluster info: its leader and replicas, and
whether they are current. `spread_leaders` plans with `leaders.py` and carries the plan out,
one stepdown at a time, each naming the new leader
(`$JS.API.STREAM.LEADER.STEPDOWN.<stream>` with `{"placement": {"preferred": <server>}}`,
nats-server 2.11 and later), waiting until it leads before the next: each move pauses only its
own partition's writes, for a leader handover (milliseconds), not an election. Nothing moves
while any log has no leader or a replica not current (a node down, or catching up after a
restart): a stepdown then could hand leadership to a replica that lacks records, and the count
of nodes is not settled. A coordinator runs it on its own (service.py: only the owner of
partition 0, every `leader_balance_interval`, a few moves a round); `txactors partitions
balance` runs it on demand.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping
from typing import Final

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from txactors.coordinator.cluster.leaders import Move, plan_moves
from txactors.coordinator.cluster.leases import LeaseView
from txactors.errors import TxActorsError
from txactors.nats.retry import LINK_TROUBLE
from txactors.observe.logs import get_logger
from txactors.wire import layout

STEPDOWN_TIMEOUT: Final = 5.0
"""Seconds a stepdown request, then the new leader's taking over, may take."""
PREFERRED_SINCE: Final = (2, 11)
READS: Final = 32
"""Stream infos in flight at once."""
_POLL: Final = 0.05
POLL_TIMEOUT: Final = 0.5
"""Seconds one look at the stream waits after a stepdown: a request that reached the old
leader as it handed over is never answered, and must not hold up the next look (measured:
the new leader leads within 0.4 s; an info request lost in the handover waited its full 5 s)."""

log = get_logger(__name__)


class StepdownRefused(TxActorsError):
    """The server refused to move a stream's leader (its answer's description)."""


class Replica(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    current: bool
    offline: bool = False
    lag: int | None = None
    """Operations it is behind the leader, as the leader reports."""


class LogPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """One partition's log stream on the cluster."""

    partition: int
    stream: str
    leader: str | None = None
    """The server leading it (None: no stream yet, or an election under way)."""
    replicas: list[Replica] = []
    """Its followers (empty on a single server or with one replica)."""
    missing: bool = False
    """No such stream: no coordinator has taken the partition yet."""

    @property
    def current(self) -> bool:
        """A leader, and every follower caught up (a server that is down is not)."""
        return self.leader is not None and all(r.current for r in self.replicas)


class SpreadReport(msgspec.Struct, kw_only=True):
    """What one round of `spread_leaders` saw and did."""

    leaders: dict[str, int]
    """Log streams led per server, before the round."""
    planned: list[Move] = []
    moved: list[Move] = []
    failed: dict[str, str] = {}
    """Stream -> why its move failed."""
    waiting: str | None = None
    """Why nothing was planned (a log without a leader, or with a replica not current)."""


def takes_preferred(major: int, minor: int) -> bool:
    """Whether a nats-server of this version hands a stream's leadership to the server a
    stepdown names (`placement.preferred`, since 2.11); an older one ignores it."""
    return (major, minor) >= PREFERRED_SINCE


def connected_server(nc: Client) -> str | None:
    """The name of the server `nc` is connected to now (as stream infos name leaders)."""
    info = getattr(nc, "_server_info", None) or {}  # nats-py keeps the server's INFO here
    name = info.get("server_name")
    return name if isinstance(name, str) and name else None


async def read_placement(js: JetStreamContext, partitions: Iterable[int]) -> list[LogPlacement]:
    """Each partition's log stream: leader, followers, whether they are current (READS at a
    time)."""
    limiter = anyio.CapacityLimiter(READS)

    async def one(partition: int) -> LogPlacement:
        async with limiter:
            return await _placement(js, partition)

    return list(await asyncio.gather(*(one(p) for p in partitions)))


async def _placement(js: JetStreamContext, partition: int) -> LogPlacement:
    stream = layout.log_stream(partition)
    try:
        info = await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        return LogPlacement(partition=partition, stream=stream, missing=True)
    except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
        return LogPlacement(partition=partition, stream=stream)  # no leader answers
    cluster = info.cluster
    if cluster is None:  # a single server: it leads everything
        return LogPlacement(partition=partition, stream=stream, leader=None)
    return LogPlacement(
        partition=partition,
        stream=stream,
        leader=cluster.leader or None,
        replicas=[
            Replica(
                name=peer.name or "?",
                current=bool(peer.current),
                offline=bool(peer.offline),
                lag=peer.lag,
            )
            for peer in cluster.replicas or ()
        ],
    )


async def log_leaders(
    js: JetStreamContext, partitions: Iterable[int], timeout: float
) -> dict[int, str]:
    """The leaders of the partitions' logs that answer within `timeout` (a log whose leader
    died answers nothing until its election: it is left out rather than waited for)."""
    found: dict[int, str] = {}
    limiter = anyio.CapacityLimiter(READS)

    async def one(partition: int) -> None:
        async with limiter:
            try:
                placement = await _placement(js, partition)
            except LINK_TROUBLE:  # unknown: not near
                return
        if placement.leader is not None:
            found[partition] = placement.leader

    with anyio.move_on_after(timeout):
        async with anyio.create_task_group() as reads:
            for partition in partitions:
                reads.start_soon(one, partition)
    return found


def owner_servers(view: LeaseView) -> dict[int, str]:
    """Partition -> the server its owner is connected to (where its member key says)."""
    servers: dict[int, str] = {}
    for partition, holder in view.holders.items():
        member = view.members.get(holder)
        if member is not None and member.server:
            servers[partition] = member.server
    return servers


def plan_spread(
    placements: Iterable[LogPlacement], owners: Mapping[int, str] | None = None
) -> tuple[list[Move], str | None]:
    """The moves that spread these logs' leaders, or why none may be planned now; as few as
    that takes, and of those, the ones that leave the most logs led where their partition's
    owner is connected (`owners`: partition -> server)."""
    found = [p for p in placements if not p.missing]
    waiting = [p.stream for p in found if not p.current]
    if waiting:
        return [], f"not current (no leader, or a replica behind or down): {', '.join(waiting)}"
    replicated = [p for p in found if p.leader is not None and p.replicas]
    leaders = {p.stream: p.leader for p in replicated if p.leader is not None}
    eligible = {p.stream: [r.name for r in p.replicas if r.current] for p in replicated}
    nodes = set(leaders.values()) | {name for names in eligible.values() for name in names}
    near = {
        p.stream: (owners or {})[p.partition] for p in replicated if p.partition in (owners or {})
    }
    return plan_moves(leaders, eligible, nodes, near), None


def leader_counts(placements: Iterable[LogPlacement]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for placement in placements:
        for name in (placement.leader, *(r.name for r in placement.replicas)):
            if name is not None:
                counts.setdefault(name, 0)
        if placement.leader is not None:
            counts[placement.leader] += 1
    return dict(sorted(counts.items()))


async def step_down(nc: Client, stream: str, preferred: str) -> None:
    """Ask `stream`'s leader to hand over to `preferred`, and wait until it leads."""
    js = nc.jetstream()
    prefix = getattr(js, "_prefix", layout.JS_API)  # a JetStream domain changes it
    body = json.dumps({"placement": {"preferred": preferred}}).encode()
    subject = layout.leader_stepdown_subject(stream, prefix)
    reply = await nc.request(subject, body, timeout=STEPDOWN_TIMEOUT)
    try:
        answer = json.loads(reply.data or b"{}")
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise StepdownRefused(f"not a stepdown answer: {reply.data[:200]!r}")
    error = answer.get("error")
    if error or not answer.get("success"):
        raise StepdownRefused((error or {}).get("description") or f"refused: {answer}")
    deadline = time.monotonic() + STEPDOWN_TIMEOUT
    seen: str | None = None
    polling = nc.jetstream(timeout=POLL_TIMEOUT)
    while time.monotonic() < deadline:
        try:
            info = await polling.stream_info(stream)
        except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
            info = None
        seen = info.cluster.leader if info is not None and info.cluster is not None else None
        if seen == preferred:
            return
        await anyio.sleep(_POLL)
    raise StepdownRefused(
        f"{preferred} did not take over {stream} within {STEPDOWN_TIMEOUT:g}s "
        f"(its leader: {seen or 'none'})"
    )


async def spread_leaders(
    nc: Client,
    partitions: Iterable[int],
    *,
    dry_run: bool = False,
    limit: int | None = None,
    owners: Mapping[int, str] | None = None,
) -> SpreadReport:
    """Plan the moves that spread the partitions' log leaders; unless `dry_run`, carry out
    at most `limit` of them (all when None), one at a time. A move that fails is reported
    and the others are still made; the next round plans from what happened. `owners`
    (partition -> its owner's server, `owner_servers`) picks, among as few moves, those that
    bring logs to their owners."""
    placements = await read_placement(nc.jetstream(), partitions)
    report = SpreadReport(leaders=leader_counts(placements))
    planned, report.waiting = plan_spread(placements, owners)
    report.planned = planned
    version = nc.connected_server_version
    if planned and not takes_preferred(version.major, version.minor):
        report.waiting = (
            f"nats-server {version.major}.{version.minor} does not take a preferred leader "
            f"(2.11 and later do): a stepdown would elect any replica"
        )
    if dry_run or report.waiting:
        return report
    for move in planned if limit is None else planned[:limit]:
        try:
            await step_down(nc, move.stream, move.target)
        except (StepdownRefused, *LINK_TROUBLE) as error:
            report.failed[move.stream] = str(error) or repr(error)
            log.warning(
                "log_leader_not_moved",
                stream=move.stream,
                target=move.target,
                error=report.failed[move.stream],
            )
            continue
        report.moved.append(move)
        log.info("log_leader_moved", stream=move.stream, source=move.source, target=move.target)
    return report
