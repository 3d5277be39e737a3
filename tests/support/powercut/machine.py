"""What runs on the power-cut machine: nats-server with its store on the disk, the
coordinator and the tests' peers, each its own process that the next cut kills.

Their output goes to files beside the disk, not on it, so what a process printed before
the cut (a peer's `COMMITTED <txid>`) can still be read after it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from tests.support.powercut.fixture import ROOT, PowerCut
from tests.support.wait import eventually
from txactors.embedded.server import find_nats_server_binary

COORDINATOR_FLAGS = (
    "--transaction-timeout=0.5",
    "--check-interval=0.25",
    "--check-interval-max=0.5",
    "--check-answer-timeout=2",
    "--check-max=60",
    "--lease-ttl=1",  # the lease of the coordinator the cut killed may still be on disk
)
"""Check-backs within a second or two, so a restarted machine settles in seconds."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class Machine:
    """One machine's processes; `sync` is nats-server's `sync_interval` (None: its default,
    a flush every two minutes)."""

    disk: PowerCut
    logs: Path
    sync: str | None
    port: int = field(default_factory=_free_port)
    life: int = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def store(self) -> Path:
        return self.disk.mountpoint / "nats"

    def path(self, name: str) -> Path:
        """A file of this life's output, beside the disk."""
        return self.logs / f"{name}-{self.life}.log"

    async def boot(self) -> None:
        """A new life: nats-server, then the coordinator, each ready."""
        self.life += 1
        self.logs.mkdir(parents=True, exist_ok=True)
        config = self.logs / "nats.conf"
        sync = f"\n  sync_interval: {self.sync}" if self.sync else ""
        config.write_text(
            f'listen: 127.0.0.1:{self.port}\njetstream {{\n  store_dir: "{self.store}"{sync}\n}}\n'
        )
        await self._start([str(find_nats_server_binary()), "-c", str(config)], "nats")
        await self.wait_for("nats", "Server is ready")
        await self._start(
            [sys.executable, "-m", "txactors.cli", "coordinator", *COORDINATOR_FLAGS],
            "coordinator",
        )
        await self.wait_for("coordinator", "coordinator ready")

    async def start_peer(self, name: str, module: str, *args: str) -> None:
        """`python -m <module> <args>` on this machine; ready once it prints READY."""
        await self._start([sys.executable, "-m", module, *args], name)
        await self.wait_for(name, "READY")

    def output(self, name: str, life: int | None = None) -> str:
        path = self.logs / f"{name}-{self.life if life is None else life}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def lines(self, name: str, prefix: str) -> list[str]:
        """The rest of every line starting with `prefix` that `name` printed, in any life."""
        found: list[str] = []
        for life in range(1, self.life + 1):
            for line in self.output(name, life).splitlines():
                if line.startswith(prefix + " "):
                    found.append(line[len(prefix) + 1 :])
        return found

    async def wait_for(self, name: str, text: str, timeout: float = 30) -> None:
        await eventually(
            lambda: text in self.output(name),
            timeout=timeout,
            interval=0.05,
            what=f"{name} printed {text!r}",
            explain=lambda: self.output(name)[-3000:],
        )

    async def _start(self, command: list[str], name: str) -> None:
        env = {**os.environ, "NATS_URL": self.url, "PYTHONPATH": str(ROOT)}
        with self.path(name).open("wb") as out:
            process = await anyio.open_process(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        self.disk.track(process)
