"""When a client leaves its server for another of the cluster: its server cannot reach JetStream
(cut off from the other servers) or answers nothing (paused), and another one serves.

nats-py changes server only when its connection breaks. A server cut off from the rest of
its cluster keeps its clients' connections and answers them: no responders for the services
beyond it (a coordinator's prepare), JetStream requests unanswered, then "temporarily
unavailable" once it sees no leader. A paused one keeps them open and silent until nats-py's
pings give up, minutes later. A producer or consumer on it would stall for the whole fault.

So a `TolerantClient` notes signs of trouble: a no-responders status, a request timed out, a
pull ended without its end status, a server telling of fewer peers than before (it lost
routes); `watch_server` adds one when the server does not answer a PING (sent every
`ping_every`). While signs are fresh it judges the server every `probe_every`: it fails when
it routes to fewer than a majority of the servers it told of at most (the peers listed in
its INFO), or when JetStream does not answer `$JS.API.INFO` (the meta leader's to answer)
through it, or answers "temporarily unavailable". Once it has failed for `grace` seconds, the
client looks for a server that passes the same test, on a connection of its own, and
reconnects to it. If none does, the whole cluster is electing (a killed meta leader): the
client stays, and looks again later. A pass ends the run; each look that found nowhere to go,
and each move, with no pass since doubles the grace (up to `max_grace`). A client with one
server never moves.

The route count is what tells a meta leader cut off, which goes on answering the probe
until it steps down (10-20 s after it lost its peers): without `connect_urls` in the servers'
INFO (`no_advertise`), or with the probe refused by permissions, the other half judges alone.

`Watch` is the decision, with no I/O (`now` given); `watch_server` runs it on a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any, Final

import nats.errors
from nats.aio.client import Client, Server

from txactors.errors import ConfigError
from txactors.nats.retry import CLUSTER_TRANSIENT_CODES, LINK_TROUBLE
from txactors.observe.logs import get_logger

__all__ = [
    "DEFAULT_WATCH",
    "PROBE_OPTIONS",
    "PROBE_SUBJECT",
    "ServerSigns",
    "Step",
    "Watch",
    "WatchPolicy",
    "leave_server",
    "routed",
    "watch_server",
]

PROBE_SUBJECT: Final = "$JS.API.INFO"
"""The probe: JetStream's account info, answered by the meta leader alone."""
PROBE_OPTIONS: Final = frozenset(
    {
        "name",
        "user",
        "password",
        "token",
        "user_credentials",
        "nkeys_seed",
        "nkeys_seed_str",
        "signature_cb",
        "user_jwt_cb",
        "tls",
        "tls_hostname",
        "tls_handshake_first",
        "inbox_prefix",
    }
)
"""The `connect` options a look at another server connects with: who the client is."""
_UNAVAILABLE_STATUS: Final = frozenset({500, 503})

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class WatchPolicy:
    """How long a client waits before it leaves a server (seconds)."""

    grace: float = 3.0
    """The server failing for this long makes the client look for another."""
    probe_timeout: float = 1.0
    """How long a probe, a PING or a connection to another server waits."""
    probe_every: float = 1.0
    """Between two judgements while trouble is seen."""
    ping_every: float = 2.0
    """Between two PINGs otherwise: what notices a server that answers nothing."""
    signs_last: float = 10.0
    """How long after the last sign of trouble the judgements go on."""
    max_grace: float = 60.0
    """The grace doubles with each look elsewhere that no pass followed, up to this."""

    def __post_init__(self) -> None:
        for name in ("grace", "probe_timeout", "probe_every", "ping_every", "signs_last"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"{name} must be a positive number of seconds")
        if not self.grace <= self.max_grace < math.inf:
            raise ConfigError("max_grace must be at least grace")


DEFAULT_WATCH: Final = WatchPolicy()
"""How a client watches its server unless told otherwise."""


class Step(enum.Enum):
    """What the watch asks for now."""

    WAIT = "wait"
    PING = "ping"
    PROBE = "probe"
    LOOK_ELSEWHERE = "look elsewhere"


class Watch:
    """The decision: fed signs, PING answers and judgements of the server, it says when to
    ping, judge, or look for another server. Pure: every time is given."""

    __slots__ = (
        "_failed",
        "_failing_since",
        "_looks",
        "_next_ping",
        "_next_probe",
        "_suspect_until",
        "policy",
    )

    def __init__(self, policy: WatchPolicy, now: float) -> None:
        self.policy = policy
        self._suspect_until = -math.inf
        self._next_ping = now + policy.ping_every
        self._next_probe = now
        self._failing_since: float | None = None
        """When the first failed judgement of the current run (no pass since) came."""
        self._failed = 0
        self._looks = 0
        """Looks elsewhere (found or not) with no pass since."""

    @property
    def grace(self) -> float:
        """Seconds of failed judgements after which the client looks elsewhere, now."""
        return min(self.policy.grace * 2.0**self._looks, self.policy.max_grace)

    def sign(self, now: float) -> None:
        """Something on the connection looked like trouble: judge the server for a while."""
        self._suspect_until = max(self._suspect_until, now + self.policy.signs_last)

    def pinged(self, now: float, answered: bool) -> None:
        self._next_ping = now + self.policy.ping_every
        if not answered:
            self.sign(now)

    def probed(self, now: float, passed: bool) -> None:
        self._next_probe = now + self.policy.probe_every
        if passed:
            self._failing_since, self._failed, self._looks = None, 0, 0
        else:
            if self._failing_since is None:
                self._failing_since = now
            self._failed += 1
            self.sign(now)

    def looked(self, now: float, *, moved: bool) -> None:
        """The client looked for another server (`moved`: found one and went there): the run
        starts over, with the grace doubled; a new server is judged at once."""
        self._failing_since, self._failed = None, 0
        self._looks += 1
        if moved:
            self._next_probe = now
        self.sign(now)

    def moved(self, now: float) -> None:
        """nats-py moved the client itself (its server went away): what the judgements said
        was about the one before; the new one is judged at once."""
        self._failing_since, self._failed = None, 0
        self._next_probe = now
        self.sign(now)

    def step(self, now: float, elsewhere: bool) -> Step:
        """What to do at `now`; `elsewhere`: the pool holds a server to go to."""
        if not elsewhere:
            return Step.WAIT
        if self._look_at() <= now:
            return Step.LOOK_ELSEWHERE
        if now < self._suspect_until:
            return Step.PROBE if now >= self._next_probe else Step.WAIT
        return Step.PING if now >= self._next_ping else Step.WAIT

    def wake_at(self, now: float) -> float:
        """When `step` may next say something but WAIT, signs aside."""
        if now < self._suspect_until:
            return min(self._next_probe, self._look_at())
        return self._next_ping

    def _look_at(self) -> float:
        if self._failing_since is None or self._failed < 2:
            return math.inf
        return self._failing_since + self.grace


@dataclass
class ServerSigns:
    """What a client has seen of its server, noted by the client (`TolerantClient.signs`)
    and judged by its watch: the watch reads this record, never the client's own class."""

    trouble: asyncio.Event = field(default_factory=asyncio.Event)
    """Set on each sign that the server may not reach JetStream (the watch clears it)."""
    probe_refused: bool = False
    """The server refused the watch's probe (permissions): the probe cannot judge."""
    peers: int | None = None
    """How many client URLs the server told of last: itself and those it routes to."""
    cluster_size: int = 0
    """The most client URLs a server of this connection ever told of."""
    probe_options: dict[str, Any] = field(default_factory=dict)
    """Who the client is (`PROBE_OPTIONS` of its `connect`), to look at other servers."""


async def watch_server(nc: Client, signs: ServerSigns, policy: WatchPolicy) -> None:
    """Run `Watch` on `nc` until it closes: ping, judge, look elsewhere and move as it says,
    from the `signs` its client notes."""
    loop = asyncio.get_running_loop()
    watch = Watch(policy, loop.time())
    server = nc._current_server
    while not nc.is_closed:
        now = loop.time()
        elsewhere = _elsewhere(nc)
        wait = watch.wake_at(now) - now if elsewhere else policy.ping_every
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(wait, 0.0)):
                await signs.trouble.wait()
        now = loop.time()
        if signs.trouble.is_set():
            signs.trouble.clear()
            watch.sign(now)
        if not nc.is_connected or nc.is_draining:  # reconnecting, or closing: nothing to judge
            await asyncio.sleep(policy.probe_every)
            continue
        if nc._current_server is not server:
            server = nc._current_server
            watch.moved(now)
        match watch.step(now, elsewhere):
            case Step.PING:
                watch.pinged(loop.time(), await _ping(nc, policy.probe_timeout))
            case Step.PROBE:
                passed = routed(signs.peers, signs.cluster_size) and (
                    signs.probe_refused or await _probe(nc, policy.probe_timeout)
                )
                watch.probed(loop.time(), passed)
            case Step.LOOK_ELSEWHERE:
                target = await _serving_elsewhere(nc, signs, policy.probe_timeout)
                if target is not None:
                    log.warning(
                        "nats_server_left", server=_netloc(server), to=target, after=watch.grace
                    )
                    await leave_server(nc, target)
                else:
                    log.info("nats_server_kept", server=_netloc(server), reason="none serves")
                watch.looked(loop.time(), moved=target is not None)
            case Step.WAIT:
                pass


def routed(peers: int | None, cluster_size: int) -> bool:
    """Whether a server that tells of `peers` client URLs (itself and the servers it routes
    to; None: it tells of none) routes to a majority of the `cluster_size` servers."""
    return peers is None or 2 * peers > cluster_size


async def leave_server(nc: Client, target: str) -> bool:
    """Reconnect `nc` to the server at `target` (`host:port` of its pool), or to the next one
    nats-py picks if that fails. The connection is aborted, not closed: a paused server would
    hold a graceful close until it resumes. False when `nc` is not connected or may not
    reconnect."""
    if nc._current_server is None or not nc.is_connected or not nc.options["allow_reconnect"]:
        return False
    own = nc._reconnect_to_server_handler

    def chosen(servers: list[Server], info: dict[str, Any]) -> tuple[Server | None, float]:
        nc._reconnect_to_server_handler = own  # only this first choice is ours
        return next((s for s in servers if s.uri.netloc == target), None), 0.0

    nc._reconnect_to_server_handler = chosen
    transport = nc._transport
    await nc.force_reconnect()
    writer = getattr(transport, "_io_writer", None)
    if writer is not None:
        writer.transport.abort()
    return True


async def _serving_elsewhere(nc: Client, signs: ServerSigns, timeout: float) -> str | None:
    """The first server of `nc`'s pool (but its own) that passes the watch's test, asked on a
    connection of its own; None when none does."""
    here = _netloc(nc._current_server)
    others = list(dict.fromkeys(s.uri for s in nc._server_pool if s.uri.netloc != here))
    passes = await asyncio.gather(
        *(
            _serves(
                uri.geturl(), signs.probe_options, signs.cluster_size, signs.probe_refused, timeout
            )
            for uri in others
        )
    )
    return next((str(uri.netloc) for uri, ok in zip(others, passes, strict=True) if ok), None)


async def _serves(
    url: str, options: dict[str, Any], cluster_size: int, refused: bool, timeout: float
) -> bool:
    """Whether the server at `url` routes to a majority and JetStream answers through it."""
    probe = Client()
    try:
        try:
            await asyncio.wait_for(
                probe.connect(
                    servers=[url],
                    allow_reconnect=False,
                    max_reconnect_attempts=1,
                    connect_timeout=timeout,  # type: ignore[arg-type]  # typed int, seconds
                    error_cb=_quiet,
                    **options,
                ),
                2 * timeout,
            )
        except LINK_TROUBLE:
            return False
        urls = probe._server_info.get("connect_urls")
        peers = len(urls) if isinstance(urls, list) else None
        return routed(peers, cluster_size) and (refused or await _probe(probe, timeout))
    finally:
        with contextlib.suppress(*LINK_TROUBLE):
            await asyncio.wait_for(probe.close(), timeout)


async def _ping(nc: Client, timeout: float) -> bool:
    """Whether the server answered a PING in time (a connection going away meanwhile is no
    news: nats-py is on it)."""
    try:
        await nc.flush(timeout)  # type: ignore[arg-type]  # typed int, taken as seconds
    except nats.errors.TimeoutError:
        return False
    except (nats.errors.Error, OSError):
        pass
    return True


async def _probe(nc: Client, timeout: float) -> bool:
    """Whether JetStream answered through this server. No responders means no JetStream at
    all, which no other server changes: a pass. `Client.request`, not the `TolerantClient`'s,
    so that a probe's timeout is not itself a sign."""
    try:
        msg = await Client.request(nc, PROBE_SUBJECT, b"", timeout=timeout)
    except nats.errors.NoRespondersError:
        return True
    except nats.errors.TimeoutError:
        return False
    except (nats.errors.Error, OSError):
        return True  # the connection went away meanwhile: nats-py is on it
    try:
        error = json.loads(msg.data).get("error") or {}
    except (ValueError, AttributeError):
        return True
    return not (
        error.get("code") in _UNAVAILABLE_STATUS or error.get("err_code") in CLUSTER_TRANSIENT_CODES
    )


async def _quiet(error: Exception) -> None:
    """A look at another server that fails is an answer, not news."""


def _elsewhere(nc: Client) -> bool:
    here = _netloc(nc._current_server)
    return any(s.uri.netloc != here for s in nc._server_pool)


def _netloc(server: Any) -> str:
    return "" if server is None else str(server.uri.netloc)
