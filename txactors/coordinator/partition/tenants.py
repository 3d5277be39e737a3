"""What keeps tenants apart beyond the boundary's checks: their inboxes, their streams' count.

NATS permissions confine each group to its own subjects (docs/nats-tenants.conf); three things
they cannot see are kept here.

- **Replies.** The coordinator publishes an answer where the request's reply subject points,
  with its own rights. With a tenant policy (`group_topics`), a group's request on
  `txn.coord.<p>.prepare|end.<group>` is answered only under that group's inbox
  (`_INBOX.<group>.`, the `inbox_prefix` its clients connect with), and any other request
  (admin) never into a tenant's inbox: one group cannot aim answers
  into another's. A request whose reply breaks this is not executed at all.
- **How many streams a prefix rule makes.** A rule `orders-*` lets a producer name new topics,
  each a stream the coordinator creates; `max_prefix_topics` caps the streams under each rule
  (`nats/topics.py`'s `topic_stream_count`, asked only when a new topic's stream would be created).
- **The consumers' streams.** A consumer that may not create streams waits for its topic and
  dead-letter streams; `declare_consumer_streams` makes those of `consumer_groups` at start.
"""

from __future__ import annotations

from collections.abc import Iterable

from nats.js import JetStreamContext

from txactors.coordinator.options import CoordinatorOptions
from txactors.nats.topics import ensure_dlq_stream, ensure_topic_stream
from txactors.observe.logs import get_logger
from txactors.wire import layout

log = get_logger(__name__)


class TenantReplies:
    """The `ReplyRule` of a coordinator with a tenant policy (see the module docstring)."""

    def __init__(self, prefix: str, groups: Iterable[str]) -> None:
        self._prefix = prefix
        self._tenants = tuple(sorted({f"{prefix}{group}." for group in groups}))

    def __call__(self, subject: str, reply: str) -> str | None:
        group = layout.subject_group(subject)
        if group is not None:
            inbox = f"{self._prefix}{group}."
            if reply.startswith(inbox):
                return None
            return f"a request of group {group!r} is answered only under its inbox {inbox!r}"
        for inbox in self._tenants:
            if reply.startswith(inbox):
                return f"the reply subject is in the inbox {inbox!r} of a tenant"
        return None


def tenant_groups(options: CoordinatorOptions) -> set[str]:
    """Every group whose inbox is a tenant's: producer groups of the policy, consumer groups."""
    return {*options.group_topics, *options.consumer_groups}


async def declare_consumer_streams(js: JetStreamContext, options: CoordinatorOptions) -> None:
    """The dead-letter stream of every group of `consumer_groups` and the stream of every
    topic it names, as the coordinator declares its own (replicas, duplicate window)."""
    for group, topics in options.consumer_groups.items():
        await ensure_dlq_stream(js, group, replicas=options.replicas)
        for topic in topics:
            await ensure_topic_stream(
                js,
                topic,
                duplicate_window=options.topic_duplicate_window,
                replicas=options.replicas,
            )
        log.info("consumer_streams_declared", group=group, topics=topics)
