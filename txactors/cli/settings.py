"""Every setting of `txactors coordinator`: from flags, the environment or a TOML file.

The settings are the fields of three Structs, each beside what it governs and checking its
own values: CoordinatorConfig (a transaction's rules, `wire/rules.py`, shared with producers),
CoordinatorOptions (how the coordinator process runs, `coordinator/options.py`) and
ProcessSettings (what the command itself adds, below). This module only says where a value
comes from, which is the command's concern, not the coordinator's. The settings are derived
from those fields, not listed again: a field added to one of them is at once a flag
(`--check-max`), an environment variable (`TXACTORS_CHECK_MAX`) and a key of the config file
(`check_max`), with the field's docstring as its help.

Flags win over the environment, the environment over the file, the file over the default. A
bad value is a ConfigError that says where it came from; nothing is dropped or altered.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import itertools
import math
import re
import textwrap
import tomllib
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import msgspec

from txactors.coordinator.options import CoordinatorOptions
from txactors.embedded.setup import FsyncSetting
from txactors.errors import ConfigError
from txactors.observe.logs import level_number
from txactors.ops.views import parse_duration
from txactors.wire.rules import CoordinatorConfig

ENV_PREFIX = "TXACTORS_"
CONFIG_ENV = "TXACTORS_CONFIG"
"""The config file, when `--config` is not given."""


class ProcessSettings(FsyncSetting, frozen=True, kw_only=True):
    """What the `txactors coordinator` process needs beside the coordinator's own settings:
    the embedded server's `FsyncSetting`, and these."""

    metrics_port: int | None = None
    """Serve Prometheus metrics on http://0.0.0.0:PORT/metrics (off when unset)."""
    log_level: str = "INFO"
    """Least level of the log lines written to stderr: DEBUG, INFO, WARNING, ERROR, CRITICAL."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be in 1..65535, got {self.metrics_port}")
        level_number(self.log_level, source="log_level")


S = TypeVar("S", bound=msgspec.Struct)

OWNERS: tuple[type[msgspec.Struct], ...] = (CoordinatorConfig, CoordinatorOptions, ProcessSettings)

_KINDS: dict[Any, str] = {
    int: "a whole number",
    float: "a number",
    str: "text",
    bool: "true or false",
}
_METAVARS: dict[Any, str] = {int: "INTEGER", float: "NUMBER", str: "TEXT", bool: "BOOLEAN"}
NOT_DURATIONS: frozenset[str] = frozenset({"check_backoff", "check_jitter"})
"""The number settings that are factors; every other `float` one is a time, in seconds, and
takes a unit as `txn list --older-than` does (`6s`, `10m`, `1h30m`, `3d`)."""


@dataclass(frozen=True, slots=True)
class Setting:
    """One field of one of the OWNERS, and the ways an operator sets it."""

    name: str
    owner: type[msgspec.Struct]
    type: Any
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def is_duration(self) -> bool:
        return self.type is float and self.name not in NOT_DURATIONS

    @property
    def metavar(self) -> str:
        if self.is_duration:
            return "DURATION"
        return " | ".join(_metavar(kind) for kind in _kinds_of(self.type))

    @property
    def shown_default(self) -> str:
        if self.default is None:
            return "unset"
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return str(self.default)

    def from_text(self, text: str, where: str) -> Any:
        """A value given as text (a flag, an environment variable): "15", "0.5", "nan"…, a
        time with a unit ("6s", "10m"); a table (`group_topics`) as JSON."""
        if get_origin(self.type) is dict:
            try:
                return self._checked(msgspec.json.decode(text), where, strict=True)
            except msgspec.DecodeError:
                raise ConfigError(f"{where}: expected a JSON object, got {text!r}") from None
        if self.is_duration and _has_a_unit(text):
            return self._checked(_seconds(text, where), where, strict=False)
        return self._checked(text, where, strict=False)

    def from_file(self, value: Any, where: str) -> Any:
        """A value of a TOML file, which is typed already: 15, 0.5, nan, "INFO"; a time may be
        a string with a unit ("3d")."""
        if self.is_duration and isinstance(value, str):
            return self._checked(_seconds(value, where), where, strict=True)
        return self._checked(value, where, strict=True)

    def _checked(self, raw: Any, where: str, *, strict: bool) -> Any:
        try:
            value = msgspec.convert(raw, self.type, strict=strict)
        except msgspec.ValidationError:
            kinds = " or ".join(_kind_name(kind) for kind in _kinds_of(self.type))
            raise ConfigError(f"{where}: expected {kinds}, got {raw!r}") from None
        # Every number here is a count, a port, a duration or a factor: none may be negative,
        # and NaN or infinity would pass the Structs' own `<` checks unnoticed.
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{where}: must be a finite number, got {raw!r}")
            if value < 0:
                raise ConfigError(f"{where}: must not be negative, got {raw!r}")
        return value


def _has_a_unit(text: str) -> bool:
    """Not a plain number ("6", "0.5", "nan", "1e999" keep the number's own checks)."""
    try:
        float(text)
    except ValueError:
        return True
    return False


def _seconds(text: str, where: str) -> float:
    try:
        return parse_duration(text)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def _kinds_of(annotation: Any) -> list[Any]:
    """`int | None` -> [int]: what a value may be when it is given at all."""
    if get_origin(annotation) in (Union, types.UnionType):
        return [arg for arg in get_args(annotation) if arg is not type(None)]
    return [annotation]


def _kind_name(kind: Any) -> str:
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(map(str, get_args(kind)))
    if get_origin(kind) is dict:
        return "a table of lists of text"
    return _KINDS.get(kind, str(kind))


def _metavar(kind: Any) -> str:
    if get_origin(kind) is Literal:
        return "|".join(map(str, get_args(kind)))
    if get_origin(kind) is dict:
        return "JSON"
    return _METAVARS.get(kind, "VALUE")


def _field_docs(owner: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it), which Python does not keep; a
    field a base Struct defines (`FsyncSetting`) has the base's."""
    docs: dict[str, str] = {}
    for cls in reversed(owner.__mro__):
        if not issubclass(cls, msgspec.Struct) or cls is msgspec.Struct:
            continue
        [node] = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
        assert isinstance(node, ast.ClassDef)
        for field, doc in itertools.pairwise(node.body):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
            ):
                docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


def _settings_of(*owners: type[msgspec.Struct]) -> tuple[Setting, ...]:
    found: list[Setting] = []
    for owner in owners:
        docs = _field_docs(owner)
        for field in msgspec.structs.fields(owner):
            default = (
                field.default_factory()
                if field.default is msgspec.NODEFAULT and field.default_factory is not None
                else field.default
            )
            found.append(Setting(field.name, owner, field.type, default, docs.get(field.name, "")))
    return tuple(found)


SETTINGS = _settings_of(*OWNERS)
BY_NAME = {setting.name: setting for setting in SETTINGS}


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    """The settings a `txactors coordinator` runs with, and where each came from."""

    config: CoordinatorConfig
    options: CoordinatorOptions
    process: ProcessSettings
    sources: Mapping[str, str]
    """Setting name -> the flag, variable or file line that set it (absent: the default)."""

    def source(self, name: str) -> str:
        return self.sources.get(name, "the default")


def load_settings(
    flags: Mapping[str, str | None],
    environ: Mapping[str, str],
    config_file: Path | None = None,
) -> CoordinatorSettings:
    """Flags (None: not given) over `environ` over `config_file` over the defaults.

    An empty environment variable counts as unset, as for the NATS_* variables.
    """
    chosen: dict[str, tuple[Any, str]] = {}  # name -> (value, where it came from)
    if config_file is not None:
        for key, raw in read_config_file(config_file).items():
            where = f"{config_file}: {key}"
            chosen[key] = (BY_NAME[key].from_file(raw, where), where)
    for setting in SETTINGS:
        text = environ.get(setting.env, "").strip()
        if text:
            chosen[setting.name] = (setting.from_text(text, setting.env), setting.env)
    for name, flag in flags.items():
        if flag is not None:
            setting = BY_NAME[name]
            chosen[name] = (setting.from_text(flag, setting.flag), setting.flag)
    return CoordinatorSettings(
        config=_build(CoordinatorConfig, chosen),
        options=_build(CoordinatorOptions, chosen),
        process=_build(ProcessSettings, chosen),
        sources={name: where for name, (_, where) in chosen.items()},
    )


def read_config_file(path: Path) -> dict[str, Any]:
    """The settings of a TOML file: top-level keys named as the settings (`check_max = 15`)."""
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except OSError as error:
        raise ConfigError(f"config file {path}: {error.strerror}") from error
    except ValueError as error:  # TOMLDecodeError, or bytes that are not UTF-8
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from error
    for key in data:
        if key not in BY_NAME:
            close = difflib.get_close_matches(key, BY_NAME, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see `txactors coordinator --help`"
            raise ConfigError(f"config file {path}: unknown setting {key!r}; {hint}")
    return data


def _build(owner: type[S], chosen: Mapping[str, tuple[Any, str]]) -> S:
    values = {s.name: chosen[s.name][0] for s in SETTINGS if s.owner is owner and s.name in chosen}
    try:
        return owner(**values)
    except (ValueError, TypeError) as error:
        # The Struct's own check names fields; say where the operator set those.
        wheres = [chosen[name][1] for name in values if re.search(rf"\b{name}\b", str(error))]
        by = f" (set by {', '.join(wheres)})" if wheres else ""
        raise ConfigError(f"{error}{by}") from None


def markdown_table() -> str:
    """The settings as docs/operations.md lists them; a test keeps the two the same."""
    rows = [
        "| file key | flag | environment | default | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for setting in SETTINGS:
        meaning = setting.help.replace("|", "\\|")
        rows.append(
            f"| `{setting.name}` | `{setting.flag}` | `{setting.env}` "
            f"| {setting.shown_default} | {meaning} |"
        )
    return "\n".join(rows)
