"""Prometheus metrics of the coordinator (and checker), read where the facts live.

The counts come straight from each partition's `TransactionTable.counters` at scrape time
(a custom collector), so the hot path pays nothing for them. Two things only the actor
sees are recorded as they happen: how long a commit took, and duplicate check-backs (a
check sent while another for the same transaction is in flight), which must stay 0.

Each `CoordinatorMetrics` registers into a registry of its own (unless given one), so two
coordinators in one process do not collide on metric names; `serve_metrics` serves one such
registry. `txactors coordinator --metrics-port N` serves them on http://host:N/metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from txactors.coordinator.state import TransactionTable
from txactors.errors import ConfigError

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
    "txactors_refusals_total": ("refusals", "Requests refused (forbidden, conflict, ...)."),
    "txactors_quarantined_total": (
        "quarantined",
        "Records JetStream refused for good, or recovery could not read (see TXN_DISCARD).",
    ),
}


class CoordinatorMetrics(Collector):
    """One coordinator's metrics, in `registry`: by default a new one, so coordinators sharing
    a process each report their own partitions."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = CollectorRegistry() if registry is None else registry
        self.registry = registry
        """Where these metrics are registered: what `serve_metrics` serves."""
        self._tables: dict[int, TransactionTable] = {}
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
        registry.register(self)

    def track(self, partition: int, table: TransactionTable) -> None:
        """Report `table` for `partition` (a restarted partition actor replaces its table)."""
        self._tables[partition] = table

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
