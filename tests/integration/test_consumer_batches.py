"""A batch's acks leave only after its handlers returned; acks that never left mean redelivery.

The consumer sends the acks of a batch together (one socket write), so these tests watch the
socket: no ack may be written for a message whose handler has not returned, a failing
handler's message is never acked, and a consumer that dies after its handlers returned but
before the acks left has the messages redelivered. Each runs on a plain nats-py client (an
ack a publish) and on a `TolerantClient` (a batch's acks one command, `ack_all`).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import anyio.lowlevel
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from tests.integration.test_consumer import info, names, publish
from tests.support.wait import eventually
from txactors.consumer import ConsumedMessage, Consumer
from txactors.errors import NatsConnectionLost
from txactors.nats.client import connect

_ACK = re.compile(rb"PUB (\$JS\.ACK\.[^ ]+) +0\r\n\r\n")

CLIENTS: dict[str, Callable[[str], Awaitable[Client]]] = {
    "nats-py": lambda url: nats.connect(url),
    "tolerant": lambda url: connect(url),
}


def acked_seqs(payload: list[bytes]) -> list[int]:
    """Stream sequences of the `+ACK`s (an empty publish to a `$JS.ACK.` subject) in a write:
    a part is one publish, or (`ack_all`) several."""
    seqs = []
    for part in payload:
        for subject in _ACK.findall(part):
            tokens = subject.split(b".")
            # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.… (v1), or with
            # <domain>.<account hash> after ACK (v2).
            seqs.append(int(tokens[5] if len(tokens) == 9 else tokens[7]))
    return seqs


@pytest.mark.parametrize("client", list(CLIENTS))
async def test_acks_are_written_only_after_their_handlers_returned(nc: Client, client: str) -> None:
    count = 60
    returned: set[int] = set()
    failing = {seq for seq in range(1, count + 1) if seq % 5 == 0}

    async def handler(msg: ConsumedMessage) -> None:
        await anyio.lowlevel.checkpoint()  # it yields: other work (and writes) runs meanwhile
        if msg.stream_seq in failing:
            raise RuntimeError("fails: must be retried, never acked")
        returned.add(msg.stream_seq)

    async with names(nc) as (topic, group):
        for i in range(count):
            await publish(nc, topic, i)
        consumer_nc = await CLIENTS[client](nc.connected_url.geturl())  # type: ignore[union-attr]
        acked: list[int] = []
        early: list[int] = []
        transport = consumer_nc._transport  # a spy on the real socket
        writelines = transport.writelines  # type: ignore[union-attr]

        def spied(payload: list[bytes]) -> None:
            seqs = acked_seqs(payload)
            early.extend(seq for seq in seqs if seq not in returned)
            acked.extend(seqs)
            writelines(payload)

        transport.writelines = spied  # type: ignore[union-attr,method-assign]
        try:
            async with Consumer(consumer_nc, topic, group, handler, concurrency=8):
                await eventually(lambda: len(acked) == count - len(failing))
        finally:
            await consumer_nc.close()
        assert early == [], f"acks written before their handler returned: {early}"
        assert sorted(acked) == sorted(returned)
        assert not failing & set(acked)
        state = await info(nc, topic, group)
        assert state.num_ack_pending == len(failing)  # naked with a delay: still the group's


@pytest.mark.parametrize("client", list(CLIENTS))
async def test_handled_messages_whose_acks_never_left_are_redelivered(
    nc: Client, client: str
) -> None:
    async with names(nc) as (topic, group):
        for i in range(3):
            await publish(nc, topic, i)
        consumer_nc = await CLIENTS[client](nc.connected_url.geturl())  # type: ignore[union-attr]
        handled: list[int] = []
        all_handled = anyio.Event()

        async def dies_after_handling(msg: ConsumedMessage) -> None:
            handled.append(msg.stream_seq)
            if len(handled) == 3:
                # The process dies after the handlers' work, before any of their acks left.
                await consumer_nc.close()
                all_handled.set()
            await all_handled.wait()

        lost: list[NatsConnectionLost] = []
        consumer = Consumer(consumer_nc, topic, group, dies_after_handling, ack_wait=1.0)

        async def run(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            try:
                await consumer.run(task_status=task_status)
            except NatsConnectionLost as error:
                lost.append(error)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(run)
        assert sorted(handled) == [1, 2, 3] and len(lost) == 1

        again: list[ConsumedMessage] = []

        async def handler(msg: ConsumedMessage) -> None:
            again.append(msg)

        async with Consumer(nc, topic, group, handler, ack_wait=1.0):
            await eventually(lambda: len(again) == 3)
        assert sorted(m.stream_seq for m in again) == [1, 2, 3]
        assert all(m.deliveries == 2 for m in again)


async def test_ack_all_sends_a_batch_or_nothing(nc: Client) -> None:
    client = await connect(nc.connected_url.geturl())  # type: ignore[union-attr]
    try:

        def delivery(seq: int) -> Msg:
            reply = f"$JS.ACK.S.c.1.{seq}.{seq}.1700000000000000000.0"
            return Msg(_client=client, subject="topic.t.x", reply=reply, data=b"")

        written: list[int] = []
        transport = client._transport
        writelines = transport.writelines  # type: ignore[union-attr]

        def spied(payload: list[bytes]) -> None:
            written.extend(acked_seqs(payload))
            writelines(payload)

        transport.writelines = spied  # type: ignore[union-attr,method-assign]
        done = delivery(1)
        done._ackd = True
        # One already acked: nothing sent, so one by one they raise as nats-py's `ack` does.
        assert not await client.ack_all([delivery(2), done])
        assert not await client.ack_all([delivery(3), Msg(_client=client, reply="")])
        batch = [delivery(4), delivery(5)]
        assert await client.ack_all(batch)
        assert all(msg._ackd for msg in batch)
        await client.flush()
        assert written == [4, 5]
    finally:
        await client.close()
