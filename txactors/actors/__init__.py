"""The actor runtime: bounded mailboxes, supervision, local, pooled and remote refs, and
one reply handle (`Request`) for answering now or later."""

from txactors.actors.actor import Actor
from txactors.actors.cell import Escalated, TaskFailed
from txactors.actors.envelope import Request
from txactors.actors.pool import ActorPool
from txactors.actors.ref import DEFAULT_ASK_TIMEOUT, ActorRef, LocalActorRef
from txactors.actors.remote import RemoteActorRef, serve
from txactors.actors.replies import ReplyGuard
from txactors.actors.supervision import Directive, Supervisor
from txactors.actors.system import ActorSystem
from txactors.wire.inbox import DEFAULT_INBOX_PREFIX

__all__ = [
    "DEFAULT_ASK_TIMEOUT",
    "DEFAULT_INBOX_PREFIX",
    "Actor",
    "ActorPool",
    "ActorRef",
    "ActorSystem",
    "Directive",
    "Escalated",
    "LocalActorRef",
    "RemoteActorRef",
    "ReplyGuard",
    "Request",
    "Supervisor",
    "TaskFailed",
    "serve",
]
