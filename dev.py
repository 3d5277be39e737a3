#!/usr/bin/env python3
"""One entry point for a fresh machine: needs only Python 3.11+.

`python3 dev.py demo` and `python3 dev.py test` create `.venv`, install the project with
the extras they need (only when pyproject.toml changed since the last install), then run.
The justfile and `.ci/run` call this script, so there is one way to do each thing.
"""

from __future__ import annotations

import ctypes.util
import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / "python"
EXTRAS = "dev,postgres,spark"


def ensure_env(extras: str = EXTRAS) -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 (dev.py must explain itself on old Pythons)
        sys.exit(f"txactors needs Python 3.11 or newer; this is {sys.version.split()[0]}.")
    if not PYTHON.exists():
        print(f"creating virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + extras.encode()).hexdigest()
    stamp = VENV / ".txactors-installed"
    if stamp.exists() and stamp.read_text() == digest:
        return
    print(f"installing txactors[{extras}] into {VENV}", flush=True)
    run([str(PYTHON), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    run([str(PYTHON), "-m", "pip", "install", "--quiet", "-e", f".[{extras}]"])
    stamp.write_text(digest)


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


def run(cmd: list[str]) -> None:
    code = subprocess.call(cmd, cwd=ROOT)
    if code != 0:
        sys.exit(code)


def tool(name: str) -> str:
    return str(BIN / name)


def main(argv: list[str]) -> None:
    command, rest = (argv[0], argv[1:]) if argv else ("help", [])
    if command == "setup":
        ensure_env()
    elif command == "demo":
        ensure_env()
        run([str(PYTHON), "-m", "apps.transfer", *rest])  # the bank transfer, with faults
    elif command == "test":
        ensure_env()
        ensure_fuse()
        run([tool("pytest"), *rest])
    elif command == "lint":
        ensure_env()
        run([tool("ruff"), "check", "."])
        run([tool("ruff"), "format", "--check", "."])
        run([tool("mypy"), "txactors"])
    elif command == "bench":
        ensure_env()
        run([str(PYTHON), "-m", "bench", *rest])
    else:
        print("usage: python3 dev.py {setup|demo|test|lint|bench} [args...]")
        sys.exit(0 if command == "help" else 2)


if __name__ == "__main__":
    main(sys.argv[1:])
