"""One way to get a NATS connection: the configured server, or a private embedded one.

`nats_session()` is what apps, the CLI and tests use, so "no NATS_URL → embedded server, else
connect there and start nothing" (DESIGN §10) is decided in exactly one place, and a server we
started is always stopped when the session ends. Its client is a `TolerantClient`, which
survives a malformed header block from any publisher (see txactors.nats.client).
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import nats.errors
import nkeys  # type: ignore[import-untyped]  # no stubs; used for two checks
from nats.aio.client import Client
from nats.js import JetStreamContext

from txactors.embedded.server import EmbeddedNatsServer
from txactors.errors import ConfigError, NatsConnectError
from txactors.nats.client import TolerantClient
from txactors.nats.config import NatsConfig, setting_name
from txactors.nats.retry import LINK_TROUBLE
from txactors.observe.logs import get_logger

DRAIN_TIMEOUT = 5.0

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class NatsSession:
    """A live connection, and the embedded server behind it if we started one."""

    nc: Client
    url: str
    server: EmbeddedNatsServer | None

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream()


def connect_options(config: NatsConfig) -> dict[str, Any]:
    """Keyword arguments for `nats.connect` carrying the config's name, auth and TLS.

    Files are checked here (not in NatsConfig) because a config may be built on another machine.
    """
    opts: dict[str, Any] = {
        "name": config.name,
        "connect_timeout": config.connect_timeout,
        "reconnect_time_wait": config.reconnect_time_wait,
    }
    if config.user is not None:
        opts["user"] = config.user
        opts["password"] = config.password
    if config.token is not None:
        opts["token"] = config.token
    if config.creds_file is not None:
        creds = _existing_file(config, "creds_file")
        _check_creds(config, creds)
        opts["user_credentials"] = str(creds)
    if config.nkeys_seed is not None:
        seed = _existing_file(config, "nkeys_seed")
        _check_seed(config, "nkeys_seed", seed.read_bytes().strip())
        opts["nkeys_seed"] = str(seed)
    if config.inbox_prefix is not None:
        opts["inbox_prefix"] = config.inbox_prefix.removesuffix(".")
    tls = tls_context(config)
    if tls is not None:
        opts["tls"] = tls
    return opts


def tls_context(config: NatsConfig) -> ssl.SSLContext | None:
    """A client SSL context when a CA or client certificate is configured, else None.

    (For a tls:// URL without these, nats-py builds a default context that trusts system CAs.)
    """
    if config.tls_ca is None and config.tls_cert is None:
        return None
    cafile = str(_existing_file(config, "tls_ca")) if config.tls_ca is not None else None
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
        if config.tls_cert is not None:
            context.load_cert_chain(
                str(_existing_file(config, "tls_cert")), str(_existing_file(config, "tls_key"))
            )
    except ssl.SSLError as exc:
        raise ConfigError(
            f"could not load the TLS files ({setting_name('tls_ca')}, "
            f"{setting_name('tls_cert')}, {setting_name('tls_key')}): {exc}. "
            "Check they are PEM and that the key matches the certificate."
        ) from exc
    return context


@asynccontextmanager
async def nats_session(
    config: NatsConfig | None = None, **connect_kwargs: Any
) -> AsyncIterator[NatsSession]:
    """Connect to `config.url`, or start an embedded server when it is None; clean up on exit.

    `config` defaults to `NatsConfig.from_env()`. `connect_kwargs` go to `nats.connect` and win
    over the config (e.g. callbacks).
    """
    config = NatsConfig.from_env() if config is None else config
    server: EmbeddedNatsServer | None = None
    if config.embedded:
        server = EmbeddedNatsServer(
            config.data_dir, fsync=config.fsync, fsync_interval=config.fsync_interval
        )
        await server.start()
        servers = [server.url]
        # The embedded server has no auth or TLS; only name and timeouts apply.
        opts: dict[str, Any] = {
            "name": config.name,
            "connect_timeout": config.connect_timeout,
            "reconnect_time_wait": config.reconnect_time_wait,
            "server_watch": None,  # one server: nowhere to go
        }
    else:
        servers = config.servers
        opts = {**connect_options(config), "server_watch": config.server_watch}
    try:
        nc = await _connect(servers, config, {**opts, **connect_kwargs})
        try:
            connected = nc.connected_url
            url = connected.geturl() if connected is not None else servers[0]
            yield NatsSession(nc=nc, url=url, server=server)
        finally:
            await _close(nc)
    finally:
        if server is not None:
            await server.stop()


async def _connect(servers: list[str], config: NatsConfig, opts: dict[str, Any]) -> Client:
    errors: list[Exception] = []
    user_error_cb = opts.pop("error_cb", _on_error)
    user_disconnected_cb = opts.pop("disconnected_cb", _on_disconnected)
    connected = False  # until then, errors are collected for NatsConnectError, not logged each

    async def on_error(exc: Exception) -> None:
        errors.append(exc)
        if connected:
            await user_error_cb(exc)

    async def on_disconnected() -> None:
        if connected and not nc.is_closed:  # closed on purpose: nothing to report
            await user_disconnected_cb()

    opts.setdefault("reconnected_cb", _on_reconnected)
    nc = TolerantClient()
    # nats-py counts the first connection against max_reconnect_attempts, so a short limit
    # here makes a wrong URL fail in seconds; the real limit is set once connected. The overall
    # bound is because nats-py can hang closing a socket after a failed TLS handshake.
    attempts = (config.connect_retries + 1) * len(servers)
    budget = attempts * (config.connect_timeout + config.reconnect_time_wait) + 1.0
    try:
        await asyncio.wait_for(
            nc.connect(
                servers=servers,
                max_reconnect_attempts=config.connect_retries,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                **opts,
            ),
            budget,
        )
    except LINK_TROUBLE as exc:
        with suppress(Exception):
            await asyncio.wait_for(nc.close(), 1.0)
        cause = _most_telling(errors) or exc
        where = ", ".join(_redact(s) for s in servers)
        raise NatsConnectError(
            f"could not connect to NATS at {where}: {cause!r}. Check that the server is running "
            f"and reachable and the credentials are right, or unset {setting_name('url')} "
            "to run an embedded server instead."
        ) from exc
    connected = True
    nc.options["max_reconnect_attempts"] = config.max_reconnect_attempts
    return nc


def _most_telling(errors: list[Exception]) -> Exception | None:
    """A refused login explains more than the connection reset that follows it."""
    for exc in reversed(errors):
        if isinstance(exc, nats.errors.AuthorizationError) or "authorization" in str(exc).lower():
            return exc
    return errors[-1] if errors else None


async def _close(nc: Client) -> None:
    """Drain (finish in-flight handlers, flush publishes) when we can, else just close."""
    if nc.is_connected:
        try:
            await asyncio.wait_for(nc.drain(), DRAIN_TIMEOUT)
        except LINK_TROUBLE as exc:
            log.warning("nats_drain_failed", error=repr(exc))
    if not nc.is_closed:
        try:
            await nc.close()
        except OSError as exc:  # nats-py first flushes unsent data, into a socket maybe dead
            log.warning("nats_close_failed", error=repr(exc))


def _existing_file(config: NatsConfig, field: str) -> Path:
    value = getattr(config, field)
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"{setting_name(field)} names {value!r}, which is not a readable file")
    return path


def _check_seed(config: NatsConfig, field: str, seed: bytes) -> None:
    """nats-py reads the seed only while connecting, and then fails with a bare nkeys error."""
    try:
        nkeys.from_seed(bytearray(seed))
    except (nkeys.NkeysError, ValueError) as exc:
        raise ConfigError(
            f"{setting_name(field)} names {getattr(config, field)!r}, which is not an nkey seed "
            f"(nkeys: {exc}); it should hold one line starting with 'SU' (a user seed)"
        ) from exc


def _check_creds(config: NatsConfig, path: Path) -> None:
    """nats-py loops forever on a creds file without a JWT block, so look before it does."""
    text = path.read_bytes()
    seed = re.search(rb"-+BEGIN USER NKEY SEED-+\s*\n\s*(\S+)", text)
    if b"BEGIN NATS USER JWT" not in text or seed is None:
        raise ConfigError(
            f"{setting_name('creds_file')} names {config.creds_file!r}, which is not a creds "
            "file (it needs a 'BEGIN NATS USER JWT' and a 'BEGIN USER NKEY SEED' block)"
        )
    _check_seed(config, "creds_file", seed.group(1))


def _redact(url: str | None) -> str:
    """The URL without a password or token, for messages and logs."""
    if url is None:
        return ""
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = "***" if parts.password is None else f"{parts.username}:***"
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


async def _on_error(exc: Exception) -> None:
    log.warning("nats_error", error=repr(exc))


async def _on_disconnected() -> None:
    log.info("nats_disconnected")


async def _on_reconnected() -> None:
    log.info("nats_reconnected")
