"""Proving the books of both banks after a run: nothing lost, nothing invented, nothing twice.

From the databases alone: each bank's balances moved exactly by its recorded transfers and
credits, money is conserved across both banks, every transfer alipay debited was credited
exactly once (same amount) by yuebao, and nothing was credited that alipay did not debit
(a rolled-back, refused or discarded transfer). With a NATS connection, also the pipeline:
every committed message on `transfers` matches a debit and vice versa, no transaction is
left open or discarded, nothing was dead-lettered. A demo adds what it planned
(`Expectation`s: which transfers must end committed, which never) and, as tallies that are
reported but never a mismatch, how its transfers ended and what its faults did.

`book_checks` is the verdict on the books alone, a pure function of what the databases hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client

from apps.common.drain import pipeline_checks
from apps.common.report import Check, Reconciliation, Tally
from apps.transfer.bank import Bank
from apps.transfer.messages import RECEIVER_GROUP, SENDER_GROUP, TOPIC, Transfer
from txactors.coordinator.partition.recovery import read_subject
from txactors.wire import layout

APP = "transfer"


@dataclass(frozen=True, slots=True)
class Expectation:
    """Transfers `ids` (one scenario of a run) must all end committed, or all never apply."""

    scenario: str
    ids: Sequence[str]
    committed: bool


@dataclass(frozen=True, slots=True)
class Books:
    """What both banks' databases hold, as reconciliation reads it."""

    sent: Mapping[str, int]
    """Amount of every recorded (debited) transfer in alipay, by transfer id."""
    received: Mapping[str, list[int]]
    """The amounts yuebao credited for each transfer id, one entry per credit."""
    alipay: tuple[int, int]
    """(sum of balances, sum of opening balances), in cents."""
    yuebao: tuple[int, int]

    @classmethod
    async def read(cls, alipay: Bank, yuebao: Bank) -> Books:
        return cls(
            sent=await alipay.sent(),
            received=await yuebao.received(),
            alipay=await alipay.totals(),
            yuebao=await yuebao.totals(),
        )


async def reconcile(
    alipay: Bank,
    yuebao: Bank,
    *,
    nc: Client | None = None,
    expectations: Sequence[Expectation] = (),
    tallies: Sequence[Tally] = (),
) -> Reconciliation:
    books = await Books.read(alipay, yuebao)
    checks = book_checks(books, expectations)
    if nc is not None:
        checks += await _pipeline_checks(nc, books.sent)
    return Reconciliation(app=APP, checks=checks, tallies=[*tallies])


def book_checks(books: Books, expectations: Sequence[Expectation] = ()) -> list[Check]:
    """The books, exactly once, and each planned scenario: every row a mismatch if wrong."""
    sent, received = books.sent, books.received
    (a_balance, a_opening), (b_balance, b_opening) = books.alipay, books.yuebao
    once = {id_ for id_, amount in sent.items() if received.get(id_) == [amount]}
    checks = [
        Check(
            section="books",
            name="alipay: money out = recorded transfers",
            expected=sum(sent.values()),
            actual=a_opening - a_balance,
            money=True,
        ),
        Check(
            section="books",
            name="yuebao: money in = recorded credits",
            expected=sum(sum(amounts) for amounts in received.values()),
            actual=b_balance - b_opening,
            money=True,
        ),
        Check(
            section="books",
            name="money in both banks (conserved)",
            expected=a_opening + b_opening,
            actual=a_balance + b_balance,
            money=True,
        ),
        Check(
            section="exactly once",
            name="debited in alipay → credited once in yuebao",
            expected=len(sent),
            actual=len(once),
        ),
        Check(
            section="exactly once",
            name="credited twice or more",
            expected=0,
            actual=sum(len(amounts) > 1 for amounts in received.values()),
        ),
        Check(
            section="exactly once",
            name="credited with another amount than debited",
            expected=0,
            actual=sum(
                id_ in sent and any(a != sent[id_] for a in amounts)
                for id_, amounts in received.items()
            ),
        ),
        Check(
            section="exactly once",
            name="credited, never debited (rolled back / refused)",
            expected=0,
            actual=len(received.keys() - sent.keys()),
        ),
    ]
    for expectation in expectations:
        if expectation.committed:
            name, actual = "committed, credited once", sum(i in once for i in expectation.ids)
            expected = len(expectation.ids)
        else:
            # The count is of transfers debited or credited (none may be), not of the
            # scenario's transfers: said in the name, or 0 reads as "none happened".
            name, expected = "rolled back, transfers debited or credited", 0
            actual = sum(i in sent or i in received for i in expectation.ids)
        checks.append(
            Check(
                section="scenarios",
                name=f"{expectation.scenario}: {name}",
                expected=expected,
                actual=actual,
            )
        )
    return checks


async def _pipeline_checks(nc: Client, sent: Mapping[str, int]) -> list[Check]:
    js = nc.jetstream()
    published: list[str] = []
    async for msg in read_subject(js, layout.topic_stream(TOPIC), layout.topic_filter(TOPIC), 1):
        published.append(msgspec.msgpack.decode(msg.data, type=Transfer).id)
    return [
        Check(
            section="pipeline",
            name="committed messages without a debit",
            expected=0,
            actual=sum(id_ not in sent for id_ in published),
        ),
        Check(
            section="pipeline",
            name="debits without a committed message",
            expected=0,
            actual=len(sent.keys() - set(published)),
        ),
        *await pipeline_checks(nc, SENDER_GROUP, [(TOPIC, RECEIVER_GROUP)]),
    ]
