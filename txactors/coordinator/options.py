"""How a coordinator process runs, and what its hooks receive.

The coordinator's one configuration module. The rules of a transaction's life (timeouts,
check counts) are `CoordinatorConfig` (`wire/rules.py`: producers size their logs by them);
these are the process's own settings: partitions and leases, timers, stream replicas. How
`txactors coordinator` reads both from flags, the environment or a TOML file is
`cli/settings.py`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

import msgspec

from txactors.errors import ConfigError
from txactors.nats.partition_count import check_count
from txactors.nats.topics import DEFAULT_DUPLICATE_WINDOW
from txactors.wire.inbox import DEFAULT_INBOX_PREFIX, normalize_prefix
from txactors.wire.layout import name_problem
from txactors.wire.protocol import OutgoingMessage


class CoordinatorOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How the coordinator process runs (the transaction rules are in CoordinatorConfig)."""

    partitions: int = 1
    """Txid hash buckets (`crc32(txid) mod partitions`), 1 to 4096; all coordinators agree,
    clients read it."""
    tick_interval: float = 0.1
    """The unit of the partitions' clock-driven looks (for late halves: every 10 ticks).
    Check-back timers sleep until their deadline; on a custom clock that is neither the real
    time nor a `MovingClock` they look at it every tick."""
    checkpoint_interval: float = 5.0
    """How often each partition records where its recovery may start reading its streams."""
    replicas: int = 1
    """Replicas of the coordinator's streams (3 on a production cluster)."""
    topic_duplicate_window: float = DEFAULT_DUPLICATE_WINDOW
    """How long a topic stream drops a re-published `Nats-Msg-Id`: must cover recovery."""
    max_messages_per_prepare: int = 1000
    """Most messages one prepare may carry; a larger one is refused."""
    max_batch_items: int = 256
    """Most transactions one `PrepareBatch` or `EndBatch` may carry; a larger batch is
    refused whole (fewer still when the server's max_payload could not carry the answer
    to every item at its longest)."""
    lease_ttl: float = 10.0
    """A dead coordinator's partitions are taken over within this many seconds."""
    max_partitions: int = 1 << 16
    """Most partitions this process takes: set it to split partitions across processes."""
    leader_balance_interval: float = 60.0
    """Seconds between two looks at where the partitions' log streams are led (replicas > 1):
    the coordinator owning partition 0 moves a few leaders from servers leading more than
    their share to the others (as Kafka's controller does), never while a log has a replica
    not current. 0: never (`txactors partitions balance` still does it on demand)."""
    write_linger: float = 0.0
    """Seconds a half or topic append queued behind a write in flight may wait for others to
    share its write (Kafka's `linger.ms`, only while busy): fewer writes and fsyncs per
    transaction at moderate rates, for up to that much latency. 0: a write goes as soon as
    a pipeline slot is free."""
    inbox_prefix: str = DEFAULT_INBOX_PREFIX
    """Only reply subjects under this prefix are answered (an account's clients may use
    another `inbox_prefix`); a request with any other reply subject is refused unexecuted."""
    group_topics: dict[str, list[str]] = {}
    """The tenant policy: producer group -> the topics it may write, each a name or a prefix
    ending in `*` (`{"orders": ["orders", "orders-*"]}`; a flag or variable takes it as
    JSON). A prepare of a group not listed, or naming another topic, is refused `forbidden`
    before anything is stored or declared. Empty: any group may write any topic."""
    max_prefix_topics: int = 100
    """Most topic streams one prefix rule of `group_topics` (`orders-*`) may cause to exist:
    a prepare naming a topic whose stream does not exist yet, allowed only by rules whose
    prefix already has this many `TOPIC_<prefix>...` streams, is refused `forbidden`."""
    consumer_groups: dict[str, list[str]] = {}
    """Consumer group -> the topics it reads (names, no patterns). At start the coordinator
    declares each group's dead-letter stream and each topic's stream, so a consumer that may
    not create streams (`Consumer(declare_streams=False)`) finds them; with `group_topics`
    set, its replies never go to these groups' inboxes either."""

    def __post_init__(self) -> None:
        normalize_prefix(self.inbox_prefix)  # ConfigError when it cannot prefix a subject
        check_count(self.partitions)
        if self.max_partitions < 1:
            raise ConfigError("max_partitions must be >= 1")
        if self.lease_ttl <= 0:
            raise ConfigError("lease_ttl must be > 0 seconds")
        if not self.leader_balance_interval >= 0:
            raise ConfigError("leader_balance_interval must be >= 0 seconds (0: never)")
        if self.write_linger < 0:
            raise ConfigError("write_linger must be >= 0 seconds")
        if self.tick_interval <= 0 or self.checkpoint_interval <= 0:
            raise ConfigError("tick_interval and checkpoint_interval must be > 0")
        for group, patterns in self.group_topics.items():
            problem = name_problem("group", group) or next(
                filter(None, (_pattern_problem(p) for p in patterns)), None
            )
            if problem is not None:
                raise ConfigError(f"group_topics: {problem}")
        if self.max_batch_items < 1:
            raise ConfigError("max_batch_items must be >= 1")
        if self.max_prefix_topics < 1:
            raise ConfigError("max_prefix_topics must be >= 1")
        for group, topics in self.consumer_groups.items():
            problem = name_problem("group", group) or next(
                filter(None, (name_problem("topic", t) for t in topics)), None
            )
            if problem is not None:
                raise ConfigError(f"consumer_groups: {problem}")


def _pattern_problem(pattern: str) -> str | None:
    """What is wrong with a topic pattern of `group_topics` (None: nothing)."""
    if pattern == "*":
        return None
    prefix = pattern.removesuffix("*")
    problem = name_problem("topic", prefix)
    return problem and f"{problem}; a pattern is a topic name, optionally ending in '*'"


class DiscardedTransaction(msgspec.Struct, frozen=True, kw_only=True):
    """What `on_discard` hooks receive."""

    txid: str
    group: str
    producer: str
    reason: str
    check_times: int
    messages: list[OutgoingMessage]


OnDiscard = Callable[[DiscardedTransaction], Awaitable[None]]
Clock = Callable[[], float]


@runtime_checkable
class MovingClock(Protocol):
    """A clock that says when it moves (a test's `ManualClock`): timers waiting for one of
    its times wake when it moves, instead of looking at it every `tick_interval`."""

    def __call__(self) -> float: ...

    async def moved(self) -> None:
        """Return once the clock has moved."""
