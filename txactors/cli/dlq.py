"""`txactors dlq`: list, show and replay the dead letters of consumer groups
(the work is in txactors/ops/dlq.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from txactors.cli.exits import say_error
from txactors.cli.operator import (
    JsonOption,
    NatsUrlOption,
    YesOption,
    admin_call,
    ask_yes,
    print_one,
    print_rich,
)

if TYPE_CHECKING:
    from nats.aio.client import Client

T = TypeVar("T")

app = typer.Typer(
    help="Inspect and replay dead letters: messages a consumer group gave up on (DLQ_<group>).",
    no_args_is_help=True,
)

GroupArgument = Annotated[str, typer.Argument(help="The consumer group.", show_default=False)]


def _call(url: str | None, work: Callable[[Client], Awaitable[T]]) -> T:
    """`admin_call`, naming the DLQ streams' server in errors: no coordinator is involved."""
    from txactors.ops.dlq import DLQ_SERVER

    return admin_call(url, work, server=DLQ_SERVER)


@app.command("list")
def dlq_list(
    group: Annotated[
        str | None,
        typer.Argument(help="The consumer group. Without it: every group's DLQ and its size."),
    ] = None,
    start: Annotated[int, typer.Option("--from", help="First DLQ sequence to show.", min=1)] = 1,
    limit: Annotated[int, typer.Option(help="At most this many entries.", min=1)] = 100,
    as_json: JsonOption = False,
    url: NatsUrlOption = None,
) -> None:
    """List a group's dead letters, oldest first (or, without GROUP, the groups that have some)."""
    from txactors import ops as dlq_admin
    from txactors.ops import dlq_views

    if group is None:
        summaries = _call(url, dlq_admin.dlq_summaries)
        if as_json:
            typer.echo(dlq_admin.to_json(summaries))
        elif summaries:
            print_rich(dlq_views.render_summaries(summaries))
        else:
            typer.echo("no dead-letter streams on this server")
        return
    page = _call(url, lambda nc: dlq_admin.list_dead_letters(nc, group, start=start, limit=limit))
    if as_json:
        typer.echo(dlq_admin.to_json(page))
    elif page.entries:
        print_rich(dlq_views.render_list(page))
    else:
        typer.echo(f"no dead letters of group {group} from seq {start} on")


@app.command("show")
def dlq_show(
    group: GroupArgument,
    seq: Annotated[int, typer.Argument(help="The entry's DLQ sequence.", min=1)],
    as_json: JsonOption = False,
    url: NatsUrlOption = None,
) -> None:
    """Show one dead letter in full: the error, every header and the body."""
    from txactors import ops as dlq_admin
    from txactors.ops import dlq_views

    entry = _call(url, lambda nc: dlq_admin.show_dead_letter(nc, group, seq))
    print_one(entry, as_json, dlq_views.render_detail)


@app.command("replay")
def dlq_replay(
    group: GroupArgument,
    seqs: Annotated[
        list[int] | None, typer.Argument(help="DLQ sequences to replay.", show_default=False)
    ] = None,
    replay_all: Annotated[
        bool, typer.Option("--all", help="Replay every entry now in the DLQ.")
    ] = False,
    yes: YesOption = False,
    as_json: JsonOption = False,
    url: NatsUrlOption = None,
) -> None:
    """Publish dead letters again to their topics, for GROUP only, and delete them from the DLQ.

    Fix the cause first: a replayed message that fails again is dead-lettered again. A replay
    repeated soon after (the entry was not deleted) is dropped by the topic stream. Exit 1 if
    any entry could not be replayed (it stays in the DLQ).
    """
    from txactors import ops as dlq_admin
    from txactors.ops import dlq_views

    if bool(seqs) == replay_all:
        raise typer.BadParameter("give the DLQ sequences to replay, or --all (not both)")
    if replay_all:
        wanted = _call(url, lambda nc: dlq_admin.all_sequences(nc, group))
        if not wanted:
            typer.echo(f"no dead letters of group {group}: nothing to replay", err=True)
            if as_json:
                typer.echo("[]")
            return
        question = f"Replay all {len(wanted)} dead letter(s) of group {group} to their topics? "
        if not yes and not ask_yes(f"{question}[y/N] "):
            typer.echo("not done: nothing was replayed", err=True)
            raise typer.Exit(1)
    else:
        wanted = list(seqs or [])
    results = _call(url, lambda nc: dlq_admin.replay(nc, group, wanted))
    if as_json:
        typer.echo(dlq_admin.to_json(results))
    else:
        for result in results:
            if result.error is None:
                typer.echo(dlq_views.replay_line(result, group))
            else:
                say_error(result.error)
    if any(result.error is not None for result in results):
        raise typer.Exit(1)
