"""Prometheus metrics of the coordinator (and checker), read where the facts live.

The counts come straight from each partition's `TransactionTable.counters` at scrape time
(a custom collector), so the hot path pays nothing for them. Two things only the actor
sees are recorded as they happen: how long a commit took, and duplicate check-backs (a
check sent while another for the same transaction is in flight), which must stay 0.

`txactors coordinator --metrics-port N` serves them on http://host:N/metrics.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from txactors.coordinator.state import TransactionTable

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
}


class CoordinatorMetrics(Collector):
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
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
