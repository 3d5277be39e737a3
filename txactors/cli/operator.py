"""What the operator commands (`txn`, `dlq`, `lease`) share: their common options, one
exchange with NATS that turns refusals into exit codes, a yes/no question and table printing."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from txactors.actors.loop import run as run_on_loop
from txactors.cli.exits import answer_in_json, say_error
from txactors.observe.logs import configure_logging

if TYPE_CHECKING:
    import msgspec
    from nats.aio.client import Client

T = TypeVar("T")
S = TypeVar("S", bound="msgspec.Struct")

JsonOption = Annotated[
    bool,
    typer.Option("--json", help="Print JSON, for scripts (errors too).", callback=answer_in_json),
]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
NatsUrlOption = Annotated[
    str | None, typer.Option(help="The NATS server. Default: NATS_URL (one is required).")
]


def admin_call(
    url: str | None, work: Callable[[Client], Awaitable[T]], *, server: str | None = None
) -> T:
    """One exchange with the server (and the coordinators, for `txn`); exit 1 when it
    refuses, 2 when it cannot be asked. `server` names the server in errors (default: the
    coordinators')."""
    from txactors.errors import ConfigError, NatsConnectError
    from txactors.ops import (
        CommandError,
        CoordinatorsRunning,
        CoordinatorUnavailable,
        DeadLetterError,
        NoLeases,
        admin_session,
    )
    from txactors.ops.txn import COORDINATORS_SERVER

    # Operator output stays clean; connection trouble is reported once, below.
    configure_logging(default="ERROR")

    async def run() -> T:
        async with admin_session(url, server=server or COORDINATORS_SERVER) as nc:
            return await work(nc)

    try:
        return run_on_loop(run())
    except CommandError as exc:
        say_error(exc.message, exc.code)
        raise typer.Exit(1) from exc
    except (DeadLetterError, CoordinatorsRunning) as exc:
        say_error(str(exc))
        raise typer.Exit(1) from exc
    except (ConfigError, NatsConnectError, CoordinatorUnavailable, NoLeases) as exc:
        say_error(str(exc))
        raise typer.Exit(2) from exc


def ask_yes(question: str) -> bool:
    """Ask on stderr; only `y` or `yes` is a yes."""
    # Not typer.confirm: click's prompt writes a space to stdout, which would spoil --json.
    typer.echo(question, nl=False, err=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def print_one(value: S, as_json: bool, render: Callable[[S], object]) -> None:
    """One thing found: its JSON for scripts, else `render`'s view of it."""
    from txactors.ops import to_json

    if as_json:
        typer.echo(to_json(value))
    else:
        print_rich(render(value))


def print_rich(renderable: object) -> None:
    """Print to a terminal at its width; into a pipe or file, wide enough not to wrap rows
    (`consoles.py`)."""
    from txactors.cli.consoles import console

    console().print(renderable)
