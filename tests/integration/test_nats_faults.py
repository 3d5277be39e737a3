"""The NATS client's own faults: a malformed header block, a dead read loop, a closed connection.

A raw socket (tests.support.rawnats) sends header blocks that nats-py 2.16's parser raises on
in its read loop, to every subject a role of ours listens on; each role must still serve after.
A read loop that dies anyway must be revived, and a connection closed for good must stop the
role with `NatsConnectionLost`, never leave it up serving nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import nats
import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg

from tests.integration.test_producer import RecordingChecker, ask_instance, check_for, producer
from tests.support.rawnats import MALFORMED_BLOCKS, raw_hpub
from tests.support.servers import MakeNatsServer
from tests.support.txn import CoordinatorClient, message, topic_ids
from tests.support.wait import eventually
from txactors.consumer import ConsumedMessage, Consumer
from txactors.coordinator.service import run_coordinator
from txactors.errors import NatsConnectionLost
from txactors.nats.client import MALFORMED_HEADERS, TolerantClient, connect, malformed_headers
from txactors.wire import layout
from txactors.wire.protocol import CheckResult, Decision, Error, ErrorCode

ROOT = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def replies_to(nc: Client) -> AsyncIterator[tuple[str, list[Msg]]]:
    """An inbox prefix whose messages are collected: where the raw client asks for answers."""
    prefix = nc.new_inbox()
    got: list[Msg] = []

    async def collect(msg: Msg) -> None:
        got.append(msg)

    subscription = await nc.subscribe(f"{prefix}.>", cb=collect)
    await nc.flush()
    try:
        yield prefix, got
    finally:
        await subscription.unsubscribe()


def bad_request(msg: Msg) -> bool:
    answer = msgspec.msgpack.decode(msg.data, type=Error)
    return answer.code == ErrorCode.BAD_REQUEST and "header block" in answer.message


# -- the client --------------------------------------------------------------------------------


@given(st.binary(max_size=64))
async def test_no_header_block_makes_the_parser_raise(block: bytes) -> None:
    headers = await TolerantClient()._process_headers(block)
    assert headers is None or isinstance(headers, dict)


async def test_a_malformed_block_arrives_marked_and_the_client_keeps_receiving(
    nats_server: Any,
) -> None:
    nc = await connect(nats_server.url)
    got: list[Msg] = []

    async def collect(msg: Msg) -> None:
        got.append(msg)

    try:
        subject = f"raw.{uuid.uuid4().hex}"
        await nc.subscribe(subject, cb=collect)
        await nc.flush()
        for block in MALFORMED_BLOCKS:
            await raw_hpub(nats_server.url, subject, "_INBOX.x", block)
        await nc.publish(subject, b"fine", headers={"A": "b"})
        await eventually(lambda: len(got) == len(MALFORMED_BLOCKS) + 1)
        assert all(malformed_headers(m) for m in got[:-1])
        assert got[-1].data == b"fine" and got[-1].headers == {"A": "b"}
        assert malformed_headers(got[-1]) is None
    finally:
        await nc.close()


class FragileClient(TolerantClient):
    """Its read loop dies on any message to `boom`: a fault we cannot foresee."""

    async def _process_msg(self, sid: int, subject: bytes, *args: Any) -> None:
        if subject == b"boom":
            raise RuntimeError("a bug in the client")
        await super()._process_msg(sid, subject, *args)


async def test_a_read_loop_that_dies_is_revived_and_subscriptions_resume(
    nats_server: Any, nc: Client
) -> None:
    fragile = FragileClient()
    await fragile.connect(nats_server.url, reconnect_time_wait=0.1)
    got: list[bytes] = []

    async def collect(msg: Msg) -> None:
        got.append(msg.data)

    try:
        await fragile.subscribe("boom", cb=collect)
        subject = f"after.{uuid.uuid4().hex}"
        await fragile.subscribe(subject, cb=collect)
        await fragile.flush()
        with structlog.testing.capture_logs() as logs:
            await nc.publish("boom", b"")
            await nc.flush()

            async def answered() -> bool:  # sent until the revived connection re-subscribed
                await nc.publish(subject, b"ok")
                return b"ok" in got

            await eventually(answered, timeout=5, interval=0.05, what="the revived subscription")
        assert any(entry["event"] == "nats_read_loop_died" for entry in logs)
        assert fragile.is_connected
    finally:
        await fragile.close()


# -- the roles, against malformed header blocks --------------------------------------------------


async def test_the_coordinator_answers_a_malformed_block_bad_request_and_still_serves(
    private_nc: Client, make_nats_server: MakeNatsServer
) -> None:
    url = private_nc.connected_url.geturl()  # type: ignore[union-attr]
    service = await connect(url)
    try:
        async with run_coordinator(service), replies_to(private_nc) as (inbox, answers):
            client = CoordinatorClient(private_nc)
            subjects = [
                layout.prepare_subject(0, "g"),
                layout.end_subject(0, "g"),
                layout.admin_subject(0),
            ]
            sent = 0
            for subject in subjects:
                for block in MALFORMED_BLOCKS:
                    await raw_hpub(url, subject, f"{inbox}.{sent}", block, b"\x80")
                    sent += 1
            await eventually(lambda: len(answers) == sent)
            assert all(bad_request(m) for m in answers)
            receipt = await client.prepare("t1", message())
            assert (await client.end("t1", receipt.token, Decision.COMMIT)).state == "committed"
            assert await topic_ids(private_nc, "orders") == ["t1:0"]
    finally:
        await service.close()


async def test_a_coordinator_on_a_plain_client_is_revived_after_its_read_loop_dies(
    private_nc: Client,
) -> None:
    """A caller may hand run_coordinator nats-py's own client: the watch revives it."""
    url = private_nc.connected_url.geturl()  # type: ignore[union-attr]
    reconnected = anyio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    plain = await nats.connect(url, reconnect_time_wait=0.1, reconnected_cb=on_reconnect)
    try:
        async with run_coordinator(plain):
            await raw_hpub(url, layout.prepare_subject(0, "g"), "_INBOX.x", b"ab")
            with anyio.fail_after(5):
                await reconnected.wait()
            client = CoordinatorClient(private_nc)
            receipt = await client.prepare_once_up("t1", message())
            assert (await client.end("t1", receipt.token, Decision.COMMIT)).state == "committed"
    finally:
        await plain.close()


async def test_a_consumer_takes_a_stored_malformed_block_and_goes_on(
    nats_server: Any, nc: Client
) -> None:
    topic, group = f"t{uuid.uuid4().hex[:8]}", f"g{uuid.uuid4().hex[:8]}"
    client = await connect(nats_server.url)
    seen: list[ConsumedMessage] = []

    async def handler(msg: ConsumedMessage) -> None:
        seen.append(msg)

    try:
        async with Consumer(client, topic, group, handler, pull_expires=0.2):
            # Stored in the topic stream as sent: the consumer meets it on every restart.
            await raw_hpub(nats_server.url, layout.topic_subject(topic), "_INBOX.x", b"ab")
            await nc.jetstream().publish(layout.topic_subject(topic), b"fine")
            await eventually(lambda: len(seen) == 2)
        assert MALFORMED_HEADERS in seen[0].headers
        assert seen[1].body == b"fine"
    finally:
        await client.close()


async def test_a_producer_check_endpoint_answers_a_malformed_block_and_still_checks(
    nats_server: Any, nc: Client
) -> None:
    client = await connect(nats_server.url)
    checker = RecordingChecker(Decision.COMMIT)
    try:
        async with producer(client, checker=checker) as p, replies_to(nc) as (inbox, answers):
            subjects = [
                layout.check_instance_subject(p.group, p.instance),
                layout.check_group_subject(p.group),
            ]
            for index, subject in enumerate(subjects):
                await raw_hpub(nats_server.url, subject, f"{inbox}.{index}", b"NATS/1.0")
            await eventually(lambda: len(answers) == len(subjects))
            assert all(bad_request(m) for m in answers)
            result = await ask_instance(nc, p, check_for(p.group))
            assert isinstance(result, CheckResult) and result.resolution is Decision.COMMIT
    finally:
        await client.close()


# -- a connection closed for good ----------------------------------------------------------------


@pytest.mark.parametrize("role", [run_coordinator, producer], ids=["coordinator", "producer"])
async def test_a_role_whose_connection_closes_for_good_stops_with_an_error(
    make_nats_server: MakeNatsServer, role: Callable[[Client], Any]
) -> None:
    server = await make_nats_server()
    nc = await connect(server.url, max_reconnect_attempts=1, reconnect_time_wait=0.1)
    try:
        with anyio.fail_after(15), pytest.raises(NatsConnectionLost):
            async with role(nc):
                await server.stop()
                await anyio.sleep_forever()
    finally:
        await nc.close()


async def test_a_consumer_whose_connection_closes_for_good_stops_with_an_error(
    make_nats_server: MakeNatsServer,
) -> None:
    server = await make_nats_server()
    nc = await connect(server.url, max_reconnect_attempts=1, reconnect_time_wait=0.1)

    async def handler(msg: ConsumedMessage) -> None:
        pass

    consumer = Consumer(nc, "orders", "billing", handler, pull_expires=0.2)
    lost: list[NatsConnectionLost] = []

    async def run(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            await consumer.run(task_status=task_status)
        except NatsConnectionLost as error:
            lost.append(error)

    try:
        with anyio.fail_after(15):
            async with anyio.create_task_group() as tg:
                await tg.start(run)
                await server.stop()
        assert len(lost) == 1, "run() ended with the error itself"
    finally:
        await nc.close()


# -- the command ---------------------------------------------------------------------------------


async def test_txactors_coordinator_serves_after_malformed_blocks_and_stops_on_sigterm(
    make_nats_server: MakeNatsServer,
) -> None:
    server = await make_nats_server()
    env = {**os.environ, "NATS_URL": server.url, "PYTHONPATH": str(ROOT)}
    process = await anyio.open_process(
        [sys.executable, "-m", "txactors.cli", "coordinator"], cwd=ROOT, env=env
    )
    nc = await nats.connect(server.url)
    try:
        client = CoordinatorClient(nc)
        await client.prepare_once_up("warm", message())
        for subject in (
            layout.prepare_subject(0, "g"),
            layout.end_subject(0, "g"),
            layout.admin_subject(0),
        ):
            for block in MALFORMED_BLOCKS:
                await raw_hpub(server.url, subject, nc.new_inbox(), block)
        receipt = await client.prepare("t1", message())
        assert (await client.end("t1", receipt.token, Decision.COMMIT)).state == "committed"

        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        with anyio.fail_after(10):
            returncode = await process.wait()
        assert returncode == 0
        assert time.monotonic() - started < 2.5
    finally:
        await nc.close()
        if process.returncode is None:
            process.kill()
        await process.aclose()
