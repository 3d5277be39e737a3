"""When a client leaves its server for another of the cluster: its server cannot reach JetStream
(cut off from the other servers) or answers nothing (paused).

nats-py changes server only when its connection breaks. A server cut off from the rest of
its cluster keeps its clients' connections and answers them: no responders for the services
beyond it (a coordinator's prepare), JetStream requests unanswered, then "temporarily
unavailable" once it sees no leader. A paused one keeps them open and silent until nats-py's
pings give up, minutes later. A producer or consumer on it would stall for the whole fault.

So a `TolerantClient` notes signs of trouble (a no-responders status, a request timed out, a
pull that ended without its end status); `watch_server` adds one when the server does not
answer a PING (sent every `ping_every`). While signs are fresh it asks JetStream itself,
`$JS.API.INFO`, which only the meta leader answers, every `probe_every`: a probe fails when
it gets no answer or "temporarily unavailable". Once every probe has failed for `grace`
seconds, and the pool holds another server, the client reconnects, first to another server
than the one it leaves. A passing probe ends the run: a cluster electing, or a service that
is just not running, moves nobody. Each move with no passing probe since the last one doubles
the grace (up to `max_grace`), so a cluster with no leader anywhere does not send its clients
round and round; a client with one server never moves.

The meta leader itself, cut off, answers the probe until it steps down (10-20 s after it lost
its peers, nats-server's `lostQuorumInterval`), so its clients leave that much later.

`Watch` is the decision, with no I/O (`now` given); `watch_server` runs it on a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import nats.errors
from nats.aio.client import Client, Server

from txactors.errors import ConfigError
from txactors.nats.retry import CLUSTER_TRANSIENT_CODES
from txactors.observe.logs import get_logger

if TYPE_CHECKING:
    from txactors.nats.client import TolerantClient

__all__ = [
    "DEFAULT_WATCH",
    "PROBE_SUBJECT",
    "Step",
    "Watch",
    "WatchPolicy",
    "leave_server",
    "watch_server",
]

PROBE_SUBJECT: Final = "$JS.API.INFO"
"""The probe: JetStream's account info, answered by the meta leader alone."""
_UNAVAILABLE_STATUS: Final = frozenset({500, 503})

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class WatchPolicy:
    """How long a client waits before it leaves a server (seconds)."""

    grace: float = 3.0
    """Probes failing back to back for this long make the client leave."""
    probe_timeout: float = 1.0
    """How long a probe or a PING waits for its answer."""
    probe_every: float = 1.0
    """Between two probes while trouble is seen."""
    ping_every: float = 2.0
    """Between two PINGs otherwise: what notices a server that answers nothing."""
    signs_last: float = 10.0
    """How long after the last sign of trouble the probes go on."""
    max_grace: float = 60.0
    """The grace doubles with each move that no passing probe followed, up to this."""

    def __post_init__(self) -> None:
        for name in ("grace", "probe_timeout", "probe_every", "ping_every", "signs_last"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"{name} must be a positive number of seconds")
        if self.max_grace < self.grace:
            raise ConfigError("max_grace must be at least grace")


DEFAULT_WATCH: Final = WatchPolicy()
"""How a client watches its server unless told otherwise."""


class Step(enum.Enum):
    """What the watch asks for now."""

    WAIT = "wait"
    PING = "ping"
    PROBE = "probe"
    LEAVE = "leave"


class Watch:
    """The decision: fed signs, PING answers and probe results, it says when to ping, probe or
    leave. Pure: every time is given."""

    __slots__ = (
        "_failed",
        "_failing_since",
        "_moves",
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
        """When the first failed probe of the current run (no pass since) came back."""
        self._failed = 0
        self._moves = 0
        """Moves with no passing probe since."""

    @property
    def grace(self) -> float:
        """Seconds of failing probes after which the client leaves, now."""
        return min(self.policy.grace * 2.0**self._moves, self.policy.max_grace)

    def sign(self, now: float) -> None:
        """Something on the connection looked like trouble: probe for a while."""
        self._suspect_until = max(self._suspect_until, now + self.policy.signs_last)

    def pinged(self, now: float, answered: bool) -> None:
        self._next_ping = now + self.policy.ping_every
        if not answered:
            self.sign(now)

    def probed(self, now: float, passed: bool) -> None:
        self._next_probe = now + self.policy.probe_every
        if passed:
            self._failing_since, self._failed, self._moves = None, 0, 0
        else:
            if self._failing_since is None:
                self._failing_since = now
            self._failed += 1
            self.sign(now)

    def moved(self, now: float, *, left: bool) -> None:
        """The client is on another server (`left`: because we said so): what the probes
        said was about the one before; the new one is probed at once."""
        self._failing_since, self._failed = None, 0
        self._moves += left
        self._next_probe = now
        self.sign(now)

    def step(self, now: float, elsewhere: bool) -> Step:
        """What to do at `now`; `elsewhere`: the pool holds a server to go to."""
        if not elsewhere:
            return Step.WAIT
        if self._leave_at() <= now:
            return Step.LEAVE
        if now < self._suspect_until:
            return Step.PROBE if now >= self._next_probe else Step.WAIT
        return Step.PING if now >= self._next_ping else Step.WAIT

    def wake_at(self, now: float) -> float:
        """When `step` may next say something but WAIT, signs aside."""
        if now < self._suspect_until:
            return min(self._next_probe, self._leave_at())
        return self._next_ping

    def _leave_at(self) -> float:
        if self._failing_since is None or self._failed < 2:
            return math.inf
        return self._failing_since + self.grace


async def watch_server(nc: TolerantClient, policy: WatchPolicy) -> None:
    """Run `Watch` on `nc` until it closes: ping, probe and leave as it says."""
    loop = asyncio.get_running_loop()
    watch = Watch(policy, loop.time())
    server = nc._current_server
    while not nc.is_closed:
        now = loop.time()
        elsewhere = _elsewhere(nc)
        wait = watch.wake_at(now) - now if elsewhere else policy.ping_every
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(wait, 0.0)):
                await nc.trouble.wait()
        now = loop.time()
        if nc.trouble.is_set():
            nc.trouble.clear()
            watch.sign(now)
        if not nc.is_connected:  # nats-py reconnecting: nothing to judge
            await asyncio.sleep(policy.probe_every)
            continue
        if nc._current_server is not server:
            server = nc._current_server
            watch.moved(now, left=False)
        match watch.step(now, elsewhere):
            case Step.PING:
                watch.pinged(loop.time(), await _ping(nc, policy.probe_timeout))
            case Step.PROBE:
                passed = await _probe(nc, policy.probe_timeout)
                watch.probed(loop.time(), passed or nc.probe_refused)
            case Step.LEAVE:
                log.warning("nats_server_left", server=_netloc(server), after=watch.grace)
                await leave_server(nc)
                server = nc._current_server
                watch.moved(loop.time(), left=True)
            case Step.WAIT:
                pass


async def leave_server(nc: Client) -> bool:
    """Reconnect `nc` to another server of its pool: its first try is not the server it leaves
    (nats-py shuffles its pool and might pick it again). The connection is aborted, not
    closed: a paused server would hold a graceful close until it resumes. False when `nc`
    is not connected or may not reconnect."""
    current = nc._current_server
    if current is None or not nc.is_connected or not nc.options["allow_reconnect"]:
        return False
    own = nc._reconnect_to_server_handler

    def elsewhere(servers: list[Server], info: dict[str, Any]) -> tuple[Server | None, float]:
        nc._reconnect_to_server_handler = own  # only this first choice is ours
        return next((s for s in servers if s.uri.netloc != current.uri.netloc), None), 0.0

    nc._reconnect_to_server_handler = elsewhere
    transport = nc._transport
    await nc.force_reconnect()
    writer = getattr(transport, "_io_writer", None)
    if writer is not None:
        writer.transport.abort()
    return True


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


def _elsewhere(nc: Client) -> bool:
    current = nc._current_server
    here = _netloc(current)
    return any(s.uri.netloc != here for s in nc._server_pool)


def _netloc(server: Any) -> str:
    return "" if server is None else str(server.uri.netloc)
