"""`PowerCut`: a mounted power-cut disk, the processes that use it, and the cut itself.

A cut is what a power failure does to one machine: every process the test started, and any
other process with a file open on the disk, is SIGKILLed at once; then the disk is
unmounted, keeps only what was fsynced (`Disk.cut`), and is mounted again for the next life.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import shutil
import signal
import sys
from pathlib import Path
from types import TracebackType
from typing import Self

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

REQUIRE_ENV = "TXACTORS_REQUIRE_POWERCUT"
"""Set to 1 (CI does, where /dev/fuse exists): a missing piece fails the tests, not skips."""
ROOT = Path(__file__).resolve().parents[3]


def unavailable() -> str | None:
    """Why this machine cannot run the power-cut tests, in one line; None when it can."""
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse on this machine"
    if ctypes.util.find_library("fuse3") is None and ctypes.util.find_library("fuse") is None:
        return "libfuse is not installed (apt-get install fuse3 libfuse3-3; dev.py test does it)"
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
        return "fusermount3 is missing (apt-get install fuse3)"
    if importlib.util.find_spec("mfusepy") is None:
        return "mfusepy is not installed (pip install -e '.[dev]')"
    return None


def users_of(mountpoint: Path) -> set[int]:
    """Processes with a file (or their working directory) on `mountpoint`."""
    inside = str(mountpoint)
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            links = [entry / "cwd", *(entry / "fd").iterdir()]
            targets = [os.readlink(link) for link in links]
        except OSError:  # gone, or not ours to look at
            continue
        if any(t == inside or t.startswith(inside + "/") for t in targets):
            found.add(int(entry.name))
    return found


class PowerCut:
    """The disk mounted at `mountpoint` (a new, empty directory under `workdir`)."""

    def __init__(self, workdir: Path) -> None:
        self.mountpoint = workdir / "disk"
        self.cuts = 0
        self._tracked: list[Process] = []
        self._server: Process | None = None
        self._lines: BufferedByteReceiveStream | None = None

    async def __aenter__(self) -> Self:
        self.mountpoint.mkdir(parents=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self._server = await anyio.open_process(
            [sys.executable, "-m", "tests.support.powercut.fusefs", str(self.mountpoint)],
            env=env,
            stderr=None,
        )
        assert self._server.stdout is not None
        self._lines = BufferedByteReceiveStream(self._server.stdout)
        await self._mounted()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self._kill_users()
            server = self._server
            if server is None:
                return
            if server.returncode is None:
                assert server.stdin is not None
                try:
                    await server.stdin.send(b"stop\n")
                    with anyio.fail_after(15):
                        await server.wait()
                except (OSError, anyio.BrokenResourceError, TimeoutError):
                    server.kill()
            await server.aclose()

    def track(self, process: Process) -> Process:
        """A process of this machine: the next cut kills it."""
        self._tracked.append(process)
        return process

    async def cut(self) -> None:
        """Cut the power: kill every process, drop every unsynced write, mount again."""
        await self._kill_users()
        server = self._server
        assert server is not None and server.stdin is not None
        await server.stdin.send(b"cut\n")
        await self._mounted()
        self.cuts += 1

    async def _kill_users(self) -> None:
        for process in self._tracked:
            if process.returncode is None:
                process.kill()
        for process in self._tracked:
            await process.wait()
            await process.aclose()
        self._tracked.clear()
        with anyio.fail_after(10):  # and any process the tracked ones started
            while others := users_of(self.mountpoint):
                for pid in others:
                    os.kill(pid, signal.SIGKILL)
                await anyio.sleep(0.02)  # a killed process lets go of the mount soon after

    async def _mounted(self) -> None:
        assert self._lines is not None
        with anyio.fail_after(30):
            try:
                line = await self._lines.receive_until(b"\n", 1024)
            except anyio.EndOfStream:
                line = b"(the disk's process exited)"
        if line != b"mounted":
            raise RuntimeError(f"power-cut disk: {line.decode(errors='replace')}")
