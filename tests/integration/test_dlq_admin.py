"""Dead letters as an operator meets them (txactors.ops.dlq), on a real server with real
consumers: two groups read one topic, one of them dead-letters what it cannot handle; a replay
reaches that group again, once, and never the group that had the original."""

from __future__ import annotations

import io
from collections import Counter

import pytest
from nats.aio.client import Client
from rich.console import Console

from tests.support.wait import eventually
from txactors.consumer import ConsumedMessage, Consumer
from txactors.consumer.dlq import dead_letter
from txactors.nats.topics import ensure_dlq_stream, ensure_topic_stream
from txactors.ops import dlq as dlq_admin
from txactors.ops import dlq_views
from txactors.wire import layout


async def _publish(nc: Client, txid: str, body: bytes, tag: str | None = None) -> int:
    """A committed message as the coordinator publishes it; its topic stream sequence."""
    headers = {
        layout.MSG_ID_HEADER: layout.message_id(txid, 0),
        layout.TXID_HEADER: txid,
        layout.GROUP_HEADER: "shop",
        "Region": "eu",
    }
    if tag is not None:
        headers[layout.TAG_HEADER] = tag
    ack = await nc.jetstream().publish(layout.topic_subject("orders", tag), body, headers=headers)
    return ack.seq


async def _caught_up(nc: Client, group: str) -> None:
    """The group's durable has delivered and settled everything now on the topic."""
    js = nc.jetstream()
    last = (await js.stream_info("TOPIC_orders")).state.last_seq
    await eventually(
        lambda: js.consumer_info("TOPIC_orders", group),
        until=lambda info: info.ack_floor.stream_seq >= last and not info.num_ack_pending,
        what=f"{group} settled everything up to {last}",
    )


async def test_list_show_and_replay_to_the_one_group(private_nc: Client) -> None:
    nc = private_nc
    await ensure_topic_stream(nc.jetstream(), "orders")
    broken = True
    handled: list[ConsumedMessage] = []
    seen_by_other: Counter[bytes] = Counter()

    async def fragile(message: ConsumedMessage) -> None:
        if broken and message.body.startswith(b"bad"):
            raise ValueError(f"cannot handle {message.body!r}")
        handled.append(message)

    async def other(message: ConsumedMessage) -> None:
        seen_by_other[message.body] += 1

    async with (
        Consumer(nc, "orders", "g", fragile, max_reconsume=0),
        Consumer(nc, "orders", "other", other),
    ):
        await _publish(nc, "t1", b"bad one", tag="paid")
        await _publish(nc, "t2", b"fine")
        await _publish(nc, "t3", b"bad two")
        page = await _wait_for_entries(nc, "g", 2)
        first, second = page.entries
        assert (first.topic, first.txid, first.msg_id, first.deliveries) == (
            "orders",
            "t1",
            "t1:0",
            1,
        )
        assert first.error == "ValueError: cannot handle b'bad one'"
        assert (first.origin_stream, first.omitted, first.body) == ("TOPIC_orders", [], None)
        assert page.total == 2 and page.next_seq is None
        assert [e.seq for e in (await dlq_admin.list_dead_letters(nc, "g", limit=1)).entries] == [
            first.seq
        ]
        later = await dlq_admin.list_dead_letters(nc, "g", start=first.seq + 1)
        assert [e.txid for e in later.entries] == ["t3"]

        shown = await dlq_admin.show_dead_letter(nc, "g", first.seq)
        assert (shown.body, shown.headers["Region"]) == (b"bad one", "eu")

        broken = False
        [replayed] = await dlq_admin.replay(nc, "g", [first.seq])
        assert replayed.error is None and replayed.topic == "orders", replayed
        await eventually(lambda: len(handled) == 2, what="the replay is handled")
        again = handled[-1]
        assert (again.body, again.tag, again.txid) == (b"bad one", "paid", "t1")
        assert again.msg_id == dlq_admin.replay_id("g", first.seq, "t1:0")
        assert again.headers[layout.REPLAY_OF_HEADER] == "t1:0"
        assert layout.ERROR_HEADER not in again.headers and again.headers["Region"] == "eu"

        [gone] = await dlq_admin.replay(nc, "g", [first.seq])
        assert gone.error is not None and "no entry" in gone.error, "deleted once replayed"

        # A replay whose copy is already on the topic (say, the last one died before deleting
        # the entry) is dropped by the stream, and the entry is deleted now.
        copy_id = dlq_admin.replay_id("g", second.seq, "t3:0")
        await nc.jetstream().publish(
            layout.topic_subject("orders"),
            b"bad two",
            headers={layout.MSG_ID_HEADER: copy_id, layout.REPLAY_GROUP_HEADER: "g"},
        )
        [dropped] = await dlq_admin.replay(nc, "g", await dlq_admin.all_sequences(nc, "g"))
        assert dropped.duplicate and dropped.error is None
        await eventually(lambda: len(handled) == 3, what="the copy is handled once")
        assert (await dlq_admin.list_dead_letters(nc, "g")).entries == []

        await _caught_up(nc, "other")
        await _caught_up(nc, "g")
        assert seen_by_other == {b"bad one": 1, b"fine": 1, b"bad two": 1}, "replays are not theirs"
        assert [m.body for m in handled] == [b"fine", b"bad one", b"bad two"]


async def _wait_for_entries(nc: Client, group: str, count: int) -> dlq_admin.DeadLetterPage:
    return await eventually(
        lambda: dlq_admin.list_dead_letters(nc, group),
        until=lambda page: len(page.entries) >= count,
        ignoring=(dlq_admin.DeadLetterError,),  # the consumer has not declared it yet
        what=f"{count} dead letters of {group}",
    )


def _consumed(seq: int, txid: str, body: bytes) -> ConsumedMessage:
    return ConsumedMessage(
        topic="orders",
        tag=None,
        keys=(),
        txid=txid,
        msg_id=layout.message_id(txid, 0),
        body=body,
        headers={layout.MSG_ID_HEADER: layout.message_id(txid, 0), layout.TXID_HEADER: txid},
        deliveries=16,
        stream_seq=seq,
        committed_at=None,
        subject=layout.topic_subject("orders"),
    )


async def test_an_entry_stored_by_reference_is_replayed_from_its_original(
    private_nc: Client,
) -> None:
    nc = private_nc
    js = nc.jetstream()
    await ensure_topic_stream(js, "orders")
    big = b"x" * 2000
    kept, purged = await _publish(nc, "t1", big), await _publish(nc, "t2", big)
    await ensure_dlq_stream(js, "g")
    for seq, txid in ((kept, "t1"), (purged, "t2")):
        # Too large for a copy at this max_payload: stored by reference, as a consumer would.
        await dead_letter(js, "g", _consumed(seq, txid, big), ValueError("no"), max_payload=1000)
    await js.delete_msg("TOPIC_orders", purged)
    entries = (await dlq_admin.list_dead_letters(nc, "g")).entries
    assert [e.omitted for e in entries] == [["body"], ["body"]]
    page = dlq_admin.DeadLetterPage(entries=entries, total=2, next_seq=None)
    assert "by reference (TOPIC_orders" in _text(dlq_views.render_list(page))

    fine, lost = await dlq_admin.replay(nc, "g", [e.seq for e in entries])
    assert fine.error is None and fine.topic_seq is not None
    copy = await js.get_msg("TOPIC_orders", fine.topic_seq)
    assert copy.data == big and copy.subject == "topic.orders._"
    assert copy.headers is not None and copy.headers[layout.REPLAY_OF_HEADER] == "t1:0"
    assert lost.error is not None and "is gone" in lost.error and f"seq {purged}" in lost.error
    assert [e.txid for e in (await dlq_admin.list_dead_letters(nc, "g")).entries] == ["t2"]


async def test_unknown_groups_and_bad_names_are_said_plainly(private_nc: Client) -> None:
    with pytest.raises(dlq_admin.DeadLetterError, match="no dead-letter stream"):
        await dlq_admin.list_dead_letters(private_nc, "nobody")
    with pytest.raises(dlq_admin.DeadLetterError, match="may contain only"):
        await dlq_admin.show_dead_letter(private_nc, "a.b", 1)
    await ensure_dlq_stream(private_nc.jetstream(), "empty")
    with pytest.raises(dlq_admin.DeadLetterError, match="has no entry 7"):
        await dlq_admin.show_dead_letter(private_nc, "empty", 7)
    assert [s.group for s in await dlq_admin.dlq_summaries(private_nc)] == ["empty"]


def _text(renderable: object) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(renderable)
    assert isinstance(console.file, io.StringIO)
    return console.file.getvalue()
