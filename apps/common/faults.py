"""Faults a demo injects to show recovery, each one real: a refused local transaction, a
process SIGKILLed at the worst moment, an end that never arrives, a message delivered twice.

The crashes need real processes: `child_process()` starts `python -m <module> …` (a child
that talks to the same NATS server and databases), reads the lines it prints to say where it
is, and reports how it ended; the child calls `kill_self()` at the point to crash, which is
SIGKILL: no cleanup, no flushed buffers, no goodbye to the server.
"""

from __future__ import annotations

import enum
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import anyio
import anyio.abc

from apps.common.report import Tally

ROOT = Path(__file__).resolve().parents[2]
"""The directory holding the `apps` package: where children run from."""


class Fault(enum.StrEnum):
    LOCAL_FAILURE = "local-failure"
    """The local transaction refuses (e.g. insufficient funds): roll back, nothing sent."""
    PRODUCER_CRASH = "producer-crash"
    """A producer process is SIGKILLed right after its prepare (some after their local
    commit, some before): the check-back asks a surviving member of the group."""
    LOST_END = "lost-end"
    """Prepared and committed locally, but the end never reaches the coordinator."""
    CONSUMER_CRASH = "consumer-crash"
    """A consumer process is SIGKILLed in the middle of applying a message (its database
    transaction open): the message is redelivered to another member of the group."""
    DUPLICATE = "duplicate"
    """A message is delivered again after it was applied (its ack lost)."""


def parse_faults(text: str) -> frozenset[Fault]:
    """`all`, `none`, or a comma-separated list of fault names; ValueError names the choices."""
    text = text.strip().lower()
    if text == "all":
        return frozenset(Fault)
    if text in ("", "none"):
        return frozenset()
    chosen = set()
    for name in (part.strip() for part in text.split(",")):
        try:
            chosen.add(Fault(name))
        except ValueError:
            choices = ", ".join(f.value for f in Fault)
            raise ValueError(
                f"unknown fault {name!r}; choose all, none, or any of: {choices}"
            ) from None
    return frozenset(chosen)


DEFAULT_FAULTS = "all"
"""Both demos inject every fault unless told otherwise: that is what they are there to show."""


FAULTS_SECTION = "faults injected"


@dataclass
class FaultLog:
    """What the injected faults really did in this run, for the reconciliation's "faults
    injected" tallies: each child that died by SIGKILL, each ack lost on purpose, each second
    delivery absorbed. Counted, never compared with a plan: a transfer meant to be delivered
    twice that was rolled back first is never delivered at all, and that is no mismatch."""

    producer_exits: list[int] = field(default_factory=list)
    """Exit codes of the producer children (-SIGKILL when killed)."""
    consumer_exits: list[int] = field(default_factory=list)

    def tallies(self, faults: frozenset[Fault], *, acks_lost: int, absorbed: int) -> list[Tally]:
        """`acks_lost`: deliveries whose ack the handlers dropped on purpose; `absorbed`:
        deliveries the consumers found already applied (a lost ack's redelivery, or a slow
        ack's)."""
        tallies = []
        if Fault.PRODUCER_CRASH in faults:
            killed = self.producer_exits.count(-signal.SIGKILL)
            name = "producer processes SIGKILLed after prepare"
            tallies.append(Tally(section=FAULTS_SECTION, name=name, count=killed))
        if Fault.CONSUMER_CRASH in faults:
            killed = self.consumer_exits.count(-signal.SIGKILL)
            name = "consumer processes SIGKILLed mid-apply"
            tallies.append(Tally(section=FAULTS_SECTION, name=name, count=killed))
        if Fault.DUPLICATE in faults:
            tallies += [
                Tally(section=FAULTS_SECTION, name="acks lost after applying", count=acks_lost),
                Tally(
                    section=FAULTS_SECTION,
                    name="deliveries found applied (absorbed, nothing changed)",
                    count=absorbed,
                ),
            ]
        return tallies


class LostAck(Exception):
    """Raised by a handler after its change committed: the consumer naks the message, so the
    server delivers it again, exactly as when an ack is lost; idempotency must absorb it."""


def kill_self() -> NoReturn:
    """SIGKILL this process (after flushing what it printed, so the parent sees where it was)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL cannot be caught")


class Child:
    """A running child process and the lines it printed."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        self._buffer = b""

    async def expect(self, prefix: str, timeout: float = 30.0) -> str:
        """The rest of the next printed line starting with `prefix` (others are skipped);
        RuntimeError if the child ends first."""
        assert self.process.stdout is not None
        with anyio.fail_after(timeout):
            while True:
                while b"\n" in self._buffer:
                    line, self._buffer = self._buffer.split(b"\n", 1)
                    text = line.decode()
                    if text.startswith(prefix):
                        return text[len(prefix) :].strip()
                try:
                    self._buffer += await self.process.stdout.receive()
                except anyio.EndOfStream:
                    code = await self.process.wait()
                    raise RuntimeError(
                        f"child process ended (exit {code}) before printing {prefix!r}"
                    ) from None

    async def wait(self, timeout: float = 30.0) -> int:
        """Its exit code (`-signal.SIGKILL` when killed), waiting at most `timeout` seconds."""
        with anyio.fail_after(timeout):
            return await self.process.wait()


@asynccontextmanager
async def child_process(
    module: str, *args: str, env: Mapping[str, str] | None = None
) -> AsyncIterator[Child]:
    """Run `python -m module args…`; a child still running when the block exits is killed."""
    process = await anyio.open_process(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=None,  # the child's errors go where ours do
    )
    try:
        yield Child(process)
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                with suppress(ProcessLookupError):
                    process.kill()
            await process.wait()
            await process.aclose()
