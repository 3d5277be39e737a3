"""`TransactionProducer`: the producer role of DESIGN §2, behind a small facade.

Two halves with different needs. Sending (prepare, local transaction, end) runs in the
caller's task and talks to the coordinator directly: funnelling it through one actor's
mailbox would allow one transaction in flight per producer. Answering check-backs is done
by actors (`CheckResponder`), which must be running for as long as the producer may owe
the coordinator an answer, hence the `async with`.
"""

from __future__ import annotations

import inspect
import os
import re
import secrets
import socket
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Self

from nats.aio.client import Client

from txactors.errors import ActorDeadError, ConfigError
from txactors.nats.partition_count import PartitionCount, PartitionCountUnknown
from txactors.observe.logs import get_logger
from txactors.producer.checks import Checker, CheckResponder, CheckWorker
from txactors.producer.client import CoordinatorClient
from txactors.producer.failed_sends import FailedSends
from txactors.producer.inflight import InFlight
from txactors.producer.message import TxMessage
from txactors.producer.outcomes import UnconfirmedOutcomes
from txactors.producer.transaction import EndMode, Transaction, TransactionResult
from txactors.wire.layout import validate_name
from txactors.wire.protocol import Decision

log = get_logger(__name__)

LocalTransaction = Callable[[Any, Any], Awaitable[Decision] | Decision]
"""`(message, arg) -> Decision`, async or plain; `message` is what was passed to
`send_in_transaction` (one TxMessage or the list)."""

DEFAULT_CHECKER_CONCURRENCY = 4
DEFAULT_CHECK_TIMEOUT = 30.0
DEFAULT_PREPARE_RETRIES = 2


def default_instance_id() -> str:
    """host-pid-random: readable in logs, unique across restarts, a valid subject token."""
    raw = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    return re.sub(r"[^A-Za-z0-9_-]", "-", raw)


class TransactionProducer:
    """Sends transactional messages for `group` and answers the group's check-backs.

    `checker` is called when the coordinator asks about a transaction whose end never
    arrived or said UNKNOWN; it should look the transaction up in the local database and
    answer COMMIT, ROLLBACK, or UNKNOWN (ask again later). It is not called for a
    transaction this producer is still working on (prepare, local transaction or end still
    running): that check is answered UNKNOWN; nor for one with a failed send this producer
    remembers (see `failed_sends`): committing it would publish only part of it, so that
    check is answered ROLLBACK. Up to `checker_concurrency` checks run at once, each for at
    most `check_timeout` seconds. The partition count is read where the coordinators publish
    it; `partitions`, if given, is checked against it (`PartitionCountMismatch`).
    `end_mode` says how transactions end by default: `"ack"` waits for the coordinator's
    answer, `"oneway"` publishes the end and goes on (see `EndMode`); `begin(end_mode=...)`
    chooses per transaction. A prepare the coordinator refuses for now, with a retry-after
    hint (it cannot write at the moment), or that nobody received (no coordinator served its
    partition: a handover), is sent again up to `prepare_retries` times, each after waiting at
    least the hint (a second for nobody); then `PrepareFailed.retry_after` says how long to
    wait.
    A producer runs once: enter it a single time.

        async with TransactionProducer(nc, "bank-a", checker) as producer:
            result = await producer.send_in_transaction(message, debit, arg=transfer)
    """

    def __init__(
        self,
        nc: Client,
        group: str,
        checker: Checker,
        *,
        partitions: int | None = None,
        instance: str | None = None,
        request_timeout: float = 5.0,
        checker_concurrency: int = DEFAULT_CHECKER_CONCURRENCY,
        check_timeout: float = DEFAULT_CHECK_TIMEOUT,
        end_mode: EndMode | str = EndMode.ACK,
        prepare_retries: int = DEFAULT_PREPARE_RETRIES,
    ) -> None:
        self.group = validate_name("group", group)
        self.instance = validate_name("instance", instance or default_instance_id())
        if request_timeout <= 0 or check_timeout <= 0:
            raise ConfigError("request_timeout and check_timeout must be positive")
        if prepare_retries < 0:
            raise ConfigError(f"prepare_retries must be 0 or more, not {prepare_retries}")
        self.end_mode = _end_mode(end_mode)
        outcomes = UnconfirmedOutcomes()
        in_flight = InFlight()
        failed_sends = FailedSends()
        self._partitions = PartitionCount(nc, partitions, request_timeout)
        self._client = CoordinatorClient(
            nc,
            group=self.group,
            instance=self.instance,
            partitions=self._partitions,
            request_timeout=request_timeout,
            outcomes=outcomes,
            in_flight=in_flight,
            failed_sends=failed_sends,
            prepare_retries=prepare_retries,
        )
        self._responder = CheckResponder(
            nc,
            group=self.group,
            instance=self.instance,
            worker=lambda: CheckWorker(
                checker, self.group, outcomes, in_flight, failed_sends, check_timeout
            ),
            concurrency=checker_concurrency,
        )
        self._running = False

    def __repr__(self) -> str:
        return f"<TransactionProducer {self.group}/{self.instance}>"

    async def __aenter__(self) -> Self:
        try:  # a count that disagrees is refused before anything runs
            await self._partitions.get()
        except PartitionCountUnknown as error:  # read again by the first transaction
            log.warning("partition_count_unknown", error=str(error))
        await self._responder.__aenter__()
        self._running = True
        log.info("producer_started", group=self.group, instance=self.instance)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._running = False
        try:
            await self._responder.__aexit__(exc_type, exc, tb)
        finally:
            await self._client.close()
        log.info("producer_stopped", group=self.group, instance=self.instance)

    def begin(
        self, *, end_mode: EndMode | str | None = None, txid: str | None = None
    ) -> Transaction:
        """A new transaction: `async with producer.begin() as txn: await txn.send(...)`.

        `end_mode` overrides the producer's for this transaction. `txid` is for a caller
        that derives it (a chained handler, `txactors.app.chain`): it must be new to the
        coordinator, whose first prepare of a txid it holds already is refused (`CONFLICT`);
        by default the producer picks a random one in the partition it fills."""
        if not self._running:
            raise ActorDeadError(
                f"{self!r} is not running (it could not answer check-backs); "
                "use `async with TransactionProducer(...)`"
            )
        mode = self.end_mode if end_mode is None else _end_mode(end_mode)
        if txid is not None:
            validate_name("txid", txid)
        return Transaction(self._client, txid, end_mode=mode)

    async def send_in_transaction(
        self,
        message: TxMessage | Sequence[TxMessage],
        local_transaction: LocalTransaction,
        arg: Any = None,
    ) -> TransactionResult:
        """Prepare `message`, run `local_transaction(message, arg)`, end with its Decision.

        An exception in the local transaction, or a result that is not a Decision, counts
        as UNKNOWN (logged): the check-back decides. Raises `PrepareFailed`, without running
        the local transaction, if the halves were not confirmed; `EndRefused` if the
        coordinator refused the end. An end that does not reach the coordinator is logged
        and gives an unconfirmed result. Cancelled or timed out before its end, the
        transaction is left UNKNOWN without a request, and the checker answers its
        check-back from then on.

        The local transaction commits on its own, so it runs only once the prepare is
        confirmed; to overlap the two, commit yourself: `TxLog.send_in_transaction`, or a
        `begin()` block with `start_send`. With the one-way end mode, the end is
        published and not waited for.
        """
        # The block owns the transaction's fate: a failed prepare rolls back (nothing to
        # send; remembered for the check-back), and a cancellation or timeout anywhere in
        # it leaves the transaction to the checker at once.
        # Nobody else can reach `txn`: its lock would never be contended, so it is not taken.
        async with self.begin() as txn:
            await txn._send_alone(message)
            return await txn._end(await _run_local(local_transaction, message, arg))


def _end_mode(value: EndMode | str) -> EndMode:
    try:
        return EndMode(value)
    except ValueError:
        modes = ", ".join(repr(m.value) for m in EndMode)
        raise ConfigError(f"end_mode must be one of {modes}, not {value!r}") from None


async def _run_local(local_transaction: LocalTransaction, message: Any, arg: Any) -> Decision:
    try:
        outcome: object = local_transaction(message, arg)
        if isinstance(outcome, Decision):  # the usual answer, and no awaitable
            return outcome
        if inspect.isawaitable(outcome):
            outcome = await outcome
    except Exception:
        log.exception("local_transaction_failed", hint="ending UNKNOWN; the check-back decides")
        return Decision.UNKNOWN
    if not isinstance(outcome, Decision):
        log.error(
            "local_transaction_bad_result",
            result=repr(outcome),
            hint="return a Decision; ending UNKNOWN, the check-back decides",
        )
        return Decision.UNKNOWN
    return outcome
