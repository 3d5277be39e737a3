"""`txactors top`'s arithmetic and drawing without a server: rates between two snapshots (a
restarted coordinator's counts start again from zero), a partition whose owner does not
answer, and the counts read from a metrics endpoint's text."""

from __future__ import annotations

import io

from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

from txactors.coordinator.core.table import TransactionTable
from txactors.observe.metrics import CoordinatorMetrics
from txactors.ops.leases import LeaseInfo, LeaseTable
from txactors.ops.top import PartitionView, Snapshot, counted, rate, total
from txactors.ops.top_view import render_top

COMMITS = "txactors_commits_total"


def snapshot(at: float, counts: dict[str, dict[int, float]], **kwargs: object) -> Snapshot:
    return Snapshot(
        taken_at=at,
        partitions=1,
        leases=LeaseTable(ttl=10, leases=[LeaseInfo(partition=0, owner="c1")]),
        views=[PartitionView(partition=0)],
        dead_letters=[],
        counts={"http://c1/metrics": {COMMITS: counts}},
        **kwargs,  # type: ignore[arg-type]
    )


def text(renderable: object) -> str:
    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(renderable)
    return console.export_text()


def test_rates_between_two_looks_and_after_a_restart() -> None:
    first = snapshot(100.0, {0: 50.0})
    assert rate(None, first, COMMITS, 0) is None, "one look has no rate"
    assert rate(first, snapshot(102.0, {0: 70.0}), COMMITS, 0) == 10.0
    assert rate(first, snapshot(102.0, {0: 8.0}), COMMITS, 0) == 4.0, "restarted: from zero"
    assert rate(first, snapshot(102.0, {}), COMMITS, 0) is None, "not reported"
    assert total(first, COMMITS, 0) == 50.0 and total(first, COMMITS, 3) is None


def test_a_partition_whose_owner_does_not_answer_says_why() -> None:
    current = snapshot(100.0, {0: 1.0})
    current.views = [PartitionView(partition=0, error="did not answer within 10s")]
    frame = text(render_top(None, current))
    assert "no answer" in frame and "partition 0: did not answer within 10s" in frame, frame


def test_counts_are_read_from_the_exposition_a_coordinator_serves() -> None:
    metrics = CoordinatorMetrics(CollectorRegistry())
    table = TransactionTable()
    table.counters.commits = 7
    metrics.track(3, table)
    found = counted(generate_latest(metrics.registry).decode())
    assert found[COMMITS] == {3: 7.0}
    assert found["txactors_discards_total"] == {3: 0.0}
