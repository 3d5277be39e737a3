"""Every exception txactors raises, under one root.

    TxActorsError
    ├── ActorError
    │   ├── ActorDeadError        the actor is stopped (or stopped while your ask waited)
    │   │   └── NotHandled        it stopped with your message still queued: nothing was done
    │   ├── MailboxFull           tell_nowait found the bounded mailbox full
    │   ├── AskTimeout            no reply in time (also a builtin TimeoutError)
    │   └── Escalated*            an actor's failure escalated to its ActorSystem (cause chained)
    ├── CommandError              the actor replied with a protocol Error (code + message)
    ├── ConfigError               a setting or argument is invalid (also a ValueError)
    │   ├── ConfigTypeError       an argument has the wrong type (also a TypeError)
    │   ├── FsyncError*           a bad fsync setting; `field` names it (txactors.embedded.setup)
    │   ├── PartitionCountMismatch*  a partition count disagrees with the published one
    │   ├── PartitionCountInvalid*   the published count is no count (or above 4096)
    │   └── PartitionCountUnknown*   no partition count is published (or it is unreadable)
    ├── PoisonMessage             no retry can help this message: dead-letter it at once
    ├── TransactionError          a transactional send went wrong (carries the txid)
    │   ├── PrepareFailed         the halves were not stored; the local transaction did not run
    │   ├── EndRefused            the coordinator refused the end (conflict, forbidden, …)
    │   ├── TransactionStateError this Transaction cannot do that now (ended, or a send failed)
    │   └── RolledBackByCheck     a check-back claimed the txid first: the local transaction
    │                             must roll back (txactors.producer.txlog)
    ├── CoordinatorUnavailable*   no coordinator answered an admin command (txactors.ops.txn)
    ├── DeadLetterError*          a dead letter cannot be read or replayed (txactors.ops.dlq)
    ├── NoLeases*                 no coordinator has run on this server (txactors.ops.leases)
    ├── CoordinatorsRunning*      the partition count cannot change now (txactors.ops.partitions)
    ├── ScrapeFailed*             a metrics endpoint could not be read (txactors.ops.top)
    ├── StepdownRefused*          a log's leader could not be moved (coordinator.cluster.placement)
    ├── CoordinatorStateError*    the coordinator's table was fed an impossible event (a bug)
    ├── FencedOut*                another coordinator wrote this partition's op log: stop
    ├── LinkLost*                 the connection dropped while a JetStream call waited
    ├── ReadLoopDied*             nats-py's read loop ended while connected (also a nats error)
    ├── NatsConnectError          the configured NATS server could not be reached
    │   └── NatsConnectionLost    the connection closed for good while a role served on it
    └── NatsServerError           the embedded nats-server could not be run
        ├── NatsServerNotFound    no nats-server binary
        ├── PortInUse             the port is taken
        ├── DataDirNotWritable    the JetStream store directory cannot be written
        ├── DataDirLocked         another server runs on that data directory
        └── ServerExitedEarly     the process died before it was ready (log tail attached)

* defined beside the code that raises it (txactors.actors, the admin modules,
  txactors.coordinator, txactors.nats.client, txactors.nats.partition_count,
  txactors.embedded.setup). Two never leave the coordinator: `nats.link.WriteNotAcked` (a
  write that did not land, caught by the writers) and `coordinator.boundary._Refused` are
  control flow; they derive from TxActorsError all the same.
  Nor does `producer.txlog.decide.LogUnavailable` leave the check-back: it is answered UNKNOWN.

Callers catch the precise class they can act on; `TxActorsError` catches them all. An error
raised in a task group leaves it as itself, not inside an `ExceptionGroup` (`ungrouped`), so
that such a catch works wherever the error was raised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn


class TxActorsError(Exception):
    """Root of every txactors exception."""


class ActorError(TxActorsError):
    """Something went wrong delivering a message to an actor."""


class ActorDeadError(ActorError):
    """The actor is not running: it was stopped, or stopped before answering."""


class NotHandled(ActorDeadError):
    """The actor stopped while the message still waited in its mailbox: nothing of it was
    done, so it may be sent again (over NATS: an `internal` answer with a `retry_after`)."""


class MailboxFull(ActorError):
    """A non-waiting send found the bounded mailbox full; retry later or use `tell`."""


class AskTimeout(ActorError, TimeoutError):
    """No reply arrived within the ask timeout. Also a `TimeoutError`, so generic handlers work."""


class CommandError(TxActorsError):
    """The actor answered with an `Error` reply; `code` is one of protocol.ErrorCode, and
    `retry_after` the seconds to wait before trying again when the failure should pass."""

    def __init__(self, code: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after = retry_after


class ConfigError(TxActorsError, ValueError):
    """A setting is invalid; the message names the setting (and its variable) to fix.

    Also a `ValueError`, so generic validation handlers work.
    """


class ConfigTypeError(ConfigError, TypeError):
    """An argument has the wrong type (a handler without annotations, a body that is not
    bytes). Also a `TypeError`, as Python raises for a wrong type, so `except TypeError` works.
    """


class PoisonMessage(TxActorsError):
    """A consumed message no retry can help (its body does not decode as the handler's type,
    say). Raised from a handler, the message goes to the group's dead-letter stream at once,
    with this error's text, instead of being retried `max_reconsume` times."""


class TransactionError(TxActorsError):
    """A transactional send went wrong; `txid` names the transaction, `code` is the
    coordinator's protocol.ErrorCode when it answered with one (None when it did not), and
    `retry_after` the seconds to wait before trying again when the failure should pass
    (None: no hint; the coordinator may be down, or retrying cannot help)."""

    def __init__(
        self,
        message: str,
        *,
        txid: str,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.txid = txid
        self.code = code
        self.retry_after = retry_after


class PrepareFailed(TransactionError):
    """The coordinator did not confirm the half messages, so the local transaction was not run.

    With `code` None the coordinator was unreachable or slow: halves may still have been
    stored, and the check-back resolves them (this producer answers ROLLBACK for them).
    """


class RolledBackByCheck(TransactionError):
    """A check-back found no record of this transaction and claimed it rolled back, so
    recording it now fails on the log's key: the local transaction must roll back (let the
    error propagate). The coordinator rolled, or will roll, its messages back."""


class EndRefused(TransactionError):
    """The coordinator refused the end: the transaction was already decided the other way
    (`conflict`), the token was wrong (`forbidden`) or it is unknown (`not_found`). The local
    transaction has run; reconcile it with what the coordinator decided."""


class TransactionStateError(TransactionError):
    """The Transaction cannot do this now: it already ended (with another decision), or an
    earlier send failed and only a rollback (or leaving it unknown) is still allowed."""


class NatsConnectError(TxActorsError):
    """The configured NATS server (NATS_URL or config) could not be reached or refused us."""


class NatsConnectionLost(NatsConnectError):
    """A long-lived role's NATS connection closed for good (reconnects given up); the role
    stops with this rather than stay up serving nothing."""


class NatsServerError(TxActorsError):
    """The embedded nats-server could not be started or stopped."""


class NatsServerNotFound(NatsServerError):
    """No nats-server binary was found."""


class PortInUse(NatsServerError):
    """The requested port is already taken by another process."""


class DataDirNotWritable(NatsServerError):
    """The JetStream data directory cannot be created or written."""


class DataDirLocked(NatsServerError):
    """Another embedded server holds the data directory; two would corrupt one store."""


class ServerExitedEarly(NatsServerError):
    """nats-server exited before it accepted connections."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(f"{message}\n--- last lines of the nats-server log ---\n{log_tail}")
        self.log_tail = log_tail


@contextmanager
def ungrouped(*alike: type[BaseException]) -> Iterator[None]:
    """Raise what a task group inside raised as the error itself, not in an `ExceptionGroup`,
    so that a caller's `except PrepareFailed` (or `except LINK_TROUBLE`) catches it.

    A group holding one error (nested groups of one included) is raised as that error; a
    group of several whose every error is one of `alike` (concurrent reads failing for the
    same cause) as the first of them. Anything else stays a group: several unrelated errors
    cannot pass for one. The error keeps its own traceback, cause and context.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        errors = _leaves(group)
        if len(errors) > 1 and not all(isinstance(error, alike) for error in errors):
            raise
        _raise_as_itself(errors[0])


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    return [
        leaf
        for error in group.exceptions
        for leaf in (_leaves(error) if isinstance(error, BaseExceptionGroup) else [error])
    ]


def _raise_as_itself(error: BaseException) -> NoReturn:
    # Raised while the group is handled, the error would get the group as its context (which
    # holds the error itself): what it had before is put back on its way out.
    context, suppressed = error.__context__, error.__suppress_context__
    try:
        raise error
    finally:
        error.__context__, error.__suppress_context__ = context, suppressed
