"""The command-line flags both demos share, with the same names and defaults.

    --concurrency 16   --faults all   --seed 7
    --db sqlite        --data-dir ~/.local/share/txactors/<demo> (or under $XDG_DATA_HOME)
    --db postgres      --pg-dsn postgresql://postgres@127.0.0.1:5432/test  --pg-prefix <demo>_

Each demo adds only its own count (`--transfers`, `--orders`). The databases stay after a
run (so they can be inspected); the next run empties them and starts clean on NATS too.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer

from apps.common.db import DEFAULT_PG_DSN, Storage
from apps.common.faults import DEFAULT_FAULTS, Fault, parse_faults
from txactors.nats.config import DATA_DIR_ENV
from txactors.nats.connect import NatsSession

DEFAULT_CONCURRENCY = 16
DEFAULT_SEED = 7


class Backend(enum.StrEnum):
    SQLITE = "sqlite"
    POSTGRES = "postgres"


Concurrency = Annotated[int, typer.Option(min=1, help="Operations (and handlers) in flight.")]
Faults = Annotated[
    str,
    typer.Option(help=f"Faults to inject: all, none, or a comma list of {', '.join(Fault)}."),
]
Seed = Annotated[int, typer.Option(help="Seeds the data and which operation gets which fault.")]
Db = Annotated[Backend, typer.Option(help="Where every service keeps its database.")]
DataDir = Annotated[
    Path | None,
    typer.Option(
        help="SQLite: directory of the database files (TXACTORS_DATA_DIR is the embedded "
        "NATS server's store, not theirs).",
        show_default="~/.local/share/txactors/<demo>",
    ),
]
PgDsn = Annotated[str, typer.Option(help="PostgreSQL: the database every service lives in.")]
PgPrefix = Annotated[
    str | None,
    typer.Option(
        help="PostgreSQL: each service gets schema <prefix><service>.", show_default="<demo>_"
    ),
]


def default_data_dir(demo: str, environ: Mapping[str, str] = os.environ) -> Path:
    """The user's own: `$XDG_DATA_HOME/txactors/<demo>`, by default under ~/.local/share. A
    fixed name in the machine's temp directory was shared by every user, who then read each
    other's books or could not write them at all."""
    base = environ.get("XDG_DATA_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "share"
    return root / "txactors" / demo


def where_nats(session: NatsSession) -> str:
    """The demos' line about NATS: where it runs, and for an embedded server where its store
    is (TXACTORS_DATA_DIR, or a temporary one), which is not where the databases are."""
    if session.server is None:
        return f"NATS at {session.url}; coordinator in this process"
    given = os.environ.get(DATA_DIR_ENV, "").strip()
    store = f"store {session.server.data_dir} ({DATA_DIR_ENV})" if given else "temporary store"
    return f"embedded nats-server at {session.url}, {store}; coordinator in this process"


def storage_of(
    demo: str,
    db: Backend,
    data_dir: Path | None = None,
    pg_dsn: str = DEFAULT_PG_DSN,
    pg_prefix: str | None = None,
) -> Storage:
    """Where `demo`'s services keep their databases, from the shared flags."""
    if db is Backend.SQLITE:
        return Storage.sqlite(data_dir or default_data_dir(demo))
    return Storage.postgres(pg_dsn, f"{demo}_" if pg_prefix is None else pg_prefix)


def faults_option(text: str) -> frozenset[Fault]:
    """`--faults`, or typer.BadParameter (one line, exit 2) naming the choices."""
    try:
        return parse_faults(text)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--faults") from error


__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_FAULTS",
    "DEFAULT_PG_DSN",
    "DEFAULT_SEED",
    "Backend",
    "Concurrency",
    "DataDir",
    "Db",
    "Faults",
    "PgDsn",
    "PgPrefix",
    "Seed",
    "storage_of",
    "where_nats",
]
