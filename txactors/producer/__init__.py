"""The producer role: transactional sends and the answers to check-backs."""

from txactors.producer.checks import Checker, CheckView, MessageView
from txactors.producer.message import TxMessage
from txactors.producer.producer import LocalTransaction, TransactionProducer
from txactors.producer.transaction import EndMode, Transaction, TransactionResult
from txactors.wire.protocol import Decision

__all__ = [
    "CheckView",
    "Checker",
    "Decision",
    "EndMode",
    "LocalTransaction",
    "MessageView",
    "Transaction",
    "TransactionProducer",
    "TransactionResult",
    "TxMessage",
]
