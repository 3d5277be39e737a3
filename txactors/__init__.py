"""txactors: transactional messages on NATS JetStream, built from asyncio actors."""

from txactors.errors import (
    ActorDeadError,
    ActorError,
    AskTimeout,
    CommandError,
    ConfigError,
    DataDirNotWritable,
    MailboxFull,
    NatsConnectError,
    NatsServerError,
    NatsServerNotFound,
    PortInUse,
    ServerExitedEarly,
    TxActorsError,
)

__all__ = [
    "ActorDeadError",
    "ActorError",
    "AskTimeout",
    "CommandError",
    "ConfigError",
    "DataDirNotWritable",
    "MailboxFull",
    "NatsConnectError",
    "NatsServerError",
    "NatsServerNotFound",
    "PortInUse",
    "ServerExitedEarly",
    "TxActorsError",
]
