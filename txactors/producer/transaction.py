"""`Transaction`: one transaction id, any number of sends, exactly one decision.

The rules a caller can rely on, all checked locally before anything is sent:
- the first send prepares without a token and keeps the coordinator's; later sends carry it;
- a transaction is decided once: ending again with the same decision retries an end that
  was not confirmed (or returns the result), a different decision is refused;
- after a failed send (refused, unconfirmed, or cancelled while its prepare was out) the
  transaction can only roll back: committing part of what the caller meant to send would
  break all-or-nothing. A commit is refused, leaving it unknown rolls it back, and if it is
  never ended (dropped, abandoned, its end lost) this producer answers its check-back
  ROLLBACK whatever the checker says, for as long as it remembers the failure
  (`failed_sends`);
- a send can be started without waiting (`start_send`): its prepare is out while the caller
  does its local work, and awaited just before the local commit, which must not happen
  unless every send was confirmed;
- a transaction that sent nothing ends without a request;
- an end is acknowledged (`EndMode.ACK`, the default: the result says the state reached) or
  one-way (`EndMode.ONEWAY`: published without waiting, the result is unconfirmed and the
  check-back settles an end that was lost);
- from its first prepare until its end is answered, a check-back for it is answered UNKNOWN
  by this producer (see `inflight`), so the checker never judges a local transaction that
  is still running; given up on (the block cancelled or timed out, a send cancelled, the
  object dropped), it is the checker's at once, unless a send of it failed (above).

Used as `async with producer.begin() as txn:`, leaving the block normally commits and an
exception rolls back. Do the local database work *inside* the block, so it commits before
the messages do: the block's exit is the commit of the messages.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import structlog

from txactors.errors import ConfigError, PrepareFailed, TransactionStateError, TxActorsError
from txactors.observe import logs, tracing
from txactors.observe.logs import get_logger
from txactors.producer.client import CoordinatorClient
from txactors.producer.inflight import LocalCommit
from txactors.producer.message import TxMessage
from txactors.wire.protocol import Decision, OutgoingMessage

log = get_logger(__name__)


class EndMode(enum.StrEnum):
    """How a transaction's end reaches the coordinator."""

    ACK = "ack"
    """A request: `end()` returns once the coordinator applied it (for a commit: every message
    published), with the state reached, and raises `EndRefused` if it was refused."""
    ONEWAY = "oneway"
    """A publish without a reply subject (RocketMQ's `endTransactionOneway`): `end()` returns
    at once, unconfirmed. A lost or refused end is settled by the check-back, answered from
    the decision this producer keeps (or, once forgotten, by the checker)."""


@dataclass(frozen=True, slots=True)
class TransactionResult:
    """How a transaction ended, as far as this producer knows."""

    txid: str
    seqs: tuple[int, ...]
    """TXN_HALF sequences of the half messages, in send order."""
    local_state: Decision
    """What the producer decided (the local transaction's result)."""
    state: str | None
    """The coordinator's state after the end (e.g. `committed`, `rolled_back`, `prepared`
    after UNKNOWN); None when no end was confirmed: the end was one-way, did not reach the
    coordinator (the check-back settles it), or nothing was sent."""

    @property
    def confirmed(self) -> bool:
        return self.state is not None


class Transaction:
    """Sends and ends one transaction; get one from `TransactionProducer.begin()`."""

    def __init__(
        self,
        client: CoordinatorClient,
        txid: str | None = None,
        *,
        end_mode: EndMode = EndMode.ACK,
    ) -> None:
        self.txid = txid or client.new_txid()
        self.end_mode = end_mode
        self._client = client
        # One request at a time: the first send fixes the token, and an end waits for a send
        # still in flight. Needed when tasks share a transaction. Uncontended, asyncio's lock
        # takes no event-loop turn and, unlike anyio's, looks up no backend per transaction.
        self._lock = asyncio.Lock()
        self._token: str | None = None
        self._seqs: list[int] = []
        self._failed_send: str | None = None
        """Why a send failed. Kept as text: the exception's traceback holds this object,
        and a cycle would keep a dropped transaction in flight until the next GC."""
        self._decision: Decision | None = None
        self._result: TransactionResult | None = None
        self._context_tokens: Mapping[str, contextvars.Token[Any]] = {}
        self._context_bound = False
        """Log lines carry txid and group already (in the block, or `logging_context`)."""
        found = client.tracer()
        self._span = (
            None if found is None else tracing.start_transaction(self.txid, client.group, found)
        )
        self._span_scope: AbstractContextManager[None] | None = None
        self._span_topics: set[str] = set()

    def __repr__(self) -> str:
        return f"<Transaction {self.txid} {self._decision or 'open'}, {len(self._seqs)} sent>"

    @property
    def seqs(self) -> tuple[int, ...]:
        return tuple(self._seqs)

    @property
    def result(self) -> TransactionResult | None:
        """How it ended; None until an end completed."""
        return self._result

    async def send(self, message: TxMessage | Sequence[TxMessage]) -> tuple[int, ...]:
        """Store one or more half messages (any topics); returns their TXN_HALF sequences.

        Raises `PrepareFailed` if the coordinator did not confirm them; the transaction can
        then only roll back, and its check-back is answered ROLLBACK (see `failed_sends`).
        """
        messages, outgoing = self._outgoing(message)
        async with self._lock:
            return await self._prepare(messages, outgoing)

    async def _send_alone(self, message: TxMessage | Sequence[TxMessage]) -> tuple[int, ...]:
        """`send` for a transaction no other task can reach (`send_in_transaction`'s): its
        lock would never be contended, so it is not taken."""
        messages, outgoing = self._outgoing(message)
        return await self._prepare(messages, outgoing)

    def _outgoing(
        self, message: TxMessage | Sequence[TxMessage]
    ) -> tuple[list[TxMessage], list[OutgoingMessage]]:
        """The messages to send, and their wire forms (carrying the span's context)."""
        if isinstance(message, TxMessage):
            messages, outgoing = [message], [message.to_outgoing()]
        else:
            messages = list(message)
            if not messages:
                raise ConfigError("send() needs at least one TxMessage")
            outgoing = [m.to_outgoing() for m in messages]
        if self._span is not None:
            self._span_topics.update(m.topic for m in messages)
            self._span.set_attribute("txactors.topics", sorted(self._span_topics))
            for half in outgoing:
                tracing.inject(self._span, half.properties)
        return messages, outgoing

    async def _prepare(
        self, messages: list[TxMessage], outgoing: list[OutgoingMessage]
    ) -> tuple[int, ...]:
        """The prepare itself, the transaction's lock held (or needless)."""
        self._check_sendable()
        # From here until the end, a check-back for it is answered UNKNOWN.
        self._client.in_flight.add(self.txid, self)
        try:
            prepared = await self._client.prepare(self.txid, outgoing, self._token)
        except PrepareFailed as error:
            self._fail_send(str(error))
            tracing.fail(self._span, error)
            raise
        except BaseException as error:
            # Cancelled while the prepare was out: halves may exist, and nobody is at
            # work on it any more (whoever holds the traceback is not).
            self._fail_send(f"interrupted by {type(error).__name__}")
            self._client.in_flight.discard(self.txid)
            raise
        self._token = self._token or prepared.token
        self._seqs.extend(prepared.seqs)
        if logs.enabled(logging.DEBUG):  # the line's arguments cost too
            log.debug(
                "transaction_prepared",
                txid=self.txid,
                seqs=prepared.seqs,
                topics=_topics(messages),
            )
        return tuple(prepared.seqs)

    def start_send(self, message: TxMessage | Sequence[TxMessage]) -> asyncio.Task[tuple[int, ...]]:
        """`send` without waiting: the prepare goes out now, and the caller does its local
        work meanwhile. Await the task (it gives the sequences, or raises as `send` does)
        before the local commit: commit locally only once it succeeded, else roll back.

        Sends started together go out one after another, in order. Cancelling the task, or
        the task awaiting it, is a failed send (the transaction can only roll back). Left
        unawaited, the send still completes and an end waits for it; a block given up on
        meanwhile leaves the transaction to the checker, or to a rollback if the send fails.
        """
        self._check_sendable()
        task = asyncio.get_running_loop().create_task(self.send(message))
        _SENDING.add(task)
        task.add_done_callback(_sent)
        return task

    def local_commit(self) -> LocalCommit:
        """For a caller that makes the local commit itself and calls `begin()` on the result
        just before it: a last check-back that finds the transaction still in flight then
        rolls it back (and `begin()` raises `RolledBackByCheck`) instead of answering
        UNKNOWN, which would discard it (see `inflight`)."""
        return self._client.in_flight.local_commit(self.txid)

    def _check_sendable(self) -> None:
        if self._decision is not None:
            raise TransactionStateError(
                f"transaction {self.txid} already ended ({self._decision}); "
                "start a new one to send more",
                txid=self.txid,
            )
        if self._failed_send is not None:
            raise TransactionStateError(
                f"an earlier send of transaction {self.txid} failed ({self._failed_send}); "
                "roll it back",
                txid=self.txid,
            )

    def _fail_send(self, reason: str) -> None:
        """From now on it may only roll back, here and in the check-back: recorded before
        anyone can drop or abandon it."""
        self._failed_send = reason
        self._client.failed_sends.add(self.txid, reason)

    async def commit(self) -> TransactionResult:
        return await self.end(Decision.COMMIT)

    async def rollback(self) -> TransactionResult:
        return await self.end(Decision.ROLLBACK)

    async def leave_unknown(self) -> TransactionResult:
        """End with UNKNOWN: the coordinator keeps the transaction and the check-back (the
        group's checker) decides it later. Use it when the local outcome is not known yet.

        After a failed send it rolls back instead (logged): whatever the local outcome, only
        part of the messages could be committed, so there is nothing left to decide."""
        return await self.end(Decision.UNKNOWN)

    async def end(self, decision: Decision) -> TransactionResult:
        """End with `decision`. If the end does not reach the coordinator the result is
        unconfirmed (logged, not raised); `EndRefused` if the coordinator said no. After a
        failed send, COMMIT is refused and UNKNOWN rolls back (see `leave_unknown`)."""
        if self._context_bound:  # inside the block: its lines carry txid and group already
            async with self._lock:
                return await self._end(decision)
        with self.logging_context():
            async with self._lock:
                return await self._end(decision)

    async def _end(self, decision: Decision) -> TransactionResult:
        """The end itself, the transaction's lock held (or needless: `send_in_transaction`)."""
        if self._failed_send is not None and decision is Decision.UNKNOWN:
            log.warning(
                "transaction_unknown_rolled_back",
                reason=self._failed_send,
                hint="a send failed, so only a rollback keeps it all-or-nothing",
            )
            decision = Decision.ROLLBACK
        if self._decision is not None and decision is not self._decision:
            raise TransactionStateError(
                f"transaction {self.txid} already ended with {self._decision}; "
                f"it cannot {decision} now",
                txid=self.txid,
            )
        if self._failed_send is not None and decision is Decision.COMMIT:
            raise TransactionStateError(
                f"a send of transaction {self.txid} failed ({self._failed_send}), so "
                "committing would deliver only part of it; roll it back",
                txid=self.txid,
            )
        if self._result is not None and (self._result.confirmed or self._token is None):
            return self._result
        self._decision = decision
        try:
            self._result = await self._send_end(decision)
        except BaseException as error:
            self._finish_span(error)
            raise
        finally:
            self._client.in_flight.discard(self.txid)
        if self._span is not None:  # tracing on, and not finished yet
            self._finish_span()
        return self._result

    async def _send_end(self, decision: Decision) -> TransactionResult:
        if self._token is None:
            # Nothing confirmed. After a failed send halves may exist even so: their
            # check-back is answered ROLLBACK from `failed_sends`.
            state = None
        elif self.end_mode is EndMode.ONEWAY:
            await self._client.end_oneway(self.txid, self._token, decision)
            state = None
        else:
            ended = await self._client.end(self.txid, self._token, decision)
            state = ended.state if ended is not None else None
            if state is not None and self._failed_send is not None:
                self._client.failed_sends.forget(self.txid)  # rolled back: nobody will ask
        result = TransactionResult(self.txid, tuple(self._seqs), decision, state)
        if logs.enabled(logging.INFO):
            log.info(
                "transaction_ended",
                local_state=decision,
                state=state,
                confirmed=result.confirmed,
                end_mode=self.end_mode,
                messages=len(self._seqs),
            )
        return result

    async def __aenter__(self) -> Self:
        self._context_tokens = structlog.contextvars.bind_contextvars(
            txid=self.txid, group=self._client.group
        )
        self._context_bound = True
        if self._span is not None:  # tracing on: nothing to enter otherwise
            self._span_scope = self.traced()
            self._span_scope.__enter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        interruption = exc
        try:
            if self._decision is None and exc is None:
                await self.commit()
            elif self._decision is None and isinstance(exc, Exception):
                if not (isinstance(exc, PrepareFailed) and exc.txid == self.txid):
                    tracing.fail(self._span, exc)  # a failed send of its own is recorded
                try:
                    await self.rollback()
                except TxActorsError as error:  # never hide the caller's exception
                    log.error("rollback_failed", error=repr(error), cause=repr(exc))
        except BaseException as error:  # the end itself was cancelled or interrupted
            interruption = error
            raise
        finally:
            # However the block was left (cancelled, timed out, interrupted, or its end was):
            # without a completed end nobody is at work on it any more.
            if self._result is None:
                self._abandon(interruption)
            if self._span_scope is not None:
                self._span_scope.__exit__(None, None, None)
                self._span_scope = None  # it holds this transaction: no cycle to outlive it
            structlog.contextvars.reset_contextvars(**self._context_tokens)
            self._context_bound = False

    def _abandon(self, cause: BaseException | None) -> None:
        """Work on it stopped without a completed end: it is no longer in flight, so a
        check-back asks the checker. Undecided, it is left UNKNOWN without a request:
        whether the local work committed is not known here. After a failed send that does
        not matter: it is ROLLBACK (still without a request; a `rollback()` may send it),
        and the check-back is answered ROLLBACK from `failed_sends`, not by the checker."""
        self._client.in_flight.discard(self.txid)
        if self._decision is None:
            self._decision = Decision.UNKNOWN if self._failed_send is None else Decision.ROLLBACK
            log.warning(
                "transaction_interrupted",
                error=repr(cause),
                messages=len(self._seqs),
                decision=self._decision,
                failed_send=self._failed_send,
            )
        self._finish_span(cause)

    @contextmanager
    def traced(self) -> Iterator[None]:
        """Make the transaction's span current (when tracing is on), so the local
        transaction's own spans nest in it; an error escaping before the end ends it."""
        with tracing.current(self._span):
            try:
                yield
            except BaseException as error:
                self._finish_span(error)  # nothing to do if the end already finished it
                raise

    def _finish_span(self, error: BaseException | None = None) -> None:
        """End the transaction's span once, at its first end (a retried end is outside it)."""
        span, self._span = self._span, None
        if span is None:  # tracing off, or finished already
            return
        attributes: dict[str, str | int] = {
            "txactors.decision": str(self._decision),
            "txactors.messages": len(self._seqs),
        }
        if self._result is not None:
            attributes["txactors.state"] = self._result.state or "unconfirmed"
        tracing.fail(span, error)
        tracing.finish(span, attributes)

    @contextmanager
    def logging_context(self) -> Iterator[None]:
        """Log lines meanwhile carry txid and group; bound once (≈ 3 µs a bind), so an end
        inside the block or inside `send_in_transaction` binds nothing again."""
        if self._context_bound:
            yield
            return
        self._context_bound = True
        try:
            with structlog.contextvars.bound_contextvars(txid=self.txid, group=self._client.group):
                yield
        finally:
            self._context_bound = False


_SENDING: set[asyncio.Task[tuple[int, ...]]] = set()
"""Started sends, held until done: the event loop keeps only weak references to tasks."""


def _sent(task: asyncio.Task[tuple[int, ...]]) -> None:
    """A started send is done: let it go, and mark its failure as seen (the transaction
    recorded it; whoever awaits the task gets it too)."""
    _SENDING.discard(task)
    if not task.cancelled():
        task.exception()


def _topics(messages: list[TxMessage]) -> list[str]:
    return sorted({m.topic for m in messages})
