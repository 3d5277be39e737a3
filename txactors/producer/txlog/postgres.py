"""What the PostgreSQL backends (asyncpg, psycopg) share: DDL lock, durable commits, and
which errors mean "cannot answer now".

Each transaction of the log runs with `SET LOCAL synchronous_commit = on`, whatever the
server, database or role default: a commit with `off` or `local` returns before its WAL is
flushed, and a power cut could then take back a local commit whose message went out.
"""

from __future__ import annotations

import zlib
from typing import Final

from txactors.producer.txlog.schema import TABLE

DDL_LOCK: Final = zlib.crc32(b"txactors." + TABLE.encode())
"""Advisory lock serializing CREATE TABLE IF NOT EXISTS, which races with itself across
sessions (a unique violation on the catalog)."""
DURABLE: Final = "SET LOCAL synchronous_commit = on"
UNIQUE_VIOLATION: Final = "23505"
_TRANSIENT: Final = (
    "08",  # connection exception
    "40",  # transaction rollback: serialization failure, deadlock
    "53",  # insufficient resources
    "57",  # operator intervention: shutdown, query canceled (statement_timeout)
    "55P03",  # lock not available (lock_timeout)
)


def is_transient(error: BaseException) -> bool:
    """Whether `error` means the database cannot answer now, rather than a bug."""
    if isinstance(error, OSError | TimeoutError):
        return True
    sqlstate = getattr(error, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate.startswith(_TRANSIENT)
