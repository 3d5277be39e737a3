#!/usr/bin/env python3
"""One entry point for a fresh machine: needs only Python 3.11+.

`python3 dev.py demo [orders]`, `python3 dev.py example` (the README's test of its handler),
`python3 dev.py sink …` (`txactors sink …`) and `python3 dev.py test` create `.venv`, install
the project with the extras that command needs, then run. The
venv remembers which extras it holds and for which pyproject.toml: a command whose extras are
already there (a `demo` after a `test`) installs nothing, and a missing one is added to what is
there, never swapped for it.
The justfile and `.ci/run` call this script, so there is one way to do each thing.
"""

from __future__ import annotations

import ctypes.util
import difflib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / "python"
STAMP = VENV / ".txactors-installed"
EVERYTHING = ("dev", "postgres", "spark")
"""Tests, lint and benchmarks: the test tools, PostgreSQL and Spark."""
DEMO_EXTRAS = ("postgres",)
"""A demo needs the base dependencies, and asyncpg for `--db postgres`; not Spark (849 MB)."""
SINK_EXTRAS = ("spark",)
"""`dev.py sink`: the Spark sink (pyspark and pyarrow; Java 17+ is the user's to install)."""
TEST_SETS = {"unit": "tests/unit", "integration": "tests/integration"}
"""`python3 dev.py test unit`: the tests that need no server, in seconds."""
WORKERS_ENV = "TXACTORS_TEST_WORKERS"
"""pytest-xdist workers of `dev.py test` (`-n`): 0 runs in this process, one test at a time.
Most tests wait on servers, elections and child processes rather than compute, so a few
workers keep two cores busy; 0 stays the default until parallel runs prove as reliable."""
NO_TESTS = 5
"""pytest's exit code when it collected nothing: fine for the `serial` run of a set that has
none (unit)."""
DEMOS = {"transfer": "apps.transfer", "orders": "apps.orders"}
EXAMPLE = ROOT / "examples" / "shop"
"""`python3 dev.py example`: the README's handler and its test, as a project of its own (its
own pytest settings, the README's, not this project's), run by pytest."""
EXAMPLE_EXTRAS = ("testing",)
"""The example's test needs pytest and pytest-asyncio, and the txactors plugin: `testing`."""
"""`python3 dev.py demo [name] [flags]`: the bank transfer unless another one is named."""


def extras_to_install(
    stamp: str | None, digest: str, wanted: Collection[str], known: Collection[str]
) -> set[str] | None:
    """The extras to install so that `wanted` is there, or None when it already is.

    `stamp` is what the last install recorded (None: nothing yet). Extras it installed for
    this same pyproject.toml count as installed; whatever is installed (and still exists)
    is kept in a new install, so alternating commands never uninstall each other's extras.
    """
    try:
        record = json.loads(stamp) if stamp else {}
    except ValueError:  # an older stamp format: install afresh
        record = {}
    have = set(record.get("extras", ())) if isinstance(record, dict) else set()
    if isinstance(record, dict) and record.get("pyproject") == digest and have >= set(wanted):
        return None
    return set(wanted) | (have & set(known))


def ensure_env(extras: Collection[str] = EVERYTHING) -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 (dev.py must explain itself on old Pythons)
        sys.exit(f"txactors needs Python 3.11 or newer; this is {sys.version.split()[0]}.")
    if not PYTHON.exists():
        print(f"creating virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    import tomllib  # here: an old Python must reach the version check above

    pyproject = (ROOT / "pyproject.toml").read_bytes()
    digest = hashlib.sha256(pyproject).hexdigest()
    known = tomllib.loads(pyproject.decode())["project"].get("optional-dependencies", {})
    stamp = STAMP.read_text() if STAMP.exists() else None
    install = extras_to_install(stamp, digest, extras, known)
    if install is None:
        return
    names = ",".join(sorted(install))
    print(f"installing txactors[{names}] into {VENV}", flush=True)
    run([str(PYTHON), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    run([str(PYTHON), "-m", "pip", "install", "--quiet", "-e", f".[{names}]"])
    STAMP.write_text(json.dumps({"pyproject": digest, "extras": sorted(install)}))


def demo_command(args: list[str]) -> list[str]:
    """`python -m <demo module> flags…` for `dev.py demo [name] flags…`; ValueError for a
    name that is no demo (`order`), suggesting the closest (`orders`)."""
    if args and args[0] in DEMOS:
        return ["-m", DEMOS[args[0]], *args[1:]]
    if args and not args[0].startswith("-"):
        close = difflib.get_close_matches(args[0], DEMOS, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ValueError(
            f"no demo named '{args[0]}'; {hint}the demos: {', '.join(DEMOS)} "
            "(python3 dev.py demo [name] [flags])"
        )
    return ["-m", DEMOS["transfer"], *args]


def example_command(args: list[str]) -> list[str]:
    """The pytest run of `dev.py example [pytest flags…]`, from the clone's root: pytest takes
    examples/shop/pyproject.toml as its configuration, the directory as its root."""
    return [tool("pytest"), str(EXAMPLE.relative_to(ROOT)), *args]


def sink_command(args: list[str]) -> list[str]:
    """The `txactors sink …` command line of `dev.py sink …`, from the venv."""
    return [tool("txactors"), "sink", *args]


def ensure_fuse() -> None:
    """The power-cut tests mount a FUSE disk: install libfuse3 and fusermount3 (Debian's
    fuse3) where /dev/fuse exists and they are missing, when we are root with apt-get.
    Otherwise leave it: the tests then skip, saying why (or fail, in CI)."""
    if not Path("/dev/fuse").exists() or (
        ctypes.util.find_library("fuse3") and shutil.which("fusermount3")
    ):
        return
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("apt-get") is None:
        print("note: libfuse3 is missing; the power-cut tests cannot run", flush=True)
        return
    print("installing fuse3 (libfuse3) for the power-cut tests", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "fuse3", "libfuse3-3"],
    ):
        if subprocess.call(cmd, env=env, stdout=subprocess.DEVNULL) != 0:
            print(f"note: {' '.join(cmd)} failed; the power-cut tests cannot run", flush=True)
            return


def test_commands(args: list[str]) -> list[list[str]]:
    """The pytest runs of `dev.py test [unit|integration]`: the tests on `TXACTORS_TEST_WORKERS`
    workers, then those marked `serial` (they need the machine to themselves) alone. Any other
    argument (a file, `-k`, `-x`) makes one plain pytest run with the arguments as typed."""
    if any(arg not in TEST_SETS for arg in args):
        return [[tool("pytest"), *args]]
    paths = [TEST_SETS[arg] for arg in args]
    workers = os.environ.get(WORKERS_ENV, "0")
    parallel = ["-n", workers, "--dist", "loadgroup", "-m", "not serial"]
    return [[tool("pytest"), *parallel, *paths], [tool("pytest"), "-m", "serial", *paths]]


def run(cmd: list[str], ok: Collection[int] = (0,)) -> None:
    code = subprocess.call(cmd, cwd=ROOT)
    if code not in ok:
        sys.exit(code)


def tool(name: str) -> str:
    return str(BIN / name)


def main(argv: list[str]) -> None:
    command, rest = (argv[0], argv[1:]) if argv else ("help", [])
    if command == "setup":
        ensure_env()
    elif command == "demo":
        try:
            demo = demo_command(rest)
        except ValueError as error:  # before building .venv: a typo costs no install
            sys.exit(f"error: {error}")
        ensure_env(DEMO_EXTRAS)
        run([str(PYTHON), *demo])
    elif command == "example":
        ensure_env(EXAMPLE_EXTRAS)
        run(example_command(rest))
    elif command == "sink":
        ensure_env(SINK_EXTRAS)
        run(sink_command(rest))
    elif command == "test":
        ensure_env()
        ensure_fuse()
        *first, last = test_commands(rest)
        for cmd in first:
            run(cmd)
        run(last, ok=(0, NO_TESTS) if first else (0,))
    elif command == "lint":
        ensure_env()
        run([tool("ruff"), "check", "."])
        run([tool("ruff"), "format", "--check", "."])
        run([tool("mypy"), "txactors"])
        run([tool("pytest"), "-q", "tests/unit/test_layers.py"])  # the layer map, enforced
    elif command == "bench":
        ensure_env()
        run([str(PYTHON), "-m", "bench", *rest])
    else:
        print(
            "usage: python3 dev.py {setup|demo [transfer|orders]|example|sink [run|query]"
            "|test [unit|integration]|lint|bench}"
            " [args...]"
        )
        sys.exit(0 if command == "help" else 2)


if __name__ == "__main__":
    main(sys.argv[1:])
