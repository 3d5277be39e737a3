"""The hosts of `bench cluster`: one Linux network namespace per host, wired through a delay
line (`bench.netdelay`), as data and as the `ip` commands that make and remove them.

Each host is a namespace of its own (`txbench-n1` .. `txbench-n3` for the NATS nodes,
`txbench-app` for the producers) with one TUN device, `txb-<host>`, addressed in
198.18.0.0/24 (RFC 2544's range for benchmarks: no real network uses it). The bench process
itself, in the root namespace, is host `ctl` (198.18.0.1): it reaches every node for set-up
and monitoring. Every packet from one host to another leaves through its TUN device, is held
for the one-way delay by `bench.netdelay` (which owns every device's file descriptor), and
enters the other host's namespace through its device: every pair of hosts is as far apart as
two machines of a data center. (tc's netem would do the same in the kernel, but the kernels
this project runs on are built without it: CONFIG_NET_SCH_NETEM is not set.)

The devices are created by `bench.netdelay` (in the root namespace) and moved into their
namespaces by `Plan.attach`; `Plan.teardown` removes everything, and `leftovers` finds what
a run killed before its teardown left behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "txbench-"
"""Every namespace of the benchmark is named with this prefix."""
DEVICE_PREFIX = "txb-"
"""Every TUN device of the benchmark is named with this prefix."""
SUBNET = "198.18.0"
PREFIX_LEN = 24
MTU = 9000
"""Jumbo frames, as data-center networks run: fewer packets for the delay line to carry."""
CONTROL = "ctl"
"""The host of the bench process itself (the root namespace)."""
APP = "app"
"""The host of the producer processes."""
LOCK = Path("/run/lock/txactors-bench-cluster.lock")


class NoNamespaces(RuntimeError):
    """This machine or user cannot make network namespaces: the benchmark cannot run."""


@dataclass(frozen=True)
class Host:
    """One host: its name, its namespace (None: the root one), its device and address."""

    name: str
    address: str

    @property
    def namespace(self) -> str | None:
        return None if self.name == CONTROL else f"{PREFIX}{self.name}"

    @property
    def device(self) -> str:
        return f"{DEVICE_PREFIX}{self.name}"

    def run(self, argv: Sequence[str]) -> list[str]:
        """`argv` run in this host's namespace."""
        if self.namespace is None:
            return list(argv)
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass(frozen=True)
class Plan:
    """The hosts of one run and the commands that wire them."""

    hosts: tuple[Host, ...]

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    @property
    def nodes(self) -> list[Host]:
        return [h for h in self.hosts if h.name.startswith("n")]

    def namespaces(self) -> list[list[str]]:
        """Make each namespace, its loopback up (before the delay line makes the devices)."""
        commands = []
        for host in self.hosts:
            if host.namespace is not None:
                commands.append(["ip", "netns", "add", host.namespace])
                commands.append(["ip", "-n", host.namespace, "link", "set", "lo", "up"])
        return commands

    def attach(self) -> list[list[str]]:
        """Move each device into its namespace and bring it up with its address (no IPv6
        link-local address: nothing but the benchmark's own IPv4 goes on the wire)."""
        commands = []
        for host in self.hosts:
            ip = ["ip"] if host.namespace is None else ["ip", "-n", host.namespace]
            if host.namespace is not None:
                commands.append(["ip", "link", "set", host.device, "netns", host.namespace])
            commands += [
                [*ip, "link", "set", host.device, "addrgenmode", "none"],
                [*ip, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", host.device],
                [*ip, "link", "set", host.device, "mtu", str(MTU), "up"],
            ]
        return commands

    def teardown(self) -> list[list[str]]:
        """Remove every namespace (its device goes with it) and the root namespace's device
        (gone already once the delay line has exited)."""
        commands = [["ip", "netns", "del", h.namespace] for h in self.hosts if h.namespace]
        return [*commands, ["ip", "link", "del", self.host(CONTROL).device]]

    def delay_line_args(self) -> list[str]:
        """`DEVICE=ADDRESS` for each host, as `bench.netdelay` takes them."""
        return [f"{h.device}={h.address}" for h in self.hosts]


def plan(nodes: int = 3) -> Plan:
    """The control host (.1), nodes n1.. (.11, .12, ..) and the producers' host (.100)."""
    hosts = [Host(CONTROL, f"{SUBNET}.1")]
    hosts += [Host(f"n{i + 1}", f"{SUBNET}.{11 + i}") for i in range(nodes)]
    hosts.append(Host(APP, f"{SUBNET}.100"))
    return Plan(tuple(hosts))


def leftovers(namespaces: Iterable[str], links: Iterable[str]) -> list[list[str]]:
    """The commands that remove what an earlier run left (`ip netns list` names, root
    namespace device names): only names with the benchmark's prefixes."""
    commands = [["ip", "netns", "del", n] for n in namespaces if n.startswith(PREFIX)]
    return commands + [["ip", "link", "del", d] for d in links if d.startswith(DEVICE_PREFIX)]


def listed_namespaces(text: str) -> list[str]:
    """Names from `ip netns list` (`name (id: 3)` or `name`)."""
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def listed_links(text: str) -> list[str]:
    """Device names from `ip -o link show` (`7: name: <...>` or `7: name@peer: <...>`)."""
    names = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            names.append(parts[1].strip().split("@")[0])
    return names


def check_usable() -> None:
    """NoNamespaces unless we are root with `ip` and /dev/net/tun."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise NoNamespaces(
            "bench cluster makes network namespaces and TUN devices (ip netns, /dev/net/tun): "
            "run it as root (sudo .venv/bin/python -m bench.cluster)"
        )
    if shutil.which("ip") is None:
        raise NoNamespaces("bench cluster needs the `ip` command (Debian's iproute2)")
    if not Path("/dev/net/tun").exists():
        raise NoNamespaces("bench cluster needs /dev/net/tun (the kernel's TUN driver)")


def run(commands: Iterable[Sequence[str]], *, check: bool = True) -> None:
    """Run each command; with `check`, the first that fails raises with what it said."""
    for command in commands:
        done = subprocess.run(list(command), capture_output=True, text=True)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")


def remove_leftovers() -> None:
    """Remove the namespaces and devices an earlier run of the benchmark left behind."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    run(leftovers(listed_namespaces(listed), listed_links(links)), check=False)
