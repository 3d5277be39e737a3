"""Group commit: appends queued meanwhile go out as one atomic batch, and nothing doubles.

Against a real nats-server; the lost ack is a real one (a proxy swallows the server's
answers, then cuts the connection), so the re-sent batch meets JetStream's dedupe.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import nats
import structlog
from nats.aio.client import Client
from nats.js.api import Header, PubAck, StreamConfig

from tests.support.logstreams import ensure_log_streams
from tests.support.servers import MakeNatsServer
from tests.support.wait import eventually
from txactors.nats.topics import ensure_topic_stream
from txactors.nats.writer import ATOMIC_MIN_MESSAGES, Append, PipelinedWriter
from txactors.wire import layout


class Reports:
    """Collects what a writer reports, in report order."""

    def __init__(self) -> None:
        self.acks: list[list[PubAck | None]] = []
        self.quarantined: list[tuple[Append, str]] = []

    def submit(self, writer: PipelinedWriter, appends: list[Append]) -> None:
        writer.submit(appends, self.report, self.quarantine)

    async def report(self, acks: list[PubAck | None]) -> None:
        self.acks.append(acks)

    async def quarantine(self, append: Append, reason: str) -> None:
        self.quarantined.append((append, reason))

    async def wait(self, jobs: int) -> None:
        await eventually(lambda: len(self.acks) >= jobs, timeout=20, what=f"{jobs} jobs acked")


@contextlib.asynccontextmanager
async def running(
    nc: Client, reports: Reports, max_in_flight: int = 2, linger: float = 0.0
) -> AsyncIterator[PipelinedWriter]:
    writer = PipelinedWriter(nc, nc.jetstream(), max_in_flight=max_in_flight, linger=linger)
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer.run)
        yield writer
        tg.cancel_scope.cancel()


def appends(stream: str, subject: str, names: list[str], body: bytes = b"b") -> list[Append]:
    return [Append(subject, body, {layout.MSG_ID_HEADER: n}, stream) for n in names]


async def stored(nc: Client, stream: str) -> list[tuple[int, str]]:
    """(seq, Nats-Msg-Id) of every message in `stream`."""
    js = nc.jetstream()
    last = (await js.stream_info(stream)).state.last_seq
    out = []
    for seq in range(1, last + 1):
        msg = await js.get_msg(stream, seq)
        out.append((seq, (msg.headers or {}).get(layout.MSG_ID_HEADER, "")))
    return out


async def test_appends_queued_while_writes_are_in_flight_go_out_as_one_atomic_batch(
    private_nc: Client,
) -> None:
    await ensure_topic_stream(private_nc.jetstream(), "gc")
    reports = Reports()
    writes = 0
    async with running(private_nc, reports, max_in_flight=1) as writer:
        publish = writer._inbox.publish

        async def counted(*args: Any) -> Any:  # each write asks for one ack
            nonlocal writes
            writes += 1
            return await publish(*args)

        writer._inbox.publish = counted  # type: ignore[method-assign]
        reports.submit(writer, appends("TOPIC_gc", "topic.gc._", ["m0"]))
        with anyio.fail_after(5):
            while not writer._open:  # the first write is out, awaiting its ack
                await anyio.lowlevel.checkpoint()
        for i in range(1, 40):  # the other 39 wait for it, then go out together
            reports.submit(writer, appends("TOPIC_gc", "topic.gc._", [f"m{i}"]))
        await reports.wait(40)
    assert writes == 2
    seqs = [acks[0].seq for acks in reports.acks if acks[0] is not None]
    assert await stored(private_nc, "TOPIC_gc") == [(s, f"m{i}") for i, s in enumerate(seqs)]


async def test_a_few_appends_queued_meanwhile_go_each_alone_all_in_flight(
    private_nc: Client,
) -> None:
    """Fewer than `ATOMIC_MIN_MESSAGES`: nats-server takes longer over a small atomic batch
    than over the same messages one by one, so they go one by one, none waiting for another."""
    await ensure_topic_stream(private_nc.jetstream(), "gc")
    reports = Reports()
    writes = 0
    in_flight = 0
    async with running(private_nc, reports, max_in_flight=1) as writer:
        publish = writer._inbox.publish

        async def counted(*args: Any) -> Any:
            nonlocal writes, in_flight
            writes += 1
            in_flight = max(in_flight, len(writer._open) + 1)
            return await publish(*args)

        writer._inbox.publish = counted  # type: ignore[method-assign]
        reports.submit(writer, appends("TOPIC_gc", "topic.gc._", ["m0"]))
        with anyio.fail_after(5):
            while not writer._open:  # the first write is out, awaiting its ack
                await anyio.lowlevel.checkpoint()
        for i in range(1, 4):
            reports.submit(writer, appends("TOPIC_gc", "topic.gc._", [f"m{i}"]))
        await reports.wait(4)
    assert writes == 4 and in_flight == 3
    seqs = [acks[0].seq for acks in reports.acks if acks[0] is not None]
    assert await stored(private_nc, "TOPIC_gc") == [(s, f"m{i}") for i, s in enumerate(seqs)]
    js = private_nc.jetstream()
    for seq in seqs:
        headers = (await js.get_msg("TOPIC_gc", seq)).headers or {}
        assert Header.BATCH_ID not in headers


async def test_appends_linger_behind_a_write_in_flight_and_share_the_next_one(
    private_nc: Client,
) -> None:
    await ensure_topic_stream(private_nc.jetstream(), "gc")
    reports = Reports()
    writes = 0
    held = asyncio.Event()
    async with running(private_nc, reports, max_in_flight=2, linger=0.05) as writer:
        publish = writer._inbox.publish

        async def counted(*args: Any) -> Any:  # the first write's ack is held back
            nonlocal writes
            writes += 1
            future = await publish(*args)
            if writes > 1:
                return future
            delayed = asyncio.get_running_loop().create_future()
            asyncio.ensure_future(held.wait()).add_done_callback(
                lambda _: future.add_done_callback(lambda f: delayed.set_result(f.result()))
            )
            return delayed

        writer._inbox.publish = counted  # type: ignore[method-assign]
        reports.submit(writer, appends("TOPIC_gc", "topic.gc._", ["m0"]))
        with anyio.fail_after(5):
            while not writer._open:  # nothing was in flight: it went out at once
                await anyio.lowlevel.checkpoint()
        for i in range(1, ATOMIC_MIN_MESSAGES + 1):  # a slot is free, but they linger
            reports.submit(writer, appends("TOPIC_gc", "topic.gc._", [f"m{i}"]))
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
        await eventually(lambda: writes >= 2, timeout=5, what="the second write")
        held.set()
        await reports.wait(ATOMIC_MIN_MESSAGES + 1)
    assert writes == 2
    seqs = [acks[0].seq for acks in reports.acks if acks[0] is not None]
    assert await stored(private_nc, "TOPIC_gc") == [(s, f"m{i}") for i, s in enumerate(seqs)]


async def test_a_batch_resent_after_its_ack_was_lost_stores_nothing_twice(
    make_nats_server: MakeNatsServer,
) -> None:
    server = await make_nats_server()
    async with anyio.create_task_group() as tg, Proxy(server.port) as proxy:
        tg.start_soon(proxy.serve)
        writer_nc = await nats.connect(
            f"nats://127.0.0.1:{proxy.port}", reconnect_time_wait=0.1, max_reconnect_attempts=-1
        )
        observer = await nats.connect(server.url)
        await ensure_topic_stream(observer.jetstream(), "gc")
        reports = Reports()
        async with running(writer_nc, reports) as writer:
            reports.submit(writer, appends("TOPIC_gc", "topic.gc._", ["a"]))
            await reports.wait(1)
            proxy.swallow = True  # the server stores the next batch; its ack never comes back
            names = [f"x{i}" for i in range(ATOMIC_MIN_MESSAGES)]
            with structlog.testing.capture_logs() as logs:
                reports.submit(writer, appends("TOPIC_gc", "topic.gc._", names))
                await eventually(
                    lambda: stored(observer, "TOPIC_gc"),
                    until=lambda messages: len(messages) > len(names),
                    what="the batch stored on TOPIC_gc",
                )
                await proxy.cut()  # the client reconnects and re-sends the same batch
                await reports.wait(2)
        await writer_nc.close()
        content = await stored(observer, "TOPIC_gc")
        await observer.close()
        tg.cancel_scope.cancel()
    assert content == [(1, "a"), *((i + 2, n) for i, n in enumerate(names))], "no doubles"
    assert [ack.seq for ack in reports.acks[1] if ack is not None] == [
        i + 2 for i in range(len(names))
    ]
    assert "appends_reissued" in [e["event"] for e in logs]
    [one_by_one] = [e for e in logs if e["event"] == "batch_refused"]
    assert "10201" in one_by_one["error"], "JetStream refused the re-sent batch as a duplicate"


async def test_one_refused_message_does_not_sink_the_rest_of_its_batch(
    private_nc: Client,
) -> None:
    js = private_nc.jetstream()
    await js.add_stream(
        StreamConfig(name="SMALL", subjects=["small.>"], max_msg_size=512, allow_atomic=True)
    )
    reports = Reports()
    async with running(private_nc, reports, max_in_flight=1) as writer:
        reports.submit(writer, appends("SMALL", "small.x", ["first"]))
        reports.submit(writer, appends("SMALL", "small.x", ["a"]))
        reports.submit(writer, appends("SMALL", "small.x", ["big"], b"x" * 1000))
        rest = [f"b{i}" for i in range(ATOMIC_MIN_MESSAGES - 2)]  # queued: one batch
        for name in rest:
            reports.submit(writer, appends("SMALL", "small.x", [name]))
        await reports.wait(3 + len(rest))
    assert [acks[0] is None for acks in reports.acks] == [False, False, True] + [False] * len(rest)
    assert [a.headers[layout.MSG_ID_HEADER] for a, _ in reports.quarantined] == ["big"]
    assert [name for _, name in await stored(private_nc, "SMALL")] == ["first", "a", *rest]


async def test_a_stream_without_atomic_batches_is_written_one_by_one_after_one_refusal(
    private_nc: Client,
) -> None:
    await private_nc.jetstream().add_stream(StreamConfig(name="PLAIN", subjects=["plain.>"]))
    reports = Reports()
    with structlog.testing.capture_logs() as logs:
        async with running(private_nc, reports, max_in_flight=1) as writer:
            for round_ in range(2):
                reports.submit(writer, appends("PLAIN", "plain.x", [f"{round_}-0"]))
                for i in range(1, ATOMIC_MIN_MESSAGES + 1):  # queued: a batch, refused once
                    names = [f"{round_}-{i}"]
                    reports.submit(writer, appends("PLAIN", "plain.x", names))
                await reports.wait((ATOMIC_MIN_MESSAGES + 1) * (round_ + 1))
    refusals = [e for e in logs if e["event"] == "batch_refused"]
    assert len(refusals) == 1 and "10174" in refusals[0]["error"]
    assert len(await stored(private_nc, "PLAIN")) == 2 * (ATOMIC_MIN_MESSAGES + 1)


async def test_existing_streams_are_updated_in_place_to_take_atomic_batches(
    private_nc: Client,
) -> None:
    js = private_nc.jetstream()
    await js.add_stream(StreamConfig(name=layout.half_stream(0), subjects=[layout.half_subject(0)]))
    await js.add_stream(StreamConfig(name="TOPIC_old", subjects=["topic.old.>"]))
    await js.publish("topic.old._", b"kept")
    await ensure_log_streams(js, half_retention=60)
    await ensure_topic_stream(js, "old")
    assert (await js.stream_info(layout.half_stream(0))).config.allow_atomic
    info = await js.stream_info("TOPIC_old")
    assert info.config.allow_atomic and info.state.messages == 1


class Proxy:
    """A TCP relay to nats-server that can swallow the server's answers and cut connections."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.swallow = False
        self._listener: anyio.abc.SocketListener | None = None
        self._open: list[anyio.abc.SocketStream] = []

    @property
    def port(self) -> int:
        assert self._listener is not None
        return int(self._listener.extra(anyio.abc.SocketAttribute.local_port))

    async def __aenter__(self) -> Proxy:
        self._listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._listener is not None
        try:
            await self.cut()
        finally:
            await self._listener.aclose()

    async def serve(self) -> None:
        assert self._listener is not None
        await self._listener.serve(self._relay)

    async def cut(self) -> None:
        """Close every relayed connection; later ones are relayed faithfully."""
        self.swallow = False
        for stream in self._open:
            await stream.aclose()
        self._open.clear()

    async def _relay(self, client: anyio.abc.SocketStream) -> None:
        async with client, await anyio.connect_tcp("127.0.0.1", self.upstream_port) as upstream:
            self._open += [client, upstream]

            async def pump(
                src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream, up: bool
            ) -> None:
                with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError, OSError):
                    async for chunk in src:
                        if up or not self.swallow:
                            await dst.send(chunk)
                with contextlib.suppress(anyio.ClosedResourceError, OSError):
                    await dst.aclose()

            async with anyio.create_task_group() as tg:
                tg.start_soon(pump, client, upstream, True)
                tg.start_soon(pump, upstream, client, False)
