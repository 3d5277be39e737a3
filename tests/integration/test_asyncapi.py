"""docs/asyncapi.json is the code's protocol: regenerated, it is the same; it is a valid AsyncAPI
3.0 document whose references all resolve; its schemas say no less than the coordinator accepts;
and a real coordinator's JSON answers have the fields the schemas promise."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from typer.testing import CliRunner

from txactors import asyncapi
from txactors.cli import app
from txactors.coordinator import boundary as validation
from txactors.coordinator.service import run_coordinator
from txactors.wire import layout, protocol

ROOT = Path(__file__).resolve().parents[2]
CHECKED_IN = ROOT / asyncapi.OUTPUT


def test_the_checked_in_document_is_what_the_code_generates() -> None:
    assert CHECKED_IN.read_text(encoding="utf-8") == asyncapi.render(), (
        f"{asyncapi.OUTPUT} is stale: regenerate it with `{asyncapi.REGENERATE}` and commit it"
    )


def test_the_cli_writes_the_document(tmp_path: Path) -> None:
    target = tmp_path / "asyncapi.json"
    written = CliRunner().invoke(app, ["protocol", "asyncapi", "-o", str(target)])
    assert written.exit_code == 0, written.output
    assert target.read_text(encoding="utf-8") == asyncapi.render()
    printed = CliRunner().invoke(app, ["protocol", "asyncapi"])
    assert json.loads(printed.stdout) == asyncapi.document()


def test_it_is_an_asyncapi_3_document() -> None:
    with warnings.catch_warnings():  # the model's own field names shadow pydantic's
        warnings.simplefilter("ignore", UserWarning)
        from asyncapi3.models.asyncapi import AsyncAPI3

    document = json.loads(CHECKED_IN.read_text(encoding="utf-8"))
    parsed = AsyncAPI3.model_validate(document)
    assert parsed.asyncapi == "3.0.0"
    assert {"asyncapi", "info", "channels", "operations", "components"} <= document.keys()


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        here = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return here + [r for value in node.values() for r in _refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in _refs(value)]
    return []


def _resolve(document: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"{ref}: only local references"
    node: Any = document
    for token in ref[2:].split("/"):
        key = token.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and key in node, f"{ref} does not resolve (at {key!r})"
        node = node[key]
    return node


def test_every_reference_resolves_and_operations_use_their_channels_messages() -> None:
    document = asyncapi.document()
    refs = _refs(document)
    assert len(refs) > 50
    for ref in refs:
        _resolve(document, ref)
    for name, operation in document["operations"].items():
        channel = operation["channel"]["$ref"]
        for message in operation["messages"]:
            assert message["$ref"].startswith(f"{channel}/messages/"), name
        if "reply" in operation:
            reply = operation["reply"]
            for message in reply["messages"]:
                assert message["$ref"].startswith(f"{reply['channel']['$ref']}/messages/"), name


def test_channels_are_the_subjects_of_layout() -> None:
    channels = asyncapi.document()["channels"]
    values = {"partition": "3", "group": "bank", "producer": "p-1", "topic": "orders", "tag": "_"}
    expected = {
        "prepare": layout.prepare_subject(3, "bank"),
        "end": layout.end_subject(3, "bank"),
        "admin": layout.admin_subject(3),
        "checkInstance": layout.check_instance_subject("bank", "p-1"),
        "checkGroup": layout.check_group_subject("bank"),
        "topic": layout.topic_subject("orders"),
        "deadLetters": layout.dlq_subject("bank", "orders"),
        "discarded": layout.discard_subject("bank"),
        "quarantine": layout.quarantine_subject(),
    }
    for name, subject in expected.items():
        address = channels[name]["address"]
        placeholders = set(re.findall(r"\{(\w+)\}", address))
        assert placeholders == set(channels[name].get("parameters", {})), name
        assert address.format(**values) == subject, name
    assert channels["inbox"]["address"] is None  # the requester's own reply subject


def _served(channel: dict[str, Any]) -> set[str]:
    return set(channel["messages"])


def test_every_command_and_reply_of_the_code_is_in_the_document() -> None:
    document = asyncapi.document()
    channels = document["channels"]
    tags = protocol.Codec(protocol.CoordinatorCommand).tags
    assert tags == _served(channels["prepare"]) | _served(channels["end"])
    assert protocol.Codec(protocol.AdminCommand).tags == _served(channels["admin"])
    assert _served(channels["checkGroup"]) == _served(channels["checkInstance"])
    assert _served(channels["checkGroup"]) == {"CheckTransaction"}
    structs = {
        cls.__name__
        for cls in vars(protocol).values()
        if isinstance(cls, type)
        and issubclass(cls, protocol.Message)
        # bases, never sent
        and cls not in (protocol.Message, protocol.Command, protocol.OperatorDecision)
    }
    assert structs <= set(document["components"]["messages"])


def test_every_header_name_of_layout_is_described() -> None:
    described = {
        name
        for schema in asyncapi.header_schemas().values()
        for name in schema.get("properties", {})
    }
    constants = {
        value
        for name, value in vars(layout).items()
        if name.endswith("_HEADER") and isinstance(value, str)
    }
    assert constants - asyncapi.INTERNAL_HEADERS <= described
    assert protocol.CONTENT_TYPE_HEADER in described


NAME_ALPHABET = st.characters(codec="utf-8", categories=["L", "N", "P", "S", "Z", "Cc"])


@given(
    kind=st.sampled_from(sorted(layout.NAME_MAX_LENGTH)), name=st.text(NAME_ALPHABET, max_size=140)
)
def test_the_name_schema_refuses_exactly_what_the_coordinator_refuses(kind: str, name: str) -> None:
    schema = asyncapi.name_schema(kind)
    allowed = bool(re.fullmatch(schema["pattern"].strip("^$"), name)) and (
        schema["minLength"] <= len(name) <= schema["maxLength"]
    )
    assert allowed == (layout.name_problem(kind, name) is None)


@given(key=st.text(NAME_ALPHABET, max_size=300))
def test_the_key_schema_allows_every_key_the_coordinator_allows(key: str) -> None:
    message = protocol.OutgoingMessage(topic="t", body=b"", keys=[key])
    prepare = protocol.Prepare(
        txid="x", group="g", producer="p", messages=[message], version=protocol.PROTOCOL_VERSION
    )
    boundary = validation.Boundary(partition=0, partitions=1, max_messages=10, max_immunity=60)
    if boundary.refusal(prepare, max_payload=1 << 20) is None:
        assert re.search(asyncapi.KEY_PATTERN, key)
        assert len(key) <= validation.MAX_KEY_LENGTH


def _assert_fits(schemas: dict[str, Any], name: str, payload: dict[str, Any]) -> None:
    """The fields of a real answer: all required ones there, none the schema does not name."""
    schema = schemas[name]
    assert set(schema["required"]) <= payload.keys() <= set(schema["properties"]), name
    assert payload["type"] == name


async def test_a_real_coordinator_answers_with_the_documented_fields(nc: Client) -> None:
    schemas = asyncapi.payload_schemas()
    json_headers = {protocol.CONTENT_TYPE_HEADER: protocol.Encoding.JSON.value}

    async def ask(subject: str, command: protocol.Message) -> dict[str, Any]:
        reply = await nc.request(
            subject, protocol.encode(command, protocol.Encoding.JSON), 5, headers=json_headers
        )
        assert reply.headers == json_headers
        decoded: dict[str, Any] = msgspec.json.decode(reply.data)
        return decoded

    body = protocol.OutgoingMessage(topic="asyncapi", body=b"\x00\xff", keys=["k"])
    async with run_coordinator(nc):
        prepared = await ask(
            layout.prepare_subject(0, "g"),
            protocol.Prepare(
                txid="asyncapi-doc",
                group="g",
                producer="p",
                messages=[body],
                version=protocol.PROTOCOL_VERSION,
            ),
        )
        _assert_fits(schemas, "Prepared", prepared)
        assert re.fullmatch(
            schemas["Prepared"]["properties"]["token"]["pattern"].strip("^$"), prepared["token"]
        )
        info = await ask(
            layout.admin_subject(0),
            protocol.ShowTransaction(txid="asyncapi-doc", version=protocol.PROTOCOL_VERSION),
        )
        _assert_fits(schemas, "TransactionInfo", info)
        listed = await ask(
            layout.admin_subject(0), protocol.ListTransactions(version=protocol.PROTOCOL_VERSION)
        )
        _assert_fits(schemas, "TransactionList", listed)
        ended = await ask(
            layout.end_subject(0, "g"),
            protocol.EndTransaction(
                txid="asyncapi-doc",
                token=prepared["token"],
                decision=protocol.Decision.ROLLBACK,
                version=protocol.PROTOCOL_VERSION,
            ),
        )
        _assert_fits(schemas, "Ended", ended)
        assert ended["state"] in schemas["Ended"]["properties"]["state"]["enum"]
        refused = await ask(
            layout.admin_subject(0),
            protocol.ShowTransaction(txid="no such", version=protocol.PROTOCOL_VERSION),
        )
        _assert_fits(schemas, "Error", refused)
        assert refused["code"] == protocol.ErrorCode.BAD_REQUEST
