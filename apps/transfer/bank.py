"""A bank's books, the same schema in both banks' databases (SQLite file or PostgreSQL schema).

- `accounts`: the balance, and the opening balance it was seeded with, so reconciliation can
  prove every movement since then;
- `transfers`: money sent, one row per transfer with the transaction id that carried it;
- `credits`: money received, one row per application of a transfer (deliberately not unique
  on the transfer, so reconciliation would *see* a double credit, not a constraint error).

Alipay's database also holds the `alipay` group's transaction log (`Sender`), which answers
its check-backs. The log's row, the debit and the transfer row are one local transaction;
so are the message-apply record, the credit row and the balance update
(`Database.apply_once`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from apps.common.db import Database, Tx
from apps.transfer.messages import Transfer

ALIPAY = "alipay"
YUEBAO = "yuebao"

SCHEMA = [
    "CREATE TABLE IF NOT EXISTS accounts (id TEXT PRIMARY KEY, balance BIGINT NOT NULL "
    "CHECK (balance >= 0), opening BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS transfers (id TEXT PRIMARY KEY, txid TEXT NOT NULL UNIQUE, "
    "source TEXT NOT NULL, target TEXT NOT NULL, amount BIGINT NOT NULL, "
    "created_at DOUBLE PRECISION NOT NULL)",
    "CREATE TABLE IF NOT EXISTS credits (transfer_id TEXT NOT NULL, msg_id TEXT NOT NULL, "
    "account TEXT NOT NULL, amount BIGINT NOT NULL, applied_at DOUBLE PRECISION NOT NULL)",
]


class TransferRefused(ValueError):
    """A transfer that must not happen; nothing was changed or sent."""


class InsufficientFunds(TransferRefused):
    pass


class Bank:
    def __init__(self, db: Database) -> None:
        self.db = db
        self.name = db.name

    async def seed(self, balances: Mapping[str, int]) -> None:
        """Create the tables and open `balances` (cents per account)."""
        await self.db.script(SCHEMA)
        async with self.db.transaction() as tx:
            for account, balance in balances.items():
                await tx.execute(
                    "INSERT INTO accounts (id, balance, opening) VALUES (?, ?, ?)",
                    account,
                    balance,
                    balance,
                )

    async def has_accounts(self) -> bool:
        """Whether the bank was seeded (its tables exist and hold an account)."""
        try:
            return int(await self.db.fetchval("SELECT COUNT(*) FROM accounts")) > 0
        except Exception:  # no table yet: sqlite3.OperationalError / asyncpg's UndefinedTable
            return False

    async def has_account(self, account: str) -> bool:
        return await self.db.fetchval("SELECT 1 FROM accounts WHERE id = ?", account) is not None

    async def balance(self, account: str) -> int | None:
        value = await self.db.fetchval("SELECT balance FROM accounts WHERE id = ?", account)
        return None if value is None else int(value)

    async def debit(self, tx: Tx, transfer: Transfer, txid: str) -> None:
        """Debit the source and record the transfer under `txid`, in the caller's
        transaction; raises (the caller rolls back) InsufficientFunds when the balance does
        not cover it."""
        changed = await tx.execute(
            "UPDATE accounts SET balance = balance - ? WHERE id = ? AND balance >= ?",
            transfer.amount,
            transfer.source,
            transfer.amount,
        )
        if changed != 1:
            raise InsufficientFunds(
                f"account {transfer.source} in {self.name} cannot cover "
                f"¥{transfer.amount / 100:,.2f}"
            )
        await tx.execute(
            "INSERT INTO transfers (id, txid, source, target, amount, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            transfer.id,
            txid,
            transfer.source,
            transfer.target,
            transfer.amount,
            transfer.created_at,
        )

    async def credit(self, tx: Tx, transfer: Transfer, msg_id: str) -> None:
        """Credit the target and record it, in the caller's transaction."""
        changed = await tx.execute(
            "UPDATE accounts SET balance = balance + ? WHERE id = ?",
            transfer.amount,
            transfer.target,
        )
        if changed != 1:  # raised, it rolls back and the consumer retries (then dead-letters)
            raise LookupError(f"no account {transfer.target} in {self.name}")
        await tx.execute(
            "INSERT INTO credits (transfer_id, msg_id, account, amount, applied_at) "
            "VALUES (?, ?, ?, ?, ?)",
            transfer.id,
            msg_id,
            transfer.target,
            transfer.amount,
            time.time(),
        )

    async def totals(self) -> tuple[int, int]:
        """(sum of balances, sum of opening balances), in cents."""
        row = await self.db.fetch(
            "SELECT COALESCE(SUM(balance), 0), COALESCE(SUM(opening), 0) FROM accounts"
        )
        return int(row[0][0]), int(row[0][1])

    async def sent(self) -> dict[str, int]:
        """Amount of every recorded (debited) transfer, by transfer id."""
        return {
            id_: int(amount)
            for id_, amount in await self.db.fetch("SELECT id, amount FROM transfers")
        }

    async def received(self) -> dict[str, list[int]]:
        """The amounts credited for each transfer id, one entry per credit."""
        credits: dict[str, list[int]] = {}
        for transfer_id, amount in await self.db.fetch("SELECT transfer_id, amount FROM credits"):
            credits.setdefault(transfer_id, []).append(int(amount))
        return credits

    async def credited_count(self) -> int:
        return int(await self.db.fetchval("SELECT COUNT(*) FROM credits"))
