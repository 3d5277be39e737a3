"""Every documented series is exported from the start, zeros included, with the build info."""

from __future__ import annotations

from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from txactors.coordinator.service import run_coordinator
from txactors.observe.metrics import ConsumerMetrics, CoordinatorMetrics, build_version


async def test_a_fresh_coordinator_exports_its_must_stay_zero_series_at_zero(
    private_nc: Client,
) -> None:
    metrics = CoordinatorMetrics()
    registry = metrics.registry
    assert registry.get_sample_value("txactors_build_info", {"version": build_version()}) == 1
    async with run_coordinator(private_nc, metrics=metrics):
        partition = {"partition": "0"}
        assert registry.get_sample_value("txactors_duplicate_checks_total", partition) == 0.0
        assert registry.get_sample_value("txactors_commit_latency_seconds_count", partition) == 0
        assert registry.get_sample_value("txactors_commits_total", partition) == 0.0
        assert registry.get_sample_value("txactors_pending_transactions", partition) == 0.0


def test_coordinator_and_consumer_metrics_may_share_one_registry() -> None:
    registry = CollectorRegistry()
    CoordinatorMetrics(registry)
    consumers = ConsumerMetrics(registry)
    consumers.track("orders", "shipping")
    labels = {"topic": "orders", "group": "shipping"}
    assert registry.get_sample_value("txactors_consumer_dead_letters_total", labels) == 0.0
    assert registry.get_sample_value("txactors_build_info", {"version": build_version()}) == 1
