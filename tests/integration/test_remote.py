"""Remote actors over a real nats-server: another process asks, bad input gets error codes."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from nats.aio.client import Client

from tests.peers.echo_protocol import Add, Calculator, Fail, Greet, Reply, Request, Sum
from txactors.actors import ActorSystem, RemoteActorRef, serve
from txactors.errors import ActorDeadError, AskTimeout, CommandError
from txactors.wire.layout import CONTENT_TYPE_HEADER
from txactors.wire.protocol import Encoding, Error, encode

ROOT = Path(__file__).resolve().parents[2]
SUBJECT = "test.calculator"


@asynccontextmanager
async def serving_calculator(nc: Client) -> AsyncIterator[RemoteActorRef]:
    """Not a fixture: pytest-asyncio tears fixtures down in another task than it set them
    up in, and a task group (the ActorSystem) must be left by the task that entered it."""
    async with ActorSystem() as system:
        ref = await system.spawn(Calculator, name="calculator")
        subscription = await serve(nc, ref, SUBJECT, Request)
        yield RemoteActorRef(nc, SUBJECT, Reply)
        await subscription.unsubscribe()


async def raw_request(nc: Client, payload: bytes, headers: dict[str, str] | None = None) -> Any:
    msg = await nc.request(SUBJECT, payload, timeout=2, headers=headers)
    is_json = (msg.headers or {}).get(CONTENT_TYPE_HEADER) == Encoding.JSON
    decode = msgspec.json.decode if is_json else msgspec.msgpack.decode
    return decode(msg.data, type=Error | Sum)


async def test_remote_ask_from_a_second_os_process_gets_its_reply(
    nc: Client, nats_server: Any
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    async with serving_calculator(nc):
        result = await anyio.run_process(
            [sys.executable, "-m", "tests.peers.remote_asker", nats_server.url, SUBJECT],
            cwd=ROOT,
            env=env,
            check=False,
        )
    assert result.returncode == 0, result.stderr.decode()
    assert json.loads(result.stdout) == {"sum": 42, "greeting": "hello, other process"}


@pytest.mark.parametrize(
    ("payload", "code", "hint"),
    [
        (b"\xc1\x00garbage", "bad_request", "malformed"),
        (encode({"type": "Add", "a": 1, "b": "two"}), "bad_request", "$.b"),
        (encode({"type": "Divide", "a": 1, "b": 2}), "unknown_command", "Divide"),
        (encode({"a": 1, "b": 2}), "bad_request", "type"),
    ],
    ids=["malformed-bytes", "wrong-field-type", "unknown-tag", "missing-tag"],
)
async def test_bad_input_gets_an_error_code_and_the_actor_keeps_serving(
    nc: Client, payload: bytes, code: str, hint: str
) -> None:
    async with serving_calculator(nc) as calculator:
        reply = await raw_request(nc, payload)
        assert isinstance(reply, Error)
        assert reply.code == code
        assert hint in reply.message
        assert await calculator.ask(Add(1, 2)) == Sum(3)


async def test_an_answer_too_large_for_nats_is_an_error_reply_not_a_timeout(nc: Client) -> None:
    """NATS refuses a publish over `max_payload`: the requester must still hear back."""
    name = "n" * (nc.max_payload - 100)  # the request fits; "hello, " + name does not
    async with serving_calculator(nc) as calculator:
        with pytest.raises(CommandError) as too_large:
            await calculator.ask(Greet(name), timeout=5)
        assert too_large.value.code == "bad_request"
        assert "ask for less" in too_large.value.message
        assert await calculator.ask(Add(1, 2)) == Sum(3)


async def test_json_clients_get_json_replies_and_json_errors(nc: Client) -> None:
    headers = {CONTENT_TYPE_HEADER: "application/json"}
    async with serving_calculator(nc):
        assert await raw_request(nc, b'{"type":"Add","a":20,"b":22}', headers) == Sum(42)
        for broken in (b'{"type":"Add","a":"x"', b'{"type":"Add","a":1}', b"[1"):
            reply = await raw_request(nc, broken, headers)
            assert isinstance(reply, Error) and reply.code == "bad_request", broken
        reply = await raw_request(nc, b"{}", {CONTENT_TYPE_HEADER: "text/xml"})
        assert isinstance(reply, Error) and "Content-Type" in reply.message


async def test_remote_errors_raise_command_error_with_the_code(nc: Client) -> None:
    async with serving_calculator(nc) as calculator:
        with pytest.raises(CommandError) as missing:
            await calculator.ask(Fail("missing"))
        assert missing.value.code == "not_found"
        with pytest.raises(CommandError) as crashed:
            await calculator.ask(Fail("kaput"))
        assert crashed.value.code == "internal" and "kaput" in crashed.value.message
        assert await calculator.ask(Greet("again")) is not None


async def test_remote_tell_reaches_the_actor(nc: Client) -> None:
    class Tally(Calculator):
        total = 0

        async def receive(self, message: Any) -> Any:
            if isinstance(message, Add):
                Tally.total += message.a + message.b
            return await super().receive(message)

    async with ActorSystem() as system:
        ref = await system.spawn(Tally)
        subscription = await serve(nc, ref, SUBJECT, Request)
        remote = RemoteActorRef(nc, SUBJECT, Reply)
        for i in range(50):
            await remote.tell(Add(i, 1))
        # One connection, one subject: NATS keeps order, so the ask comes after the tells.
        assert await remote.ask(Add(0, 0)) == Sum(0)
        assert Tally.total == sum(range(50)) + 50
        await subscription.unsubscribe()


async def test_remote_ask_to_nobody_or_a_silent_actor_fails_clearly(nc: Client) -> None:
    nobody = RemoteActorRef(nc, "test.nobody", Reply)
    with pytest.raises(ActorDeadError, match="no actor"):
        await nobody.ask(Add(1, 1), timeout=1)

    async def ignore(msg: Any) -> None:
        pass

    silent = await nc.subscribe("test.silent", cb=ignore)
    try:
        with pytest.raises(AskTimeout):
            await RemoteActorRef(nc, "test.silent", Reply).ask(Add(1, 1), timeout=0.1)
    finally:
        await silent.unsubscribe()


async def test_a_full_mailbox_holds_requests_back_in_order_and_drops_none(nc: Client) -> None:
    """Requests taken in the read loop while there is room, and those held back by a full
    mailbox (the subscription's own way), reach the actor all, in the order they were sent."""
    release = anyio.Event()
    seen: list[int] = []

    class Slow(Calculator):
        async def receive(self, message: Any) -> Any:
            if isinstance(message, Add):
                await release.wait()
                seen.append(message.a)
            return await super().receive(message)

    async with ActorSystem() as system:
        ref = await system.spawn(Slow, mailbox_size=2)
        subscription = await serve(nc, ref, SUBJECT, Request)
        remote = RemoteActorRef(nc, SUBJECT, Reply)
        for i in range(20):
            await remote.tell(Add(i, 0))
        await nc.flush()
        release.set()
        with anyio.fail_after(5):
            assert await remote.ask(Add(20, 0)) == Sum(20)
        assert seen == list(range(21))
        await subscription.unsubscribe()


async def test_requests_still_queued_when_the_actor_stops_are_told_to_come_back(
    nc: Client,
) -> None:
    """The actor stops after the message it is handling: those still queued were not
    handled at all, and their callers are told so (`internal` with a `retry_after`)."""
    started, release = anyio.Event(), anyio.Event()

    class Slow(Calculator):
        async def receive(self, message: Any) -> Any:
            if isinstance(message, Add) and message.a == 0:
                started.set()
                await release.wait()
            return await super().receive(message)

    answers: dict[int, Any] = {}
    async with ActorSystem() as system:
        ref = await system.spawn(Slow, mailbox_size=8)
        subscription = await serve(nc, ref, SUBJECT, Request)
        remote = RemoteActorRef(nc, SUBJECT, Reply)

        async def ask(a: int) -> None:
            try:
                answers[a] = await remote.ask(Add(a, 0), timeout=5)
            except CommandError as error:
                answers[a] = error

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(ask, 0)
            await started.wait()
            for a in (1, 2):
                tasks.start_soon(ask, a)
            await nc.flush()
            await anyio.sleep(0.2)  # both queued behind the one being handled
            tasks.start_soon(ref.stop)
            await anyio.sleep(0.1)
            release.set()
        await subscription.unsubscribe()
    assert answers[0] == Sum(0), "the one being handled is finished"
    for a in (1, 2):
        error = answers[a]
        assert isinstance(error, CommandError) and error.code == "internal"
        assert error.retry_after is not None and error.retry_after > 0, "nothing done: come back"
