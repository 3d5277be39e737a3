"""Which reply subjects a served endpoint answers: inboxes only.

A served endpoint publishes its answer to the reply subject the requester chose, with the
server's permissions, not the requester's. Answering a reply subject such as `topic.x.y`,
`$KV.TXN_LEASE.0` or `$JS.API.STREAM.PURGE.X` would let any client write into a topic, a
lease or the JetStream API through us. So only subjects under the inbox prefix (`_INBOX.` by
default, as nats-py's `request` makes them) are answered; a request with any other reply
subject is not executed at all, counted, and logged at most once a minute per pattern.

A guard may also be given a `rule` that narrows the inbox by the subject a request came on
(the coordinator's tenants: a group's requests are answered only in that group's inbox).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from txactors.observe.logs import RateLimited, get_logger
from txactors.wire.inbox import DEFAULT_INBOX_PREFIX, normalize_prefix, reply_refusal

log = get_logger(__name__)

ReplyRule = Callable[[str, str], str | None]
"""(subject the request came on, its reply subject) -> why that reply may not be answered
there (None: it may); asked only of replies already under the inbox prefix."""


def reply_pattern(reply: str) -> str:
    """What log lines are rate-limited by: the first token (`topic.x.y` → `topic.>`).

    Truncated, so a client cannot fill the log (or our memory) with long subjects.
    """
    first = reply.split(".", 1)[0][:64]
    return f"{first}.>" if "." in reply else first


class ReplyGuard:
    """Decides whether a reply subject may be answered, and reports those that may not.

    One guard may serve many subscriptions (a coordinator shares one across its partitions),
    so a pattern is logged once per process and interval, not once per subscription.
    `on_refused` is called for every refusal (a metric's `inc`).
    """

    def __init__(
        self,
        prefix: str = DEFAULT_INBOX_PREFIX,
        *,
        rule: ReplyRule | None = None,
        on_refused: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        prefix = normalize_prefix(prefix)
        self.prefix = prefix
        self._rule = rule
        self._on_refused = on_refused
        self._logged = RateLimited(clock=clock)
        """One line per (served subject, reply pattern) and minute."""

    def refusal(self, reply: str, subject: str | None = None) -> str | None:
        """Why `reply` to a request on `subject` may not be answered (None: it may)."""
        reason = reply_refusal(reply, self.prefix)
        if reason is None and self._rule is not None and subject is not None:
            reason = self._rule(subject, reply)
        return reason

    def allows(self, reply: str, served: str, subject: str | None = None) -> bool:
        """True when `reply` to a request on `subject` (one matching the served subject)
        may be answered; otherwise counts and (rate-limited) logs it."""
        reason = self.refusal(reply, subject)
        if reason is None:
            return True
        if self._on_refused is not None:
            self._on_refused()
        self._report(served, reply, reason)
        return False

    def _report(self, served: str, reply: str, reason: str) -> None:
        pattern = reply_pattern(reply)
        suppressed = self._logged.suppressed((served, pattern))
        if suppressed is None:
            return
        log.warning(
            "reply_subject_refused",
            subject=served,
            reply_pattern=pattern,
            reply=reply[:200],
            reason=reason,
            suppressed=suppressed,
        )
