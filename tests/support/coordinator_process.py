"""A coordinator in its own process (`python -m txactors.cli coordinator`), as operators run it.

Tests that attack the coordinator must see it die, hang or ignore SIGTERM the way a real
deployment would; an in-process coordinator would share the test's event loop and NATS
client, so one poisoned read loop would take the test's own eyes with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from tests.support.wait import eventually

ROOT = Path(__file__).resolve().parent.parent.parent
READY_LINE = "coordinator ready"
STOP_GRACE = 5.0
"""Seconds a SIGTERM may take before we call the coordinator deaf to it."""


class CoordinatorProcess:
    """Start, stop, kill and restart one `txactors coordinator` on `url`.

    Its stderr goes to a file (never a pipe a hang could fill) so a failing test can show the
    tail. Fast check-back timing by default, so garbage check answers are exercised within a
    batch, and a short lease TTL so a SIGKILLed coordinator's successor takes over quickly.
    """

    def __init__(
        self, url: str, log_dir: Path, *, partitions: int, extra_args: Sequence[str] = ()
    ) -> None:
        self.url = url
        self.partitions = partitions
        self.log_dir = log_dir
        self.args = [
            "--partitions",
            str(partitions),
            "--transaction-timeout",
            "0.3",
            "--check-interval",
            "0.2",
            "--check-max",
            "3",
            "--check-answer-timeout",
            "0.5",
            "--lease-ttl",
            "2",
            *extra_args,
        ]
        self.starts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def log_tail(self, lines: int = 40) -> str:
        if self._log is None or not self._log.exists():
            return "(no log)"
        text = self._log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    async def start(self, ready_timeout: float = 20.0) -> None:
        """Spawn and wait for its ready line (partitions may still be recovering after it)."""
        assert not self.alive(), "already running"
        self.starts += 1
        self._log = self.log_dir / f"coordinator-{self.starts}.log"
        env = {**os.environ, "NATS_URL": self.url, "PYTHONPATH": str(ROOT)}
        env.pop("TXACTORS_LOG_LEVEL", None)
        env["_TYPER_STANDARD_TRACEBACK"] = "1"  # plain tracebacks: readable in a log tail
        self._proc = _spawn([*COMMAND, *self.args], env, self._log)

        def ready() -> bool:
            assert self.alive(), f"coordinator exited at start:\n{self.log_tail()}"
            return READY_LINE in self._log.read_text(errors="replace")

        await eventually(
            ready,
            timeout=ready_timeout,
            interval=0.05,
            what="the coordinator ready",
            explain=self.log_tail,
        )

    async def terminate(self) -> bool:
        """SIGTERM; True if it exited within STOP_GRACE. A deaf one is SIGKILLed regardless."""
        if not self.alive():
            return True
        assert self._proc is not None
        self._proc.send_signal(signal.SIGTERM)
        stopped = await self._wait_exit(STOP_GRACE)
        if not stopped:
            await self.kill()
        return stopped

    def pause(self) -> None:
        """SIGSTOP: the process stalls (as under a long GC pause or a frozen VM) until `resume`."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    async def kill(self) -> None:
        if self.alive():
            assert self._proc is not None
            self._proc.kill()
            await self._wait_exit(STOP_GRACE)

    async def _wait_exit(self, timeout: float) -> bool:
        """True once the process has exited, False if it still runs after `timeout`."""
        assert self._proc is not None
        return await _exited(self._proc, timeout)


COMMAND = (sys.executable, "-m", "txactors.cli", "coordinator")


async def _exited(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait for the exit itself (in a thread), not for a poll to notice it."""
    try:
        await anyio.to_thread.run_sync(proc.wait, timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def _spawn(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Popen returns at once (the child runs on its own); output goes to `log_path`."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
