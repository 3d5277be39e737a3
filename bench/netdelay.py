"""The wire between the hosts of `bench cluster`: every IPv4 packet held for a fixed one-way
delay, as a data center's network would (tc's netem, which this machine's kernel lacks).

`python -m bench.netdelay ONE_WAY_MS DEVICE=ADDRESS ...` creates one TUN device per host (in
the root namespace; `bench.netns` then moves each into its host's namespace, the file
descriptor staying here), prints `ready`, and forwards until its stdin closes: a packet read
from any device goes, `ONE_WAY_MS` later, to the device whose address it is sent to (packets
to nobody's address are dropped). Then it prints one JSON line: packets carried, and how late
they left against their due time (p50 / p99, ms: the delay line's own error).

The delay is constant, so the packets leave in the order they came: a FIFO, no heap.
`select` (microsecond timeouts, unlike epoll's milliseconds) with a 1 µs timer slack, at a
real-time priority, keeps the error to the wake-up latency of the machine.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import json
import os
import select
import struct
import sys
import time
from collections.abc import Iterator

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
PR_SET_TIMERSLACK = 29
MAX_PACKET = 65536
SAMPLE_EVERY = 16
"""One packet in this many has its lateness kept (bounded memory on long runs)."""
MAX_SAMPLES = 200_000


class DelayLine:
    """The packets in flight: each leaves `delay` seconds after it came, to the device of its
    IPv4 destination address (bytes 16..19 of the header)."""

    def __init__(self, delay: float, routes: dict[bytes, int]) -> None:
        self.delay = delay
        self.routes = routes
        self.queue: collections.deque[tuple[float, int, bytes]] = collections.deque()
        self.carried = 0
        self.dropped = 0
        self.lateness: list[float] = []

    def came(self, now: float, packet: bytes) -> None:
        """A packet read at `now`: queued for its destination, or dropped (not IPv4, or to an
        address no host has)."""
        out = self.routes.get(packet[16:20]) if packet[:1] and packet[0] >> 4 == 4 else None
        if out is None:
            self.dropped += 1
            return
        self.queue.append((now + self.delay, out, packet))

    def due(self, now: float) -> Iterator[tuple[int, bytes]]:
        """The packets whose time has come, in order, as (device fd, packet)."""
        while self.queue and self.queue[0][0] <= now:
            at, out, packet = self.queue.popleft()
            self.carried += 1
            if self.carried % SAMPLE_EVERY == 0 and len(self.lateness) < MAX_SAMPLES:
                self.lateness.append(now - at)
            yield out, packet

    def wait(self, now: float) -> float | None:
        """Seconds until the next packet is due (None: nothing in flight)."""
        return max(0.0, self.queue[0][0] - now) if self.queue else None

    def report(self) -> dict[str, float | int]:
        late = sorted(self.lateness) or [0.0]
        return {
            "packets": self.carried,
            "dropped": self.dropped,
            "late_p50_ms": late[len(late) // 2] * 1e3,
            "late_p99_ms": late[min(len(late) - 1, int(len(late) * 0.99))] * 1e3,
        }


def address_bytes(address: str) -> bytes:
    return bytes(int(part) for part in address.split("."))


def open_tun(name: str) -> int:
    """A new TUN device `name` (IP packets, no extra header), non-blocking; it lives as long
    as this descriptor, wherever its device is moved."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def first_in_line() -> None:
    """Run before the roles when both are ready, as a network does not wait for a host's CPU:
    the lowest real-time priority (the kernel's RT throttling still leaves the others 5% of
    each second should this loop ever spin), or else the highest nice level we may take."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (OSError, AttributeError):
        with contextlib.suppress(OSError):
            os.nice(-10)


def forward(line: DelayLine, devices: list[int], stdin: int) -> None:
    """Carry packets until `stdin` closes."""
    readers = [*devices, stdin]
    while True:
        ready, _, _ = select.select(readers, [], [], line.wait(time.monotonic()))
        now = time.monotonic()
        for fd in ready:
            if fd == stdin:
                if not os.read(stdin, 4096):
                    return
                continue
            while True:
                try:
                    line.came(now, os.read(fd, MAX_PACKET))
                except BlockingIOError:
                    break
        for out, packet in line.due(time.monotonic()):
            try:
                os.write(out, packet)
            except OSError:  # its device is down (a namespace removed): a lost packet
                line.dropped += 1


def main() -> None:
    one_way_ms, *hosts = sys.argv[1:]
    routes: dict[bytes, int] = {}
    devices = []
    for host in hosts:
        name, address = host.split("=")
        fd = open_tun(name)
        devices.append(fd)
        routes[address_bytes(address)] = fd
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)  # 1 µs, not 50
    first_in_line()
    line = DelayLine(float(one_way_ms) / 1e3, routes)
    print("ready", flush=True)
    forward(line, devices, sys.stdin.fileno())
    print(json.dumps(line.report()), flush=True)


if __name__ == "__main__":
    main()
