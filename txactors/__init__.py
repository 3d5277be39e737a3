"""txactors: transactional messages on NATS JetStream, built from asyncio actors.

The names most programs need are here; each role's module has the rest
(`txactors.producer`, `txactors.coordinator`, `txactors.consumer`, `txactors.actors`);
`txactors.testing` is a pytest plugin for testing your own code against them.
"""

from txactors.actors import Actor, ActorSystem, RemoteActorRef, serve
from txactors.app.chain import Outbox, apply_and_send
from txactors.app.txapp import TxApp
from txactors.consumer import ConsumedMessage, Consumer, apply_once_postgres, apply_once_sqlite
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.service import run_coordinator
from txactors.errors import (
    ActorDeadError,
    ActorError,
    AskTimeout,
    CommandError,
    ConfigError,
    ConfigTypeError,
    DataDirLocked,
    DataDirNotWritable,
    EndRefused,
    MailboxFull,
    NatsConnectError,
    NatsConnectionLost,
    NatsServerError,
    NatsServerNotFound,
    PoisonMessage,
    PortInUse,
    PrepareFailed,
    ServerExitedEarly,
    TransactionError,
    TransactionStateError,
    TxActorsError,
)
from txactors.nats.config import NatsConfig
from txactors.nats.connect import nats_session
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage

__all__ = [
    "Actor",
    "ActorDeadError",
    "ActorError",
    "ActorSystem",
    "AskTimeout",
    "CheckView",
    "CommandError",
    "ConfigError",
    "ConfigTypeError",
    "ConsumedMessage",
    "Consumer",
    "CoordinatorConfig",
    "DataDirLocked",
    "DataDirNotWritable",
    "Decision",
    "EndRefused",
    "MailboxFull",
    "NatsConfig",
    "NatsConnectError",
    "NatsConnectionLost",
    "NatsServerError",
    "NatsServerNotFound",
    "Outbox",
    "PoisonMessage",
    "PortInUse",
    "PrepareFailed",
    "RemoteActorRef",
    "ServerExitedEarly",
    "TransactionError",
    "TransactionProducer",
    "TransactionStateError",
    "TxActorsError",
    "TxApp",
    "TxMessage",
    "apply_and_send",
    "apply_once_postgres",
    "apply_once_sqlite",
    "nats_session",
    "run_coordinator",
    "serve",
]
