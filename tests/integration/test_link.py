"""Waiting on JetStream is woken, not polled: by the ack, the connection dropping, or a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import anyio
import nats
import nats.js.errors
import pytest
from nats.aio.client import Client

from tests.support.servers import MakeNatsServer
from txactors.nats import link
from txactors.nats.client import TolerantClient
from txactors.nats.link import Ack, await_ack, link_generation, until_changed, wait_connected


def count_timers(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every timer the running loop schedules from now on (`call_later` goes through here)."""
    loop = asyncio.get_running_loop()
    timers: list[float] = []
    schedule = loop.call_at

    def counting(when: float, callback: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        timers.append(when)
        return schedule(when, callback, *args, **kw)

    monkeypatch.setattr(loop, "call_at", counting)
    return timers


async def test_an_ack_waiter_sleeps_until_the_connection_drops(
    private_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    generation = link_generation(private_nc)
    waiter = asyncio.create_task(await_ack(private_nc, never, generation, time.monotonic()))
    await asyncio.sleep(0)  # the waiter is waiting now
    timers = count_timers(monkeypatch)
    await asyncio.sleep(0.5)  # the scenario: a while with no ack (this sleep is one timer)
    assert len(timers) <= 1, "the waiter woke on a timer while nothing happened"
    assert not waiter.done()

    await private_nc.force_reconnect()
    with anyio.fail_after(5):
        assert await waiter is Ack.LINK_LOST
        await wait_connected(private_nc)  # woken by the reconnect
    assert private_nc.is_connected
    assert never.cancelled(), "an answer that can no longer come is given up"


async def test_an_ack_waiter_is_woken_by_the_ack(private_nc: Client) -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    loop.call_soon(future.set_result, "ack")
    with anyio.fail_after(5):
        outcome = await await_ack(private_nc, future, link_generation(private_nc), time.monotonic())
    assert outcome is Ack.SETTLED


async def test_an_ack_not_back_by_its_deadline_is_overdue(
    private_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(link, "ACK_TIMEOUT", 0.2)
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    started = time.monotonic()
    with anyio.fail_after(5):
        outcome = await await_ack(private_nc, never, link_generation(private_nc), started)
    assert outcome is Ack.OVERDUE
    assert time.monotonic() - started >= 0.2
    assert never.cancelled()


async def test_an_ack_waiter_cancelled_is_cancelled_not_overdue(private_nc: Client) -> None:
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    generation = link_generation(private_nc)
    waiter = asyncio.create_task(await_ack(private_nc, never, generation, time.monotonic()))
    await asyncio.sleep(0)  # the waiter is waiting now
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_a_refused_write_is_settled(private_nc: Client) -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    loop.call_soon(future.set_exception, ValueError("refused"))
    with anyio.fail_after(5):
        outcome = await await_ack(private_nc, future, link_generation(private_nc), time.monotonic())
    assert outcome is Ack.SETTLED
    assert isinstance(future.exception(), ValueError)


async def test_the_applications_callbacks_still_run_first(make_nats_server: MakeNatsServer) -> None:
    server = await make_nats_server()
    heard: list[str] = []

    async def disconnected() -> None:
        heard.append("disconnected")

    async def reconnected() -> None:
        heard.append("reconnected")

    nc = await nats.connect(
        server.url, disconnected_cb=disconnected, reconnected_cb=reconnected, reconnect_time_wait=0
    )
    try:
        generation = link_generation(nc)
        never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        waiter = asyncio.create_task(await_ack(nc, never, generation, time.monotonic()))
        await asyncio.sleep(0)
        await nc.force_reconnect()
        with anyio.fail_after(5):
            assert await waiter is Ack.LINK_LOST
            await wait_connected(nc)
            while "reconnected" not in heard:
                await until_changed(nc)
        assert heard == ["disconnected", "reconnected"]
    finally:
        await nc.close()


async def test_until_changed_wakes_on_a_future_or_its_timeout_and_leaves_them_alone(
    private_nc: Client,
) -> None:
    loop = asyncio.get_running_loop()
    ack: asyncio.Future[Any] = loop.create_future()
    waiter = asyncio.create_task(until_changed(private_nc, ack))
    await asyncio.sleep(0)
    ack.set_result("ack")
    await asyncio.wait_for(waiter, 5)  # woken by the future itself
    started = time.monotonic()
    await until_changed(private_nc, loop.create_future(), timeout=0.05)
    assert time.monotonic() - started >= 0.05
    pending: asyncio.Future[Any] = loop.create_future()
    cancelled = asyncio.create_task(until_changed(private_nc, pending))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert not pending.done(), "cancelling the waiter cancels none of the futures"
    assert not pending._callbacks, "nor leaves its wake-up on them"  # type: ignore[attr-defined]


async def test_acks_are_settled_in_the_read_loop_and_the_inbox_leaves_nothing_behind(
    nc: Client,
) -> None:
    """A `TolerantClient` settles each write's answer in its read loop (`subscribe_direct`):
    acks and refusals alike; once the inbox closes, its subscription leaves no handler."""
    assert isinstance(nc, TolerantClient)
    js = nc.jetstream()
    await js.add_stream(name="DIRECTACKS", subjects=["directacks.>"], max_msg_size=64)
    inbox = link.AckInbox(nc)
    try:
        stored = await inbox.publish("directacks.a", b"x", {"Nats-Msg-Id": "one"})
        assert (await asyncio.wait_for(stored, 5)).seq == 1
        assert nc._direct is not None and len(nc._direct) == 1
        refused = await inbox.publish("directacks.b", b"y" * 100, {})
        with pytest.raises(nats.js.errors.APIError):
            await asyncio.wait_for(refused, 5)
    finally:
        await inbox.close()
        await js.delete_stream("DIRECTACKS")
    assert not nc._direct
