"""A tiny protocol shared by the remote-actor tests and their peer process."""

from __future__ import annotations

from typing import Any

from txactors.actors import Actor
from txactors.wire.protocol import Error, ErrorCode, Message


class Add(Message):
    a: int
    b: int


class Greet(Message):
    name: str


class Fail(Message):
    reason: str


class Sum(Message):
    value: int


class Greeting(Message):
    text: str


Request = Add | Greet | Fail
Reply = Sum | Greeting


class Calculator(Actor):
    """Answers Add and Greet; Fail either raises or returns a not_found Error."""

    async def receive(self, message: Any) -> Any:
        match message:
            case Add(a=a, b=b):
                return Sum(a + b)
            case Greet(name=name):
                return Greeting(f"hello, {name}")
            case Fail(reason="missing"):
                return Error(ErrorCode.NOT_FOUND, "nothing called 'missing'")
            case Fail(reason=reason):
                raise RuntimeError(reason)
