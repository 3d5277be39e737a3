"""Replies go only to inboxes: a request whose reply subject is anything else is not executed.

The rule itself is pure (`reply_refusal`, `ReplyGuard`); the coordinator and the producer's
check endpoint are then shown, on a real nats-server, to leave topics, leases and the
JetStream API untouched when a request names them as its reply subject.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from tests.integration.test_producer import RecordingChecker, ask_instance, check_for, producer
from tests.support.servers import MakeNatsServer
from tests.support.txn import CoordinatorClient, message, topic_ids
from tests.support.wait import eventually
from txactors.actors import RemoteActorRef
from txactors.actors.replies import ReplyGuard, reply_pattern
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.errors import AskTimeout, CommandError
from txactors.nats.client import connect
from txactors.observe.logs import LOG_EVERY
from txactors.observe.metrics import CoordinatorMetrics
from txactors.wire import layout
from txactors.wire.inbox import normalize_prefix, reply_refusal
from txactors.wire.protocol import (
    PROTOCOL_VERSION,
    CheckResult,
    Decision,
    EndTransaction,
    Prepare,
    Prepared,
    ShowTransaction,
    encode,
)

HOSTILE_REPLIES = [
    "topic.orders._",
    f"$KV.{layout.LEASE_BUCKET}.0",
    "txn.op.0",
    "txn.coord.0.prepare",
    f"$JS.API.STREAM.PURGE.{layout.topic_stream('orders')}",
    "_INBOX",
    "_INBOX.",
    "_INBOX.*",
    "_INBOX.>",
    "_INBOX.a.*",
    "_INBOX..a",
    "_INBOXES.a",
    "my_INBOX.a",
]


# -- the rule ----------------------------------------------------------------------------------


@pytest.mark.parametrize("reply", HOSTILE_REPLIES)
def test_anything_but_an_inbox_subject_is_refused(reply: str) -> None:
    assert reply_refusal(reply) is not None


@pytest.mark.parametrize("reply", ["_INBOX.abc", "_INBOX.Zx9.17", "_INBOX.a-b_c"])
def test_inbox_subjects_are_answered(reply: str) -> None:
    assert reply_refusal(reply) is None


@given(st.text(min_size=1, max_size=40).filter(lambda s: not s.startswith("_INBOX.")))
def test_no_subject_outside_the_prefix_is_answered(reply: str) -> None:
    assert reply_refusal(reply) is not None


@given(st.text(max_size=20), st.sampled_from("*> \t\r\n"), st.text(max_size=20))
def test_wildcards_and_whitespace_are_refused_even_under_the_prefix(
    head: str, bad: str, tail: str
) -> None:
    assert reply_refusal(f"_INBOX.{head}{bad}{tail}") is not None


def test_another_inbox_prefix_replaces_the_default() -> None:
    guard = ReplyGuard("_ACCOUNT_A_INBOX")  # nats-py's inbox_prefix is given without the dot
    assert guard.prefix == "_ACCOUNT_A_INBOX."
    assert guard.allows("_ACCOUNT_A_INBOX.xyz", "s")
    assert not guard.allows("_INBOX.xyz", "s")


@pytest.mark.parametrize(
    "prefix", ["", ".", "a.*", "a.>", "a b", "a..b", "topic", "txn.x", "$KV.TXN_LEASE", "$js.api"]
)
def test_a_prefix_that_cannot_start_a_subject_is_a_value_error(prefix: str) -> None:
    with pytest.raises(ValueError):
        normalize_prefix(prefix)
    with pytest.raises(ValueError):
        CoordinatorOptions(inbox_prefix=prefix)


def test_refusals_are_all_counted_but_logged_once_per_pattern_and_interval() -> None:
    now = [1000.0]
    counted: list[None] = []
    guard = ReplyGuard(on_refused=lambda: counted.append(None), clock=lambda: now[0])
    with structlog.testing.capture_logs() as logs:
        for index in range(50):
            assert not guard.allows(f"topic.orders.t{index}", "txn.coord.0.prepare")
        assert not guard.allows("$KV.TXN_LEASE.0", "txn.coord.0.prepare")
        now[0] += LOG_EVERY + 1
        assert not guard.allows("topic.orders.late", "txn.coord.0.prepare")
    lines = [entry for entry in logs if entry["event"] == "reply_subject_refused"]
    assert len(counted) == 52
    assert [(e["reply_pattern"], e["suppressed"]) for e in lines] == [
        ("topic.>", 0),
        ("$KV.>", 0),
        ("topic.>", 49),
    ]


def test_a_rule_narrows_the_inbox_by_the_subject_the_request_came_on() -> None:
    """The coordinator's tenants (coordinator/partition/tenants.py): asked only of inbox replies,
    with
    the request's own subject; a refusal is counted and logged like any other."""
    asked: list[tuple[str, str]] = []

    def rule(subject: str, reply: str) -> str | None:
        asked.append((subject, reply))
        return None if reply.startswith("_INBOX.orders.") else "not the group's inbox"

    counted: list[None] = []
    guard = ReplyGuard(rule=rule, on_refused=lambda: counted.append(None))
    served, subject = "txn.coord.0.prepare.*", "txn.coord.0.prepare.orders"
    with structlog.testing.capture_logs() as logs:
        assert guard.allows("_INBOX.orders.a1", served, subject)
        assert not guard.allows("_INBOX.payments.a1", served, subject)
        assert not guard.allows("topic.orders._", served, subject)  # refused before the rule
        assert guard.allows("_INBOX.payments.a1", served)  # no subject: the prefix alone
    assert asked == [(subject, "_INBOX.orders.a1"), (subject, "_INBOX.payments.a1")]
    assert len(counted) == 2
    assert [e["reason"] for e in logs if e["event"] == "reply_subject_refused"] == [
        "not the group's inbox",
        "the reply subject is not under the inbox prefix '_INBOX.'",
    ]


@given(st.text(max_size=500))
def test_a_log_pattern_is_short_whatever_the_subject(reply: str) -> None:
    assert len(reply_pattern(reply)) <= 66


# -- the coordinator ---------------------------------------------------------------------------


def counter(registry: CollectorRegistry) -> Callable[[], float]:
    return lambda: registry.get_sample_value("txactors_refused_replies_total") or 0.0


async def test_a_coordinator_never_writes_to_a_reply_subject_outside_the_inbox(
    private_nc: Client,
) -> None:
    registry = CollectorRegistry()
    refused = counter(registry)
    metrics = CoordinatorMetrics(registry=registry)
    js = private_nc.jetstream()
    async with run_coordinator(private_nc, metrics=metrics):
        client = CoordinatorClient(private_nc)
        first = await client.prepare("t0", message())
        await client.end("t0", first.token, Decision.COMMIT)
        open_ = await client.prepare("open", message())
        leases = await js.key_value(layout.LEASE_BUCKET)
        lease = await leases.get("0")
        stream = layout.topic_stream("orders")

        for index, reply in enumerate(HOSTILE_REPLIES):
            txid = f"evil-{index}"
            prepare = Prepare(
                txid=txid, group="g", producer="p1", messages=[message()], version=PROTOCOL_VERSION
            )
            end = EndTransaction(
                txid="open", token=open_.token, decision=Decision.COMMIT, version=PROTOCOL_VERSION
            )
            await private_nc.publish(layout.prepare_subject(0, "g"), encode(prepare), reply=reply)
            await private_nc.publish(layout.end_subject(0, "g"), encode(end), reply=reply)
            await private_nc.publish(
                layout.admin_subject(0),
                encode(ShowTransaction(txid="t0", version=PROTOCOL_VERSION)),
                reply=reply,
            )
        await eventually(lambda: refused() == 3 * len(HOSTILE_REPLIES))

        assert await topic_ids(private_nc, "orders") == ["t0:0"], "no phantom, no purge"
        assert (await js.stream_info(stream)).state.messages == 1
        after = await leases.get("0")
        assert (after.revision, after.value) == (lease.revision, lease.value), "lease untouched"
        for index in range(len(HOSTILE_REPLIES)):
            with pytest.raises(CommandError) as unknown:
                await client.admin(ShowTransaction(txid=f"evil-{index}", version=PROTOCOL_VERSION))
            assert unknown.value.code == "not_found", "a refused prepare wrote no halves"
        shown = await client.admin(ShowTransaction(txid="open", version=PROTOCOL_VERSION))
        assert shown.state == "prepared", "a refused end was not applied"

        # ... and it still serves everyone else.
        assert (await client.end("open", open_.token, Decision.COMMIT)).state == "committed"
        later = await client.prepare("t1", message())
        assert (await client.end("t1", later.token, Decision.COMMIT)).state == "committed"
        assert await topic_ids(private_nc, "orders") == ["t0:0", "open:0", "t1:0"]
        assert refused() == 3 * len(HOSTILE_REPLIES)


async def test_a_coordinator_answers_the_inbox_prefix_it_is_configured_with(
    make_nats_server: MakeNatsServer,
) -> None:
    server = await make_nats_server()
    custom = await connect(server.url, inbox_prefix="_ACCOUNT_INBOX")
    default = await connect(server.url)
    try:
        options = CoordinatorOptions(inbox_prefix="_ACCOUNT_INBOX")
        async with run_coordinator(custom, options=options):
            client = CoordinatorClient(custom)
            receipt = await client.prepare("t1", message())
            assert (await client.end("t1", receipt.token, Decision.COMMIT)).state == "committed"
            ref = RemoteActorRef(default, layout.prepare_subject(0, "g"), Prepared)
            with pytest.raises(AskTimeout):  # `_INBOX.` is not this account's prefix
                await ref.ask(
                    Prepare(
                        txid="t2",
                        group="g",
                        producer="p",
                        messages=[message()],
                        version=PROTOCOL_VERSION,
                    ),
                    0.5,
                )
            assert await topic_ids(custom, "orders") == ["t1:0"]
    finally:
        await custom.close()
        await default.close()


# -- the producer's check endpoint -------------------------------------------------------------


async def test_a_check_with_a_reply_subject_outside_the_inbox_is_not_asked(nc: Client) -> None:
    checker = RecordingChecker(Decision.COMMIT)
    async with producer(nc, checker=checker) as p:
        subject = layout.check_instance_subject(p.group, p.instance)
        hostile = check_for(p.group, txid=f"evil-{uuid.uuid4().hex}")
        for reply in HOSTILE_REPLIES:
            await nc.publish(subject, encode(hostile), reply=reply)
        await nc.publish(subject, encode(hostile))  # no reply subject: nobody to answer
        good = check_for(p.group)
        result = await ask_instance(nc, p, good)  # one subscription: the hostile ones came first
        assert isinstance(result, CheckResult) and result.resolution is Decision.COMMIT
        assert [view.txid for view in checker.views] == [good.txid]
