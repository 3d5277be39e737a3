"""`txactors lease list`: which coordinator owns which partition (txactors/ops/leases.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from txactors.cli.operator import JsonOption, NatsUrlOption, admin_call, print_rich

app = typer.Typer(
    help="See which coordinator owns which partition (the TXN_LEASE bucket).",
    no_args_is_help=True,
)


@app.command("list")
def lease_list(
    partitions: Annotated[
        int | None,
        typer.Option(
            help="Expect this partition count (an error if the coordinators publish another). "
            "Default: the count they publish. Free partitions are listed too.",
            min=1,
        ),
    ] = None,
    as_json: JsonOption = False,
    url: NatsUrlOption = None,
) -> None:
    """List each partition's lease: owner, revision, last renewal and when it expires."""
    from txactors import ops
    from txactors.ops.leases import render_leases

    leases = admin_call(url, lambda nc: ops.lease_table(nc, partitions=partitions))
    if as_json:
        typer.echo(ops.to_json(leases))
    elif leases.leases:
        print_rich(render_leases(leases))
    else:
        typer.echo("no partition is leased: no coordinator is running")
