"""The operator's Python API (`txactors.ops`): one typed module, listed in docs/operations.md,
the one the `txactors` operator commands are built on, and its example script run against a
real coordinator."""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
import re
import sys
from pathlib import Path

from nats.aio.client import Client

from tests.support.txn import FAST, CoordinatorClient, message
from tests.support.wait import eventually
from txactors import ops
from txactors.consumer import ConsumedMessage
from txactors.consumer.dlq import dead_letter
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.nats.topics import ensure_dlq_stream, ensure_topic_stream
from txactors.wire import layout

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "operator_report.py"
OPERATOR_COMMANDS = ("operator", "txn", "dlq", "lease", "partitions")
"""The modules of txactors/cli/ behind `txactors txn|dlq|lease|partitions`."""


def test_every_name_in_all_is_there_and_every_public_name_is_in_all() -> None:
    assert [name for name in ops.__all__ if not hasattr(ops, name)] == []
    assert len(set(ops.__all__)) == len(ops.__all__)
    public = {
        name
        for name, value in vars(ops).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert public - set(ops.__all__) == set()


def test_every_function_is_typed() -> None:
    """Scripts get their types from the signatures (mypy checks the bodies)."""
    untyped = []
    for name in ops.__all__:
        value = getattr(ops, name)
        if not inspect.isfunction(value):
            continue
        signature = inspect.signature(value)
        if signature.return_annotation is inspect.Signature.empty:
            untyped.append(f"{name} -> ?")
        untyped += [
            f"{name}({param})"
            for param, spec in signature.parameters.items()
            if spec.annotation is inspect.Parameter.empty
        ]
    assert untyped == []


def test_operations_md_lists_every_name() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## The operator API", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(\w+)[`(]", section))
    assert sorted(set(ops.__all__) - listed) == []
    assert "examples/operator_report.py" in section
    [snippet] = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    compile(snippet, "operations.md", "exec")
    used = set(re.findall(r"\bops\.(\w+)", snippet))
    assert used and used <= set(ops.__all__), used - set(ops.__all__)


def test_the_operator_commands_do_their_work_through_the_public_module() -> None:
    """`txactors txn|dlq|lease|partitions` call the names of `txactors.ops`, never NATS, the
    coordinator's modules, or what `ops` makes public by its back door (its modules); only
    the views they print with are taken from `ops`' modules."""
    views = {"views", "dlq_views"}
    found = []
    for command in OPERATOR_COMMANDS:
        path = ROOT / "txactors" / "cli" / f"{command}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [(alias.name, "") for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [(node.module, alias.name) for alias in node.names]
            else:
                continue
            for module, name in names:
                below = module.startswith(("txactors.nats", "txactors.coordinator"))
                private = module == "txactors.ops" and name not in {*ops.__all__, *views}
                back_door = module.startswith("txactors.ops.") and name in ops.__all__
                if below or private or back_door:
                    found.append(f"{command}.py: {module} {name}".strip())
    assert found == []


async def test_the_example_script_reports_and_resumes(private_nc: Client) -> None:
    assert private_nc.connected_url is not None
    url = private_nc.connected_url.geturl()
    js = private_nc.jetstream()
    await ensure_topic_stream(js, "orders")
    await ensure_dlq_stream(js, "mailer")
    body = b"body"
    headers = {layout.MSG_ID_HEADER: "t9:0", layout.TXID_HEADER: "t9"}
    ack = await js.publish(layout.topic_subject("orders"), body, headers=headers)
    consumed = ConsumedMessage(
        topic="orders",
        tag=None,
        keys=(),
        txid="t9",
        msg_id="t9:0",
        body=body,
        headers=headers,
        deliveries=17,
        stream_seq=ack.seq,
        committed_at=None,
        subject=layout.topic_subject("orders"),
    )
    await dead_letter(js, "mailer", consumed, KeyError("sku"), max_payload=private_nc.max_payload)

    config = CoordinatorConfig(check_max=1, **FAST)
    options = CoordinatorOptions(partitions=2)
    async with run_coordinator(private_nc, config=config, options=options, owner="coord-a"):
        client = CoordinatorClient(private_nc)
        await client.prepare("shop-1", message(), group="shop")
        await client.prepare("billing-1", message(), group="billing")
        for txid in ("shop-1", "billing-1"):
            await eventually(
                lambda txid=txid: ops.show(private_nc, txid),
                until=lambda info: info.state == ops.TxnState.DISCARDED,
                what=f"{txid} discarded",
            )

        env = {k: v for k, v in os.environ.items() if not k.startswith(("TXACTORS_", "NATS_"))}
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(EXAMPLE),
            "--url",
            url,
            "--resume-group",
            "shop",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**env, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
        )
        out, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 0, err.decode()
        lines = out.decode().splitlines()
        assert lines[:3] == [
            "partitions: 2",
            "  partition 0: coord-a",
            "  partition 1: coord-a",
        ]
        assert "discarded transactions: 2" in lines
        assert any(line.startswith("  shop-1 group shop,") for line in lines)
        assert any(line.startswith("  billing-1 group billing,") for line in lines)
        assert "  resumed shop-1: prepared" in lines
        assert not any("billing-1:" in line for line in lines), "another group: left alone"
        assert lines[-2:] == [
            "consumer groups with dead letters: 1",
            "  mailer: 1, oldest: KeyError: 'sku'",
        ]

        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(EXAMPLE),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**env, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
        )
        _, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 1
        assert err.decode().startswith("error: no NATS server given"), err.decode()
