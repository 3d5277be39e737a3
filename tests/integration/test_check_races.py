"""Check-backs against a real coordinator: one that overtakes its own transaction,
and one that the instance is slow to answer.

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
import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry

from tests.support.txn import FAST, CoordinatorClient, message, topic_ids
from tests.support.wait import eventually
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.service import run_coordinator
from txactors.observe.metrics import CoordinatorMetrics
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.wire import layout
from txactors.wire.protocol import CheckResult, CheckTransaction, encode


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


async def test_a_live_instance_slow_to_answer_is_asked_again_and_only_a_gone_one_hands_over(
    private_nc: Client,
) -> None:
    """The instance that prepared a transaction is subscribed but does not answer in time
    (its database busy): the next checks go to it again, never to the group, where another
    member would decide for it (with the log: claim it, rolling back what it was about to
    commit). Only once it is gone (no responders) does the group answer, and a rollback
    decided there is counted."""
    registry = CollectorRegistry()
    at_instance: list[CheckTransaction] = []
    at_group: list[CheckTransaction] = []

    async def busy(msg: Msg) -> None:
        at_instance.append(msgspec.msgpack.decode(msg.data, type=CheckTransaction))

    async def claiming_member(msg: Msg) -> None:
        check = msgspec.msgpack.decode(msg.data, type=CheckTransaction)
        at_group.append(check)
        answer = CheckResult(txid=check.txid, check_id=check.check_id, resolution=Decision.ROLLBACK)
        await msg.respond(encode(answer))

    def sample(name: str) -> float:
        return registry.get_sample_value(name, {"partition": "0"}) or 0.0

    client = CoordinatorClient(private_nc, group="g")
    async with run_coordinator(
        private_nc, config=CoordinatorConfig(**FAST), metrics=CoordinatorMetrics(registry)
    ):
        instance = await private_nc.subscribe(layout.check_instance_subject("g", "p1"), cb=busy)
        await private_nc.subscribe(layout.check_group_subject("g"), "g", cb=claiming_member)
        await private_nc.flush()
        await client.prepare("t-slow", message())
        await eventually(lambda: len(at_instance) >= 3, what="three checks at the instance")
        assert at_group == []
        assert sample("txactors_group_check_rollbacks_total") == 0

        await instance.unsubscribe()  # the instance is gone now: the group decides
        await eventually(
            lambda: sample("txactors_rollbacks_total") == 1, what="rolled back by the group"
        )
        assert [c.txid for c in at_group] == ["t-slow"]
        assert sample("txactors_group_check_rollbacks_total") == 1
