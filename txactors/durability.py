"""What a SQLite commit needs to be on disk when it returns.

Shared by the consumer's `apply_once_sqlite` (a commit acked to the bus) and the producer's
SQLite transaction log (a row a check-back reads): both must survive a power cut right after
the commit. The common WAL-with-NORMAL is not durable; with a rollback journal FULL does not
sync the journal's deletion, so a power cut can bring the journal back and undo the commit
(tests/integration/test_powercut.py shows both).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import aiosqlite

SQLITE_FULL: Final = 2  # PRAGMA synchronous: 0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA
SQLITE_EXTRA: Final = 3


async def sqlite_durable(conn: aiosqlite.Connection) -> None:
    """The least `synchronous` level at which a commit is on disk when it returns: FULL in WAL
    mode, EXTRA with a rollback journal. A higher level is kept.

    Looked at on every call: it costs two pragma reads, and a connection's owner may change it.
    """
    cursor = await conn.execute("PRAGMA journal_mode")
    mode = await cursor.fetchone()
    needed = SQLITE_FULL if mode is not None and str(mode[0]).lower() == "wal" else SQLITE_EXTRA
    cursor = await conn.execute("PRAGMA synchronous")
    row = await cursor.fetchone()
    if row is None or row[0] < needed:
        await conn.execute(f"PRAGMA synchronous={needed}")
