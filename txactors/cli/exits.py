"""How every command line of ours ends: a failure an operator can fix is one line on stderr
and an exit code, never a traceback (`txactors`, and the demos' own commands). Every error
line reads `error: …`; a command given `--json` answers its errors in JSON too."""

from __future__ import annotations

import json
import sys
from contextvars import ContextVar
from typing import Final, NoReturn

import typer

from txactors.errors import ConfigError, NatsServerError

# The parser's own errors (a bad or unknown flag): click's ClickException, which typer vendors.
_ParserError: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"
)


_json_answers: ContextVar[bool] = ContextVar("txactors_json_answers", default=False)


def answer_in_json(on: bool) -> bool:
    """`--json`'s callback: from here on, this command's errors are JSON as well."""
    _json_answers.set(on)
    return on


def say_error(message: str, code: str | None = None) -> None:
    """An error as the command's answer: `error: [code: ]message` on stderr; under `--json`,
    `{"error": message, "code": code}` on stdout, where a script reads the answer."""
    text = " ".join(message.split())
    if _json_answers.get():
        typer.echo(json.dumps({"error": text, "code": code}))
    else:
        typer.echo(f"error: {code}: {text}" if code else f"error: {text}", err=True)


def run_cli(command_line: typer.Typer) -> NoReturn:
    """Run `command_line`; each failure an operator can fix is one line on stderr, no traceback.

    Exit 2: a bad flag, environment variable, config file or setting. Exit 1: NATS could not be
    reached (or its embedded server not started). Anything else is a bug: it keeps its traceback.
    """
    # Before parsing: a bad flag next to --json is answered in JSON too.
    _json_answers.set("--json" in sys.argv[1:])
    try:
        code = typer.main.get_command(command_line).main(standalone_mode=False)
    except typer.Abort:
        _fail("aborted", 1)
    except Exception as error:
        known = _operator_error(error)
        if known is None:
            raise
        _fail(*known)
    sys.exit(code if isinstance(code, int) else 0)


def _operator_error(error: BaseException) -> tuple[str, int] | None:
    """What to tell the operator about `error` and the exit code, if it is theirs to fix."""
    import nats.errors

    from txactors.errors import NatsConnectError

    if isinstance(error, BaseExceptionGroup):  # raised out of a task group
        return next(filter(None, map(_operator_error, error.exceptions)), None)
    if isinstance(error, _ParserError):
        context = getattr(error, "ctx", None)  # a UsageError knows its command
        hint = f" (see {context.command_path} --help)" if context is not None else ""
        _in_our_words(error)
        message: str = error.format_message()  # type: ignore[attr-defined]
        return f"{message}{hint}", getattr(error, "exit_code", 2)
    if isinstance(error, ConfigError):
        return str(error), 2
    if isinstance(error, NatsConnectError | NatsServerError):
        return str(error), 1
    if isinstance(error, nats.errors.Error):
        return f"NATS: {error}", 1
    return None


_EXPECTED: Final = {
    "int_parsing": "a whole number",
    "int_from_float": "a whole number",
    "float_parsing": "a number",
    "bool_parsing": "true or false",
}
_BOUNDS: Final = {
    "greater_than_equal": ">=",
    "greater_than": ">",
    "less_than_equal": "<=",
    "less_than": "<",
}


def _in_our_words(error: Exception) -> None:
    """typer checks a value (a type, `min=`, `max=`) with pydantic, and its BadParameter says
    what pydantic said ("Input should be greater than or equal to 1"). Say it as our settings
    do (`expected a whole number, got 'x'`, `must be >= 1, got 0`)."""
    cause = error.__cause__
    errors = getattr(cause, "errors", None)
    if not callable(errors) or not hasattr(error, "message"):
        return
    try:
        first = errors()[0]
        kind, given = first["type"], first.get("input")
    except (IndexError, KeyError, TypeError):
        return
    bounds = first.get("ctx") or {}
    if kind in _EXPECTED:
        error.message = f"expected {_EXPECTED[kind]}, got {given!r}"
    elif kind in _BOUNDS and len(bounds) == 1:
        [limit] = bounds.values()
        error.message = f"must be {_BOUNDS[kind]} {limit}, got {given}"
    elif isinstance(first.get("msg"), str):  # anything else: the gist, not pydantic's voice
        error.message = first["msg"].replace("Input should be", "must be")


def _fail(message: str, code: int) -> NoReturn:
    say_error(message)
    sys.exit(code)
