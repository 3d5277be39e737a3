"""`txactors partitions`: show the partition count the coordinators publish, or change it with
every coordinator stopped (txactors/ops/partitions.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from txactors.cli.operator import JsonOption, NatsUrlOption, YesOption, admin_call, ask_yes

app = typer.Typer(
    help="The partition count the coordinators publish (key partitions of KV bucket TXN_META).",
    no_args_is_help=True,
)


@app.command("show")
def partitions_show(as_json: JsonOption = False, url: NatsUrlOption = None) -> None:
    """Print the published partition count (every producer and operator command uses it)."""
    from txactors import ops

    count = admin_call(url, ops.partition_count)
    if as_json:
        typer.echo("null" if count is None else str(count))
    elif count is None:
        typer.echo("no partition count is published: no coordinator has run on this server")
    else:
        typer.echo(str(count))


@app.command("set")
def partitions_set(
    partitions: Annotated[int, typer.Argument(help="The new partition count.", min=1)],
    yes: YesOption = False,
    url: NatsUrlOption = None,
) -> None:
    """Change the partition count, with every coordinator stopped (refused while one runs).

    First settle every transaction (`txactors txn list` shows none) and stop the producers;
    then stop the coordinators, run this, and start them with the new --partitions. Needs
    credentials that may write the coordinators' TXN_META bucket.
    """
    from txactors import ops

    if not yes and not ask_yes(
        f"Set the partition count to {partitions}? Transactions still open stay where the old "
        "count put them, out of every coordinator's reach [y/N] "
    ):
        typer.echo("not done: the count was left as it is", err=True)
        raise typer.Exit(1)
    before = admin_call(url, lambda nc: ops.change_partition_count(nc, partitions))
    was = "none" if before is None else str(before)
    typer.echo(f"partition count {partitions} (was {was}): start the coordinators with it")


PartitionsOption = Annotated[
    int | None,
    typer.Option(
        help="Expect this partition count (an error if the coordinators publish another). "
        "Default: the count they publish.",
        min=1,
    ),
]


@app.command("list")
def partitions_list(
    partitions: PartitionsOption = None, as_json: JsonOption = False, url: NatsUrlOption = None
) -> None:
    """List each partition: its owner and the server it is connected to, its log stream's
    leader and replicas current, and its open and discarded transactions."""
    from txactors.cli.operator import print_rich
    from txactors.ops import list_partitions, to_json
    from txactors.ops.placement import render_partitions

    table = admin_call(url, lambda nc: list_partitions(nc, partitions=partitions))
    if as_json:
        typer.echo(to_json(table))
    else:
        print_rich(render_partitions(table))


@app.command("balance")
def partitions_balance(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only say which leaders would move.")
    ] = False,
    partitions: PartitionsOption = None,
    as_json: JsonOption = False,
    url: NatsUrlOption = None,
) -> None:
    """Move the partitions' log stream leaders so that no server leads more than its share
    (as `nats stream cluster balance` does; the coordinators also do it every
    --leader-balance-interval). Nothing moves while a log has a replica not current.
    Exit 1 when a move failed or nothing could be planned for that reason."""
    from txactors.ops import balance_partitions, to_json
    from txactors.ops.placement import render_balance

    report = admin_call(
        url, lambda nc: balance_partitions(nc, partitions=partitions, dry_run=dry_run)
    )
    if as_json:
        typer.echo(to_json(report))
    else:
        typer.echo(render_balance(report, dry_run=dry_run))
    if report.failed or report.waiting:
        raise typer.Exit(1)
