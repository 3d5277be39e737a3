"""The package as a user gets it: the sdist and wheel built from this checkout (`python -m
build`: the wheel from the sdist, so a file the sdist lacks fails here), their metadata passed
by `twine check`, the wheel installed with `[testing]` into a fresh venv outside the clone
(dependencies from the package index), and there, with no path into the clone: the README's
API example, and the README's handler and its test under that venv's pytest, whose
`txactors_*` fixtures come from the installed plugin's entry point.

The README's code is read from README.md at run time, so what runs is what the README says.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.test_readme import block_named, python_blocks, toml_block_named

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("wheel")]


@dataclass(frozen=True)
class Installed:
    """A fresh venv holding the built wheel, and the files that were built."""

    venv: Path
    sdist: Path
    wheel: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def env(self, home: Path) -> dict[str, str]:
        """A user's shell: the venv first on PATH, nothing that points into the clone or at
        a NATS server, and the embedded server's data under `home`."""
        dropped = ("PYTHON", "VIRTUAL_ENV", "NATS_", "TXACTORS_", "PYTEST_", "XDG_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
        env["PATH"] = os.pathsep.join([str(self.venv / "bin"), env.get("PATH", "")])
        env["XDG_DATA_HOME"] = str(home / "data")
        return env

    def run(self, *args: str | Path, cwd: Path, timeout: float = 180) -> str:
        result = subprocess.run(
            [str(a) for a in args],
            cwd=cwd,
            env=self.env(cwd),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert result.returncode == 0, f"{args}\n{result.stdout[-4000:]}{result.stderr[-4000:]}"
        return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [sdist] = dist.glob("txactors-*.tar.gz")
    [wheel] = dist.glob("txactors-*.whl")
    venv = tmp_path_factory.mktemp("user") / "venv"
    # The base interpreter, not this venv's: a user's fresh venv has none of our packages.
    base = Path(sysconfig.get_config_var("BINDIR") or "") / "python3"
    subprocess.run([str(base), "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", f"{wheel}[testing]"],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return Installed(venv=venv, sdist=sdist, wheel=wheel)


def test_twine_passes_the_sdist_and_the_wheel(installed: Installed) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", installed.sdist, installed.wheel],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_the_venv_imports_the_installed_package_and_agrees_on_its_version(
    installed: Installed, tmp_path: Path
) -> None:
    where = installed.run(
        installed.python, "-c", "import txactors; print(txactors.__file__)", cwd=tmp_path
    )
    assert Path(where.strip()).is_relative_to(installed.venv), where
    assert not tmp_path.is_relative_to(ROOT) and not installed.venv.is_relative_to(ROOT)
    version = installed.run(installed.venv / "bin" / "txactors", "--version", cwd=tmp_path)
    project = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert project is not None
    assert version.split() == ["txactors", project[1]]
    assert installed.wheel.name.startswith(f"txactors-{project[1]}-")


def test_the_readme_api_example_runs_from_the_wheel(installed: Installed, tmp_path: Path) -> None:
    [block] = [b for b in python_blocks() if "anyio.run(main)" in b]
    (tmp_path / "example.py").write_text(block)
    out = installed.run(installed.python, "example.py", cwd=tmp_path, timeout=120)
    assert "shipping ('42',) b'order 42 paid'" in out, out


def test_the_readme_test_example_passes_with_the_installed_plugin(
    installed: Installed, tmp_path: Path
) -> None:
    """As a user's project: shop.py, test_shop.py and the README's pytest settings; the
    plugin is not named (`-p`): its entry point loads it. Any warning fails it."""
    (tmp_path / "shop.py").write_text(block_named("shop.py"))
    (tmp_path / "test_shop.py").write_text(block_named("test_shop.py"))
    (tmp_path / "pyproject.toml").write_text(toml_block_named("pyproject.toml"))
    out = installed.run(
        installed.python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-s", "-W", "error",
        cwd=tmp_path,
    )  # fmt: skip
    assert "1 passed" in out, out
    assert "shipping order 42 of transaction" in out, "the app's handler ran"
