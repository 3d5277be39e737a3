"""What the PostgreSQL backends (asyncpg, psycopg) share: DDL lock, durable commits, and
which errors mean "cannot answer now".

Each transaction that writes a row of the log commits with `synchronous_commit = on`,
whatever the server, database, role or session default: a commit with `off` or `local`
returns before its WAL is flushed, and a power cut could then take back a local commit whose
message went out. The row's INSERT sets it for its own transaction (`set_config(..., true)`,
which is `SET LOCAL`), so it costs no round trip of its own, and a user's transaction that
`record`s a txid is durable too. PostgreSQL reads the setting when the transaction commits.
"""

from __future__ import annotations

import zlib
from typing import Final

from txactors.producer.txlog.schema import APPLIED_TABLE, TABLE

DDL_LOCK: Final = zlib.crc32(b"txactors." + TABLE.encode())
"""Advisory lock serializing CREATE TABLE IF NOT EXISTS, which races with itself across
sessions (a unique violation on the catalog)."""
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


def durable_insert(values: str) -> str:
    """The INSERT of a log row from `values` (the driver's four placeholders) that also sets
    `synchronous_commit = on` for its transaction: one statement, one round trip."""
    return (
        "WITH durable AS (SELECT set_config('synchronous_commit', 'on', true)) "
        f"INSERT INTO {TABLE} (producer_group, txid, decision, recorded_at) "
        f"SELECT {values} FROM durable"
    )


def durable_applied_insert(values: str) -> str:
    """The INSERT of an apply record from `values` (the driver's three placeholders), durable
    as `durable_insert`'s (a chained handler that sends nothing writes no log row)."""
    return (
        "WITH durable AS (SELECT set_config('synchronous_commit', 'on', true)) "
        f"INSERT INTO {APPLIED_TABLE} (consumer_group, msg_id, applied_at) "
        f"SELECT {values} FROM durable"
    )
