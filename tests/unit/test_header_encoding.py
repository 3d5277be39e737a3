"""`TolerantClient` sends header blocks as nats-py 2.16 does, byte for byte.

It builds the block itself only for speed (nats-py's regular expression per name and charmap
translation per value were about a tenth of the coordinator's instructions per transaction),
so the property is equality with what nats-py sends for any headers, names valid or not, values
with line breaks and blanks, including names seen before (remembered as valid).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.errors import BadHeaderError

from txactors.nats.client import TolerantClient
from txactors.wire.framing import header_block

NAMES = st.sampled_from(["Nats-Msg-Id", "Txn-Id", " a", "B ", "", " ", "bad name", "é", "x:y"])
VALUES = st.lists(
    st.sampled_from(["tx1:0", " ", "\r", "\n", "\t", "\x85", "é", "\u2028", "v", ""]), max_size=8
).map("".join)


def sent(client: Client, headers: dict[str, Any] | None) -> list[bytes] | type[BaseException]:
    """The commands `client` queues to publish `headers` (or the error it raises)."""
    commands: list[bytes] = []

    async def send_command(command: bytes, priority: bool = False) -> None:
        commands.append(command)

    client._send_command = send_command  # type: ignore[method-assign]
    client._flush_queue = None
    try:
        asyncio.run(client._send_publish("s", "r", b"data", 4, headers))
    except Exception as error:
        return type(error)
    return commands


@settings(max_examples=1000)
@given(st.dictionaries(NAMES, VALUES, max_size=5))
def test_headers_are_sent_as_nats_py_sends_them(headers: dict[str, str]) -> None:
    expected = sent(Client(), headers)
    assert sent(TolerantClient(), headers) == expected
    assert sent(TolerantClient(), headers) == expected  # names now remembered


def test_a_committed_message_block() -> None:
    headers = {"Nats-Msg-Id": "tx1:0", "Txn-Id": " tx1\r\n", " K ": "a\nb"}
    expected = b"NATS/1.0\r\nNats-Msg-Id: tx1:0\r\nTxn-Id: tx1\r\nK: a b\r\n\r\n"
    assert header_block(headers) == expected


def test_an_invalid_name_is_refused_as_nats_py_refuses_it() -> None:
    assert header_block({"bad name": "v"}) is None
    assert sent(TolerantClient(), {"bad name": "v"}) is BadHeaderError


@pytest.mark.parametrize("headers", [None, {}])
def test_no_headers_or_an_empty_block(headers: dict[str, str] | None) -> None:
    assert sent(TolerantClient(), headers) == sent(Client(), headers)


def test_another_nats_py_release_takes_its_own_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mirror is of one release's private method: under another, nats-py's runs."""
    import txactors.nats.client as client_module

    assert client_module._mirrors_nats_py == client_module.nats_py_version.startswith("2.16.")
    built: list[dict[str, Any]] = []
    monkeypatch.setattr(client_module, "header_block", lambda headers: built.append(headers))
    monkeypatch.setattr(client_module, "_mirrors_nats_py", False)
    headers = {"Nats-Msg-Id": "tx1:0"}
    assert sent(TolerantClient(), headers) == sent(Client(), headers)
    assert built == []
