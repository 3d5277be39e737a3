"""`txactors lease list`: which coordinator owns which partition (txactors/ops/leases.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from txactors.cli.operator import JsonOption, NatsUrlOption, admin_call, print_rich

if TYPE_CHECKING:
    from nats.aio.client import Client

    from txactors.ops.leases import LeaseTable

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
    from txactors.ops import leases as lease_admin
    from txactors.ops import views as admin_views

    leases = admin_call(url, lambda nc: _leases(nc, partitions))
    if as_json:
        typer.echo(admin_views.to_json(leases))
    elif leases.leases:
        print_rich(lease_admin.render_leases(leases))
    else:
        typer.echo("no partition is leased: no coordinator is running")


async def _leases(nc: Client, partitions: int | None) -> LeaseTable:
    """The lease table, a row for every partition of the published count (or `partitions`)."""
    from txactors.nats.partition_count import agreed_count, read_published
    from txactors.ops import leases as lease_admin
    from txactors.ops.txn import ADMIN_TIMEOUT

    published = await read_published(nc, ADMIN_TIMEOUT)
    return await lease_admin.list_leases(nc, partitions=agreed_count(published, partitions))
