"""Prometheus metrics of the coordinator (and checker) and of consumers.

The coordinator's counts come straight from each partition's `TransactionTable.counters` at
scrape time (a custom collector), so the hot path pays nothing for them. Two things only the
actor sees are recorded as they happen: how long a commit took, duplicate check-backs (a
check sent while another for the same transaction is in flight), which must stay 0, and how
many transactions each batch request carried.
A consumer records its lag, retries, dead letters and handler latency as they happen.

Every series is exported from the moment its partition or consumer is tracked, zeros
included: an alert on "must stay 0" needs the 0, and a rate needs its starting point.
Each registry also carries `txactors_build_info{version=...} 1`.

Each `CoordinatorMetrics` / `ConsumerMetrics` registers into a registry of its own (unless
given one), so two coordinators or apps in one process do not collide on metric names;
`serve_metrics` serves one such registry. `txactors coordinator --metrics-port N` and
`txactors run --metrics-port N` serve them on http://host:N/metrics.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable, Iterator
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from txactors.errors import ConfigError
from txactors.wire.protocol import ErrorCode

HANDLER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
"""Seconds; a handler usually writes to a database, so the tail reaches further than commits'."""

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Items per batch: powers of two up to past the default `max_batch_items` (256)."""
BATCH_VERBS = ("prepare", "end")

_COUNTED: dict[str, tuple[str, str]] = {
    # metric name: (Counters field, help)
    "txactors_halves_total": ("halves_stored", "Half messages stored."),
    "txactors_commits_total": ("commits", "Transactions committed and published."),
    "txactors_rollbacks_total": ("rollbacks", "Transactions rolled back."),
    "txactors_unknown_ends_total": ("unknown_ends", "Ends that said UNKNOWN."),
    "txactors_checks_total": ("checks_sent", "Check-backs sent to producers."),
    "txactors_checks_inconclusive_total": (
        "checks_inconclusive",
        "Check-backs answered UNKNOWN, not answered, or failed.",
    ),
    "txactors_discards_total": ("discards", "Transactions discarded after check_max checks."),
    "txactors_unexpected_check_answers_total": (
        "unexpected_check_answers",
        "Answers to check-backs no longer in flight (late or after a decision).",
    ),
    "txactors_late_check_answers_total": (
        "late_check_answers",
        "Answers that came after their check timed out, and still decided.",
    ),
    "txactors_group_check_rollbacks_total": (
        "group_check_rollbacks",
        "Transactions rolled back by a check-back another member of their group answered "
        "(the instance that prepared them had no responders): with the log, its claim.",
    ),
    "txactors_refusals_total": ("refusals", "Requests refused (forbidden, conflict, ...)."),
    "txactors_quarantined_total": (
        "quarantined",
        "Records JetStream refused for good, or recovery could not read (see TXN_DISCARD).",
    ),
}


class CountedTable(Protocol):
    """What the collector reads of a partition's `TransactionTable` at scrape time: its
    `counters` (by the field names in `_COUNTED`) and how many transactions it holds.
    observe/ stands below the coordinator, so it names what it reads, not the table."""

    @property
    def counters(self) -> object: ...
    def __len__(self) -> int: ...


class CoordinatorMetrics(Collector):
    """One coordinator's metrics, in `registry`: by default a new one, so coordinators sharing
    a process each report their own partitions."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = CollectorRegistry() if registry is None else registry
        self.registry = registry
        """Where these metrics are registered: what `serve_metrics` serves."""
        self._tables: dict[int, CountedTable] = {}
        self.commit_latency = Histogram(
            "txactors_commit_latency_seconds",
            "From a producer's COMMIT end to its acknowledgement (decision, publish, done).",
            ["partition"],
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.duplicate_checks = Counter(
            "txactors_duplicate_checks_total",
            "Check-backs sent while one for the same transaction was in flight (must be 0).",
            ["partition"],
            registry=registry,
        )
        self.refused_replies = Counter(
            "txactors_refused_replies_total",
            "Requests dropped unexecuted: their reply subject was not under the inbox prefix.",
            registry=registry,
        )
        self.oneway_errors = Counter(
            "txactors_oneway_errors_total",
            "Requests sent without a reply subject (one-way ends) that failed: refused or "
            "malformed. Never answered; the check-back settles their transactions.",
            ["partition", "code"],
            registry=registry,
        )
        self.partition_count_restored = Counter(
            "txactors_partition_count_restored_total",
            "Values of the published partition count (key partitions of KV bucket TXN_META) "
            "no coordinator wrote, which this one put its count back over (should stay 0).",
            registry=registry,
        )
        self.batch_items = Histogram(
            "txactors_batch_items",
            "Transactions per batch request (PrepareBatch, EndBatch) that passed the boundary.",
            ["partition", "verb"],
            registry=registry,
            buckets=BATCH_BUCKETS,
        )
        registry.register(self)
        register_build_info(registry)

    def oneway(self, partition: int) -> Callable[[str], None]:
        """What counts one failed one-way request of `partition`, by its error code."""
        return lambda code: self.oneway_errors.labels(str(partition), code).inc()

    def track(self, partition: int, table: CountedTable) -> None:
        """Report `table` for `partition` (a restarted partition actor replaces its table)."""
        self._tables[partition] = table
        self.commit_latency.labels(str(partition))  # exported from now on, zeros included
        self.duplicate_checks.labels(str(partition))
        for code in ErrorCode:
            self.oneway_errors.labels(str(partition), code.value)
        for verb in BATCH_VERBS:
            self.batch_items.labels(str(partition), verb)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        for name, (field, text) in _COUNTED.items():
            family = CounterMetricFamily(name.removesuffix("_total"), text, labels=["partition"])
            for partition, table in sorted(self._tables.items()):
                value: int = getattr(table.counters, field)
                family.add_metric([str(partition)], value)
            yield family
        pending = GaugeMetricFamily(
            "txactors_pending_transactions",
            "Transactions in memory: open, deciding, or discarded within retention.",
            labels=["partition"],
        )
        for partition, table in sorted(self._tables.items()):
            pending.add_metric([str(partition)], len(table))
        yield pending


class ConsumerMetrics:
    """The consumers of one app (or process), in `registry`: by default a new one.

    Pass it to each `Consumer(..., metrics=...)`; a consumer's series (labelled by topic and
    group) exist, at zero, from the moment it starts.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = CollectorRegistry() if registry is None else registry
        self.registry = registry
        """Where these metrics are registered: what `serve_metrics` serves."""
        labels = ["topic", "group"]
        self.lag = Gauge(
            "txactors_consumer_lag_messages",
            "Messages on the topic stream not yet delivered to the group (JetStream "
            "num_pending), as of the group's last delivery.",
            labels,
            registry=registry,
        )
        self.retries = Counter(
            "txactors_consumer_retries_total",
            "Handler failures whose message was scheduled for a redelivery.",
            labels,
            registry=registry,
        )
        self.dead_letters = Counter(
            "txactors_consumer_dead_letters_total",
            "Messages moved to the group's dead-letter stream (retries spent, or poison).",
            labels,
            registry=registry,
        )
        self.handler_latency = Histogram(
            "txactors_consumer_handler_seconds",
            "How long a handler ran on one delivery, whether it returned or raised.",
            labels,
            registry=registry,
            buckets=HANDLER_BUCKETS,
        )
        self._lags: dict[tuple[str, str], Lag] = {}
        register_build_info(registry)

    def track(self, topic: str, group: str) -> None:
        """Export the series of (topic, group) now, at zero."""
        for metric in (self.lag, self.retries, self.dead_letters, self.handler_latency):
            metric.labels(topic, group)

    def lag_of(self, topic: str, group: str) -> Lag:
        """The writer of (topic, group)'s lag: one per series, however many consumers set it."""
        key = (topic, group)
        lag = self._lags.get(key)
        if lag is None:
            lag = self._lags[key] = Lag(self.lag.labels(topic, group))
        return lag


class Lag:
    """A consumer lag series, written only when its value changes: a group that keeps up
    reports 0 on every delivery, and a gauge write takes a lock."""

    __slots__ = ("_gauge", "_value")

    def __init__(self, gauge: Gauge) -> None:
        self._gauge = gauge
        self._value: float | None = None

    def set(self, value: float) -> None:
        if value != self._value:
            self._value = value
            self._gauge.set(value)


@functools.cache
def build_version() -> str:
    """The installed txactors version ("unknown" when run from a tree that is not installed)."""
    try:
        return importlib.metadata.version("txactors")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def register_build_info(registry: CollectorRegistry) -> None:
    """`txactors_build_info{version=...} 1`: which release a scrape target runs (once per
    registry, so coordinator and consumer metrics may share one)."""
    version = build_version()
    if registry.get_sample_value("txactors_build_info", {"version": version}) is not None:
        return
    info = Gauge(
        "txactors_build_info",
        "Always 1; the label says which txactors version runs.",
        ["version"],
        registry=registry,
    )
    info.labels(version).set(1)


def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> WSGIServer:
    """Serve `registry` on http://addr:port/metrics from a daemon thread, until `shutdown()`.

    The process's own metrics (CPU, memory, GC) are added, as the global registry would have
    them. A port that cannot be bound is a ConfigError: the operator chose it.
    """
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as error:
        raise ConfigError(f"cannot serve metrics on {addr}:{port}: {error.strerror}") from error
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return server
