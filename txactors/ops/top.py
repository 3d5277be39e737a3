"""What `txactors top` shows, gathered: one snapshot of the partitions, their owners, their open
and discarded transactions, the dead letters, and (from the coordinators' metrics endpoints,
when given) the counts whose rates it shows.

A snapshot is read with the operator functions (`list_leases`, the admin subject of each
partition, `dlq_summaries`); nothing here writes. Rates (commits per second, check-backs per
second, ...) are the difference of two snapshots' counts over the time between them, as
Prometheus's `rate` takes them: a count that went down (the coordinator restarted) counts from
zero. A partition that does not answer is a row that says so, not a failed frame: an operator
opens this view when something is wrong.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import msgspec
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from txactors.errors import CommandError, TxActorsError
from txactors.nats.partition_count import PartitionCountUnknown, agreed_count, read_published
from txactors.ops.dlq import DlqSummary, dlq_summaries
from txactors.ops.leases import LeaseTable, NoLeases, list_leases
from txactors.ops.txn import ADMIN_TIMEOUT, CoordinatorUnavailable, _ask
from txactors.wire.protocol import (
    PROTOCOL_VERSION,
    ListTransactions,
    TransactionInfo,
    TransactionList,
)

COUNTED: Final = (
    "txactors_commits_total",
    "txactors_rollbacks_total",
    "txactors_checks_total",
    "txactors_checks_inconclusive_total",
    "txactors_group_check_rollbacks_total",
    "txactors_discards_total",
    "txactors_quarantined_total",
)
"""The coordinator's per-partition counters `top` reads from a metrics endpoint
(txactors/observe/metrics.py; tests/unit/test_dashboards.py checks they are exported)."""

SCRAPE_TIMEOUT: Final = 5.0


class PartitionView(msgspec.Struct, kw_only=True):
    """One partition as its admin subject answered: its transactions, or why not."""

    partition: int
    transactions: list[TransactionInfo] = msgspec.field(default_factory=list)
    more: int = 0
    """Transactions left out by the coordinator's reply limit."""
    error: str | None = None


class Snapshot(msgspec.Struct, kw_only=True):
    """Everything one frame shows, read at `taken_at` (seconds since the epoch)."""

    taken_at: float
    partitions: int | None
    """The published partition count (None: no coordinator ever ran on this server)."""
    leases: LeaseTable | None
    views: list[PartitionView]
    dead_letters: list[DlqSummary]
    counts: dict[str, dict[str, dict[int, float]]] = msgspec.field(default_factory=dict)
    """Endpoint -> counter name -> partition -> value, from the metrics endpoints."""
    problems: list[str] = msgspec.field(default_factory=list)
    """What could not be read (an endpoint, the leases), one line each."""


async def take_snapshot(
    nc: Client,
    *,
    metrics: Sequence[str] = (),
    partitions: int | None = None,
    per_partition: int = 1000,
    timeout: float = ADMIN_TIMEOUT,
    clock: float | None = None,
) -> Snapshot:
    """Read one frame's worth: leases, each partition's open and discarded transactions (at
    most `per_partition` each), every group's dead letters, and the `metrics` endpoints."""
    problems: list[str] = []
    try:
        count = agreed_count(await read_published(nc, timeout), partitions)
    except PartitionCountUnknown as error:
        count, problems = partitions, [str(error)]
    try:
        leases: LeaseTable | None = await list_leases(nc, partitions=count)
    except NoLeases as error:
        leases = None
        problems.append(str(error))
    scraped = asyncio.gather(*(scrape(url) for url in metrics), return_exceptions=True)
    views = await asyncio.gather(
        *(_partition(nc, p, per_partition, timeout) for p in range(count or 0))
    )
    dead_letters = await dlq_summaries(nc)
    counts: dict[str, dict[str, dict[int, float]]] = {}
    for url, result in zip(metrics, await scraped, strict=True):
        if isinstance(result, BaseException):
            problems.append(f"metrics {url}: {result}")
        else:
            counts[url] = result
    return Snapshot(
        taken_at=time.time() if clock is None else clock,
        partitions=count,
        leases=leases,
        views=list(views),
        dead_letters=dead_letters,
        counts=counts,
        problems=problems,
    )


async def _partition(nc: Client, partition: int, limit: int, timeout: float) -> PartitionView:
    where = ListTransactions(limit=limit, version=PROTOCOL_VERSION)
    try:
        found = await _ask(nc, partition, where, TransactionList, timeout)
    except CoordinatorUnavailable as error:
        return PartitionView(partition=partition, error=str(error))
    except CommandError as error:
        return PartitionView(partition=partition, error=f"{error.code}: {error.message}")
    return PartitionView(partition=partition, transactions=found.transactions, more=found.more)


class ScrapeFailed(TxActorsError):
    """A metrics endpoint that could not be read or parsed."""


async def scrape(url: str, timeout: float = SCRAPE_TIMEOUT) -> dict[str, dict[int, float]]:
    """The `COUNTED` series of one coordinator's metrics endpoint, by name and partition."""
    try:
        text = await asyncio.to_thread(_fetch, url, timeout)
        return counted(text)
    except (OSError, ValueError) as error:  # URLError is an OSError
        raise ScrapeFailed(str(getattr(error, "reason", error))) from error


def _fetch(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: bytes = response.read()
    return body.decode()


def counted(text: str) -> dict[str, dict[int, float]]:
    """The `COUNTED` samples of a Prometheus text exposition, by name and partition."""
    found: dict[str, dict[int, float]] = {name: {} for name in COUNTED}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found and "partition" in sample.labels:
                found[sample.name][int(sample.labels["partition"])] = sample.value
    return found


def rate(before: Snapshot | None, after: Snapshot, name: str, partition: int) -> float | None:
    """Per second, between the two snapshots, of counter `name` in `partition` summed over the
    endpoints both read (a count that fell counts from zero); None without two readings."""
    if before is None or after.taken_at <= before.taken_at:
        return None
    seen = False
    increase = 0.0
    for url, now in after.counts.items():
        then = before.counts.get(url)
        if then is None or partition not in now.get(name, {}):
            continue
        seen = True
        current = now[name][partition]
        previous = then.get(name, {}).get(partition, 0.0)
        increase += current - previous if current >= previous else current
    return increase / (after.taken_at - before.taken_at) if seen else None


def total(snapshot: Snapshot, name: str, partition: int) -> float | None:
    """Counter `name` of `partition`, summed over the endpoints that report it (None: none)."""
    values = [
        by_partition[partition]
        for counts in snapshot.counts.values()
        if partition in (by_partition := counts.get(name, {}))
    ]
    return sum(values) if values else None


def owners(snapshot: Snapshot) -> Mapping[int, str | None]:
    """Each partition's owner in the lease table (None: free)."""
    if snapshot.leases is None:
        return {}
    return {lease.partition: lease.owner for lease in snapshot.leases.leases}


def oldest(
    views: Iterable[PartitionView], states: Iterable[str], limit: int
) -> list[tuple[int, TransactionInfo]]:
    """The `limit` oldest transactions in `states`, with their partition."""
    wanted = set(states)
    found = [
        (view.partition, info)
        for view in views
        for info in view.transactions
        if info.state in wanted
    ]
    return sorted(found, key=lambda pair: (pair[1].born, pair[1].txid))[:limit]
