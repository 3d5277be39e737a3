"""`txactors txn`: operators list, show and resolve the transactions a running coordinator
holds (the work is in txactors/ops/txn.py; these functions parse, confirm and print)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from txactors.cli.consoles import console
from txactors.cli.exits import say_error
from txactors.cli.operator import JsonOption, YesOption, admin_call, ask_yes, print_one, print_rich

if TYPE_CHECKING:
    from nats.aio.client import Client

    from txactors.ops import Ended, ListTransactions, Resolution, TransactionInfo

app = typer.Typer(
    help="Inspect and resolve transactions held by a running coordinator (`txactors coordinator`).",
    no_args_is_help=True,
)

TxidArgument = Annotated[str, typer.Argument(help="The transaction id.", show_default=False)]
UrlOption = Annotated[
    str | None,
    typer.Option(help="NATS server the coordinator runs on. Default: NATS_URL (one is required)."),
]
PartitionsOption = Annotated[
    int | None,
    typer.Option(
        envvar="TXACTORS_PARTITIONS",
        min=1,
        show_default=False,
        help="Expect this partition count: an error if the coordinators publish another. "
        "Default: the count they publish.",
    ),
]


StateFilter = Annotated[
    list[str] | None,
    typer.Option(help="Only transactions in this state (repeatable), e.g. discarded."),
]
GroupFilter = Annotated[str | None, typer.Option(help="Only transactions of this producer group.")]
TopicFilter = Annotated[
    str | None, typer.Option(help="Only transactions with a message for this topic.")
]
OlderThanFilter = Annotated[
    str | None,
    typer.Option(
        metavar="AGE", help="Only transactions at least this old, e.g. 90s, 10m, 1h30m, 2d."
    ),
]
LimitOption = Annotated[
    int, typer.Option(help="At most this many, oldest first.", min=1, max=100_000)
]


def _filters(
    state: list[str] | None,
    group: str | None,
    topic: str | None,
    older_than: str | None,
    limit: int,
) -> ListTransactions:
    """The coordinator's query for these options; a bad one is a usage error naming it."""
    from txactors.ops import TxnState, transaction_filter
    from txactors.ops import views as admin_views
    from txactors.wire import layout

    states = state or []
    known = [s.value for s in TxnState]
    unknown = [s for s in states if s not in known]
    if unknown:
        raise typer.BadParameter(
            f"{', '.join(unknown)}; states are {', '.join(known)}", param_hint="--state"
        )
    for hint, kind, name in (("--group", "group", group), ("--topic", "topic", topic)):
        problem = None if name is None else layout.name_problem(kind, name)
        if problem is not None:
            raise typer.BadParameter(problem, param_hint=hint)
    try:
        age = None if older_than is None else admin_views.parse_duration(older_than)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--older-than") from None
    return transaction_filter(states=states, group=group, topic=topic, older_than=age, limit=limit)


def _described(where: ListTransactions) -> str:
    """The filters in words, for "no transaction matches (…)"."""
    from txactors.ops.views import human_duration

    parts = [" or ".join(where.states)] if where.states else []
    parts += [f"group {where.group}"] if where.group else []
    parts += [f"topic {where.topic}"] if where.topic else []
    if where.older_than is not None:
        parts.append(f"older than {human_duration(where.older_than)}")
    return ", ".join(parts) or "no filter"


@app.command("list")
def txn_list(
    state: StateFilter = None,
    group: GroupFilter = None,
    topic: TopicFilter = None,
    older_than: OlderThanFilter = None,
    limit: LimitOption = 1000,
    partitions: PartitionsOption = None,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """List open (prepared, checking, being decided) and discarded transactions, oldest first.

    Filters (--state, --group, --topic, --older-than) are applied by the coordinator.
    """
    from txactors import ops as admin
    from txactors.ops import views as admin_views

    where = _filters(state, group, topic, older_than, limit)
    found = admin_call(url, lambda nc: admin.find_transactions(nc, where, partitions=partitions))
    if as_json:
        typer.echo(admin.to_json(found.transactions))
    elif found.transactions:
        print_rich(admin_views.render_list(found.transactions))
    else:
        typer.echo(f"no open or discarded transaction matches ({_described(where)})")
    if found.more:
        typer.echo(f"{found.more} more match: raise --limit or narrow the filters", err=True)


@app.command("show")
def txn_show(
    txid: TxidArgument,
    partitions: PartitionsOption = None,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """Show everything about one open or discarded transaction."""
    from txactors import ops as admin
    from txactors.ops import views as admin_views

    info = admin_call(url, lambda nc: admin.show(nc, txid, partitions=partitions))
    print_one(info, as_json, admin_views.render_detail)


@app.command("resume")
def txn_resume(
    txid: TxidArgument,
    partitions: PartitionsOption = None,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """Put a discarded or pending transaction back to prepared, with a fresh check count.

    The checker then asks its producer again; nothing is published by this command.
    """
    from txactors.ops import Resolution

    _decide(Resolution.RESUME, url, txid, partitions, True, as_json)  # decides nothing: no question


@app.command("commit")
def txn_commit(
    txid: TxidArgument,
    yes: YesOption = False,
    partitions: PartitionsOption = None,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """Commit a transaction by hand: its messages are published to their topics.

    Commit only what the producer's local transaction committed (check its database first).
    """
    from txactors.ops import Resolution

    _decide(Resolution.COMMIT, url, txid, partitions, yes, as_json)


@app.command("rollback")
def txn_rollback(
    txid: TxidArgument,
    yes: YesOption = False,
    partitions: PartitionsOption = None,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """Roll a transaction back by hand: none of its messages is ever delivered."""
    from txactors.ops import Resolution

    _decide(Resolution.ROLLBACK, url, txid, partitions, yes, as_json)


_DECIDING_ONE: dict[str, tuple[str, str]] = {
    "commit": ("commit", "publishes its messages to their topics"),
    "rollback": ("roll back", "means none of its messages is delivered"),
}
"""Resolution -> how the question about one transaction names it, and what it does."""
_EFFECTS: dict[str, str] = {
    "resume": "puts them back to prepared: the checker asks their producers again",
    "commit": "publishes their messages to their topics",
    "rollback": "means none of their messages is ever delivered",
}


@app.command("resolve")
def txn_resolve(
    commit: Annotated[bool, typer.Option("--commit", help="Commit each one.")] = False,
    rollback: Annotated[bool, typer.Option("--rollback", help="Roll each one back.")] = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Resume each one (fresh check count).")
    ] = False,
    state: StateFilter = None,
    group: GroupFilter = None,
    topic: TopicFilter = None,
    older_than: OlderThanFilter = None,
    limit: LimitOption = 1000,
    yes: YesOption = False,
    partitions: PartitionsOption = None,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """Resume, commit or roll back every transaction the filters match, e.g. all discarded ones
    of a group: shows them, asks (unless --yes), then prints each one's outcome.

    At least one filter is required. Exit 1 if any of them failed (the others are done).
    """
    from txactors import ops as admin
    from txactors.ops import views as admin_views

    flags = {
        admin.Resolution.RESUME: resume,
        admin.Resolution.COMMIT: commit,
        admin.Resolution.ROLLBACK: rollback,
    }
    chosen = [resolution for resolution, on in flags.items() if on]
    if len(chosen) != 1:
        raise typer.BadParameter("give exactly one of --commit, --rollback, --resume")
    [resolution] = chosen
    if not (state or group or topic or older_than):
        raise typer.BadParameter(
            "give at least one of --state, --group, --topic, --older-than (every open "
            "transaction at once is too easy to regret)"
        )
    where = _filters(state, group, topic, older_than, limit)
    found = admin_call(url, lambda nc: admin.find_transactions(nc, where, partitions=partitions))
    if not found.transactions:
        typer.echo(f"no transaction matches ({_described(where)}): nothing to do", err=True)
        if as_json:
            typer.echo("[]")
        return
    console(stderr=True).print(admin_views.render_list(found.transactions))
    if found.more:
        typer.echo(f"{found.more} more match beyond --limit {limit}: not touched", err=True)
    count = len(found.transactions)
    question = f"{resolution.value.capitalize()} these {count} transaction(s)? "
    if not yes and not ask_yes(f"{question}This {_EFFECTS[resolution]} [y/N] "):
        typer.echo("not done: nothing was changed", err=True)
        raise typer.Exit(1)
    batch = admin.new_batch_id()
    txids = [info.txid for info in found.transactions]
    results = admin_call(
        url,
        lambda nc: admin.resolve_all(nc, txids, resolution, partitions=partitions, batch=batch),
    )
    failed = [r for r in results if r.error is not None]
    if as_json:
        typer.echo(admin.to_json(results))
    else:
        for result in results:
            if result.error is None:
                typer.echo(f"{result.txid}: {result.state}")
            else:
                say_error(f"{result.txid}: {result.error}")
    typer.echo(
        f"{batch}: {len(results) - len(failed)} done, {len(failed)} failed "
        "(the coordinator logs each as operator_action with this batch)",
        err=True,
    )
    if failed:
        raise typer.Exit(1)


def _decide(
    resolution: Resolution,
    url: str | None,
    txid: str,
    partitions: int | None,
    yes: bool,
    as_json: bool,
) -> None:
    """Resolve one transaction by hand, once the operator said yes (or --yes)."""
    from txactors import ops as admin

    if not yes:
        _confirm(url, txid, partitions, *_DECIDING_ONE[resolution])
    ended = admin_call(url, lambda nc: admin.decide(nc, txid, resolution, partitions=partitions))
    _print_ended(ended, as_json)


def _confirm(url: str | None, txid: str, partitions: int | None, action: str, effect: str) -> None:
    """Show what is about to be decided (on stderr, so --json output stays clean) and ask."""
    from txactors import ops as admin
    from txactors.ops import CommandError
    from txactors.ops import views as admin_views

    async def find(nc: Client) -> TransactionInfo | str:
        try:
            return await admin.show(nc, txid, partitions=partitions)
        except CommandError as exc:
            return exc.message

    found = admin_call(url, find)
    if isinstance(found, str):
        typer.echo(f"note: {found}", err=True)
    else:
        console(stderr=True).print(admin_views.render_detail(found))
    if not ask_yes(f"{action.capitalize()} transaction {txid}? This {effect} [y/N] "):
        typer.echo(f"not done: {txid} was left as it is", err=True)
        raise typer.Exit(1)


def _print_ended(ended: Ended, as_json: bool) -> None:
    from txactors.ops import to_json

    typer.echo(to_json(ended) if as_json else f"{ended.txid}: {ended.state}")
