"""The batch verbs against a real coordinator: many prepares or ends in one request.

A `PrepareBatch` is stored in one JetStream write and answered with one `PreparedBatch`; an
`EndBatch` is answered with one `EndedBatch`, or, published without a reply subject, carried
out item by item like one-way ends. Each item is checked as a lone command would be and a bad
one is refused alone; what concerns the batch as a whole (its version, its group against the
subject, its size, whether its answer can fit in `max_payload`) refuses all of it, before
anything is stored.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from tests.support.servers import MakeNatsServer
from tests.support.txn import CoordinatorClient, message, topic_ids
from tests.support.wait import eventually
from txactors.actors import RemoteActorRef
from txactors.actors.remote import REPLY_HEADROOM
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.partition.packs import read_halves
from txactors.coordinator.partition.recovery import read_subject
from txactors.coordinator.service import run_coordinator
from txactors.errors import CommandError
from txactors.observe.metrics import CoordinatorMetrics
from txactors.wire import layout
from txactors.wire.answers import MAX_ITEM_ERROR_CHARS
from txactors.wire.protocol import (
    PROTOCOL_VERSION,
    Decision,
    Encoding,
    EndBatch,
    Ended,
    EndedBatch,
    EndItem,
    Error,
    ListTransactions,
    OutgoingMessage,
    Prepare,
    PrepareBatch,
    Prepared,
    PreparedBatch,
    PrepareItem,
    encode,
)

COMMIT, ROLLBACK, UNKNOWN = Decision.COMMIT, Decision.ROLLBACK, Decision.UNKNOWN
WRONG_TOKEN = "0123456789abcdef" * 2


def on_partition(prefix: str, partition: int, partitions: int) -> str:
    """The first txid `prefix<n>` that hashes to `partition`."""
    return next(
        txid
        for n in itertools.count()
        if layout.partition_of(txid := f"{prefix}{n}", partitions) == partition
    )


def item(txid: str, body: bytes = b"payload", token: str | None = None) -> PrepareItem:
    return PrepareItem(txid=txid, messages=[message(body=body)], token=token)


async def prepare_batch(
    nc: Client,
    items: list[PrepareItem],
    *,
    group: str = "g",
    subject_group: str | None = None,
    version: int = PROTOCOL_VERSION,
    encoding: Encoding = Encoding.MSGPACK,
) -> PreparedBatch:
    subject = layout.prepare_subject(0, subject_group or group)
    ref = RemoteActorRef(nc, subject, PreparedBatch, encoding=encoding)
    batch = PrepareBatch(version=version, group=group, producer="p1", items=items)
    answer: PreparedBatch = await ref.ask(batch, timeout=10)
    return answer


async def end_batch(
    nc: Client,
    items: list[EndItem],
    *,
    encoding: Encoding = Encoding.MSGPACK,
    version: int = PROTOCOL_VERSION,
) -> EndedBatch:
    ref = RemoteActorRef(nc, layout.end_subject(0, "g"), EndedBatch, encoding=encoding)
    answer: EndedBatch = await ref.ask(EndBatch(version=version, items=items), timeout=10)
    return answer


def prepared(results: list[Prepared | Error]) -> list[Prepared]:
    assert all(isinstance(r, Prepared) for r in results), results
    return [r for r in results if isinstance(r, Prepared)]


def codes(results: list[Any]) -> list[str]:
    return [r.code if isinstance(r, Error) else type(r).__name__ for r in results]


async def halves(nc: Client) -> list[nats.aio.msg.Msg]:
    js = nc.jetstream()
    if (await js.stream_info(layout.half_stream(0))).state.messages == 0:
        return []
    return [m async for m in read_subject(js, layout.half_stream(0), layout.half_subject(0), 1)]


async def test_a_batch_of_prepares_is_one_write_and_one_answer_and_its_ends_one_more(
    private_nc: Client,
) -> None:
    registry = CollectorRegistry()
    txids = [f"batch{n}" for n in range(20)]
    async with run_coordinator(private_nc, metrics=CoordinatorMetrics(registry)):
        answer = await prepare_batch(private_nc, [item(t, t.encode()) for t in txids])
        receipts = prepared(answer.results)
        assert [r.txid for r in receipts] == txids, "results[i] answers items[i]"
        assert all(len(r.seqs) == 1 for r in receipts)
        [pack] = await halves(private_nc)  # one TXN_HALF message, one write, one fsync
        assert (await private_nc.jetstream().stream_info(layout.half_stream(0))).state.messages == 1
        seq = pack.metadata.sequence.stream
        assert [r.seqs for r in receipts] == [[seq]] * len(txids), "every half in the pack"
        assert [h.txid for h in read_halves(seq, pack.headers or {}, pack.data)] == txids

        ends = [EndItem(txid=r.txid, token=r.token, decision=COMMIT) for r in receipts]
        ended = await end_batch(private_nc, ends)
        assert [(e.txid, e.state) for e in ended.results if isinstance(e, Ended)] == [
            (t, "committed") for t in txids
        ]
    assert sorted(await topic_ids(private_nc, "orders")) == sorted(f"{t}:0" for t in txids)
    for verb in ("prepare", "end"):
        labels = {"partition": "0", "verb": verb}
        assert registry.get_sample_value("txactors_batch_items_count", labels) == 1
        assert registry.get_sample_value("txactors_batch_items_sum", labels) == len(txids)


async def test_a_bad_item_is_refused_alone_and_the_others_are_stored(private_nc: Client) -> None:
    """Every per-item rule of a lone prepare, each on one item; items of one transaction are
    taken in order (a second first prepare is a conflict, follow-ups continue the indexes)."""
    partitions = 2
    known, taken, fresh, twin = (on_partition(p, 0, partitions) for p in ("kn", "tk", "fr", "tw"))
    elsewhere = on_partition("else", 1, partitions)
    options = CoordinatorOptions(partitions=partitions)
    async with run_coordinator(private_nc, options=options):
        client = CoordinatorClient(private_nc)
        token = (await client.prepare(known, message(body=b"first"))).token
        await client.prepare(taken, message())
        empty = PrepareItem(txid=on_partition("em", 0, partitions), messages=[])
        answer = await prepare_batch(
            private_nc,
            [
                item(fresh),
                item("a b"),  # the txid grammar
                item(elsewhere),  # another partition's
                item(known, token=WRONG_TOKEN),
                item(taken),  # a second first prepare
                item(known, b"second", token=token),
                item(twin),
                item(twin),  # the same txid twice in one batch
                item(known, b"third", token=token),
                empty,
            ],
        )
        results = answer.results
        assert codes(results) == [
            "Prepared",
            "bad_request",
            "bad_request",
            "forbidden",
            "conflict",
            "Prepared",
            "Prepared",
            "conflict",
            "Prepared",
            "bad_request",
        ]
        assert "belongs to partition 1" in results[2].message  # type: ignore[union-attr]
        assert all(r.token == token for r in (results[5], results[8]))  # type: ignore[union-attr]
        messages = await halves(private_nc)
        assert len(messages) == 2 + 1, "the first two prepares, and the batch's admitted items"
        stored = [
            h
            for m in messages
            for h in read_halves(m.metadata.sequence.stream, m.headers or {}, m.data)
        ]
        assert len(stored) == 2 + 4, "the first two prepares, and the four admitted items"
        assert (await client.end(known, token, COMMIT)).state == "committed"
    committed = [h for h in stored if h.txid == known]
    assert [h.message.body for h in committed] == [b"first", b"second", b"third"]
    assert await topic_ids(private_nc, "orders") == [f"{known}:{i}" for i in range(3)]


async def test_what_concerns_the_whole_batch_refuses_all_of_it(private_nc: Client) -> None:
    options = CoordinatorOptions(max_batch_items=4)
    four = [item(f"whole{n}") for n in range(4)]
    async with run_coordinator(private_nc, options=options):
        refusals = {
            "forbidden": prepare_batch(private_nc, four, group="other", subject_group="g"),
            "bad_request": prepare_batch(private_nc, [*four, item("whole4")]),
        }
        for code, refused in refusals.items():
            with pytest.raises(CommandError) as error:
                await refused
            assert error.value.code == code
        with pytest.raises(CommandError, match=r"\$.items: 1 to 4 items") as error:
            await prepare_batch(private_nc, [])
        with pytest.raises(CommandError, match=r"\$.version: 3 or later") as error:
            await prepare_batch(private_nc, four, version=2)
        assert error.value.code == "bad_request"
        ends = [EndItem(txid=f"whole{n}", token=WRONG_TOKEN, decision=COMMIT) for n in range(5)]
        with pytest.raises(CommandError, match=r"\$.items") as error:
            await end_batch(private_nc, ends)
        with pytest.raises(CommandError, match=r"\$.version") as error:
            await end_batch(private_nc, ends[:1], version=2)
        assert await halves(private_nc) == [], "nothing of a refused batch was stored"
        answer = await prepare_batch(private_nc, four)
        assert codes(answer.results) == ["Prepared"] * 4


async def test_a_batch_of_ends_carries_out_each_item_and_one_way_too(private_nc: Client) -> None:
    registry = CollectorRegistry()
    names = ["ea", "eb", "ec", "ed", "ee", "ef"]
    async with run_coordinator(private_nc, metrics=CoordinatorMetrics(registry)):
        receipts = prepared((await prepare_batch(private_nc, [item(t) for t in names])).results)
        a, b, c, d, e, f = ((r.txid, r.token) for r in receipts)
        answer = await end_batch(
            private_nc,
            [
                EndItem(txid=a[0], token=a[1], decision=COMMIT),
                EndItem(txid=b[0], token=b[1], decision=ROLLBACK),
                EndItem(txid=c[0], token=WRONG_TOKEN, decision=COMMIT),
                EndItem(txid=d[0], token=d[1], decision=UNKNOWN),
                EndItem(txid=a[0], token=a[1], decision=COMMIT),  # again: idempotent
                EndItem(txid=b[0], token=b[1], decision=COMMIT),  # the other decision
                EndItem(txid="nobody", token=WRONG_TOKEN, decision=COMMIT),
            ],
        )
        assert codes(answer.results) == [
            "Ended",
            "Ended",
            "forbidden",
            "Ended",
            "Ended",
            "conflict",
            "not_found",
        ]
        states = [r.state for r in answer.results if isinstance(r, Ended)]
        assert states == ["committed", "rolled_back", "prepared", "committed"]

        one_way = EndBatch(
            version=PROTOCOL_VERSION,
            items=[
                EndItem(txid=d[0], token=d[1], decision=COMMIT),
                EndItem(txid=e[0], token=e[1], decision=ROLLBACK),
                EndItem(txid=f[0], token=WRONG_TOKEN, decision=COMMIT),
            ],
        )
        await private_nc.publish(layout.end_subject(0, "g"), encode(one_way))
        client = CoordinatorClient(private_nc)

        async def open_now() -> list[str]:
            listing = await client.admin(ListTransactions(version=PROTOCOL_VERSION))
            return sorted(t.txid for t in listing.transactions)

        async def only_the_wrongly_ended_open() -> bool:
            return await open_now() == sorted([c[0], f[0]])

        await eventually(only_the_wrongly_ended_open, what="only the wrongly ended left open")
        labels = {"partition": "0", "code": "forbidden"}
        assert registry.get_sample_value("txactors_oneway_errors_total", labels) == 1
    assert sorted(await topic_ids(private_nc, "orders")) == [f"{a[0]}:0", f"{d[0]}:0"]


async def test_a_batch_answer_always_fits_in_max_payload(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    """On a server with a small max_payload: a batch whose answer could outgrow it is refused
    up front, and one that passes is answered in full, however long its items' errors."""
    max_payload = 64 * 1024
    conf = tmp_path / "small.conf"
    conf.write_text(f"max_payload: {max_payload}\n")
    server = await make_nats_server(extra_args=["-c", str(conf)])
    nc = await nats.connect(server.url, inbox_prefix="_INBOX.g")  # the policy: its inbox
    # A tenant policy whose refusals name every topic the group may use: long messages.
    allowed = [f"allowed-topic-number-{n:03}" for n in range(40)]
    options = CoordinatorOptions(group_topics={"g": allowed})
    try:
        async with run_coordinator(nc, options=options):
            many = [
                PrepareItem(txid=f"big{n}", messages=[message("not-allowed")]) for n in range(200)
            ]
            with pytest.raises(CommandError, match="send at most the first") as error:
                await prepare_batch(nc, many, encoding=Encoding.JSON)
            assert error.value.code == "bad_request"
            fits = int(str(error.value).rsplit("the first ", 1)[1].split()[0])
            assert 0 < fits < len(many)
            for encoding in Encoding:
                answer = await prepare_batch(nc, many[:fits], encoding=encoding)
                assert codes(answer.results) == ["forbidden"] * fits
                lengths = {len(r.message) for r in answer.results if isinstance(r, Error)}
                assert max(lengths) == MAX_ITEM_ERROR_CHARS, "cut, as the bound counted on"
                size = len(encode(answer, encoding))
                assert size <= max_payload - REPLY_HEADROOM
            assert await halves(nc) == []
    finally:
        await nc.close()


async def test_batches_in_json_and_version_2_commands_are_served(private_nc: Client) -> None:
    """Another language's client: batches in JSON (bytes as base64), an item of the wrong
    type refused alone as any bad item; a version 2 client's lone commands are still carried
    out."""
    command = {
        "type": "PrepareBatch",
        "version": 3,
        "group": "g",
        "producer": "p1",
        "items": [
            {"txid": "json1", "messages": [{"topic": "orders", "body": "eA=="}]},
            {"txid": "json 2", "messages": [{"topic": "orders", "body": "eA=="}]},
            {"txid": 5, "messages": [{"topic": "orders", "body": "eA=="}]},
        ],
    }
    json_headers = {"Content-Type": "application/json"}
    async with run_coordinator(private_nc):
        reply = await private_nc.request(
            layout.prepare_subject(0, "g"),
            msgspec.json.encode(command),
            timeout=10,
            headers=json_headers,
        )
        assert reply.headers == json_headers
        answer = msgspec.json.decode(reply.data)
        assert answer["type"] == "PreparedBatch"
        first, second, third = answer["results"]
        assert (first["type"], first["txid"]) == ("Prepared", "json1")
        assert (second["type"], second["code"]) == ("Error", "bad_request")
        assert third == {
            "type": "Error",
            "code": "bad_request",
            "message": "Expected `str`, got `int` - at `$.txid`",
        }
        end = {
            "type": "EndBatch",
            "version": 3,
            "items": [
                {"txid": "json1", "token": first["token"], "decision": 1},
                {"txid": "json1", "token": first["token"], "decision": "commit"},
            ],
        }
        reply = await private_nc.request(
            layout.end_subject(0, "g"), msgspec.json.encode(end), timeout=10, headers=json_headers
        )
        assert msgspec.json.decode(reply.data) == {
            "type": "EndedBatch",
            "results": [
                {
                    "type": "Error",
                    "code": "bad_request",
                    "message": "Expected `str`, got `int` - at `$.decision`",
                },
                {"type": "Ended", "txid": "json1", "state": "committed"},
            ],
        }

        old = Prepare(
            version=2,
            txid="old1",
            group="g",
            producer="p1",
            messages=[OutgoingMessage(topic="orders", body=b"x")],
        )
        receipt = await CoordinatorClient(private_nc).prepare_for("g").ask(old, timeout=10)
        assert isinstance(receipt, Prepared)
        end_v2 = {"type": "EndTransaction", "version": 2, "txid": "old1", "token": receipt.token}
        reply = await private_nc.request(
            layout.end_subject(0, "g"),
            msgspec.msgpack.encode({**end_v2, "decision": "commit"}),
            timeout=10,
        )
        assert msgspec.msgpack.decode(reply.data)["state"] == "committed"
    assert await topic_ids(private_nc, "orders") == ["json1:0", "old1:0"]
