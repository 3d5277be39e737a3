"""A consumer's lag series: written only when it changes, and never left stale."""

from __future__ import annotations

from txactors.observe.metrics import ConsumerMetrics

LABELS = {"topic": "orders", "group": "billing"}


def lag(metrics: ConsumerMetrics) -> float | None:
    return metrics.registry.get_sample_value("txactors_consumer_lag_messages", LABELS)


def test_the_lag_is_the_last_value_set() -> None:
    metrics = ConsumerMetrics()
    metrics.track("orders", "billing")
    assert lag(metrics) == 0.0
    writer = metrics.lag_of("orders", "billing")
    for value in (5, 5, 3, 0, 0, 7):
        writer.set(value)
        assert lag(metrics) == value


def test_consumers_of_one_series_share_its_writer() -> None:
    # Two consumers of one (topic, group) in one process: what one writes, the other's
    # "unchanged" test must see, or the series would stay at the first one's value.
    metrics = ConsumerMetrics()
    first, second = metrics.lag_of("orders", "billing"), metrics.lag_of("orders", "billing")
    first.set(0)
    second.set(5)
    first.set(0)
    assert lag(metrics) == 0.0
    assert metrics.lag_of("orders", "other") is not first
