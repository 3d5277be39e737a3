"""Protocol version 2 against a real coordinator: one-way ends and the `version` field.

A one-way end (an `EndTransaction` published without a reply subject) is carried out like
an acknowledged one and never answered; a lost one is settled by the check-back, a bad one
is counted and logged (rate-limited) while the coordinator goes on. A newer version is refused
with `unsupported_version`, whatever else its fields say. What 0.x removed is refused cleanly:
a version 1 command (without `version`, or `version: 1`) with `unsupported_version`, and the
prepare and end subjects without a group are not served (a request gets no responders).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import nats.errors
import pytest
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry

from tests.support.txn import FAST, CoordinatorClient, message, topic_ids
from tests.support.wait import eventually
from txactors.consumer import ConsumedMessage, Consumer
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.partition.oneway import OneWayErrors
from txactors.coordinator.service import run_coordinator
from txactors.observe.logs import LOG_EVERY
from txactors.observe.metrics import CoordinatorMetrics
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.wire import layout
from txactors.wire.protocol import (
    OPERATOR_DECISIONS,
    PROTOCOL_VERSION,
    AdminCommand,
    Codec,
    Encoding,
    EndTransaction,
    Error,
    ErrorCode,
    ListTransactions,
    OperatorDecision,
    Resolution,
    ShowTransaction,
    TransactionInfo,
    encode,
)

TOKEN = "0123456789abcdef" * 2


class Checker:
    """Answers UNKNOWN and records what it was asked: a check-back settled without it was
    answered from the decision the producer kept."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def __call__(self, view: CheckView) -> Decision:
        self.asked.append(view.txid)
        return Decision.UNKNOWN


@asynccontextmanager
async def consumed(nc: Client, topic: str) -> AsyncIterator[list[str]]:
    received: list[str] = []

    async def handle(msg: ConsumedMessage) -> None:
        received.append(msg.msg_id)

    async with Consumer(nc, topic, "readers", handle, pull_expires=0.5):
        yield received


async def open_count(client: CoordinatorClient) -> int:
    listing = await client.admin(ListTransactions(version=PROTOCOL_VERSION))
    return len(listing.transactions)


# -- one-way ends --------------------------------------------------------------------------


async def test_oneway_ends_commit_and_roll_back_and_the_consumer_gets_the_commits(
    private_nc: Client,
) -> None:
    checker = Checker()
    async with (
        run_coordinator(private_nc),
        consumed(private_nc, "orders") as received,
        TransactionProducer(private_nc, "shop", checker, end_mode="oneway") as producer,
    ):
        results = []
        for n in range(10):
            decision = Decision.COMMIT if n % 3 else Decision.ROLLBACK
            results.append(
                await producer.send_in_transaction(
                    TxMessage("orders", str(n).encode()), lambda m, a, d=decision: d
                )
            )
        committed = sorted(f"{r.txid}:0" for r in results if r.local_state is Decision.COMMIT)
        client = CoordinatorClient(private_nc)

        async def settled() -> bool:
            return sorted(received) == committed and await open_count(client) == 0

        await eventually(settled, timeout=20, what="the committed received, nothing open")
    assert all(r.state is None and not r.confirmed for r in results), "nothing confirms them"
    assert sorted(await topic_ids(private_nc, "orders")) == committed
    assert checker.asked == [], "every one-way end arrived: no check-back was needed"


@pytest.mark.parametrize("decision", [Decision.COMMIT, Decision.ROLLBACK])
async def test_a_lost_oneway_end_is_settled_by_the_check_back(
    private_nc: Client, decision: Decision
) -> None:
    config = CoordinatorConfig(**FAST)
    checker = Checker()
    async with (
        consumed(private_nc, "orders") as received,
        TransactionProducer(private_nc, "shop", checker, end_mode="oneway") as producer,
    ):
        txn = producer.begin()
        async with run_coordinator(private_nc, config=config):
            await txn.send(TxMessage("orders", b"x"))
        await txn.end(decision)  # nobody serves the end subject now: the end is lost
        async with run_coordinator(private_nc, config=config):
            client = CoordinatorClient(private_nc)

            async def settled() -> bool:
                return await open_count(client) == 0

            await eventually(settled, timeout=20, what="nothing open")
            if decision is Decision.COMMIT:
                await eventually(lambda: received, timeout=20, what="the committed received")
    expected = [f"{txn.txid}:0"] if decision is Decision.COMMIT else []
    assert received == expected
    assert await topic_ids(private_nc, "orders") == expected
    assert checker.asked == [], "answered from the decision the producer kept"


async def test_bad_oneway_ends_are_counted_logged_once_per_code_and_never_answered(
    private_nc: Client,
) -> None:
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)
    answers: list[bytes] = []

    async def spy(msg: Msg) -> None:
        if msg.subject != layout.end_subject(0, "g"):
            answers.append(msg.data)

    def end(**fields: Any) -> bytes:
        command = {
            "type": "EndTransaction",
            "version": PROTOCOL_VERSION,
            "txid": "open",
            "token": TOKEN,
            "decision": "commit",
        }
        return msgspec.msgpack.encode({**command, **fields})

    def counted(code: ErrorCode) -> float:
        labels = {"partition": "0", "code": code.value}
        return registry.get_sample_value("txactors_oneway_errors_total", labels) or 0.0

    async with run_coordinator(private_nc, metrics=metrics):
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("open", message())
        spying = await private_nc.subscribe("_INBOX.>", cb=spy)
        await private_nc.flush()
        bad = {
            ErrorCode.BAD_REQUEST: [end(token="NOT-A-TOKEN"), end(txid="a b"), end(version=0)],
            ErrorCode.UNSUPPORTED_VERSION: [end(version=PROTOCOL_VERSION + 1)],
            ErrorCode.FORBIDDEN: [end(), end(), end()],  # well formed, the wrong token
            ErrorCode.NOT_FOUND: [end(txid="nobody")],
        }
        with structlog.testing.capture_logs() as logs:
            for payloads in bad.values():
                for payload in payloads:
                    await private_nc.publish(layout.end_subject(0, "g"), payload)
            await private_nc.publish(layout.end_subject(0, "g"), b"\xc1 not msgpack")

            async def all_counted() -> bool:
                return all(counted(code) == len(p) for code, p in bad.items())

            await eventually(all_counted, timeout=20, what="every bad end counted")
        lines = [entry for entry in logs if entry["event"] == "oneway_request_failed"]
        assert sorted(line["code"] for line in lines) == sorted(bad), "one line per code"
        assert not [entry for entry in logs if entry["event"] == "request_refused"]

        # Healthy: the transaction the forbidden ends aimed at is untouched, and ends.
        info = await client.admin(ShowTransaction(txid="open", version=PROTOCOL_VERSION))
        assert isinstance(info, TransactionInfo) and info.state == "prepared"
        assert (await client.end("open", receipt.token, Decision.COMMIT)).state == "committed"
        await spying.unsubscribe()
    replies = [t for t in map(_reply_type, answers) if t is not None]
    assert replies == ["TransactionInfo", "Ended"], "the one-way ends got no answer"
    assert await topic_ids(private_nc, "orders") == ["open:0"]


def _reply_type(data: bytes) -> str | None:
    """The `type` of a protocol reply; None for other inbox traffic (JetStream's acks)."""
    try:
        reply = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    return reply.get("type") if isinstance(reply, dict) else None


def test_oneway_errors_are_all_counted_but_logged_once_per_code_and_minute() -> None:
    now = [0.0]
    counts: list[str] = []
    errors = OneWayErrors(3, on_error=counts.append, clock=lambda: now[0])
    command = EndTransaction(
        txid="t", token=TOKEN, decision=Decision.COMMIT, version=PROTOCOL_VERSION
    )
    forbidden = Error(ErrorCode.FORBIDDEN, "wrong token")
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            errors.report(command, forbidden)
        errors.report(command, Error(ErrorCode.NOT_FOUND, "no such transaction"))
        now[0] = LOG_EVERY
        errors.report(command, forbidden)
    assert counts == ["forbidden"] * 5 + ["not_found", "forbidden"]
    assert [(e["code"], e["suppressed"]) for e in logs] == [
        ("forbidden", 0),
        ("not_found", 0),
        ("forbidden", 4),
    ]
    assert logs[0]["txid"] == "t" and logs[0]["partition"] == 3


# -- the protocol version --------------------------------------------------------------------


async def request(nc: Client, subject: str, command: dict[str, Any], *, json: bool) -> Any:
    if json:
        reply = await nc.request(
            subject,
            msgspec.json.encode(command),
            timeout=5,
            headers={"Content-Type": "application/json"},
        )
        return msgspec.json.decode(reply.data)
    reply = await nc.request(subject, msgspec.msgpack.encode(command), timeout=5)
    return msgspec.msgpack.decode(reply.data)


@pytest.mark.parametrize("json", [False, True], ids=["msgpack", "json"])
async def test_a_version_1_command_is_refused_with_unsupported_version_and_not_executed(
    private_nc: Client, json: bool
) -> None:
    """Protocol version 1 was removed in 0.x: with the field absent (as a v1 client sends) or
    1, every command is refused before it is executed, and the answer says what to send."""
    prepare = {
        "type": "Prepare",
        "txid": "old",
        "group": "g",
        "producer": "p1",
        "messages": [{"topic": "orders", "body": "eA==" if json else b"x"}],
    }
    end = {"type": "EndTransaction", "txid": "old", "token": TOKEN, "decision": "commit"}
    commands = [
        (layout.prepare_subject(0, "g"), prepare),
        (layout.end_subject(0, "g"), end),
        (layout.admin_subject(0), {"type": "ListTransactions"}),
        (layout.admin_subject(0), {"type": "CommitTransaction", "txid": "old"}),
    ]
    async with run_coordinator(private_nc):
        for subject, command in commands:
            for sent in (command, {**command, "version": 1}):
                answer = await request(private_nc, subject, sent, json=json)
                assert answer["type"] == "Error", (sent, answer)
                assert answer["code"] == "unsupported_version", (sent, answer)
                assert f"send version {PROTOCOL_VERSION}" in answer["message"]
        info = await private_nc.jetstream().stream_info(layout.half_stream(0))
        assert info.state.messages == 0, "the v1 prepare stored nothing"
    assert await topic_ids(private_nc, "orders") == []


async def test_the_prepare_and_end_subjects_without_a_group_are_not_served(
    private_nc: Client,
) -> None:
    """Removed in 0.x: a client on `txn.coord.<p>.prepare` / `.end` gets no responders."""
    prepare = {
        "type": "Prepare",
        "version": PROTOCOL_VERSION,
        "txid": "ungrouped",
        "group": "g",
        "producer": "p1",
        "messages": [{"topic": "orders", "body": b"x"}],
    }
    async with run_coordinator(private_nc):
        for subject in ("txn.coord.0.prepare", "txn.coord.0.end"):
            with pytest.raises(nats.errors.NoRespondersError):
                await request(private_nc, subject, prepare, json=False)
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("grouped", message())
        assert (await client.end("grouped", receipt.token, Decision.COMMIT)).state == "committed"
    assert await topic_ids(private_nc, "orders") == ["grouped:0"]


NEWER = PROTOCOL_VERSION + 1
FUTURE_COMMANDS = [
    ("prepare", {"type": "Prepare", "txid": "new", "group": "g", "producer": "p1", "messages": []}),
    ("prepare", {"type": "Prepare", "txid": "new", "messages": "a shape we do not know"}),
    ("end", {"type": "EndTransaction", "txid": "new", "token": TOKEN, "decision": "commit"}),
    ("end", {"type": "EndTransaction", "txid": "new", "decision": "commit-later"}),
    ("admin", {"type": "ListTransactions"}),
    ("admin", {"type": "ShowTransaction", "txid": "new"}),
    ("admin", {"type": "ForgetTransaction", "txid": "new"}),
]
SUBJECTS = {
    "prepare": lambda partition: layout.prepare_subject(partition, "g"),
    "end": lambda partition: layout.end_subject(partition, "g"),
    "admin": layout.admin_subject,
}


async def test_a_newer_version_is_refused_with_unsupported_version_whatever_its_fields(
    private_nc: Client,
) -> None:
    async with run_coordinator(private_nc):
        for verb, command in FUTURE_COMMANDS:
            for version in (NEWER, 2**40):
                for json in (False, True):
                    answer = await request(
                        private_nc, SUBJECTS[verb](0), {**command, "version": version}, json=json
                    )
                    assert answer["type"] == "Error", (command, answer)
                    assert answer["code"] == "unsupported_version", (command, answer)
                    assert f"{PROTOCOL_VERSION}" in answer["message"]
        for version in (0, -1):
            answer = await request(
                private_nc,
                layout.admin_subject(0),
                {"type": "ListTransactions", "version": version},
                json=False,
            )
            assert (answer["code"], answer["message"][:10]) == ("bad_request", "$.version:")
        answer = await request(
            private_nc,
            layout.admin_subject(0),
            {"type": "ListTransactions", "version": "2"},
            json=True,
        )
        assert answer["code"] == "bad_request"
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("still", message())
        assert (await client.end("still", receipt.token, Decision.COMMIT)).state == "committed"


def test_commands_carry_the_version_and_it_is_required() -> None:
    command = EndTransaction(
        txid="t", token=TOKEN, decision=Decision.COMMIT, version=PROTOCOL_VERSION
    )
    decoded = msgspec.msgpack.decode(encode(command))
    assert decoded["version"] == PROTOCOL_VERSION
    with pytest.raises(TypeError, match="version"):
        EndTransaction(txid="t", token=TOKEN, decision=Decision.COMMIT)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("tag", "resolution"),
    [
        ("ResumeTransaction", Resolution.RESUME),
        ("CommitTransaction", Resolution.COMMIT),
        ("RollbackTransaction", Resolution.ROLLBACK),
    ],
)
def test_each_operator_decision_keeps_its_wire_name_and_takes_the_one_path(
    tag: str, resolution: Resolution
) -> None:
    """What another-language client sends decodes to the one `OperatorDecision` path, with
    its resolution; what this client sends carries the same tag and fields."""
    sent = {"type": tag, "version": PROTOCOL_VERSION, "txid": "t1", "batch": "bulk-1"}
    decoded = Codec[AdminCommand](AdminCommand).decode(msgspec.json.encode(sent), Encoding.JSON)
    assert isinstance(decoded, OperatorDecision)
    assert (decoded.resolution, decoded.txid, decoded.batch) == (resolution, "t1", "bulk-1")
    ours = OPERATOR_DECISIONS[resolution](txid="t1", batch="bulk-1", version=PROTOCOL_VERSION)
    assert msgspec.json.decode(encode(ours, Encoding.JSON)) == sent
