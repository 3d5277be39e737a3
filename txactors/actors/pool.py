"""Several instances of one actor behind one ref, each request handed to an idle one.

Requests that must not queue behind one slow handler (a check-back while the user's
database is under load) need several actors; dealing them out blindly would still park
some behind the slow one. The pool hands a request only to an idle member, and while every
member is busy `post` waits: that wait is the backpressure, as a full mailbox is for one
actor. A member is idle again once it settled its request (the `Request` handle says so).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Self

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from txactors.actors.actor import Actor
from txactors.actors.envelope import Request
from txactors.actors.ref import DEFAULT_ASK_TIMEOUT, LocalActorRef, ask_through
from txactors.actors.system import ActorSystem
from txactors.errors import ActorDeadError, ConfigError


class ActorPool:
    """An `ActorRef` (and a `serve()` target) for `size` actors made by one factory."""

    def __init__(self, members: list[LocalActorRef], name: str) -> None:
        if not members:
            raise ConfigError("an ActorPool needs at least one member")
        self.name = name
        self.members = tuple(members)
        self._free: MemoryObjectSendStream[LocalActorRef]
        self._idle: MemoryObjectReceiveStream[LocalActorRef]
        self._free, self._idle = anyio.create_memory_object_stream[LocalActorRef](len(members))
        for member in members:
            self._free.send_nowait(member)

    @classmethod
    async def spawn(
        cls, system: ActorSystem, factory: Callable[[], Actor], size: int, *, name: str
    ) -> Self:
        """Spawn `size` members named `<name>-<index>`, each with a one-message mailbox."""
        if size < 1:
            raise ConfigError(f"a pool of {size} actors cannot answer anything; use at least 1")
        members = [
            await system.spawn(factory, name=f"{name}-{index}", mailbox_size=1)
            for index in range(size)
        ]
        return cls(members, name)

    def __repr__(self) -> str:
        return f"<ActorPool {self.name} of {len(self.members)}>"

    async def post(self, request: Request) -> None:
        """Hand `request` to an idle member, waiting while none is idle."""
        try:
            member = await self._idle.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise ActorDeadError(f"the pool {self.name!r} is closed") from None
        request.on_settled(lambda: self._release(member))
        await member.post(request)  # a dead member raises and is not returned

    async def tell(self, message: Any) -> None:
        await self.post(Request(message))

    async def ask(self, message: Any, timeout: float = DEFAULT_ASK_TIMEOUT) -> Any:
        return await ask_through(self.post, self.name, message, timeout)

    def close(self) -> None:
        """Stop handing out members; a waiting or later `post` raises `ActorDeadError`."""
        self._free.close()
        self._idle.close()

    def _release(self, member: LocalActorRef) -> None:
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._free.send_nowait(member)
