"""Where txactors finds NATS: one frozen settings object, filled from code or the environment.

No URL means "run a private embedded server" (DESIGN §10); a URL means "connect there and start
nothing", with the usual NATS auth: user/password, token, creds or nkey seed file, and TLS.
Checks that need only the settings themselves run at construction, so a typo fails at startup
with the name of the variable to fix, not later as an opaque connection error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import msgspec

from txactors.embedded.setup import FsyncError, FsyncSetting
from txactors.errors import ConfigError
from txactors.nats.watchdog import DEFAULT_WATCH, WatchPolicy
from txactors.wire.inbox import normalize_prefix

DATA_DIR_ENV = "TXACTORS_DATA_DIR"
FSYNC_ENV = "TXACTORS_FSYNC"
FSYNC_INTERVAL_ENV = "TXACTORS_FSYNC_INTERVAL"
LEAVE_SERVER_AFTER_ENV = "TXACTORS_LEAVE_SERVER_AFTER"

# Field -> environment variable; also how error messages name a setting.
ENV_VARS: dict[str, str] = {
    "url": "NATS_URL",
    "user": "NATS_USER",
    "password": "NATS_PASSWORD",
    "token": "NATS_TOKEN",
    "creds_file": "NATS_CREDS",
    "nkeys_seed": "NATS_NKEY",
    "tls_ca": "NATS_TLS_CA",
    "tls_cert": "NATS_TLS_CERT",
    "tls_key": "NATS_TLS_KEY",
    "inbox_prefix": "NATS_INBOX_PREFIX",
    "data_dir": DATA_DIR_ENV,
    "fsync": FSYNC_ENV,
    "fsync_interval": FSYNC_INTERVAL_ENV,
    "leave_server_after": LEAVE_SERVER_AFTER_ENV,
}

_SECRET_FIELDS = ("password", "token")
_URL_SCHEMES = ("nats", "tls", "ws", "wss")


class NatsConfig(FsyncSetting, kw_only=True, frozen=True):
    """How to reach NATS. `url=None` runs an embedded server in `data_dir` (a temp dir if None).

    `url` may list several servers separated by commas. `creds_file` and `nkeys_seed` are paths
    to files. Auth and TLS settings apply only to a configured `url`; the embedded server has
    no auth and listens on 127.0.0.1 only. `fsync` and `fsync_interval` (`FsyncSetting`) apply
    only to the embedded server (a server you run yourself takes `sync_interval` in its own
    configuration).
    """

    url: str | None = None
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    nkeys_seed: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    inbox_prefix: str | None = None
    """Where this client's requests get their replies (nats-py's `inbox_prefix`, e.g.
    `_INBOX.billing`); None: nats-py's `_INBOX`. A confined user may only subscribe there."""
    data_dir: str | None = None
    name: str = "txactors"
    connect_timeout: float = 2.0
    # Initial connection: retries per server before NatsConnectError (nats-py's default is 60,
    # two minutes of silence before a typo in NATS_URL is reported).
    connect_retries: int = 2
    reconnect_time_wait: float = 2.0
    # After the first connection: -1 keeps reconnecting forever, as a long-lived service wants.
    max_reconnect_attempts: int = -1
    leave_server_after: float = DEFAULT_WATCH.grace
    """Seconds the connected server may fail to reach JetStream (or answer nothing) before
    the client moves to another server of the URL list or the cluster (nats/watchdog.py);
    0 never moves. A client with one server never does."""

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except FsyncError as exc:
            raise ConfigError(f"{exc} (the {setting_name(exc.field)} setting)") from None
        if self.url is not None:
            for server in self.servers:
                problem = _server_problem(server)
                if problem is not None:
                    raise ConfigError(
                        f"{setting_name('url')}={self.url!r} is not a NATS URL{problem}; "
                        "expected e.g. nats://host:4222 (schemes: nats, tls, ws, wss; commas "
                        "between servers)"
                    )
        if self.inbox_prefix is not None:
            try:
                normalize_prefix(self.inbox_prefix)
            except ConfigError as exc:
                raise ConfigError(f"{exc} (the {setting_name('inbox_prefix')} setting)") from None
        _together(self, "user", "password")
        _together(self, "tls_cert", "tls_key")
        _not_both(self, "token", "user")
        _not_both(self, "creds_file", "nkeys_seed")
        if self.connect_timeout <= 0:
            raise ConfigError(f"connect_timeout must be > 0 seconds, got {self.connect_timeout}")
        if not 0 <= self.leave_server_after < float("inf"):  # NaN fails too
            raise ConfigError(
                f"{setting_name('leave_server_after')} must be >= 0 seconds (0: never), "
                f"got {self.leave_server_after}"
            )
        if self.connect_retries < 1:
            # nats-py reads a limit of 0 as "retry forever".
            raise ConfigError(f"connect_retries must be >= 1, got {self.connect_retries}")

    def __repr__(self) -> str:
        """Only the settings that differ from the defaults, secrets masked: safe to log."""
        shown = []
        for field in msgspec.structs.fields(self):
            value = getattr(self, field.name)
            if value != field.default:
                text = "***" if field.name in _SECRET_FIELDS else repr(value)
                shown.append(f"{field.name}={text}")
        return f"NatsConfig({', '.join(shown)})"

    @property
    def embedded(self) -> bool:
        """True when no URL is configured, so txactors runs its own server."""
        return self.url is None

    @property
    def server_watch(self) -> WatchPolicy | None:
        """How the client watches its server (None: it never leaves one)."""
        if self.embedded or self.leave_server_after == 0:
            return None
        return replace(
            DEFAULT_WATCH,
            grace=self.leave_server_after,
            max_grace=max(DEFAULT_WATCH.max_grace, self.leave_server_after),
        )

    @property
    def servers(self) -> list[str]:
        """The configured server URLs as a list (empty when embedded)."""
        if self.url is None:
            return []
        return [part.strip() for part in self.url.split(",")]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> NatsConfig:
        """Read NATS_URL, NATS_USER, ... TXACTORS_DATA_DIR; empty variables count as unset.

        `overrides` win over the environment (e.g. a CLI flag).
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field, var in ENV_VARS.items():
            raw = env.get(var, "").strip()
            if raw:
                values[field] = _number(var, raw) if field in _NUMBER_FIELDS else raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"bad NatsConfig setting: {exc}") from exc


def _server_problem(server: str) -> str | None:
    """What is wrong with one server of a URL list (`: port ...`, or "" for no detail), or
    None. A server without a scheme is nats-py's `nats://`, without a port 4222; a port that
    is no number would otherwise fail only at connect time, as "no servers available"."""
    scheme, sep, _ = server.partition("://")
    if not server or (sep and scheme not in _URL_SCHEMES):
        return ""
    parts = urlsplit(server if sep else f"nats://{server}")
    try:
        port = parts.port
    except ValueError:  # not a number, or beyond 65535
        port = 0
    if port == 0:
        shown = parts.netloc.rpartition(":")[2]
        return f": its port {shown!r} is not a number from 1 to 65535"
    if not parts.hostname:
        return ": it names no host"
    return None


def setting_name(field: str) -> str:
    """How messages name a setting: the field and its environment variable."""
    var = ENV_VARS.get(field)
    return f"{field} ({var})" if var else field


_NUMBER_FIELDS = ("fsync_interval", "leave_server_after")


def _number(var: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not a number (seconds, e.g. 120)") from None


def _together(config: NatsConfig, a: str, b: str) -> None:
    has_a, has_b = getattr(config, a) is not None, getattr(config, b) is not None
    if has_a != has_b:
        given, missing = (a, b) if has_a else (b, a)
        raise ConfigError(
            f"{setting_name(given)} is set but {setting_name(missing)} is not; set both or neither"
        )


def _not_both(config: NatsConfig, a: str, b: str) -> None:
    if getattr(config, a) is not None and getattr(config, b) is not None:
        raise ConfigError(
            f"{setting_name(a)} and {setting_name(b)} are both set; use one way to authenticate"
        )
