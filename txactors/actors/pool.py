"""Several instances of one actor behind one ref, each request handed to an idle one.

Requests that must not queue behind one slow handler (a check-back while the user's
database is under load) need several actors; dealing them out blindly would still park
some behind the slow one. The pool hands a request only to an idle member, and while every
member is busy `post` waits: that wait is the backpressure, as a full mailbox is for one
actor. A member is idle again once it settled its request (the `Request` handle says so).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Self

import anyio

from txactors.actors.actor import Actor
from txactors.actors.envelope import Request
from txactors.actors.ref import DEFAULT_ASK_TIMEOUT, LocalActorRef, ask_through
from txactors.actors.system import ActorSystem
from txactors.errors import ConfigError


class ActorPool:
    """An `ActorRef` (and a `serve()` target) for `size` actors made by one factory."""

    def __init__(self, members: list[LocalActorRef], name: str) -> None:
        if not members:
            raise ConfigError("an ActorPool needs at least one member")
        self.name = name
        self.members = tuple(members)
        self._free: deque[LocalActorRef] = deque(members)
        self._idle = anyio.Semaphore(len(members))

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
        """Hand `request` to an idle member, waiting while none is idle.

        A stopped member goes back to the free list too, so that once the members are
        stopped every `post` fails at once with `ActorDeadError` instead of waiting forever.
        """
        try:
            self._idle.acquire_nowait()  # no loop turn while a member is idle
        except anyio.WouldBlock:
            await self._idle.acquire()
        member = self._free.popleft()
        request.on_settled(lambda: self._release(member))
        try:
            await member.post(request)
        except BaseException:
            self._release(member)
            raise

    async def tell(self, message: Any) -> None:
        await self.post(Request(message))

    async def ask(self, message: Any, timeout: float = DEFAULT_ASK_TIMEOUT) -> Any:
        return await ask_through(self.post, self.name, message, timeout)

    def _release(self, member: LocalActorRef) -> None:
        self._free.append(member)
        self._idle.release()
