"""Payload Structs for the Spark sink tests; a module, so Spark's Python workers import them."""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from decimal import Decimal
from typing import Literal

import msgspec


class Currency(enum.Enum):
    EUR = "EUR"
    USD = "USD"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Transfer(msgspec.Struct, frozen=True):
    """What a bank transfer demo would commit."""

    transfer_id: str
    source: str
    target: str
    amount: Decimal
    currency: Currency


class Address(msgspec.Struct, frozen=True):
    street: str
    zip_code: int | None = None


class Everything(msgspec.Struct, frozen=True):
    """One field of every type the sink maps to a Spark column."""

    number: int
    ratio: float
    name: str
    flag: bool
    blob: bytes
    at: dt.datetime
    day: dt.date
    price: Decimal
    maybe: int | None
    tags: list[str]
    scores: set[int]
    address: Address
    addresses: list[Address]
    currency: Currency
    priority: Priority
    mode: Literal["a", "b"]
    ident: uuid.UUID
    attrs: dict[str, float]
