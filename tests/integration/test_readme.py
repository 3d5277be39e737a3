"""The README's code must run as written: the API example, the handler with its test (run by
pytest, with the txactors plugin, as a user's project would run it), and every shell command,
each either run here or excused in NOT_RUN with the reason and the test that covers it."""

from __future__ import annotations

import os
import re
import shlex
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

from tests.support.plugin import plugin_args

ROOT = Path(__file__).resolve().parents[2]

NOT_RUN = {
    "python3 dev.py demo": "builds a fresh .venv first (minutes, network); the demo it runs, "
    "`python -m apps.transfer`, is run below from the Spark block (with this interpreter's venv) "
    "and by tests/integration/test_app_transfer.py",
    "python3 dev.py test": "the whole test suite, of which this test is part",
    "python3 dev.py demo orders": "builds a fresh .venv first, like `dev.py demo`; the demo it "
    "runs is `python -m apps.orders`, run end to end by tests/integration/test_app_orders.py",
    "python3 dev.py example": "builds a fresh .venv first, like `dev.py demo`; the pytest run it "
    "makes (`dev.example_command`) is run by test_dev_example_runs_the_readme_project_as_its_own",
}
"""README shell commands this file does not run, and why."""


def python_blocks() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert blocks, "the README shows the API in python blocks"
    return blocks


def shell_blocks() -> list[list[str]]:
    """The command lines of each ```sh block: continuations joined, comments cut."""
    readme = (ROOT / "README.md").read_text()
    blocks = []
    for block in re.findall(r"```(?:sh|bash|console)\n(.*?)```", readme, flags=re.DOTALL):
        joined = block.replace("\\\n", " ")
        lines = [line.split("  #", 1)[0].strip() for line in joined.splitlines()]
        blocks.append([" ".join(line.split()) for line in lines if line and line[0] != "#"])
    assert blocks, "the README shows commands in sh blocks"
    return blocks


SPARK_BLOCK_START = "export TXACTORS_DATA_DIR="


def test_every_readme_python_block_is_run() -> None:
    """The tests below run the API example, `shop.py` and `test_shop.py`: nothing else."""
    run = [b for b in python_blocks() if "anyio.run(main)" in b]
    run += [block_named("shop.py"), block_named("test_shop.py")]
    run += [block_named("logistics.py"), block_named("test_logistics.py")]
    assert sorted(run) == sorted(python_blocks()), "a new python block needs a test that runs it"


def test_every_readme_shell_command_is_run_or_excused() -> None:
    """A command added to the README must be run by a test here, or excused with a reason."""
    commands = [c for block in shell_blocks() for c in block]
    run_here = [c for b in shell_blocks() if b[0].startswith(SPARK_BLOCK_START) for c in b]
    assert run_here, "the Spark block (keep its data, sink it afterwards) is where it was"
    unexplained = [c for c in commands if c not in NOT_RUN and c not in run_here]
    assert not unexplained, f"run these in a test or add them to NOT_RUN: {unexplained}"
    assert set(NOT_RUN) <= set(commands), "NOT_RUN names a command the README no longer has"


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_readme_demo_then_spark_sink_block_runs_and_notices_the_demo_run_again(
    tmp_path: Path,
) -> None:
    """The block as a user types it (`dev.py`'s commands run with this interpreter's venv,
    /tmp is tmp_path); then the demo again, which deletes and re-creates its topic, and the
    sink line again: one line saying the stream is another, then with --no-fail-on-data-loss
    the new run's rows. Each command that returned has let go of the catalog."""
    from spark_sinks.session import check_catalog_free

    [block] = [b for b in shell_blocks() if b[0].startswith(SPARK_BLOCK_START)]
    warehouse = tmp_path / "warehouse"
    env = {
        **user_env(),
        "TXACTORS_WAREHOUSE": str(warehouse),
        "XDG_DATA_HOME": str(tmp_path / "data"),  # the demo's databases, not the user's own
    }

    def run(command: str, *extra: str) -> subprocess.CompletedProcess[str]:
        words = [
            str(tmp_path / w.removeprefix("/tmp/")) if w.startswith("/tmp/") else w
            for w in [*shlex.split(command), *extra]
        ]
        # Output to files, as a terminal takes it: a pipe would wait for every process that
        # holds it, the JVM included, and hide one that outlives the command.
        out, err = tmp_path / "stdout", tmp_path / "stderr"
        with out.open("w") as stdout, err.open("w") as stderr:
            code = subprocess.call(
                as_user_runs_it(words), cwd=ROOT, env=env, stdout=stdout, stderr=stderr,
                timeout=500,
            )  # fmt: skip
        check_catalog_free(warehouse)  # CatalogBusy while a JVM of the command still holds it
        return subprocess.CompletedProcess(words, code, out.read_text(), err.read_text())

    outputs = []
    for command in block:
        if command.startswith("export "):
            name, value = shlex.split(command)[1].split("=", 1)
            env[name] = str(tmp_path / value.removeprefix("/tmp/")) if value else value
            continue
        result = run(command)
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        outputs.append(result.stdout)
    assert "moved" in outputs[-1], "the sink's query printed its table"
    first = table_count(outputs[-1])
    assert first > 0

    demo, sink = block[-2], block[-1]
    assert demo.startswith("python3 dev.py demo") and sink.startswith("python3 dev.py sink run")
    rerun = run(demo)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]

    refused = run(sink)
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith(
        "error: topic 'transfers': TOPIC_transfers was deleted and created again"
    ), refused.stderr

    sunk = run(sink, "--no-fail-on-data-loss")
    assert sunk.returncode == 0, sunk.stderr[-3000:]
    lines = sunk.stderr.splitlines()
    said = [line for line in lines if "reading the new stream from its first sequence" in line]
    assert len(said) == 1, sunk.stderr
    started = [line for line in lines if "reading seq" in line]
    assert len(started) == 1 and "reading seq 1.." in started[0], sunk.stderr
    rows = int(next(line for line in lines if "rows sunk" in line).split()[0].replace(",", ""))
    assert rows > 0 and table_count(sunk.stdout) == first + rows

    again = run(sink)
    assert again.returncode == 0 and "caught up at transfers" in again.stderr, again.stderr


def as_user_runs_it(words: list[str]) -> list[str]:
    """`python3 dev.py demo|sink …` as dev.py runs them, from this interpreter's venv (dev.py
    itself would build `.venv` in the clone first); `.venv/bin/x` likewise."""
    import dev

    bin_dir = Path(sys.executable).parent
    if words[:2] == ["python3", "dev.py"] and words[2] in ("demo", "sink"):
        command = (
            [sys.executable, *dev.demo_command(words[3:])]
            if words[2] == "demo"
            else dev.sink_command(words[3:])
        )
        if command[0] == dev.tool("txactors"):
            command[0] = str(bin_dir / "txactors")
        return command
    if words[0].startswith(".venv/bin/"):
        return [str(bin_dir / words[0].removeprefix(".venv/bin/")), *words[1:]]
    return words


def table_count(shown: str) -> int:
    """The sum of the second column of a table `show()` printed: the block's count(*)."""
    rows = [line.split("|") for line in shown.splitlines() if line.startswith("|")]
    return sum(int(cells[2]) for cells in rows[1:])


def block_named(filename: str) -> str:
    """The block that starts with the comment `# <filename>`."""
    [block] = [b for b in python_blocks() if b.startswith(f"# {filename}\n")]
    return block


def toml_block_named(filename: str) -> str:
    """The ```toml block that starts with the comment `# <filename>`."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", readme, flags=re.DOTALL)
    [block] = [b for b in blocks if b.startswith(f"# {filename}\n")]
    return block


def user_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_readme_api_example_runs(tmp_path: Path) -> None:
    """Run where a user would, in a directory of their own (its database file lands there)."""
    [block] = [b for b in python_blocks() if "anyio.run(main)" in b]
    result = subprocess.run(
        [sys.executable, "-c", block],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "shipping ('42',) b'order 42 paid'" in result.stdout, "the committed message arrived"
    with closing(sqlite3.connect(tmp_path / "shop.db")) as db:
        [(txid,)] = db.execute("SELECT txid FROM payments").fetchall()
        logged = db.execute("SELECT txid, decision FROM txactors_txlog").fetchall()
    assert logged == [(txid, "committed")], "the payment and its log row committed together"


@pytest.mark.parametrize(
    ("module", "printed"),
    [("shop", "shipping order 42 of transaction"), ("logistics", "")],
)
def test_readme_handler_and_its_test_pass_under_pytest(
    tmp_path: Path, module: str, printed: str
) -> None:
    """A user's project: their two files and the README's pytest settings, no conftest,
    pytest-asyncio in strict mode; any warning (a deprecation, say) fails it."""
    (tmp_path / f"{module}.py").write_text(block_named(f"{module}.py"))
    (tmp_path / f"test_{module}.py").write_text(block_named(f"test_{module}.py"))
    (tmp_path / "pyproject.toml").write_text(toml_block_named("pyproject.toml"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *plugin_args(),
            "-p",
            "no:cacheprovider",
            "-q",
            "-s",
            "-W",
            "error",
        ],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert printed in result.stdout, "the app's handler ran"
    assert "warning" not in (result.stdout + result.stderr).lower(), result.stdout + result.stderr


def test_the_example_project_is_the_readmes() -> None:
    """examples/shop, which `dev.py example` runs, holds the README's three files as written."""
    import dev

    for name in ("shop.py", "test_shop.py"):
        assert (dev.EXAMPLE / name).read_text() == block_named(name), name
    assert (dev.EXAMPLE / "pyproject.toml").read_text() == toml_block_named("pyproject.toml")


def test_dev_example_runs_the_readme_project_as_its_own() -> None:
    """From the clone's root, as `dev.py example` runs it (this interpreter's venv for the
    clone's .venv): pytest takes the example's settings, not the clone's (whose `timeout`
    needs the `dev` extra: "Unknown config option" with only `testing` installed)."""
    import dev

    command = dev.example_command(["-p", "no:cacheprovider"])
    assert command[0] == dev.tool("pytest")
    command[0] = str(Path(sys.executable).parent / "pytest")
    result = subprocess.run(
        command, cwd=ROOT, env=user_env(), capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"configfile: {Path('pyproject.toml')}" in result.stdout
    assert f"rootdir: {dev.EXAMPLE}" in result.stdout
    assert "1 passed" in result.stdout
