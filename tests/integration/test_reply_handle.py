"""One reply handle: an actor answers now (its return value) or later (through the `Request`
it kept), and a local ask and a served one see exactly the same answers."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from nats.aio.client import Client

from tests.peers.echo_protocol import Add, Calculator, Fail, Greet, Greeting, Reply, Sum
from tests.peers.echo_protocol import Request as Command
from txactors.actors import (
    Actor,
    ActorPool,
    ActorRef,
    ActorSystem,
    RemoteActorRef,
    ReplyGuard,
    Request,
    serve,
)
from txactors.errors import ActorDeadError, CommandError
from txactors.wire.protocol import Error, ErrorCode


class Pairs(Actor):
    """Answers later: holds each `Add` until a second one comes, then answers both with the
    total, the later ask first. `Fail` is answered at once with an Error, or after raising."""

    answers_later = True

    def __init__(self) -> None:
        self.held: list[Request] = []
        self.told: list[Any] = []

    async def receive(self, message: Any) -> None:
        if not isinstance(message, Request):
            self.told.append(message)  # a local tell arrives bare
            return
        match message.message:
            case Add():
                self.held.append(message)
                if len(self.held) == 2:
                    total = sum(r.message.a + r.message.b for r in self.held)
                    for request in reversed(self.held):
                        await request.answer(Sum(total))
                    self.held.clear()
            case Greet(name=name):
                await message.answer(Greeting(f"told {self.told}, {name}"))
            case Fail(reason="missing"):
                await message.answer(Error(ErrorCode.NOT_FOUND, "nothing called 'missing'"))
            case Fail(reason="answered"):
                await message.answer(Sum(1))
                raise RuntimeError("after answering")  # too late to change the answer
            case Fail(reason=reason):
                raise RuntimeError(reason)


@asynccontextmanager
async def reached(
    how: str, nc: Client, factory: Callable[[], Actor], pool: int = 0
) -> AsyncIterator[ActorRef]:
    """The actor behind a local ref, or served on a subject and reached by a remote ref."""
    async with ActorSystem() as system:
        if pool:
            ref: Any = await ActorPool.spawn(system, factory, pool, name="pool")
        else:
            ref = await system.spawn(factory)
        if how == "local":
            yield ref
            return
        subject = f"test.handle.{uuid.uuid4().hex}"
        subscription = await serve(nc, ref, subject, Command)
        try:
            yield RemoteActorRef(nc, subject, Reply)
        finally:
            await subscription.unsubscribe()


BOTH = pytest.mark.parametrize("how", ["local", "remote"])


@BOTH
async def test_an_actor_answers_a_kept_request_later_from_another_message(
    how: str, nc: Client
) -> None:
    answers: list[Any] = []

    async def ask(ref: ActorRef, add: Add) -> None:
        answers.append(await ref.ask(add, timeout=5))

    async with reached(how, nc, Pairs) as ref:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(ask, ref, Add(1, 2))
            tasks.start_soon(ask, ref, Add(3, 4))
        assert answers == [Sum(10), Sum(10)]


@BOTH
async def test_later_answers_fail_like_immediate_ones(how: str, nc: Client) -> None:
    async with reached(how, nc, Pairs) as ref:
        with pytest.raises(CommandError) as missing:
            await ref.ask(Fail("missing"))
        assert missing.value.code == ErrorCode.NOT_FOUND
        # Raised before answering: the asker learns why instead of waiting out its timeout.
        with pytest.raises((RuntimeError, CommandError), match="kaput"):
            await ref.ask(Fail("kaput"))
        # Answered, then raised: the first settlement wins.
        assert await ref.ask(Fail("answered")) == Sum(1)


async def test_a_tell_reaches_an_actor_that_answers_later_bare() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Pairs)
        await ref.tell("hello")
        assert await ref.ask(Greet("you")) == Greeting("told ['hello'], you")


async def test_a_served_one_way_message_reaches_an_actor_that_answers_later_as_a_handle(
    nc: Client,
) -> None:
    """What such an actor does must not depend on whether the sender waits (a one-way end)."""
    async with reached("remote", nc, Pairs) as ref:
        await ref.tell(Add(1, 2))  # held like an ask; its answer goes nowhere
        assert await ref.ask(Add(3, 4)) == Sum(10)


@BOTH
async def test_return_values_answer_through_the_same_handle_a_pool_waits_on(
    how: str, nc: Client
) -> None:
    """A pool frees a member when its request is settled: by a return value, a returned
    Error or a raise alike, so three such asks through a pool of one all come back."""
    async with reached(how, nc, Calculator, pool=1) as ref:
        assert await ref.ask(Add(2, 3)) == Sum(5)
        with pytest.raises(CommandError):
            await ref.ask(Fail("missing"))
        with pytest.raises((RuntimeError, CommandError), match="kaput"):
            await ref.ask(Fail("kaput"))
        assert await ref.ask(Greet("pool")) == Greeting("hello, pool")


class Blocking(Actor):
    """Holds its first `Add` until `release` is set; tells `entered` when it holds it."""

    def __init__(self, release: anyio.Event, entered: list[int]) -> None:
        self.release = release
        self.entered = entered

    async def receive(self, message: Add) -> Sum:
        self.entered.append(message.a)
        if message.a == 0:
            await self.release.wait()
        return Sum(message.a + message.b)


async def test_a_pool_hands_requests_only_to_idle_members() -> None:
    release = anyio.Event()
    entered: list[int] = []
    answers: list[Any] = []
    async with ActorSystem() as system:
        pool = await ActorPool.spawn(system, lambda: Blocking(release, entered), 2, name="p")

        async def ask(a: int) -> None:
            answers.append(await pool.ask(Add(a, 0)))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(ask, 0)  # holds one member
            with anyio.fail_after(5):
                while entered != [0]:
                    await anyio.lowlevel.checkpoint()
            for a in (1, 2, 3):  # all served by the other member, never queued behind 0
                await ask(a)
            assert answers == [Sum(1), Sum(2), Sum(3)]
            release.set()
        assert answers[-1] == Sum(0)


async def test_a_pool_of_stopped_actors_refuses_work_at_once() -> None:
    async with ActorSystem() as system:
        pool = await ActorPool.spawn(system, Calculator, 2, name="stopped")
        for member in pool.members:
            await member.stop()
        for _ in range(3):  # each stopped member went back to the free list
            with pytest.raises(ActorDeadError):
                await pool.tell(Add(1, 1))


async def test_an_endpoint_without_tells_drops_a_message_with_no_reply_unexecuted(
    nc: Client,
) -> None:
    refused: list[int] = []
    seen: list[Any] = []

    class Watched(Calculator):
        async def receive(self, message: Any) -> Any:
            seen.append(message)
            return await super().receive(message)

    guard = ReplyGuard(on_refused=lambda: refused.append(1))
    subject = f"test.asks-only.{uuid.uuid4().hex}"
    async with ActorSystem() as system:
        ref = await system.spawn(Watched)
        subscription = await serve(nc, ref, subject, Command, replies=guard, tells=False)
        remote = RemoteActorRef(nc, subject, Reply)
        await remote.tell(Add(1, 1))
        assert await remote.ask(Add(2, 2)) == Sum(4)  # one connection: after the tell
        assert seen == [Add(2, 2)] and refused == [1]
        await subscription.unsubscribe()
