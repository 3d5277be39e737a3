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
