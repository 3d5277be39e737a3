"""Who owns which partition: the leases of the TXN_LEASE bucket, read for an operator.

Coordinators take, renew and give back leases (txactors/coordinator/cluster/leases.py); this reads
them
without taking part. A lease's key is the partition, its value the owner's id, its revision
changes on every renewal, and the bucket's TTL drops it that long after the last one: so the
time since the last write says whether its owner is alive, and when a standby may take over.
Each live coordinator has a member key too (`member.<owner>`): the members, how many partitions
each holds and its fair share (txactors/coordinator/cluster/balance.py) are listed besides.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Final

import msgspec
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE
from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from txactors.coordinator.cluster.balance import MEMBER_PREFIX, MemberInfo, shares
from txactors.errors import ConfigError, TxActorsError
from txactors.nats.partition_count import agreed_count, read_published
from txactors.ops.views import human_duration
from txactors.wire.layout import LEASE_BUCKET, bucket_key_prefix, bucket_stream

READ_TIMEOUT: Final = 10.0
"""Seconds to wait for the published partition count."""
_STREAM = bucket_stream(LEASE_BUCKET)
_PREFIX = bucket_key_prefix(LEASE_BUCKET)


class NoLeases(TxActorsError):
    """No TXN_LEASE bucket: no coordinator has run on this server."""


class LeaseInfo(msgspec.Struct, kw_only=True):
    """One partition's lease: its owner, or None when no one holds it."""

    partition: int
    owner: str | None = None
    revision: int | None = None
    renewed_at: float | None = None
    """Seconds since the epoch of the last take or renewal."""
    expires_at: float | None = None
    """When the bucket drops it unless renewed: then a standby may take the partition."""


class Member(msgspec.Struct, kw_only=True):
    """A live coordinator (its member key), what it holds and what it should."""

    owner: str
    partitions: int
    """Its `--partitions`."""
    max_partitions: int
    held: int
    """Leases it holds now."""
    share: int
    """Its fair share of the partitions (what it holds once rebalanced)."""
    renewed_at: float | None = None
    expires_at: float | None = None


class LeaseTable(msgspec.Struct, kw_only=True):
    ttl: float
    """The bucket's TTL: the coordinators' `--lease-ttl`."""
    leases: list[LeaseInfo]
    members: list[Member] = msgspec.field(default_factory=list)


async def lease_table(
    nc: Client, *, partitions: int | None = None, timeout: float = READ_TIMEOUT
) -> LeaseTable:
    """`txactors lease list`: a row for every partition of the count the coordinators
    publish, free ones included (`partitions`, if given, must equal it: ConfigError if not;
    while none is published it is used as it is, and without it the bucket's keys are)."""
    published = await read_published(nc, timeout)
    return await list_leases(nc, partitions=agreed_count(published, partitions))


async def list_leases(nc: Client, *, partitions: int | None = None) -> LeaseTable:
    """Every lease in the bucket; with `partitions`, one row for each of 0..partitions-1,
    free ones included."""
    if partitions is not None and partitions < 1:
        raise ConfigError(f"partitions must be >= 1, got {partitions}")
    js = nc.jetstream()
    try:
        info = await js.stream_info(_STREAM, subjects_filter=f"{_PREFIX}>")
    except nats.js.errors.NotFoundError:
        raise NoLeases(
            f"no {LEASE_BUCKET} bucket on this server: no coordinator (`txactors coordinator`) "
            "has run here"
        ) from None
    ttl = info.config.max_age or 0.0
    keys = {subject.removeprefix(_PREFIX) for subject in (info.state.subjects or {})}
    if partitions is not None:
        keys |= {str(p) for p in range(partitions)}
    leases = [await _lease(js, key, ttl) for key in _partition_keys(keys)]
    members = await _members(js, sorted(k for k in keys if k.startswith(MEMBER_PREFIX)))
    held = Counter(lease.owner for lease in leases if lease.owner is not None)
    total = max((info.partitions for info, _ in members.values()), default=0)
    dealt = shares(
        total, {owner: info.max_partitions for owner, (info, _) in members.items()}, held
    )
    return LeaseTable(
        ttl=ttl,
        leases=leases,
        members=[
            Member(
                owner=owner,
                partitions=info.partitions,
                max_partitions=info.max_partitions,
                held=held[owner],
                share=dealt[owner],
                renewed_at=renewed,
                expires_at=None if renewed is None or not ttl else renewed + ttl,
            )
            for owner, (info, renewed) in members.items()
        ],
    )


async def _members(
    js: JetStreamContext, keys: list[str]
) -> dict[str, tuple[MemberInfo, float | None]]:
    """The live members (their key's value and last write), by owner id."""
    found: dict[str, tuple[MemberInfo, float | None]] = {}
    for key in keys:
        try:
            raw = await js.get_msg(_STREAM, subject=f"{_PREFIX}{key}")
        except nats.js.errors.NotFoundError:
            continue
        if (raw.headers or {}).get(KV_OP) in (KV_DEL, KV_PURGE) or not raw.data:
            continue
        try:
            info = msgspec.json.decode(raw.data, type=MemberInfo)
        except msgspec.DecodeError:
            continue
        found[key.removeprefix(MEMBER_PREFIX)] = (info, raw.time.timestamp() if raw.time else None)
    return found


def _partition_keys(keys: Iterable[str]) -> list[str]:
    """Keys that name a partition, in partition order (anything else is not a lease)."""
    return sorted((k for k in keys if k.isdigit()), key=int)


async def _lease(js: JetStreamContext, key: str, ttl: float) -> LeaseInfo:
    partition = int(key)
    try:
        raw = await js.get_msg(_STREAM, subject=f"{_PREFIX}{key}")
    except nats.js.errors.NotFoundError:
        return LeaseInfo(partition=partition)
    if (raw.headers or {}).get(KV_OP) in (KV_DEL, KV_PURGE) or not raw.data:
        return LeaseInfo(partition=partition)
    renewed = raw.time.timestamp() if raw.time else None
    return LeaseInfo(
        partition=partition,
        owner=raw.data.decode(errors="replace"),
        revision=raw.seq,
        renewed_at=renewed,
        expires_at=None if renewed is None or not ttl else renewed + ttl,
    )


def render_leases(table: LeaseTable, *, now: float | None = None) -> Group:
    """The `txactors lease list` tables: one row per partition, then one per coordinator."""
    now = time.time() if now is None else now
    held = sum(1 for lease in table.leases if lease.owner is not None)
    owners = len({lease.owner for lease in table.leases if lease.owner is not None})
    view = Table(
        title=f"{held} partition(s) held by {owners} coordinator(s); lease TTL "
        f"{human_duration(table.ttl)}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    view.add_column("partition", justify="right", no_wrap=True)
    view.add_column("owner", overflow="fold")
    view.add_column("revision", justify="right", no_wrap=True)
    view.add_column("renewed", justify="right", no_wrap=True)
    view.add_column("expires in", justify="right", no_wrap=True)
    for lease in table.leases:
        view.add_row(*_row(lease, now))
    return Group(view, Text(""), _members_view(table.members, now))


def _members_view(members: list[Member], now: float) -> Table:
    view = Table(
        title=f"{len(members)} live coordinator(s)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    view.add_column("coordinator", overflow="fold")
    view.add_column("held / share", justify="right", no_wrap=True)
    view.add_column("max", justify="right", no_wrap=True)
    view.add_column("renewed", justify="right", no_wrap=True)
    for member in members:
        counts = f"{member.held} / {member.share}"
        view.add_row(
            member.owner,
            counts if member.held == member.share else Text(counts, style="bold yellow"),
            str(member.max_partitions),
            _ago(member.renewed_at, now),
        )
    return view


def _ago(at: float | None, now: float) -> str:
    return "-" if at is None else f"{human_duration(now - at)} ago"


def _row(lease: LeaseInfo, now: float) -> Sequence[str | Text]:
    if lease.owner is None:
        return (str(lease.partition), Text("free", style="bold red"), "-", "-", "-")
    renewed = _ago(lease.renewed_at, now)
    if lease.expires_at is None:
        expires: str | Text = "-"
    elif lease.expires_at <= now:
        expires = Text("expired", style="bold red")
    else:
        expires = human_duration(lease.expires_at - now)
    return (str(lease.partition), lease.owner, str(lease.revision), renewed, expires)
