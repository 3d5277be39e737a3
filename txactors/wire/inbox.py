"""Which subjects are inboxes: where an answer may be published, and what may prefix one.

A served endpoint answers on the reply subject the requester chose, with the server's
permissions: only a subject under the inbox prefix is an inbox (`reply_refusal`), and no
configured prefix may lie in our streams' or the server's namespaces (`normalize_prefix`).
Pure rules of the subject grammar, so the configuration (`nats.config`, the coordinator's
options) checks a prefix by the same rule the actors' `ReplyGuard` answers by.
"""

from __future__ import annotations

from typing import Final

from txactors.errors import ConfigError

DEFAULT_INBOX_PREFIX: Final = "_INBOX."
_FORBIDDEN_CHARS: Final = frozenset("*> \t\r\n\f\v")
RESERVED_PREFIXES: Final = ("txn.", "topic.", "dlq.", "$KV.", "$JS.", "$SYS.", "$O.")
"""Namespaces of our streams and of the server: never an inbox prefix, whatever is configured."""


def reply_refusal(reply: str, prefix: str = DEFAULT_INBOX_PREFIX) -> str | None:
    """Why `reply` may not be answered, or None when it is a proper inbox subject."""
    if not reply:
        return "the request has no reply subject"
    if not reply.startswith(prefix) or len(reply) == len(prefix):
        return f"the reply subject is not under the inbox prefix {prefix!r}"
    if not _FORBIDDEN_CHARS.isdisjoint(reply):  # per request: no generator over each char
        return "the reply subject holds a wildcard or whitespace"
    if ".." in reply or reply.startswith(".") or reply.endswith("."):
        return "the reply subject has an empty token"
    return None


def normalize_prefix(prefix: str) -> str:
    """`prefix` ending in a dot (nats-py's `inbox_prefix` option is given without one).

    Raises ConfigError (a ValueError) when no subject could be under it (empty, wildcards,
    whitespace) or when it lies in a reserved namespace (a topic, a `txn.*` stream, KV or the
    JetStream API).
    """
    prefix = prefix if prefix.endswith(".") else f"{prefix}."
    if prefix == "." or reply_refusal(f"{prefix}x", prefix) is not None:
        raise ConfigError(f"the inbox prefix {prefix!r} must be subject tokens without wildcards")
    if prefix.upper().startswith(tuple(p.upper() for p in RESERVED_PREFIXES)):
        raise ConfigError(
            f"the inbox prefix {prefix!r} is under a namespace replies must never reach: "
            f"{', '.join(RESERVED_PREFIXES)}"
        )
    return prefix
