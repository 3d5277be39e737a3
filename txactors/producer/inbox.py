"""The replies to one producer's requests to the coordinator, on one subscription of its own."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Protocol

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription


class Awaiting(Protocol):
    """A request waiting for its reply: `Inbox.register` names it by `token`."""

    token: str

    async def answered(self, msg: Msg) -> None:
        """`msg` is its reply."""
        ...


class Inbox:
    """The replies to one producer's requests, on one subscription of its own: each reply
    settles its request, with no task or timer per request."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = ""
        self._subscription: Subscription | None = None
        self._opening = asyncio.Lock()
        self._requests: dict[str, Awaiting] = {}
        self._tokens = itertools.count()

    @property
    def opened(self) -> bool:
        """Subscribed (and not closed since)."""
        return self._subscription is not None

    async def open(self) -> None:
        """Subscribe, the first time."""
        if self._subscription is not None:
            return
        async with self._opening:
            if self._subscription is None:
                prefix = self._nc.new_inbox()
                self._subscription = await self._nc.subscribe(f"{prefix}.*", cb=self._answered)
                self._prefix = prefix

    def register(self, request: Awaiting) -> str:
        """The reply subject for `request`, which its reply will settle."""
        request.token = str(next(self._tokens))
        self._requests[request.token] = request
        return f"{self._prefix}.{request.token}"

    def forget(self, request: Awaiting) -> None:
        self._requests.pop(request.token, None)

    async def close(self) -> None:
        """Unsubscribe (a request still out is then answered nowhere: its callers time out)."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            with contextlib.suppress(nats.errors.Error):  # a closed connection has none left
                await subscription.unsubscribe()

    async def _answered(self, msg: Msg) -> None:
        request = self._requests.pop(msg.subject[len(self._prefix) + 1 :], None)
        if request is not None:
            await request.answered(msg)
