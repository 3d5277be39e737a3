"""Handles to actors. Callers hold refs, never actor instances.

`ActorRef` is the location-transparent surface (`tell`, `ask`) shared by a local ref, which
puts a `Request` in the mailbox, a pool of local actors (txactors.actors.pool), and a remote
ref (txactors.actors.remote), which sends the encoded Struct on the actor's NATS subject.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

import anyio

from txactors.actors.envelope import LocalReply, Request
from txactors.errors import AskTimeout

DEFAULT_ASK_TIMEOUT = 5.0


@runtime_checkable
class ActorRef(Protocol):
    name: str

    async def tell(self, message: Any) -> None:
        """Send without waiting for an answer (may wait for mailbox room)."""
        ...

    async def ask(self, message: Any, timeout: float = DEFAULT_ASK_TIMEOUT) -> Any:
        """Send and wait for the answer; `AskTimeout` after `timeout` seconds."""
        ...


class Mailbox(Protocol):
    """Where `serve()` hands requests: a local actor or a pool of them."""

    name: str

    async def post(self, request: Request) -> None: ...


async def ask_through(
    post: Callable[[Request], Awaitable[None]], name: str, message: Any, timeout: float
) -> Any:
    """An in-process ask: post a `Request` with a `LocalReply` and wait for its answer."""
    reply = LocalReply()
    try:
        with anyio.fail_after(timeout):
            await post(Request(message, reply))
            return await reply.wait()
    except TimeoutError as exc:
        if isinstance(exc, AskTimeout):
            raise
        raise AskTimeout(f"{name} did not answer within {timeout}s") from None


class Running(Protocol):
    """What a local ref drives of its actor's running side (`cell.ActorCell`, which makes
    the ref): named here so that refs, which actors hold, stand below the cell."""

    @property
    def name(self) -> str: ...
    @property
    def stopped(self) -> anyio.Event: ...
    @property
    def failure(self) -> BaseException | None: ...
    async def deliver(self, request: Request) -> None: ...
    def deliver_nowait(self, request: Request) -> None: ...
    def request_stop(self) -> None: ...


class LocalActorRef:
    __slots__ = ("_cell", "name")

    def __init__(self, cell: Running) -> None:
        self._cell = cell
        self.name = cell.name

    def __repr__(self) -> str:
        return f"<LocalActorRef {self.name}>"

    @property
    def is_alive(self) -> bool:
        return not self._cell.stopped.is_set()

    async def tell(self, message: Any) -> None:
        """Enqueue; waits while the mailbox is full (that wait is the backpressure)."""
        await self._cell.deliver(Request(message))

    def tell_nowait(self, message: Any) -> None:
        """Enqueue or raise `MailboxFull` at once; for callers that must never block."""
        self._cell.deliver_nowait(Request(message))

    async def post(self, request: Request) -> None:
        """Enqueue a request whose answer goes to its own reply sink (served, pooled)."""
        await self._cell.deliver(request)

    def post_nowait(self, request: Request) -> None:
        """`post`, or `MailboxFull` (or `ActorDeadError`) at once."""
        self._cell.deliver_nowait(request)

    async def ask(self, message: Any, timeout: float = DEFAULT_ASK_TIMEOUT) -> Any:
        return await ask_through(self._cell.deliver, self.name, message, timeout)

    async def stop(self) -> None:
        """Stop after the message in hand; queued asks fail with `ActorDeadError`."""
        self._cell.request_stop()
        await self._cell.stopped.wait()

    async def wait_stopped(self) -> BaseException | None:
        """Wait until the actor has stopped; returns the error that stopped it, if any."""
        await self._cell.stopped.wait()
        return self._cell.failure
