"""`txactors protocol asyncapi`: the wire protocol, machine-readable (txactors/asyncapi/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="Describe the wire protocol for clients in other languages.", no_args_is_help=True
)


@app.command("asyncapi")
def protocol_asyncapi(
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write the document here instead of stdout."),
    ] = None,
) -> None:
    """Print the AsyncAPI 3.0 document (JSON) of every subject, message and header."""
    from txactors import asyncapi

    text = asyncapi.render()
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text, encoding="utf-8")
        typer.echo(f"wrote {output}", err=True)
