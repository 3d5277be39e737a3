"""The local transaction log: check-backs answered from the producer's own database.

One table in the service's database records each local transaction's txid in that very
transaction; the ready checker (`TxLog.check`) decides a check-back by looking the txid up
and, when it is missing, claiming it rolled back under the same key (`decide`), so its
answer can never contradict the local commit. `TxLog.send_in_transaction` does the whole
transactional send in one call. One backend per driver, imported from its module so only
the driver you use must be installed:

    txactors.producer.txlog.sqlite       SqliteTxLog      aiosqlite (always installed)
    txactors.producer.txlog.pg_asyncpg   AsyncpgTxLog     the `postgres` extra
    txactors.producer.txlog.pg_psycopg   PsycopgTxLog     the `psycopg` extra
    txactors.producer.txlog.alchemy      SqlAlchemyTxLog  the `sqlalchemy` / `mysql` extras
"""

from txactors.errors import RolledBackByCheck
from txactors.producer.txlog.decide import COMMITTED, ROLLED_BACK
from txactors.producer.txlog.log import OpenLocal, TxLog, Work
from txactors.producer.txlog.retention import CLOCK_MARGIN, retention_age, schedule_span
from txactors.producer.txlog.schema import CREATE_INDEX, CREATE_TABLE, TABLE

__all__ = [
    "CLOCK_MARGIN",
    "COMMITTED",
    "CREATE_INDEX",
    "CREATE_TABLE",
    "ROLLED_BACK",
    "TABLE",
    "OpenLocal",
    "RolledBackByCheck",
    "TxLog",
    "Work",
    "retention_age",
    "schedule_span",
]
