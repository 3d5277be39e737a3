"""What travels between the banks: one `Transfer` per transactional message on `transfers`."""

from __future__ import annotations

import msgspec

TOPIC = "transfers"
SENDER_GROUP = "alipay"
"""Bank A's producer group: every alipay process answers check-backs for the others."""
RECEIVER_GROUP = "yuebao"
"""Bank B's consumer group on `transfers`."""


class Transfer(msgspec.Struct, frozen=True, kw_only=True):
    """Move `amount` cents from `source` (an alipay account) to `target` (a yuebao one).

    `id` is chosen by the sender and identifies the transfer in both banks' books;
    `created_at` (seconds since the epoch) lets the checker tell a transfer that may still
    be committing from one that never will.
    """

    id: str
    source: str
    target: str
    amount: int
    created_at: float
