"""A check-back that overtakes its own transaction, against a real coordinator (issue 9, item 6).

The coordinator checks a transaction once its timeout passes without an end. Here the
producer's local transaction outlasts that timeout, so the checks come while it runs; the
user's checker would say COMMIT, but the local transaction then rolls back. Only the
producer's own UNKNOWN keeps the coordinator from publishing what was rolled back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import anyio
import structlog
from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from tests.support.txn import FAST, topic_ids
from tests.support.wait import eventually
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.service import run_coordinator
from txactors.observe.metrics import CoordinatorMetrics
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage


@contextmanager
def capture_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Every log event (info included) with its bound context."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars]
        ) as logs:
            yield logs
    finally:
        structlog.configure(**saved)


async def test_checks_during_the_local_transaction_are_unknown_and_its_rollback_wins(
    private_nc: Client,
) -> None:
    registry = CollectorRegistry()
    checker_calls: list[str] = []

    async def checker(view: CheckView) -> Decision:
        checker_calls.append(view.txid)
        return Decision.COMMIT  # what a database read too early might suggest

    def inconclusive() -> float:
        value = registry.get_sample_value("txactors_checks_inconclusive_total", {"partition": "0"})
        return value or 0.0

    async def local_transaction(message: Any, arg: Any) -> Decision:
        await eventually(  # the coordinator has checked, twice, and heard UNKNOWN
            lambda: inconclusive() >= 2, what="two inconclusive checks"
        )
        return Decision.ROLLBACK

    config = CoordinatorConfig(**FAST)
    with capture_logs() as logs:
        async with (
            run_coordinator(private_nc, config=config, metrics=CoordinatorMetrics(registry)),
            TransactionProducer(private_nc, "shop", checker) as producer,
        ):
            result = await producer.send_in_transaction(
                TxMessage("orders", b"must never be seen"), local_transaction
            )
            await anyio.sleep(config.check_interval_max * 3)  # room for a late check or commit

    assert (result.local_state, result.state) == (Decision.ROLLBACK, "rolled_back")
    answered = [e for e in logs if e["event"] == "check_answered" and e["txid"] == result.txid]
    assert len(answered) >= 2
    assert {(e["resolution"], e["source"]) for e in answered} == {(Decision.UNKNOWN, "in flight")}
    assert checker_calls == []
    assert await topic_ids(private_nc, "orders") == []
    assert registry.get_sample_value("txactors_commits_total", {"partition": "0"}) in (None, 0.0)
