"""`txactors lease list`: which coordinator owns which partition (txactors/lease_admin.py)."""

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
        typer.Option(help="The coordinators' --partitions: also list the free ones.", min=1),
    ] = None,
    as_json: JsonOption = False,
    url: NatsUrlOption = None,
) -> None:
    """List each partition's lease: owner, revision, last renewal and when it expires."""
    from txactors import admin_views, lease_admin

    leases = admin_call(url, lambda nc: lease_admin.list_leases(nc, partitions=partitions))
    if as_json:
        typer.echo(admin_views.to_json(leases))
    elif leases.leases:
        print_rich(lease_admin.render_leases(leases))
    else:
        typer.echo("no partition is leased: no coordinator is running")
