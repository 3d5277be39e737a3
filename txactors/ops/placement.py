"""`txactors partitions list` and `balance`: each partition's owner, log and open transactions,
and moving the logs' leaders so the nodes share them.

One row per partition: the coordinator holding its lease (and the NATS server that coordinator
is connected to, from its member key), its log stream `TXN_LOG_<p>` (leader, followers and
whether they are current, from the stream's cluster info) and how many transactions it holds
open or discarded (the coordinator's own count, asked on its admin subject). A partition whose
owner is connected to another server than the one leading its log is flagged: each of its
writes crosses one more hop between servers, and a loss of either server pauses it.
Only reads; `balance` moves leaders (coordinator/cluster/placement.py).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

import msgspec
import nats.js.errors
from nats.aio.client import Client
from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from txactors.actors import RemoteActorRef
from txactors.coordinator.cluster.balance import MemberInfo
from txactors.coordinator.cluster.leaders import Move
from txactors.coordinator.cluster.leases import Leases, LeaseView
from txactors.coordinator.cluster.placement import (
    LogPlacement,
    Replica,
    SpreadReport,
    leader_counts,
    owner_servers,
    read_placement,
    spread_leaders,
)
from txactors.coordinator.core.states import TxnState
from txactors.errors import ActorDeadError, AskTimeout, CommandError
from txactors.nats.partition_count import PartitionCountUnknown, client_count
from txactors.ops.leases import NoLeases
from txactors.ops.txn import ADMIN_TIMEOUT, CoordinatorUnavailable
from txactors.wire import layout
from txactors.wire.protocol import PROTOCOL_VERSION, ListTransactions, TransactionList

__all__ = [
    "OPEN_STATES",
    "PartitionRow",
    "PartitionTable",
    "balance_partitions",
    "list_partitions",
    "render_balance",
    "render_partitions",
]

OPEN_STATES = tuple(
    s.value
    for s in TxnState
    if s not in (TxnState.COMMITTED, TxnState.ROLLED_BACK, TxnState.DISCARDED)
)
"""States of a transaction not yet final: what a partition's owner still has to decide."""
_ADMIN_NAME = "txactors-admin"
"""The id this reader gives the lease bucket's reader (it takes and announces nothing)."""


class PartitionRow(msgspec.Struct, kw_only=True):
    partition: int
    owner: str | None = None
    """The coordinator holding its lease (None: free)."""
    owner_server: str | None = None
    """The NATS server that coordinator is connected to (None: unknown)."""
    stream: str
    leader: str | None = None
    """The server leading its log (None: no log yet, or an election under way)."""
    log_exists: bool = True
    """False until a coordinator takes the partition (and creates its log)."""
    replicas: list[Replica] = []
    current: bool = False
    """The log has a leader and every follower is caught up."""
    open: int | None = None
    """Transactions not yet decided and done (None: its owner did not answer)."""
    discarded: int | None = None
    error: str | None = None
    """Why the open count is missing."""
    apart: bool = False
    """Its owner is connected to another server than the one leading its log."""


class PartitionTable(msgspec.Struct, kw_only=True):
    partitions: int
    rows: list[PartitionRow]
    leaders: dict[str, int]
    """Log streams led per server (every server holding a replica is listed)."""


async def list_partitions(
    nc: Client, *, partitions: int | None = None, timeout: float = ADMIN_TIMEOUT
) -> PartitionTable:
    """One row per partition of the published count (`partitions`, if given, must agree)."""
    count = await _count(nc, partitions, timeout)
    js = nc.jetstream()
    view = await _lease_view(nc, timeout)
    placements = await read_placement(js, range(count))
    counts = await asyncio.gather(
        *(_counts(nc, p, timeout) if p in view.holders else _unowned() for p in range(count))
    )
    rows = [
        _row(placement, view.holders.get(placement.partition), view.members, answer)
        for placement, answer in zip(placements, counts, strict=True)
    ]
    return PartitionTable(partitions=count, rows=rows, leaders=leader_counts(placements))


async def _lease_view(nc: Client, timeout: float) -> LeaseView:
    """Who holds which partition, and the live coordinators' member keys (read only)."""
    js = nc.jetstream()
    try:
        kv = await js.key_value(layout.LEASE_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        raise NoLeases(
            f"no {layout.LEASE_BUCKET} bucket on this server: no coordinator (`txactors "
            "coordinator`) has run here"
        ) from None
    return await Leases(js, kv, _ADMIN_NAME).view(timeout)


async def _count(nc: Client, partitions: int | None, timeout: float) -> int:
    """The published partition count (`partitions`, if given, must equal it)."""
    try:
        return await client_count(nc, partitions, timeout)
    except PartitionCountUnknown as error:  # no coordinator ever ran here
        raise CoordinatorUnavailable(str(error)) from None


async def _unowned() -> tuple[None, None, str]:
    return None, None, "no owner"


async def _counts(
    nc: Client, partition: int, timeout: float
) -> tuple[int | None, int | None, str | None]:
    """(open, discarded, why not) as the partition's owner counts them."""

    ref = RemoteActorRef(nc, layout.admin_subject(partition), TransactionList)

    async def count(states: Sequence[str]) -> int:
        where = ListTransactions(states=list(states), limit=1, version=PROTOCOL_VERSION)
        found: TransactionList = await ref.ask(where, timeout=timeout)
        return len(found.transactions) + found.more

    try:
        return await count(OPEN_STATES), await count([TxnState.DISCARDED.value]), None
    except ActorDeadError:
        return None, None, "no coordinator serves it"
    except AskTimeout:
        return None, None, f"its coordinator did not answer within {timeout:g}s"
    except CommandError as error:
        return None, None, f"{error.code}: {error.message}"


def _row(
    placement: LogPlacement,
    owner: str | None,
    members: dict[str, MemberInfo],
    counts: tuple[int | None, int | None, str | None],
) -> PartitionRow:
    member = members.get(owner) if owner is not None else None
    server = member.server if member is not None else None
    open_, discarded, error = counts
    return PartitionRow(
        partition=placement.partition,
        owner=owner,
        owner_server=server,
        stream=placement.stream,
        leader=placement.leader,
        log_exists=not placement.missing,
        replicas=list(placement.replicas),
        current=placement.current,
        open=open_,
        discarded=discarded,
        error=error,
        apart=bool(server and placement.leader and server != placement.leader),
    )


async def balance_partitions(
    nc: Client,
    *,
    partitions: int | None = None,
    dry_run: bool = False,
    timeout: float = ADMIN_TIMEOUT,
) -> SpreadReport:
    """Move the partitions' log leaders so no server leads more than its share (see
    coordinator/cluster/placement.py); with `dry_run`, only say which moves."""
    count = await _count(nc, partitions, timeout)
    view = await _lease_view(nc, timeout)
    return await spread_leaders(nc, range(count), dry_run=dry_run, owners=owner_servers(view))


def _table(title: str) -> Table:
    return Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False
    )


def render_partitions(table: PartitionTable) -> Group:
    """The `txactors partitions list` tables: one row per partition, then leaders per server."""
    held = sum(1 for row in table.rows if row.owner is not None)
    view = _table(f"{table.partitions} partition(s), {held} held")
    for name, justify in (
        ("partition", "right"),
        ("owner", "left"),
        ("owner's server", "left"),
        ("log leader", "left"),
        ("replicas current", "right"),
        ("open", "right"),
        ("discarded", "right"),
    ):
        view.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for row in table.rows:
        view.add_row(*_cells(row))
    servers = _table(f"log leaders on {len(table.leaders)} server(s)")
    servers.add_column("server", overflow="fold")
    servers.add_column("leads", justify="right")
    share = -(-table.partitions // max(1, len(table.leaders)))
    for name, leads in table.leaders.items():
        servers.add_row(name, str(leads) if leads <= share else Text(str(leads), "bold yellow"))
    return Group(view, Text(""), servers)


def _cells(row: PartitionRow) -> Sequence[str | Text]:
    owner: str | Text = row.owner if row.owner is not None else Text("free", style="bold red")
    server: str | Text = row.owner_server or "-"
    if row.apart:
        server = Text(f"{row.owner_server} (not the leader)", style="bold yellow")
    leader: str | Text = row.leader or (
        Text("none", style="bold red") if row.log_exists else "no log yet"
    )
    if row.replicas:
        behind = sum(1 for r in row.replicas if not r.current)
        total = len(row.replicas) + 1
        replicas: str | Text = f"{total - behind}/{total}"
        if behind:
            replicas = Text(str(replicas), style="bold red")
    else:
        replicas = "1/1" if row.leader else "-"
    if row.open is not None:
        open_: str | Text = str(row.open)
    else:
        open_ = "-" if row.owner is None else Text("?", style="bold red")
    discarded = str(row.discarded) if row.discarded is not None else "-"
    return (str(row.partition), owner, server, leader, replicas, open_, discarded)


def render_balance(report: SpreadReport, *, dry_run: bool) -> str:
    """What `txactors partitions balance` did (or would do), one line per move."""
    if report.waiting:
        return f"nothing moved: {report.waiting}"
    if not report.planned:
        leads = ", ".join(f"{name} {count}" for name, count in report.leaders.items())
        return f"balanced: log leaders per server: {leads}"
    lines = [_move_line(m, report, dry_run) for m in report.planned]
    after = Counter(report.leaders)
    for move in report.planned if dry_run else report.moved:
        after[move.source] -= 1
        after[move.target] += 1
    lines.append(
        "log leaders per server: " + ", ".join(f"{n} {c}" for n, c in sorted(after.items()))
    )
    return "\n".join(lines)


def _move_line(move: Move, report: SpreadReport, dry_run: bool) -> str:
    what = f"{move.stream}: {move.source} -> {move.target}"
    if dry_run:
        return f"would move {what}"
    if move.stream in report.failed:
        return f"not moved {what}: {report.failed[move.stream]}"
    return f"moved {what}"
