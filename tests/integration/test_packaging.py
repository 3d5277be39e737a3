"""What a user installs: the wheel's contents, and what `python3 dev.py` installs per command.

The wheel is built with hatchling (the build backend) from this checkout and its file list
read: only the `txactors` and `spark_sinks` packages, with `py.typed` and the LICENSE; no
top-level `apps` (the demos run from the source tree) to collide with a user's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import dev

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out = tmp_path_factory.mktemp("wheel")
    build = "import sys; from hatchling.build import build_wheel; print(build_wheel(sys.argv[1]))"
    subprocess.run(
        [sys.executable, "-c", build, str(out)], cwd=ROOT, check=True, capture_output=True
    )
    [wheel] = out.glob("txactors-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_the_wheel_ships_txactors_and_spark_sinks_only(wheel_files: list[str]) -> None:
    tops = {name.split("/")[0] for name in wheel_files}
    [dist_info] = [top for top in tops if top.endswith(".dist-info")]
    assert tops == {"txactors", "spark_sinks", dist_info}
    assert "txactors/__init__.py" in wheel_files
    assert "spark_sinks/__init__.py" in wheel_files
    assert not any(name.startswith(("apps/", "tests/", "bench/")) for name in wheel_files)


def test_the_wheel_is_typed_and_carries_the_license(wheel_files: list[str]) -> None:
    assert "txactors/py.typed" in wheel_files
    [license_file] = [name for name in wheel_files if name.endswith(".dist-info/licenses/LICENSE")]
    assert license_file
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "txactors authors" in text


def test_the_demos_still_run_from_the_source_tree() -> None:
    """Out of the wheel, `python -m apps.transfer` keeps working from a clone."""
    for module in ("apps.transfer", "apps.orders"):
        result = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert "--faults" in result.stdout


# -- dev.py: which extras each command installs ------------------------------------------

KNOWN = {"dev", "postgres", "spark", "testing"}


def stamp(digest: str, *extras: str) -> str:
    return json.dumps({"pyproject": digest, "extras": sorted(extras)})


def test_a_demo_needs_neither_spark_nor_the_test_tools() -> None:
    assert set(dev.DEMO_EXTRAS) == {"postgres"}
    assert dev.extras_to_install(None, "d1", dev.DEMO_EXTRAS, KNOWN) == {"postgres"}


def test_installed_extras_that_are_a_superset_count_as_installed() -> None:
    """A demo after a test installs nothing; a test after a demo adds to it, and neither
    undoes the other (no reinstall ping-pong)."""
    after_test = stamp("d1", *dev.EVERYTHING)
    assert dev.extras_to_install(after_test, "d1", dev.DEMO_EXTRAS, KNOWN) is None
    after_demo = stamp("d1", *dev.DEMO_EXTRAS)
    assert dev.extras_to_install(after_demo, "d1", dev.DEMO_EXTRAS, KNOWN) is None
    assert dev.extras_to_install(after_demo, "d1", dev.EVERYTHING, KNOWN) == set(dev.EVERYTHING)


def test_a_changed_pyproject_reinstalls_what_is_there_plus_what_is_wanted() -> None:
    before = stamp("d1", "dev", "spark", "gone")  # "gone": an extra since removed
    assert dev.extras_to_install(before, "d2", dev.DEMO_EXTRAS, KNOWN) == {
        "dev",
        "spark",
        "postgres",
    }


def test_an_old_or_broken_stamp_means_install() -> None:
    for old in ("3f2a9c" * 10 + "abcd", "", "[1, 2]", "{"):
        assert dev.extras_to_install(old, "d1", dev.DEMO_EXTRAS, KNOWN) == {"postgres"}


def test_dev_sink_adds_the_spark_extra_and_runs_txactors_sink() -> None:
    """The README's sink block after the quickstart: `dev.py sink` brings pyspark itself."""
    assert "spark" in dev.SINK_EXTRAS
    after_demo = stamp("d1", *dev.DEMO_EXTRAS)
    assert dev.extras_to_install(after_demo, "d1", dev.SINK_EXTRAS, KNOWN) == {"postgres", "spark"}
    assert dev.sink_command(["run", "--once"]) == [dev.tool("txactors"), "sink", "run", "--once"]


def test_dev_demo_runs_the_transfer_demo_unless_another_is_named() -> None:
    assert dev.demo_command([]) == ["-m", "apps.transfer"]
    assert dev.demo_command(["--faults", "none"]) == ["-m", "apps.transfer", "--faults", "none"]
    assert dev.demo_command(["orders", "--orders", "5"]) == ["-m", "apps.orders", "--orders", "5"]
    assert dev.demo_command(["transfer"]) == ["-m", "apps.transfer"]


def test_dev_demo_given_no_demo_name_suggests_the_closest_one() -> None:
    """`dev.py demo order` ran the transfer demo with a stray `order`: now it says `orders`,
    before any install."""
    with pytest.raises(ValueError, match=r"no demo named 'order'; did you mean 'orders'\?"):
        dev.demo_command(["order", "--orders", "5"])
    with pytest.raises(ValueError, match="the demos: transfer, orders"):
        dev.demo_command(["pingpang"])
    result = subprocess.run(
        [sys.executable, "dev.py", "demo", "order"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("error: no demo named 'order'; did you mean 'orders'?")


def test_dev_test_runs_a_set_in_parallel_then_its_serial_tests_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(dev.WORKERS_ENV, "3")
    pytest_ = dev.tool("pytest")
    [parallel, alone] = dev.test_commands(["unit"])
    assert parallel[0] == pytest_ and parallel[-1] == "tests/unit"
    assert parallel[1:3] == ["-n", "3"] and parallel[5:7] == ["-m", "not serial"]
    assert alone == [pytest_, "-m", "serial", "tests/unit"]
    assert [cmd[-1] for cmd in dev.test_commands([])] == ["not serial", "serial"], "everything"
    as_typed = ["tests/unit/test_wait.py", "-x"]
    assert dev.test_commands(as_typed) == [[pytest_, *as_typed]], "a file or flags: one plain run"
    monkeypatch.delenv(dev.WORKERS_ENV)
    assert dev.test_commands(["unit"])[0][1:3] == ["-n", "0"], "by default: one at a time"
