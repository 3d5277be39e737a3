"""The NATS client we connect with: nats-py's, with its own faults contained.

nats-py 2.16 parses each message's header block inside its read loop. A block shorter than
`NATS/1.0` plus one byte, which anyone may publish with a raw `HPUB`, raises `IndexError`
there; the loop logs it and ends while the client still says it is connected. The process
then receives nothing (every subscription is silent), `flush()` returns at once, and a
JetStream call waits out its timeout, so a shutdown that gives back leases seems to ignore
SIGTERM. A JetStream stream stores such a block as it is, so a consumer meets it again after
every restart.

`TolerantClient` fixes both ends: a header block that cannot be parsed yields a message whose
only header is `MALFORMED_HEADERS` (serve boundaries answer it `bad_request`; a consumer's
handler sees it), and a read loop that ends while connected is treated as a lost connection,
so the client reconnects and re-subscribes as after a network fault. Its subscriptions of
`subscribe_direct` (the writers' acks, the requests served to actors) are handled in the read
loop itself, a loop turn sooner than through nats-py's per-subscription task, and `ack_all`
sends a consumer's batch of acks as one command. On uvloop a write to a connection already
closed raises where asyncio's loop drops it, and nats-py counts on the drop; its transport
drops such writes on any loop (`WritesAfterClose`).
A PONG that comes after its flush gave up is taken as nats-py 2.16 should (it kills the read
loop). And the client leaves a server that cannot reach JetStream for another of its cluster
(`nats/watchdog.py`): it notes the signs of trouble its watch acts on (`notice_trouble`).
`watch_connection` is for long-lived roles handed any client: it revives a dead read loop the
same way and raises `NatsConnectionLost` once the connection is closed for good, so the role
exits with an error instead of staying up serving nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final

import anyio
import nats.errors
from nats.aio.client import Client
from nats.aio.client import __version__ as nats_py_version
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.protocol.command import hpub_cmd

from txactors.errors import NatsConnectionLost, TxActorsError
from txactors.nats.watchdog import (
    DEFAULT_WATCH,
    PROBE_OPTIONS,
    PROBE_SUBJECT,
    ServerSigns,
    WatchPolicy,
    watch_server,
)
from txactors.observe.logs import get_logger
from txactors.wire.framing import header_block, parse_header_lines

MALFORMED_HEADERS: Final = "txactors malformed headers"
"""The one header of a message whose header block could not be parsed; its value says why.
It contains spaces, which no parsed header name can, so no client can forge or shadow it."""

WATCH_INTERVAL: Final = 0.5
"""How often `watch_connection` looks at a client it cannot hook into."""

MIRRORED_NATS_PY: Final = "2.16."
"""The nats-py release line whose `_send_publish` `TolerantClient._send_publish` mirrors (a
private method): under any other release nats-py's own runs, slower but as that release
wants it."""
_mirrors_nats_py = nats_py_version.startswith(MIRRORED_NATS_PY)

_NO_RESPONDERS: Final = b"NATS/1.0 503"
"""How the header block of a no-responders status begins."""

log = get_logger(__name__)


class ReadLoopDied(TxActorsError, nats.errors.Error):
    """The client's read loop ended while it was connected (an error nats-py only logged).

    Also a nats-py error: it is handed to the client's own error path, which reconnects."""

    def __str__(self) -> str:
        return "nats: the read loop ended while connected"


class WritesAfterClose:
    """A nats-py transport whose writes after the connection closed are dropped, as asyncio's
    own transports drop them, where uvloop's raise `RuntimeError` ("the handler is closed").

    nats-py is written against asyncio's behaviour: it writes what it has pending while
    closing a connection the server already dropped, and its flusher ends on a
    `RuntimeError`, after which a publish writes inline and would raise it to the caller
    instead of seeing the connection's loss (the read loop notices that a turn later, and
    reconnects). So on any loop the same write does what asyncio makes it do."""

    def __init__(self, transport: Any) -> None:
        self._wrapped = transport
        # what the read loop calls every turn, bound once: no `__getattr__` on the hot path
        self.read, self.drain, self.at_eof = transport.read, transport.drain, transport.at_eof

    def _closed(self) -> bool:
        writer = getattr(self._wrapped, "_io_writer", None)
        return writer is not None and writer.transport.is_closing()

    def write(self, payload: bytes) -> None:
        if not self._closed():
            self._wrapped.write(payload)

    def writelines(self, payload: list[bytes]) -> None:
        if not self._closed():
            self._wrapped.writelines(payload)

    def __bool__(self) -> bool:
        return bool(self._wrapped)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


class _GuardedTransport:
    """The client's `_transport` attribute: whatever nats-py assigns is kept wrapped in
    `WritesAfterClose`. Only `__set__`: a read is a plain lookup in the instance's dict."""

    def __set__(self, client: Client, transport: Any) -> None:
        client.__dict__["_transport"] = None if transport is None else WritesAfterClose(transport)


class TolerantClient(Client):
    """A nats-py `Client` whose read loop survives any header block a publisher sends."""

    _direct: dict[int, Callable[[Msg], bool]] | None = None
    """Subscription id -> its handler run in the read loop (`subscribe_direct`)."""

    _transport = _GuardedTransport()  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.signs = ServerSigns()
        """What this connection has seen of its server: what its watch judges by."""
        self._watch: asyncio.Task[None] | None = None

    async def connect(
        self, *args: Any, server_watch: WatchPolicy | None = DEFAULT_WATCH, **options: Any
    ) -> None:
        """nats-py's `connect`; then, with `server_watch`, the client leaves a server that
        cannot reach JetStream for another of its pool that can (`nats/watchdog.py`)."""
        self.signs.probe_options = {k: v for k, v in options.items() if k in PROBE_OPTIONS}
        await super().connect(*args, **options)
        if server_watch is not None:
            self._watch = asyncio.get_running_loop().create_task(
                watch_server(self, self.signs, server_watch), name="txactors-server-watch"
            )

    async def _close(self, status: int, do_cbs: bool = True) -> None:
        if self._watch is not None and self._watch is not asyncio.current_task():
            self._watch.cancel()
        await super()._close(status, do_cbs)

    async def request(self, *args: Any, **kwargs: Any) -> Msg:
        """nats-py's; a request not answered in time is a sign of trouble."""
        try:
            return await super().request(*args, **kwargs)
        except nats.errors.TimeoutError:
            self.signs.trouble.set()
            raise

    async def _process_pong(self) -> None:
        """nats-py's, except that the PONG of a flush that gave up (its future cancelled) is
        taken, where nats-py's sets its result, raises, and its read loop ends."""
        if self._pongs and self._pongs[0].done():
            self._pongs.pop(0)
            self._pongs_received += 1
            self._pings_outstanding = 0
            return
        await super()._process_pong()

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        """nats-py's; a server that tells of fewer peers than before has lost routes: a sign."""
        urls = info.get("connect_urls")
        if isinstance(urls, list):
            signs = self.signs
            if not initial_connection and signs.peers is not None and len(urls) < signs.peers:
                signs.trouble.set()
            signs.peers = len(urls)
            signs.cluster_size = max(signs.cluster_size, signs.peers)
        elif initial_connection:
            self.signs.peers = None  # a server that tells of no peers (`no_advertise`)
        await super()._process_info(info, initial_connection)

    async def _process_err(self, err_msg: str) -> None:
        if PROBE_SUBJECT in err_msg and "permissions violation" in err_msg.lower():
            self.signs.probe_refused = True
        await super()._process_err(err_msg)

    async def subscribe_direct(
        self,
        subject: str,
        handler: Callable[[Msg], bool],
        cb: Callable[[Msg], Awaitable[None]],
        queue: str = "",
    ) -> Subscription:
        """Subscribe with `handler` run by the read loop itself, a loop turn sooner than
        nats-py's per-subscription task would run `cb`: for the acks of every write
        (`AckInbox`) and the requests served to actors (`serve`). A message `handler` does
        not take (False) goes to `cb` as usual, in that task. `handler` must not raise nor
        wait. Under a nats-py release not `MIRRORED_NATS_PY` (whose `_process_msg` the direct
        path mirrors) every message goes to `cb`."""
        subscription = await self.subscribe(subject, queue=queue, cb=cb)
        if _mirrors_nats_py:
            if self._direct is None:
                self._direct = {}
            self._direct[subscription._id] = handler
        return subscription

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        super()._remove_sub(sid, max_msgs)
        if self._direct is not None:
            self._direct.pop(sid, None)

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        """nats-py 2.16's, for a `subscribe_direct` subscription (no JetStream flow control,
        no message limit): its handler first; what it does not take, nats-py's way."""
        handler = None if self._direct is None else self._direct.get(sid)
        subscription = None if handler is None else self._subs.get(sid)
        if handler is not None and subscription is not None:
            parsed = await self._process_headers(headers)
            msg = self._build_message(sid, subject, reply, data, parsed)
            if msg and handler(msg):
                self.stats["in_msgs"] += 1
                self.stats["in_bytes"] += len(data)
                subscription._received += 1
                return
        await super()._process_msg(sid, subject, reply, data, headers)

    async def _process_headers(self, headers: Any) -> dict[str, str] | None:
        # A no-responders status: nobody this server reaches serves the subject.
        if headers and headers.startswith(_NO_RESPONDERS):
            self.signs.trouble.set()
        try:
            parsed: dict[str, str] | None = await super()._process_headers(headers)
        except Exception as error:  # nats-py's parser has no error path for this
            return {MALFORMED_HEADERS: f"{type(error).__name__}: {error}"}
        return parsed

    _parse_header_lines = staticmethod(parse_header_lines)
    """nats-py's own, at a third of its cost (`framing.parse_header_lines`)."""

    async def _send_publish(
        self,
        subject: str,
        reply: str,
        payload: bytes,
        payload_size: int,
        headers: dict[str, Any] | None,
    ) -> None:
        """nats-py 2.16's, with the header block from `header_block`: nats-py checks every
        name with a regular expression and translates every value (a per-character charmap),
        15% of the coordinator's instructions per transaction at 64 in flight (callgrind).
        Anything unusual (no headers, an empty or invalid name, no subject) goes nats-py's
        own way, and so does everything under a nats-py release not `MIRRORED_NATS_PY`."""
        block = None
        if _mirrors_nats_py and headers is not None and subject:
            block = header_block(headers)
        if block is None:
            await super()._send_publish(subject, reply, payload, payload_size, headers)
            return
        self.stats["out_msgs"] += 1
        self.stats["out_bytes"] += payload_size
        await self._send_command(hpub_cmd(subject, reply, block, payload))
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()

    async def ack_all(self, msgs: Sequence[Msg]) -> bool:
        """`Msg.ack` for each of `msgs` (JetStream deliveries to this client), as one command:
        a consumer's batch of acks costs one bytes join instead of a publish call each. False,
        and nothing sent, when one of them is not ackable or the connection would make a
        publish raise: then ack them one by one, to get nats-py's errors. A reply subject
        needs no check: it came from the server, which cannot send one with whitespace."""
        if not (_mirrors_nats_py and self.is_connected and not self.is_draining_pubs):
            return False
        if not all(msg.reply and not msg._ackd for msg in msgs):
            return False
        # What `Msg.ack` sends (nats-py's `pub_cmd`, no reply, no payload), for each.
        command = "".join([f"PUB {msg.reply}  0\r\n\r\n" for msg in msgs]).encode()
        for msg in msgs:
            msg._ackd = True
        self.stats["out_msgs"] += len(msgs)
        await self._send_command(command)
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()
        return True

    async def _read_loop(self) -> None:
        await super()._read_loop()
        if _serving(self):  # it ended on an error that nats-py only logged
            await _reconnect(self)


def notice_trouble(nc: Client) -> None:
    """Tell `nc`'s watch that a call got no answer it should have had (a role's own request
    timed out, a pull ended without its end status): it may be time to leave the server."""
    if isinstance(nc, TolerantClient):
        nc.signs.trouble.set()


def malformed_headers(msg: Msg) -> str | None:
    """Why `msg`'s header block could not be parsed, or None when it was fine."""
    return (msg.headers or {}).get(MALFORMED_HEADERS)


async def connect(servers: str | list[str], **options: Any) -> TolerantClient:
    """`nats.connect`, returning a `TolerantClient` (for code that connects by itself)."""
    nc = TolerantClient()
    await nc.connect(servers, **options)
    return nc


def read_loop_dead(nc: Client) -> bool:
    """True when `nc` says it is connected but its read loop has ended."""
    task: asyncio.Task[None] | None = nc._reading_task
    return _serving(nc) and task is not None and task.done()


async def revive_if_dead(nc: Client) -> None:
    """Reconnect `nc` if its read loop ended while connected."""
    if read_loop_dead(nc):
        await _reconnect(nc)


def _serving(nc: Client) -> bool:
    # A draining client is on its way to closed; reconnecting it would undo that.
    return nc.is_connected and not nc.is_draining


async def _reconnect(nc: Client) -> None:
    """Handle a dead read loop as nats-py handles a network fault: reconnect (re-sending
    every subscription, so subscribers need not act), or close when reconnects are off."""
    log.error("nats_read_loop_died", action="reconnecting")
    await nc._process_op_err(ReadLoopDied())


async def watch_connection(nc: Client, interval: float = WATCH_INTERVAL) -> None:
    """Run beside a role that serves on `nc`: revive a dead read loop, and raise
    `NatsConnectionLost` once the connection is closed for good (reconnects given up)."""
    while True:
        if nc.is_closed:
            log.error("nats_connection_closed")
            raise NatsConnectionLost(
                "the NATS connection is closed for good (reconnect attempts exhausted or "
                "closed by the client); stopping rather than serving nothing"
            )
        await revive_if_dead(nc)
        await anyio.sleep(interval)


@contextmanager
def raising_connection_lost() -> Iterator[None]:
    """Let a `NatsConnectionLost` out of a task group as itself, not inside an exception
    group, so a role's caller can catch it (the group rides along as its cause)."""
    try:
        yield
    except BaseExceptionGroup as group:
        matched, _ = group.split(NatsConnectionLost)
        if matched is None:
            raise
        leaf: BaseException = matched
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        raise leaf from group
