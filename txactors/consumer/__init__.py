"""The consumer role: read committed topics at least once, retry, dead-letter, apply once."""

from txactors.consumer.consumer import Consumer, Handler
from txactors.consumer.dlq import dead_letter
from txactors.consumer.idempotent import apply_once_postgres, apply_once_sqlite
from txactors.consumer.message import ConsumedMessage
from txactors.consumer.retry import DEFAULT_MAX_RECONSUME, DEFAULT_RETRY_DELAYS, RetryPolicy
from txactors.nats.topics import ensure_dlq_stream

__all__ = [
    "DEFAULT_MAX_RECONSUME",
    "DEFAULT_RETRY_DELAYS",
    "ConsumedMessage",
    "Consumer",
    "Handler",
    "RetryPolicy",
    "apply_once_postgres",
    "apply_once_sqlite",
    "dead_letter",
    "ensure_dlq_stream",
]
