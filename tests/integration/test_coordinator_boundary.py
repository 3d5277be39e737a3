"""The coordinator's boundary against a real nats-server: raw bytes from any client.

Every request here is what a buggy or hostile client on the bus could send. Each must be
answered with an error code, write nothing, and leave the coordinator serving normal
transactions; input that is accepted (non-ASCII property values, legacy records) must work
end to end, through check-backs, discards and restarts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from tests.support.logstreams import ensure_log_streams
from tests.support.txn import FAST, CoordinatorClient, message, topic_ids, topic_messages
from tests.support.wait import eventually
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.core import tokens
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.partition.halves import half_headers, stored_half
from txactors.coordinator.partition.packs import read_raw_halves
from txactors.coordinator.service import run_coordinator
from txactors.errors import CommandError
from txactors.nats.topics import ensure_topic_stream
from txactors.wire import layout
from txactors.wire.copies import stored_headers
from txactors.wire.protocol import (
    PROTOCOL_VERSION,
    CheckResult,
    CheckTransaction,
    CommitTransaction,
    Decision,
    Encoding,
    Prepare,
    ShowTransaction,
    encode,
    headers_for,
)

COMMIT = Decision.COMMIT
TOKEN = "0123456789abcdef" * 2
DEEP = 100_000


def prepare_dict(**message_fields: Any) -> dict[str, Any]:
    return {
        "type": "Prepare",
        "version": PROTOCOL_VERSION,
        "txid": "bad",
        "group": "g",
        "producer": "p1",
        "messages": [{"topic": "orders", "body": b"x", **message_fields}],
    }


def json_prepare(**message_fields: Any) -> dict[str, Any]:
    command = prepare_dict(**message_fields)
    command["messages"][0]["body"] = ""
    return command


ms, js = Encoding.MSGPACK, Encoding.JSON
valid_end = encode(
    {
        "type": "EndTransaction",
        "version": PROTOCOL_VERSION,
        "txid": "tx",
        "token": TOKEN,
        "decision": "commit",
    }
)
RAW_CASES: list[tuple[str, str, bytes, Encoding, str]] = [
    # (name, verb, payload, encoding, expected code)
    ("invalid-utf8-msgpack", "end", valid_end.replace(b"tx", b"\xff\xfe"), ms, "bad_request"),
    (
        "invalid-utf8-json",
        "end",
        b'{"type":"EndTransaction","version":2,"txid":"\xff","token":"t","decision":"commit"}',
        js,
        "bad_request",
    ),
    ("deep-msgpack", "prepare", b"\x91" * DEEP + b"\xc0", ms, "bad_request"),
    ("deep-json", "prepare", b"[" * DEEP + b"]" * DEEP, js, "bad_request"),
    (
        "deep-json-field",
        "admin",
        b'{"type":"ShowTransaction","txid":' + b"[" * DEEP + b"]" * DEEP + b"}",
        js,
        "bad_request",
    ),
    ("topic-newline", "prepare", encode(prepare_dict(topic="orders\n")), ms, "bad_request"),
    ("txid-huge", "prepare", encode({**prepare_dict(), "txid": "t" * 10_000}), ms, "bad_request"),
    ("group-long", "prepare", encode({**prepare_dict(), "group": "g" * 65}), ms, "bad_request"),
    (
        "producer-long",
        "prepare",
        encode({**prepare_dict(), "producer": "p" * 129}),
        ms,
        "bad_request",
    ),
    ("property-space", "prepare", encode(prepare_dict(properties={"a b": "1"})), ms, "bad_request"),
    ("property-colon", "prepare", encode(prepare_dict(properties={"a:b": "1"})), ms, "bad_request"),
    (
        "property-nonascii",
        "prepare",
        encode(prepare_dict(properties={"café": "1"})),
        ms,
        "bad_request",
    ),
    (
        "property-blank-nats",
        "prepare",
        encode(prepare_dict(properties={" Nats-Msg-Id": "t1:0"})),
        ms,
        "bad_request",
    ),
    (
        "property-case-nats",
        "prepare",
        encode(prepare_dict(properties={"nats-msg-id": "t1:0"})),
        ms,
        "bad_request",
    ),
    (
        "property-status",
        "prepare",
        encode(prepare_dict(properties={"Status": "503"})),
        ms,
        "bad_request",
    ),
    (
        "property-value-injection",
        "prepare",
        encode(prepare_dict(properties={"X": "a\r\nNats-Msg-Id: t1:0"})),
        ms,
        "bad_request",
    ),
    (
        "headers-over-64k",
        "prepare",
        encode(prepare_dict(properties={f"P{i}": "v" * 1000 for i in range(70)})),
        ms,
        "bad_request",
    ),
    (
        "keys-over-64k",
        "prepare",
        encode(prepare_dict(keys=[f"{i:04d}" + "k" * 200 for i in range(400)])),
        ms,
        "bad_request",
    ),
    ("immunity-nan", "prepare", encode(prepare_dict(check_immunity=math.nan)), ms, "bad_request"),
    ("immunity-inf", "prepare", encode(prepare_dict(check_immunity=math.inf)), ms, "bad_request"),
    ("immunity-negative", "prepare", encode(prepare_dict(check_immunity=-1.0)), ms, "bad_request"),
    ("json-topic-newline", "prepare", encode(json_prepare(topic="o\n"), js), js, "bad_request"),
    (
        "end-bad-token",
        "end",
        encode(
            {
                "type": "EndTransaction",
                "version": PROTOCOL_VERSION,
                "txid": "t",
                "token": "x",
                "decision": "commit",
            }
        ),
        ms,
        "bad_request",
    ),
    (
        "admin-bad-txid",
        "admin",
        encode({"type": "ShowTransaction", "version": PROTOCOL_VERSION, "txid": "t\n"}),
        ms,
        "bad_request",
    ),
    (
        "admin-bad-state",
        "admin",
        encode({"type": "ListTransactions", "version": PROTOCOL_VERSION, "states": ["bogus"]}),
        ms,
        "bad_request",
    ),
    (
        "check-answer-on-prepare",
        "prepare",
        encode(CheckResult(txid="t", check_id=1, resolution=COMMIT)),
        ms,
        "unknown_command",
    ),
]
SUBJECTS: dict[str, Callable[[int], str]] = {
    "prepare": lambda partition: layout.prepare_subject(partition, "g"),
    "end": lambda partition: layout.end_subject(partition, "g"),
    "admin": layout.admin_subject,
}


async def raw_request(nc: Client, verb: str, payload: bytes, encoding: Encoding) -> Any:
    reply = await nc.request(SUBJECTS[verb](0), payload, timeout=5, headers=headers_for(encoding))
    decode = msgspec.json.decode if encoding is Encoding.JSON else msgspec.msgpack.decode
    return decode(reply.data)


async def half_count(nc: Client) -> int:
    info = await nc.jetstream().stream_info(layout.half_stream(0))
    return info.state.messages


async def test_raw_bad_input_is_refused_writes_nothing_and_the_coordinator_serves_on(
    private_nc: Client,
) -> None:
    async with run_coordinator(private_nc):
        for name, verb, payload, encoding, code in RAW_CASES:
            answer = await raw_request(private_nc, verb, payload, encoding)
            assert answer["type"] == "Error", name
            assert answer["code"] == code, (name, answer)
            assert len(answer["message"]) < 2000, name
        refused = await raw_request(
            private_nc, "prepare", encode(prepare_dict(properties={"a b": "1"})), ms
        )
        assert refused["message"].startswith("$.messages[0].properties['a b']")
        assert await half_count(private_nc) == 0, "nothing refused was stored"

        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("ok", message())
        assert (await client.end("ok", receipt.token, COMMIT)).state == "committed"
        assert await topic_ids(private_nc, "orders") == ["ok:0"], "no phantom messages"


async def test_a_txid_is_served_only_by_the_partition_it_hashes_to(private_nc: Client) -> None:
    options = CoordinatorOptions(partitions=2)
    txid = next(f"t{i}" for i in range(100) if layout.partition_of(f"t{i}", 2) == 1)
    async with run_coordinator(private_nc, options=options) as running:
        assert running.partitions == [0, 1]
        wrong, right = CoordinatorClient(private_nc, 0), CoordinatorClient(private_nc, 1)
        with pytest.raises(CommandError) as refused:
            await wrong.prepare(txid, message())
        assert refused.value.code == "bad_request" and "partition 1" in refused.value.message
        receipt = await right.prepare(txid, message())
        for attempt in (
            lambda: wrong.end(txid, receipt.token, COMMIT),
            lambda: wrong.admin(ShowTransaction(txid=txid, version=PROTOCOL_VERSION)),
        ):
            with pytest.raises(CommandError) as refused:
                await attempt()
            assert refused.value.code == "bad_request"
        assert (await right.end(txid, receipt.token, COMMIT)).state == "committed"
        assert await topic_ids(private_nc, "orders") == [f"{txid}:0"]


async def test_a_txid_begins_once_and_its_token_is_stored_only_as_a_digest(
    private_nc: Client,
) -> None:
    async with run_coordinator(private_nc):
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("once", message(body=b"first"))
        with pytest.raises(CommandError) as second:
            await client.prepare("once", message(body=b"second"))
        assert second.value.code == "conflict"

        stored = await private_nc.jetstream().get_msg(layout.half_stream(0), receipt.seqs[0])
        [half] = read_raw_halves(stored)  # in a pack
        assert half.token == tokens.digest(receipt.token)
        assert all(receipt.token not in value for value in stored_headers(stored).values())
        assert receipt.token.encode() not in (stored.data or b"")

        assert (await client.end("once", receipt.token, COMMIT)).state == "committed"
        with pytest.raises(CommandError) as after:
            await client.prepare("once", message(body=b"third"))
        assert after.value.code == "conflict"
        [published] = await topic_messages(private_nc, "orders")
        assert published.data == b"first"


async def test_a_half_stored_with_a_raw_token_is_no_longer_ended_by_it_but_is_not_lost(
    private_nc: Client,
) -> None:
    """Raw stored tokens were removed in 0.x (docs/protocol.md, "Removed in 0.2.0"): no token
    matches such a half, so its end is refused `forbidden`; the transaction stays open for
    its check-back or an operator, who can still commit it."""
    jetstream = private_nc.jetstream()
    await ensure_log_streams(jetstream, half_retention=3600)
    await ensure_topic_stream(jetstream, "orders", duplicate_window=60)  # made at its prepare
    legacy = half_headers(
        stored_half(
            txid="legacy",
            token_digest=TOKEN,  # what versions before digests wrote: the token itself
            group="g",
            producer="p1",
            begins=True,
            index=0,
            born=time.time(),
            message=message(),
        )
    )
    await jetstream.publish(layout.half_subject(0), b"payload", headers=legacy)
    async with run_coordinator(private_nc, config=CoordinatorConfig(transaction_timeout=60)):
        client = CoordinatorClient(private_nc)
        for token in ("f" * 32, TOKEN):
            with pytest.raises(CommandError) as refused:
                await client.end("legacy", token, COMMIT)
            assert refused.value.code == "forbidden"
        assert await topic_ids(private_nc, "orders") == []
        show = ShowTransaction(txid="legacy", version=PROTOCOL_VERSION)
        assert (await client.admin(show)).state == "prepared"
        commit = CommitTransaction(txid="legacy", version=PROTOCOL_VERSION)
        assert (await client.admin(commit)).state == "committed"
        assert await topic_ids(private_nc, "orders") == ["legacy:0"]


Answer = Callable[[CheckTransaction], Awaitable[bytes]]


async def serve_checks(nc: Client, answer: Answer) -> list[CheckTransaction]:
    """Answer the check-backs of producer `p1` of group `g` (its instance subject and the
    group's) as a producer in any language would; returns the list of checks received."""
    seen: list[CheckTransaction] = []

    async def on_check(msg: Msg) -> None:
        check = msgspec.msgpack.decode(msg.data, type=CheckTransaction)
        seen.append(check)
        await msg.respond(await answer(check))

    await nc.subscribe(layout.check_instance_subject("g", "p1"), cb=on_check)
    await nc.subscribe(layout.check_group_subject("g"), queue="g", cb=on_check)
    return seen


async def test_non_ascii_values_and_keys_survive_restart_check_back_and_publish(
    private_nc: Client,
) -> None:
    properties = {"Lang": "café", "Note": "Grüße aus Köln 東京"}
    keys = ["clé", "ключ"]
    async with run_coordinator(private_nc, config=CoordinatorConfig(transaction_timeout=60)):
        client = CoordinatorClient(private_nc)
        await client.prepare("cafe", message(keys=keys, properties=properties))

    async def commit(check: CheckTransaction) -> bytes:
        return encode(CheckResult(txid=check.txid, check_id=check.check_id, resolution=COMMIT))

    checks = await serve_checks(private_nc, commit)
    async with run_coordinator(private_nc, config=CoordinatorConfig(**FAST)):
        await eventually(
            lambda: _has_messages(private_nc, "orders"), timeout=15, what="a message on orders"
        )
        [check] = checks
        assert check.messages[0].properties == properties
        assert check.messages[0].keys == keys
        [published] = await topic_messages(private_nc, "orders")
        headers = published.headers or {}
        assert {k: headers[k] for k in properties} == properties
        assert headers[layout.KEYS_HEADER] == ",".join(keys)
    async with run_coordinator(private_nc, config=CoordinatorConfig(**FAST)):
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("after", message())
        assert (await client.end("after", receipt.token, COMMIT)).state == "committed"


async def _has_messages(nc: Client, topic: str) -> bool:
    return bool(await topic_ids(nc, topic))


async def test_non_ascii_values_reach_the_discard_stream_intact(private_nc: Client) -> None:
    config = CoordinatorConfig(check_max=1, **FAST)
    async with run_coordinator(private_nc, config=config):
        client = CoordinatorClient(private_nc)
        await client.prepare("lost", message(properties={"Lang": "café"}))
        await eventually(
            lambda: _state_is(client, "lost", "discarded"), timeout=15, what="lost discarded"
        )
        js = private_nc.jetstream()
        # The copy follows the durable discard record; it is made beside the partition's loop.
        await eventually(
            lambda: _has_stored(js, layout.DISCARD_STREAM, layout.discard_subject("g")),
            timeout=15,
            what="the discard copy",
        )
        copy = await js.get_last_msg(layout.DISCARD_STREAM, layout.discard_subject("g"))
        assert stored_headers(copy)["Lang"] == "café"
        receipt = await client.prepare("after", message())
        assert (await client.end("after", receipt.token, COMMIT)).state == "committed"


async def _has_stored(js: JetStreamContext, stream: str, subject: str) -> bool:
    info = await js.stream_info(stream, subjects_filter=subject)
    return bool(info.state.subjects)


async def _state_is(client: CoordinatorClient, txid: str, state: str) -> bool:
    info = await client.admin(ShowTransaction(txid=txid, version=PROTOCOL_VERSION))
    return bool(info.state == state)


async def test_unreadable_or_mismatched_check_answers_are_inconclusive(
    private_nc: Client,
) -> None:
    garbage = [
        b"\xc1",
        b"\x91" * DEEP + b"\xc0",
        encode({"type": "CheckResult", "txid": "\xff", "check_id": 1, "resolution": "commit"}),
        encode({"type": "CheckResult", "txid": "t", "check_id": 1, "resolution": "commit"}).replace(
            b"\xa1t", b"\xa1\xff"
        ),
    ]

    async def answer(check: CheckTransaction) -> bytes:
        if garbage:
            return garbage.pop(0)
        if len(checks) == 5:  # right check id, wrong transaction
            return encode(CheckResult(txid="other", check_id=check.check_id, resolution=COMMIT))
        return encode(CheckResult(txid=check.txid, check_id=check.check_id, resolution=COMMIT))

    checks = await serve_checks(private_nc, answer)
    config = CoordinatorConfig(check_max=10, **FAST)
    async with run_coordinator(private_nc, config=config):
        client = CoordinatorClient(private_nc)
        await client.prepare("checked", message())
        await eventually(
            lambda: _has_messages(private_nc, "orders"), timeout=15, what="a message on orders"
        )
        assert len(checks) == 6, "five inconclusive answers, then the commit"
        assert await topic_ids(private_nc, "orders") == ["checked:0"]


async def test_a_prepare_for_a_producer_instance_in_another_encoding_round_trips(
    private_nc: Client,
) -> None:
    """A JSON client gets the same boundary: a valid prepare passes, a bad one names its path."""
    async with run_coordinator(private_nc):
        good = Prepare(
            txid="json", group="g", producer="p1", messages=[message()], version=PROTOCOL_VERSION
        )
        answer = await raw_request(private_nc, "prepare", encode(good, js), js)
        assert answer["type"] == "Prepared"
        bad = await raw_request(
            private_nc, "prepare", encode(json_prepare(properties={"Txn-Id": "x"}), js), js
        )
        assert bad["code"] == "bad_request" and "properties['Txn-Id']" in bad["message"]


async def test_a_transaction_too_large_to_check_back_is_inconclusive_not_fatal(
    private_nc: Client,
) -> None:
    """Each prepare fits max_payload; together they do not fit one CheckTransaction."""
    checks = await serve_checks(private_nc, _never_called)
    half = b"x" * (private_nc.max_payload * 6 // 10)
    config = CoordinatorConfig(check_max=2, **FAST)
    async with run_coordinator(private_nc, config=config):
        client = CoordinatorClient(private_nc)
        first = await client.prepare("big", message(body=half))
        await client.prepare("big", message(body=half), token=first.token)
        await eventually(
            lambda: _state_is(client, "big", "discarded"), timeout=15, what="big discarded"
        )
        assert checks == [], "no check could be sent"
        receipt = await client.prepare("after", message())
        assert (await client.end("after", receipt.token, COMMIT)).state == "committed"


async def _never_called(check: CheckTransaction) -> bytes:
    raise AssertionError(f"unexpected check {check.txid}")
