"""Who owns which partition: the leases of the TXN_LEASE bucket, read for an operator.

Coordinators take, renew and give back leases (txactors/coordinator/leases.py); this reads them
without taking part. A lease's key is the partition, its value the owner's id, its revision
changes on every renewal, and the bucket's TTL drops it that long after the last one: so the
time since the last write says whether its owner is alive, and when a standby may take over.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import msgspec
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from rich import box
from rich.table import Table
from rich.text import Text

from txactors.admin_views import human_duration
from txactors.errors import ConfigError, TxActorsError
from txactors.layout import LEASE_BUCKET

_KV_OPERATION = "KV-Operation"
_STREAM = f"KV_{LEASE_BUCKET}"
_PREFIX = f"$KV.{LEASE_BUCKET}."


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


class LeaseTable(msgspec.Struct, kw_only=True):
    ttl: float
    """The bucket's TTL: the coordinators' `--lease-ttl`."""
    leases: list[LeaseInfo]


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
    return LeaseTable(ttl=ttl, leases=leases)


def _partition_keys(keys: Iterable[str]) -> list[str]:
    """Keys that name a partition, in partition order (anything else is not a lease)."""
    return sorted((k for k in keys if k.isdigit()), key=int)


async def _lease(js: JetStreamContext, key: str, ttl: float) -> LeaseInfo:
    partition = int(key)
    try:
        raw = await js.get_msg(_STREAM, subject=f"{_PREFIX}{key}")
    except nats.js.errors.NotFoundError:
        return LeaseInfo(partition=partition)
    if (raw.headers or {}).get(_KV_OPERATION) in ("DEL", "PURGE") or not raw.data:
        return LeaseInfo(partition=partition)
    renewed = raw.time.timestamp() if raw.time else None
    return LeaseInfo(
        partition=partition,
        owner=raw.data.decode(errors="replace"),
        revision=raw.seq,
        renewed_at=renewed,
        expires_at=None if renewed is None or not ttl else renewed + ttl,
    )


def render_leases(table: LeaseTable, *, now: float | None = None) -> Table:
    """The `txactors lease list` table: one row per partition."""
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
    return view


def _row(lease: LeaseInfo, now: float) -> Sequence[str | Text]:
    if lease.owner is None:
        return (str(lease.partition), Text("free", style="bold red"), "-", "-", "-")
    renewed = "-" if lease.renewed_at is None else f"{human_duration(now - lease.renewed_at)} ago"
    if lease.expires_at is None:
        expires: str | Text = "-"
    elif lease.expires_at <= now:
        expires = Text("expired", style="bold red")
    else:
        expires = human_duration(lease.expires_at - now)
    return (str(lease.partition), lease.owner, str(lease.revision), renewed, expires)
