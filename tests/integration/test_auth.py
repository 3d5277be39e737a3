"""NKey and credentials auth against a real nats-server, as a fresh install would use them.

The keys, and for the creds file the operator → account → user chain of JWTs, are made here
with the `nkeys` library (a dependency of txactors), so no `nsc` tool is needed. A JWT is
`base64url(header).base64url(claims).base64url(ed25519 signature by the issuer's key)`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nkeys
import pytest

from txactors.errors import ConfigError, NatsConnectError
from txactors.nats.config import NatsConfig
from txactors.nats.connect import connect_options, nats_session

if TYPE_CHECKING:
    from tests.support.servers import MakeNatsServer

ROOT = Path(__file__).resolve().parents[2]
FAST_FAIL = {"connect_retries": 1, "reconnect_time_wait": 0.05, "connect_timeout": 0.5}
USER_LIMITS = {"subs": -1, "data": -1, "payload": -1}
"""A claim left out is a limit of 0: a user without these could not publish a byte."""
UNLIMITED = {**USER_LIMITS, "imports": -1, "exports": -1, "conn": -1}


class Key:
    """A fresh nkey of one role (user, account, operator): its seed and public key."""

    def __init__(self, prefix: int) -> None:
        self.seed: str = nkeys.encode_seed(os.urandom(32), prefix).decode()
        self.pair = nkeys.from_seed(bytearray(self.seed.encode()))
        self.public: str = self.pair.public_key.decode()

    def write_seed(self, path: Path) -> str:
        path.write_text(self.seed + "\n")
        return str(path)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt(issuer: Key, subject: str, name: str, nats: dict[str, Any]) -> str:
    claims: dict[str, Any] = {
        "jti": "",
        "iat": int(time.time()),
        "iss": issuer.public,
        "name": name,
        "sub": subject,
        "nats": {**nats, "version": 2},
    }
    digest = hashlib.sha256(json.dumps(claims).encode()).digest()
    claims["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    signed = f"{_b64(json.dumps({'typ': 'JWT', 'alg': 'ed25519-nkey'}).encode())}."
    signed += _b64(json.dumps(claims).encode())
    return f"{signed}.{_b64(issuer.pair.sign(signed.encode()))}"


def test_nkeys_is_a_dependency() -> None:
    """nats-py imports nkeys only when NATS_NKEY or NATS_CREDS is used; a fresh install of
    txactors must bring it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.match(r"[A-Za-z0-9_.-]+", dep).group().lower() for dep in project["dependencies"]}  # type: ignore[union-attr]
    assert "nkeys" in names


async def test_an_nkey_user_connects_and_a_wrong_seed_is_refused(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    user, stranger = Key(nkeys.PREFIX_BYTE_USER), Key(nkeys.PREFIX_BYTE_USER)
    conf = tmp_path / "nkey.conf"
    conf.write_text(f"authorization {{ users = [ {{ nkey: {user.public} }} ] }}\n")
    server = await make_nats_server(extra_args=["-c", str(conf)])

    good = NatsConfig(url=server.url, nkeys_seed=user.write_seed(tmp_path / "user.nk"))
    async with nats_session(good) as session:
        sub = await session.nc.subscribe("auth.check")
        await session.nc.publish("auth.check", b"hi")
        assert (await sub.next_msg(timeout=2)).data == b"hi"

    without = NatsConfig(url=server.url, **FAST_FAIL)
    with pytest.raises(NatsConnectError, match="uthorization"):
        async with nats_session(without):
            pass
    seed = stranger.write_seed(tmp_path / "stranger.nk")
    wrong = NatsConfig(url=server.url, nkeys_seed=seed, **FAST_FAIL)
    with pytest.raises(NatsConnectError, match=rf"{server.url}.*uthorization"):
        async with nats_session(wrong):
            pass


@pytest.mark.parametrize(
    "content",
    ["not a seed\n", "", Key(nkeys.PREFIX_BYTE_USER).public + "\n"],
    ids=["text", "empty", "a-public-key"],  # fixed: parallel workers must collect the same ids
)
async def test_a_seed_file_without_a_seed_names_the_setting(
    make_nats_server: MakeNatsServer, tmp_path: Path, content: str
) -> None:
    server = await make_nats_server()
    path = tmp_path / "broken.nk"
    path.write_text(content)
    with pytest.raises(
        ConfigError, match=r"nkeys_seed \(NATS_NKEY\) .*broken.nk.*not an nkey seed"
    ):
        async with nats_session(NatsConfig(url=server.url, nkeys_seed=str(path), **FAST_FAIL)):
            pass


def operator_setup(directory: Path) -> tuple[Path, Key, str]:
    """A server config trusting a new operator, with one account and a system account
    preloaded (JetStream needs the latter); a user of that account and the user's JWT."""
    operator = Key(nkeys.PREFIX_BYTE_OPERATOR)
    account, system = Key(nkeys.PREFIX_BYTE_ACCOUNT), Key(nkeys.PREFIX_BYTE_ACCOUNT)
    user = Key(nkeys.PREFIX_BYTE_USER)
    operator_jwt = directory / "operator.jwt"
    operator_jwt.write_text(jwt(operator, operator.public, "op", {"type": "operator"}))
    accounts = {
        key.public: jwt(operator, key.public, name, {"type": "account", "limits": UNLIMITED})
        for key, name in ((account, "app"), (system, "SYS"))
    }
    preload = "\n".join(f'  {public}: "{token}"' for public, token in accounts.items())
    conf = directory / "operator.conf"
    conf.write_text(
        f'operator: "{operator_jwt}"\nsystem_account: {system.public}\n'
        f"resolver: MEMORY\nresolver_preload: {{\n{preload}\n}}\n"
    )
    return conf, user, jwt(account, user.public, "app-user", {"type": "user", **USER_LIMITS})


def creds_file(path: Path, user_jwt: str, seed: str) -> str:
    path.write_text(
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    )
    return str(path)


async def test_a_creds_file_connects_to_an_operator_mode_server(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    conf, user, user_jwt = operator_setup(tmp_path)
    server = await make_nats_server(extra_args=["-c", str(conf)])

    good = NatsConfig(
        url=server.url, creds_file=creds_file(tmp_path / "u.creds", user_jwt, user.seed)
    )
    async with nats_session(good) as session:
        sub = await session.nc.subscribe("auth.creds")
        await session.nc.publish("auth.creds", b"hi")
        assert (await sub.next_msg(timeout=2)).data == b"hi"

    # The JWT of the user with another key's seed: the server sees a bad signature.
    impostor = Key(nkeys.PREFIX_BYTE_USER).seed
    bad = NatsConfig(
        url=server.url,
        creds_file=creds_file(tmp_path / "bad.creds", user_jwt, impostor),
        **FAST_FAIL,
    )
    with pytest.raises(NatsConnectError, match="uthorization"):
        async with nats_session(bad):
            pass


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("just text\n", "not a creds file"),
        ("-----BEGIN NATS USER JWT-----\nx.y.z\n------END NATS USER JWT------\n", "not a creds"),
        (
            "-----BEGIN NATS USER JWT-----\nx.y.z\n------END NATS USER JWT------\n"
            "-----BEGIN USER NKEY SEED-----\nSUnot-a-seed\n------END USER NKEY SEED------\n",
            "not an nkey seed",
        ),
    ],
)
def test_a_broken_creds_file_names_the_setting(tmp_path: Path, content: str, problem: str) -> None:
    path = tmp_path / "broken.creds"
    path.write_text(content)
    with pytest.raises(ConfigError, match=rf"creds_file \(NATS_CREDS\) .*broken.creds.*{problem}"):
        connect_options(NatsConfig(url="nats://x", creds_file=str(path)))
