"""One check-back: ask a producer what became of a transaction, and classify the outcome.

The answer passes the same boundary as any request (protocol.Codec, then validation): an
answer that cannot be read or is about another check counts as an inconclusive check.
"""

from __future__ import annotations

import time

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from txactors import layout
from txactors.actors import RemoteActorRef
from txactors.coordinator.core.effects import CheckTarget, SendCheck
from txactors.coordinator.core.events import CheckFailure
from txactors.coordinator.streams import checked_message, read_raw_half
from txactors.coordinator.validation import check_answer_problem
from txactors.errors import ActorDeadError, AskTimeout, CommandError
from txactors.logs import get_logger
from txactors.protocol import CheckResult, CheckTransaction, Decision, ErrorCode, encode

log = get_logger(__name__)


async def ask_producer(
    nc: Client, js: JetStreamContext, action: SendCheck
) -> tuple[Decision | None, CheckFailure | None]:
    """The producer's answer, or why there is none (no responders, timeout, error)."""
    # The table times this check out `timeout` after it was sent; ours must end first, so
    # that its outcome, not a second check, is what follows.
    deadline = time.monotonic() + action.timeout
    if action.target is CheckTarget.INSTANCE:
        subject = layout.check_instance_subject(action.group, action.producer)
    else:
        subject = layout.check_group_subject(action.group)
    resolution: Decision | None = None
    failure: CheckFailure | None = None
    try:
        command = await _check_command(js, action)
        size = len(encode(command))
        if size > nc.max_payload:
            raise CommandError(
                ErrorCode.BAD_REQUEST,
                f"the check-back takes {size} bytes, more than max_payload {nc.max_payload}: "
                "the transaction's messages together are too large to be checked back",
            )
        result = await RemoteActorRef(nc, subject, CheckResult).ask(
            command, timeout=max(deadline - time.monotonic(), 0.001)
        )
        problem = check_answer_problem(result, txid=action.txid, check_id=action.check_id)
        if problem is not None:
            raise CommandError(ErrorCode.BAD_REQUEST, problem)
        resolution = result.resolution
    except ActorDeadError:
        failure = CheckFailure.NO_RESPONDERS
    except AskTimeout:
        failure = CheckFailure.TIMEOUT
    except (CommandError, nats.errors.Error) as error:
        # One check that cannot be made or answered is inconclusive; it never stops the
        # partition (its actor would restart into the same check, again and again).
        log.warning("check_back_error", txid=action.txid, error=str(error) or repr(error))
        failure = CheckFailure.ERROR
    log.info(
        "check_back",
        txid=action.txid,
        check_id=action.check_id,
        target=action.target.value,
        check_times=action.check_times,
        resolution=resolution,
        failure=failure,
    )
    return resolution, failure


async def _check_command(js: JetStreamContext, action: SendCheck) -> CheckTransaction:
    stored = [read_raw_half(await js.get_msg(layout.HALF_STREAM, h.seq)) for h in action.halves]
    return CheckTransaction(
        txid=action.txid,
        group=action.group,
        check_id=action.check_id,
        check_times=action.check_times,
        messages=[checked_message(s) for s in stored],
    )
