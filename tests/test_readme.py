"""The README's code must run as written: the API example, and the handler with its test
(run by pytest, with the txactors plugin, as a user's project would run it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.plugin import plugin_args

ROOT = Path(__file__).resolve().parent.parent


def python_blocks() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert blocks, "the README shows the API in python blocks"
    return blocks


def block_named(filename: str) -> str:
    """The block that starts with the comment `# <filename>`."""
    [block] = [b for b in python_blocks() if b.startswith(f"# {filename}\n")]
    return block


def user_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_readme_api_example_runs() -> None:
    [block] = [b for b in python_blocks() if "anyio.run(main)" in b]
    result = subprocess.run(
        [sys.executable, "-c", block],
        cwd=ROOT,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "shipping ('42',) b'order 42 paid'" in result.stdout, "the committed message arrived"


def test_readme_handler_and_its_test_pass_under_pytest(tmp_path: Path) -> None:
    """A user's project: their two files, no conftest, pytest-asyncio in strict mode."""
    (tmp_path / "shop.py").write_text(block_named("shop.py"))
    (tmp_path / "test_shop.py").write_text(block_named("test_shop.py"))
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *plugin_args(), "-p", "no:cacheprovider", "-q", "-s"],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert "shipping order 42 of transaction" in result.stdout, "the app's handler ran"
