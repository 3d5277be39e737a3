"""What travels through a mailbox: the message and where its answer goes.

A reply sink hides whether the asker is in this process (an event it waits on) or behind
NATS (a subject to publish to), so the actor loop treats both alike.
"""

from __future__ import annotations

from typing import Any, Protocol

import anyio

from txactors.errors import CommandError
from txactors.protocol import Error


class ReplySink(Protocol):
    async def resolve(self, value: Any) -> None: ...

    async def fail(self, error: BaseException) -> None: ...


class Envelope:
    __slots__ = ("message", "reply")

    def __init__(self, message: Any, reply: ReplySink | None = None) -> None:
        self.message = message
        self.reply = reply


class LocalReply:
    """A one-shot answer for an in-process `ask`; the first outcome wins."""

    __slots__ = ("_done", "_error", "_value")

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    async def resolve(self, value: Any) -> None:
        if not self._done.is_set():
            self._value = value
            self._done.set()

    async def fail(self, error: BaseException) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()

    async def wait(self) -> Any:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return unwrap(self._value)


def unwrap(value: Any) -> Any:
    """An `Error` reply becomes a `CommandError`, locally and remotely alike."""
    if isinstance(value, Error):
        raise CommandError(value.code, value.message)
    return value
