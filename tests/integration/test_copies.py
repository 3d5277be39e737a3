"""A copy carries only what is ours: no path that writes a stored record elsewhere, and no handler,
sees the server's `Nats-*` headers of the original.

The records here are written the way load writes them: many messages in one JetStream atomic
batch, so each stored original carries `Nats-Batch-Id` / `Nats-Batch-Sequence` (and the last
`Nats-Batch-Commit`). Every test first checks that its originals really do, then follows one
copy path: a discard (hundreds at once, and one resumed or forced by an operator afterwards), a
committed message as a handler sees it, a dead letter, and a `dlq replay` of a full copy and of
an entry stored by reference.
"""

from __future__ import annotations

from collections.abc import Mapping

import anyio
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js import JetStreamContext

from tests.support.txn import FAST, CoordinatorClient, message
from tests.support.wait import eventually
from txactors.consumer import ConsumedMessage, Consumer
from txactors.consumer.dlq import dead_letter
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.options import DiscardedTransaction
from txactors.coordinator.partition.packs import is_pack, read_halves
from txactors.coordinator.partition.recovery import read_subject
from txactors.coordinator.service import run_coordinator
from txactors.nats.topics import ensure_dlq_stream
from txactors.nats.writer import ATOMIC_MIN_MESSAGES
from txactors.ops import dlq as dlq_admin
from txactors.ops import txn as admin
from txactors.wire import layout
from txactors.wire.copies import copied_headers, stored_headers
from txactors.wire.protocol import PROTOCOL_VERSION, Decision, Prepare, Prepared

REGION = "Zürich"
"""A user property with a non-ASCII value: a copy keeps it intact too."""
LOAD = 300
"""Transactions discarded at once in the load test."""
BATCHED = ATOMIC_MIN_MESSAGES
"""Messages of one transaction: enough for its writes to be atomic batches."""


def _server_headers(headers: Mapping[str, str]) -> list[str]:
    """Every header in the NATS server's namespace, whatever its spelling."""
    return sorted(k for k in headers if k.strip().lower().startswith("nats-"))


def _batch_headers(headers: Mapping[str, str]) -> list[str]:
    return sorted(k for k in headers if k.strip().lower().startswith("nats-batch-"))


async def _stored(js: JetStreamContext, stream: str, seq: int) -> dict[str, str]:
    return stored_headers(await js.get_msg(stream, seq))


async def _all(js: JetStreamContext, stream: str, subject: str) -> list[tuple[str, dict[str, str]]]:
    """(subject, headers) of every message of `subject` in `stream` now, oldest first."""
    return [(m.subject, dict(m.headers or {})) async for m in read_subject(js, stream, subject, 1)]


def _props(**extra: str) -> dict[str, str]:
    return {"Region": REGION, **extra}


# -- the helper -----------------------------------------------------------------------------

_SERVER_NAMES = st.sampled_from(
    [
        "Nats-Msg-Id",
        "Nats-Batch-Id",
        "Nats-Batch-Sequence",
        "Nats-Batch-Commit",
        "Nats-Expected-Last-Subject-Sequence",
        "Nats-Expected-Stream",
        "Nats-Rollup",
        "Nats-TTL",
        "Nats-Stream",
        "Nats-Sequence",
        "Nats-Time-Stamp",
        "Nats-Subject",
        "Nats-Stream-Source",
        "Status",
        "Description",
        "KV-Operation",
    ]
)


@st.composite
def _spelled(draw: st.DrawFn, names: st.SearchStrategy[str]) -> str:
    """A name as another client may send it: any case, blanks around it."""
    name = draw(names)
    cased = "".join(c.upper() if draw(st.booleans()) else c.lower() for c in name)
    return draw(st.sampled_from(["", " "])) + cased + draw(st.sampled_from(["", " "]))


_OURS = st.one_of(
    st.sampled_from([layout.TXID_HEADER, layout.INDEX_HEADER, layout.TAG_HEADER, "traceparent"]),
    st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,20}", fullmatch=True).filter(
        lambda n: not n.lower().startswith("nats") and n.lower() not in layout.RESERVED_HEADER_NAMES
    ),
)


@given(
    server=st.dictionaries(_spelled(_SERVER_NAMES), st.text(max_size=8), max_size=6),
    ours=st.dictionaries(_OURS, st.text(max_size=8), max_size=6),
)
def test_a_copy_keeps_every_header_but_the_servers(
    server: dict[str, str], ours: dict[str, str]
) -> None:
    assert copied_headers({**server, **ours}) == ours


# -- discards -------------------------------------------------------------------------------


async def test_hundreds_of_transactions_discarded_at_once_all_land_on_their_group(
    private_nc: Client,
) -> None:
    """Their halves were written in packs, in shared atomic batches; every copy is on
    `txn.discard.g`, none is quarantined, and none carries the server's headers of its pack."""
    nc, js = private_nc, private_nc.jetstream()
    hooked: list[DiscardedTransaction] = []

    async def on_discard(discarded: DiscardedTransaction) -> None:
        hooked.append(discarded)

    config = CoordinatorConfig(check_max=1, **FAST)
    async with run_coordinator(nc, config=config, on_discard=on_discard):
        client = CoordinatorClient(nc)

        async def prepare(i: int) -> None:
            command = Prepare(
                txid=f"t{i}",
                group="g",
                producer="p1",
                messages=[message(properties=_props()), message("points", properties=_props())],
                version=PROTOCOL_VERSION,
            )
            await client.prepare_ref.ask(command, timeout=60)

        async with anyio.create_task_group() as tg:
            for i in range(LOAD):
                tg.start_soon(prepare, i)
        packs = [
            m async for m in read_subject(js, layout.half_stream(0), layout.half_subject(0), 1)
        ]
        batches: dict[str, set[str]] = {}
        halves = 0
        for m in packs:
            read = read_halves(m.metadata.sequence.stream, m.headers or {}, m.data)
            assert [h.half.index for h in read] == [0, 1], "a prepare's halves in one pack"
            halves += len(read)
            batch = (m.headers or {}).get("Nats-Batch-Id", "")
            batches.setdefault(batch, set()).update(h.txid for h in read)
        assert halves == 2 * LOAD
        shared = [txids for batch, txids in batches.items() if batch]
        assert max(map(len, shared)) > 1, "atomic batches shared by transactions"

        async def all_copied() -> bool:
            state = (await js.stream_info(layout.DISCARD_STREAM)).state
            return state.messages >= 2 * LOAD and len(hooked) >= LOAD

        await eventually(all_copied, what=f"{LOAD} transactions discarded", timeout=120)
        copies = await _all(js, layout.DISCARD_STREAM, layout.discard_subject_filter())
    quarantined = [h for s, h in copies if s == layout.quarantine_subject()]
    assert quarantined == [], quarantined[:1]
    assert {s for s, _ in copies} == {layout.discard_subject("g")}
    ids = sorted(h[layout.MSG_ID_HEADER] for _, h in copies)
    assert ids == sorted(f"t{i}:{n}:discard" for i in range(LOAD) for n in (0, 1))
    assert [h for _, h in copies if _server_headers(h) != [layout.MSG_ID_HEADER]] == []
    assert {h[layout.DISCARD_REASON_HEADER] for _, h in copies} == {"check_max"}
    assert sorted((h[layout.TXID_HEADER], h[layout.INDEX_HEADER]) for _, h in copies) == sorted(
        (f"t{i}", str(n)) for i in range(LOAD) for n in (0, 1)
    ), "a copy names its txid and index, which the half keeps only in its own id"
    assert len(hooked) == LOAD


async def test_an_operator_resumes_or_forces_a_transaction_whose_halves_share_a_pack(
    private_nc: Client,
) -> None:
    nc, js = private_nc, private_nc.jetstream()
    seen: list[ConsumedMessage] = []

    async def handle(m: ConsumedMessage) -> None:
        seen.append(m)

    config = CoordinatorConfig(check_max=1, **FAST)
    async with (
        run_coordinator(nc, config=config),
        Consumer(nc, "payments", "ledger", handle),
    ):
        client = CoordinatorClient(nc)
        batched = [message("payments", b"%d" % i, properties=_props()) for i in range(BATCHED)]
        receipts: dict[str, Prepared] = {}
        for txid in ("resumed", "forced"):
            receipts[txid] = await client.prepare(txid, *batched)
            [seq] = set(receipts[txid].seqs)
            assert is_pack(await _stored(js, layout.half_stream(0), seq))
        for txid in receipts:
            await eventually(
                lambda txid=txid: admin.show(nc, txid),
                until=lambda info: info.state == "discarded",
                timeout=20,
                what=f"{txid} discarded",
            )

        async def all_copied() -> bool:
            return (await js.stream_info(layout.DISCARD_STREAM)).state.messages >= 2 * BATCHED

        await eventually(all_copied, what="every discarded half copied", timeout=30)
        copies = await _all(js, layout.DISCARD_STREAM, layout.discard_subject_filter())
        assert [s for s, _ in copies] == [layout.discard_subject("g")] * (2 * BATCHED), copies

        assert (await admin.resume(nc, "resumed")).state == "prepared"
        token = receipts["resumed"].token
        assert (await client.end("resumed", token, Decision.COMMIT)).state == "committed"
        assert (await admin.commit(nc, "forced")).state == "committed"

        async def all_handled() -> bool:
            return len(seen) >= 2 * BATCHED

        await eventually(all_handled, what="every committed message handled", timeout=30)
    assert sorted(m.msg_id for m in seen) == sorted(
        f"{txid}:{i}" for txid in receipts for i in range(BATCHED)
    )
    for m in seen:
        assert _server_headers(m.headers) == [], m.headers
        assert m.headers["Region"] == REGION and m.headers[layout.TXID_HEADER] == m.txid


# -- committed messages, dead letters, replays -----------------------------------------------


async def test_a_handler_sees_the_producers_headers_and_ours_only(private_nc: Client) -> None:
    nc, js = private_nc, private_nc.jetstream()
    seen: list[ConsumedMessage] = []

    async def handle(m: ConsumedMessage) -> None:
        seen.append(m)

    async with run_coordinator(nc), Consumer(nc, "orders", "shop", handle):
        client = CoordinatorClient(nc)
        bodies = [
            message(body=b"%d" % i, keys=[f"k{i}"], properties=_props()) for i in range(BATCHED)
        ]
        receipt = await client.prepare("batched", *bodies)
        assert (await client.end("batched", receipt.token, Decision.COMMIT)).state == "committed"

        async def all_handled() -> bool:
            return len(seen) >= BATCHED

        await eventually(all_handled, what="every committed message handled", timeout=30)
        originals = [
            await _stored(js, layout.topic_stream("orders"), seq) for seq in range(1, BATCHED + 1)
        ]
    assert all(_batch_headers(h) for h in originals), "written as one batch"
    assert sorted(m.msg_id for m in seen) == sorted(f"batched:{i}" for i in range(BATCHED))
    for m in seen:
        assert _server_headers(m.headers) == [], m.headers
        assert m.properties == {"Region": REGION}
        assert (m.headers[layout.TXID_HEADER], m.headers[layout.GROUP_HEADER]) == ("batched", "g")
        assert m.keys == (f"k{m.body.decode()}",)


async def test_dead_letters_and_replays_of_batched_messages_carry_only_ours(
    private_nc: Client,
) -> None:
    """The DLQ copy, a copy by reference, and the replay of each, of messages that the topic
    stream stored as one atomic batch; the handler that finally takes the replays sees them
    as clean as the originals."""
    nc, js = private_nc, private_nc.jetstream()
    broken = True
    handled: list[ConsumedMessage] = []

    async def fragile(m: ConsumedMessage) -> None:
        if broken:
            raise ValueError("not today")
        handled.append(m)

    big = b"x" * 2000
    async with run_coordinator(nc), Consumer(nc, "orders", "fragile", fragile, max_reconsume=0):
        client = CoordinatorClient(nc)
        bodies = [message(body=big, properties=_props()) for _ in range(BATCHED)]
        receipt = await client.prepare("batched", *bodies)
        assert (await client.end("batched", receipt.token, Decision.COMMIT)).state == "committed"
        originals = {
            seq: await _stored(js, layout.topic_stream("orders"), seq)
            for seq in range(1, BATCHED + 1)
        }
        assert all(_batch_headers(h) for h in originals.values()), "written as one batch"

        async def dead_lettered() -> bool:
            try:
                return len((await dlq_admin.list_dead_letters(nc, "fragile")).entries) >= BATCHED
            except dlq_admin.DeadLetterError:  # the consumer has not declared its DLQ yet
                return False

        await eventually(dead_lettered, what="every dead letter", timeout=30)
        entries = (await dlq_admin.list_dead_letters(nc, "fragile")).entries
        dead = [await _stored(js, layout.dlq_stream("fragile"), e.seq) for e in entries]
        assert [_server_headers(h) for h in dead] == [[layout.MSG_ID_HEADER]] * BATCHED
        assert sorted(h[layout.MSG_ID_HEADER] for h in dead) == sorted(
            f"batched:{i}" for i in range(BATCHED)
        )
        assert {e.headers["Region"] for e in entries} == {REGION}

        broken = False
        results = await dlq_admin.replay(nc, "fragile", [e.seq for e in entries])
        assert [r.error for r in results] == [None] * BATCHED, results

        async def all_handled() -> bool:
            return len(handled) >= BATCHED

        await eventually(all_handled, what="every replay handled", timeout=30)

        # Stored by reference (as a consumer does when a copy would not fit): its replay reads
        # the original back from the topic stream, batch headers and all.
        original = stored_headers(await js.get_msg(layout.topic_stream("orders"), 1))
        assert _batch_headers(original)
        await ensure_dlq_stream(js, "ref")
        _, by_reference = await dead_letter(
            js, "ref", _as_consumed(original, 1, big), ValueError("no"), max_payload=1000
        )
        assert by_reference.omitted == ("body",)
        assert _server_headers(by_reference.headers) == [layout.MSG_ID_HEADER]
        [from_reference] = await dlq_admin.replay(
            nc, "ref", await dlq_admin.all_sequences(nc, "ref")
        )
        assert from_reference.error is None, from_reference
    for r in [*results, from_reference]:
        assert r.topic_seq is not None
        copy = await _stored(js, layout.topic_stream("orders"), r.topic_seq)
        assert _server_headers(copy) == [layout.MSG_ID_HEADER], copy
        assert copy[layout.MSG_ID_HEADER].startswith("replay:")
        assert copy["Region"] == REGION, "kept intact"
    for m in handled:
        assert _server_headers(m.headers) == [], m.headers
        assert m.headers["Region"] == REGION
    assert sorted(m.headers[layout.REPLAY_OF_HEADER] for m in handled) == sorted(
        f"batched:{i}" for i in range(BATCHED)
    )


def _as_consumed(headers: dict[str, str], seq: int, body: bytes) -> ConsumedMessage:
    """A message as a consumer that kept every stored header would hand it to the DLQ."""
    return ConsumedMessage(
        topic="orders",
        tag=None,
        keys=(),
        txid=headers[layout.TXID_HEADER],
        msg_id=headers[layout.MSG_ID_HEADER],
        body=body,
        headers=headers,
        deliveries=1,
        stream_seq=seq,
        committed_at=None,
        subject=layout.topic_subject("orders"),
    )
