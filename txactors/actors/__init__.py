"""The actor runtime: bounded mailboxes, supervision, local and remote refs."""

from txactors.actors.actor import Actor
from txactors.actors.cell import Escalated, TaskFailed
from txactors.actors.ref import DEFAULT_ASK_TIMEOUT, ActorRef, LocalActorRef
from txactors.actors.remote import RemoteActorRef, Request, serve
from txactors.actors.replies import DEFAULT_INBOX_PREFIX, ReplyGuard
from txactors.actors.supervision import Directive, Supervisor
from txactors.actors.system import ActorSystem

__all__ = [
    "DEFAULT_ASK_TIMEOUT",
    "DEFAULT_INBOX_PREFIX",
    "Actor",
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
