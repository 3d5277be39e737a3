"""Every coordinator setting is a flag, an environment variable and a config-file key.

Pure tests of `txactors.cli.settings` (no server): the layering, and that a bad value
anywhere is a
ConfigError naming where it came from. tests/integration/test_cli.py runs the real command.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import msgspec
import pytest
import typer
from hypothesis import given
from hypothesis import strategies as st

from txactors.cli import app
from txactors.cli.settings import (
    BY_NAME,
    CONFIG_ENV,
    SETTINGS,
    load_settings,
    markdown_table,
)
from txactors.coordinator.options import CoordinatorOptions
from txactors.errors import ConfigError
from txactors.faults import FAULT_ENV
from txactors.nats.config import DATA_DIR_ENV
from txactors.wire.rules import CoordinatorConfig

ROOT = Path(__file__).resolve().parents[2]


def coordinator_flags() -> set[str]:
    command = typer.main.get_command(app).commands["coordinator"]  # type: ignore[attr-defined]
    return {opt for param in command.params for opt in param.opts}


@pytest.mark.parametrize("owner", [CoordinatorConfig, CoordinatorOptions])
def test_every_field_of_the_coordinator_structs_is_exposed(owner: type[msgspec.Struct]) -> None:
    flags = coordinator_flags()
    for field in msgspec.structs.fields(owner):
        setting = BY_NAME.get(field.name)
        assert setting is not None, f"{owner.__name__}.{field.name} is not a setting"
        assert setting.flag in flags, f"{setting.flag} is not a flag of txactors coordinator"
        assert setting.help, f"{owner.__name__}.{field.name} needs a docstring (its help text)"
        # Its default, written as text in the variable or as the value in a file, reads back.
        text = setting.shown_default
        from_env = load_settings({}, {setting.env: text})
        assert from_env.sources[field.name] == setting.env
        assert getattr(getattr(from_env, _part(owner)), field.name) == setting.default
        with tempfile.TemporaryDirectory() as scratch:
            file = Path(scratch) / "c.toml"
            file.write_text(f"{field.name} = {_toml(setting.default)}\n")
            from_file = load_settings({}, {}, file)
        assert from_file.sources[field.name] == f"{file}: {field.name}"


def _toml(value: object) -> str:
    """A default as a TOML value: JSON's, but a table is written inline (`{}`)."""
    return "{}" if value == {} else msgspec.json.encode(value).decode()


def _part(owner: type[msgspec.Struct]) -> str:
    return {CoordinatorConfig: "config", CoordinatorOptions: "options"}[owner]


def test_setting_names_are_unique_and_their_variables_are_free() -> None:
    assert len(BY_NAME) == len(SETTINGS)
    taken = {CONFIG_ENV, DATA_DIR_ENV, FAULT_ENV, "TXACTORS_NATS_SERVER", "TXACTORS_WAREHOUSE"}
    assert {s.env for s in SETTINGS} & taken == set()


def test_docs_list_every_setting_as_it_is() -> None:
    operations = (ROOT / "docs" / "operations.md").read_text()
    table = markdown_table()
    assert table in operations, (
        "docs/operations.md, section Configuration, must hold exactly this table "
        f"(txactors.cli.settings.markdown_table()):\n{table}"
    )


@given(
    file=st.none() | st.integers(1, 50),
    env=st.none() | st.integers(1, 50),
    flag=st.none() | st.integers(1, 50),
)
def test_flags_win_over_the_environment_over_the_file_over_the_default(
    file: int | None, env: int | None, flag: int | None
) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "c.toml"
        path.write_text("" if file is None else f"check_max = {file}\n")
        environ = {} if env is None else {"TXACTORS_CHECK_MAX": str(env)}
        flags = {"check_max": None if flag is None else str(flag)}
        settings = load_settings(flags, environ, path)
    expected = next((v for v in (flag, env, file) if v is not None), CoordinatorConfig().check_max)
    assert settings.config.check_max == expected


BAD = [
    # (flags, environment, file text, what the message must name)
    ({"check_max": "x"}, {}, "", "--check-max"),
    ({"lease_ttl": "-1"}, {}, "", "--lease-ttl"),
    ({"tick_interval": "inf"}, {}, "", "--tick-interval"),
    ({}, {"TXACTORS_LEASE_TTL": "nan"}, "", "TXACTORS_LEASE_TTL"),
    ({}, {"TXACTORS_CHECK_INTERVAL": "1e999"}, "", "TXACTORS_CHECK_INTERVAL"),
    ({}, {"TXACTORS_PARTITIONS": "1.5"}, "", "TXACTORS_PARTITIONS"),
    ({"partitions": "4097"}, {}, "", "--partitions"),
    ({}, {"TXACTORS_CHECK_MAX": "0"}, "", "TXACTORS_CHECK_MAX"),
    ({}, {"TXACTORS_LOG_LEVEL": "LOUD"}, "", "TXACTORS_LOG_LEVEL"),
    ({}, {"TXACTORS_METRICS_PORT": "70000"}, "", "TXACTORS_METRICS_PORT"),
    ({}, {}, "topic_duplicate_window = nan\n", "topic_duplicate_window"),
    ({}, {}, "transaction_timeout = -inf\n", "transaction_timeout"),
    ({}, {}, "half_retention = -1.0\n", "half_retention"),
    ({}, {}, 'check_max = "15"\n', "check_max"),
    ({}, {}, "log_level = 3\n", "log_level"),
    ({}, {}, "chek_max = 3\n", "'chek_max'; did you mean 'check_max'"),
    ({}, {}, "check_max = \n", "not valid TOML"),
    ({"check_interval": "10"}, {"TXACTORS_CHECK_INTERVAL_MAX": "5"}, "", "--check-interval"),
    ({"transaction_timeout": "6x"}, {}, "", "--transaction-timeout: '6x' is not a duration"),
    ({"check_backoff": "2s"}, {}, "", "--check-backoff: expected a number, got '2s'"),
    ({}, {}, 'lease_ttl = "soon"\n', "lease_ttl: 'soon' is not a duration"),
]


@pytest.mark.parametrize(("flags", "environ", "text", "named"), BAD)
def test_a_bad_value_is_refused_naming_where_it_came_from(
    tmp_path: Path, flags: dict[str, str], environ: dict[str, str], text: str, named: str
) -> None:
    path = tmp_path / "coordinator.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(named)) as refused:
        load_settings(flags, environ, path)
    assert "\n" not in str(refused.value)


def test_a_missing_config_file_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"no-such\.toml"):
        load_settings({}, {}, Path("no-such.toml"))


def test_a_struct_rule_names_every_source_it_involves() -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings({"check_interval": "10"}, {"TXACTORS_CHECK_INTERVAL_MAX": "5"})
    assert str(refused.value) == (
        "check_interval_max must be >= check_interval "
        "(set by --check-interval, TXACTORS_CHECK_INTERVAL_MAX)"
    )


def test_an_empty_variable_counts_as_unset() -> None:
    settings = load_settings({}, {"TXACTORS_CHECK_MAX": " "})
    assert settings.config.check_max == CoordinatorConfig().check_max
    assert settings.source("check_max") == "the default"


def test_times_take_a_unit_as_older_than_does(tmp_path: Path) -> None:
    """`--transaction-timeout 6s` as `txn list --older-than 10m`: flags, variables, the file."""
    path = tmp_path / "coordinator.toml"
    path.write_text('half_retention = "3d"\ncheck_interval = 45\n')
    settings = load_settings(
        {"transaction_timeout": "6s", "lease_ttl": "1m 30s"},
        {"TXACTORS_CHECK_INTERVAL_MAX": "1h30m", "TXACTORS_CHECK_ANSWER_TIMEOUT": "2.5"},
        path,
    )
    config, options = settings.config, settings.options
    assert (config.transaction_timeout, options.lease_ttl) == (6.0, 90.0)
    assert (config.check_interval_max, config.check_answer_timeout) == (5400.0, 2.5)
    assert (config.half_retention, config.check_interval) == (3 * 86400.0, 45.0)


def test_every_number_but_the_factors_is_a_time() -> None:
    """A new `float` setting is a time unless named a factor: this list says which are."""
    times = {setting.name for setting in SETTINGS if setting.is_duration}
    assert times == {
        "transaction_timeout",
        "max_immunity",
        "check_interval",
        "check_interval_max",
        "check_answer_timeout",
        "half_retention",
        "tick_interval",
        "checkpoint_interval",
        "topic_duplicate_window",
        "lease_ttl",
        "leader_balance_interval",
        "write_linger",
        "fsync_interval",
    }
    assert {BY_NAME[name].metavar for name in times} == {"DURATION"}
