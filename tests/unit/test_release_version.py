"""One version everywhere: pyproject.toml, the installed package's metadata, `txactors
--version`, `txactors_build_info` and the newest release in CHANGELOG.md."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from typer.testing import CliRunner

from txactors.cli import app
from txactors.observe.metrics import build_version

ROOT = Path(__file__).resolve().parents[2]


def declared() -> str:
    version: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return version


def test_the_installed_metadata_is_the_declared_version() -> None:
    assert importlib.metadata.version("txactors") == declared(), (
        "the installed metadata is stale: reinstall (python3 dev.py setup)"
    )


def test_txactors_version_and_build_info_say_the_declared_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert (result.exit_code, result.output) == (0, f"txactors {declared()}\n")
    assert build_version() == declared()


def test_the_newest_release_in_the_changelog_is_the_declared_version() -> None:
    releases = re.findall(
        r"^## \[(\d[^\]]*)\] - \d{4}-\d{2}-\d{2}$", (ROOT / "CHANGELOG.md").read_text(), re.M
    )
    assert releases[0] == declared()
    assert releases == sorted(
        set(releases), key=lambda v: tuple(map(int, v.split("."))), reverse=True
    )
