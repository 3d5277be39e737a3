"""NatsConfig from the environment, and nats_session: embedded vs configured, auth and TLS."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nkeys
import pytest

from txactors.embedded.server import EmbeddedNatsServer
from txactors.errors import ConfigError, NatsConnectError
from txactors.nats.config import NatsConfig
from txactors.nats.connect import connect_options, nats_session
from txactors.nats.watchdog import DEFAULT_WATCH

if TYPE_CHECKING:
    from tests.support.servers import MakeNatsServer

FAST_FAIL = {"connect_retries": 1, "reconnect_time_wait": 0.05, "connect_timeout": 0.5}


def test_from_env_reads_every_variable() -> None:
    env = {
        "NATS_URL": "nats://a:4222, tls://b:4223",
        "NATS_USER": "alice",
        "NATS_PASSWORD": "s3cret",
        "NATS_NKEY": "/keys/seed.nk",
        "NATS_TLS_CA": "/tls/ca.pem",
        "NATS_TLS_CERT": "/tls/cert.pem",
        "NATS_TLS_KEY": "/tls/key.pem",
        "TXACTORS_DATA_DIR": "",
    }
    config = NatsConfig.from_env(env)
    assert config.servers == ["nats://a:4222", "tls://b:4223"]
    assert (config.user, config.password, config.nkeys_seed) == ("alice", "s3cret", "/keys/seed.nk")
    assert (config.tls_ca, config.tls_cert, config.tls_key) == (
        "/tls/ca.pem",
        "/tls/cert.pem",
        "/tls/key.pem",
    )
    assert config.data_dir is None  # empty means unset
    assert not config.embedded
    assert "s3cret" not in repr(config)
    token = NatsConfig.from_env({"NATS_TOKEN": "t", "NATS_CREDS": "/c.creds"}, data_dir="/d")
    assert (token.token, token.creds_file, token.data_dir, token.embedded) == (
        "t",
        "/c.creds",
        "/d",
        True,
    )
    assert NatsConfig.from_env({}) == NatsConfig()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NATS_USER": "u"}, r"user \(NATS_USER\) is set but password \(NATS_PASSWORD\) is not"),
        ({"NATS_TLS_KEY": "k"}, r"tls_key \(NATS_TLS_KEY\) is set but tls_cert"),
        ({"NATS_TOKEN": "t", "NATS_USER": "u", "NATS_PASSWORD": "p"}, "both set"),
        ({"NATS_CREDS": "c", "NATS_NKEY": "n"}, "both set"),
        ({"NATS_URL": "http://example.com"}, r"url \(NATS_URL\)='http://example.com' is not a"),
        ({"NATS_URL": "nats://host:4223x"}, r"its port '4223x' is not a number from 1 to 65535"),
        ({"NATS_URL": "nats://a:4222,b:70000"}, r"its port '70000' is not a number"),
        ({"NATS_URL": "nats://:4222"}, "it names no host"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        NatsConfig.from_env(env)


def test_connect_options_pass_auth_through_and_check_files(tmp_path: Path) -> None:
    opts = connect_options(NatsConfig(url="nats://x", user="u", password="p", name="me"))
    assert (opts["user"], opts["password"], opts["name"]) == ("u", "p", "me")
    assert connect_options(NatsConfig(url="nats://x", token="t"))["token"] == "t"
    seed = nkeys.encode_seed(bytes(32), nkeys.PREFIX_BYTE_USER).decode()
    creds = tmp_path / "user.creds"
    creds.write_text(
        "-----BEGIN NATS USER JWT-----\nhead.claims.sig\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    )
    assert connect_options(NatsConfig(url="nats://x", creds_file=str(creds)))[
        "user_credentials"
    ] == str(creds)
    with pytest.raises(ConfigError, match=r"nkeys_seed \(NATS_NKEY\) names .*not a readable file"):
        connect_options(NatsConfig(url="nats://x", nkeys_seed=str(tmp_path / "missing.nk")))


async def test_configured_url_starts_nothing(
    nats_server: EmbeddedNatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_server(self: EmbeddedNatsServer) -> None:
        raise AssertionError("nats_session started a server although a URL was configured")

    monkeypatch.setattr(EmbeddedNatsServer, "start", no_server)
    async with nats_session(NatsConfig(url=nats_server.url)) as session:
        assert session.server is None
        assert session.url == nats_server.url
        sub = await session.nc.subscribe("test.session")
        await session.nc.publish("test.session", b"x")
        assert (await sub.next_msg(timeout=2)).data == b"x"
    assert session.nc.is_closed


async def test_no_url_runs_an_embedded_server(tmp_path: Path) -> None:
    async with nats_session(NatsConfig(data_dir=str(tmp_path / "data"))) as session:
        assert session.server is not None
        assert session.url == session.server.url
        assert session.server.data_dir == tmp_path / "data"
        await session.js.add_stream(name="EMBEDDED", subjects=["embedded.>"])
    assert not session.server.running
    assert session.nc.is_closed
    assert (tmp_path / "data" / "jetstream").is_dir()  # a given data dir is kept


async def test_unreachable_url_fails_fast_and_clearly(make_nats_server: MakeNatsServer) -> None:
    server = await make_nats_server()
    url = server.url
    await server.stop()
    with pytest.raises(NatsConnectError, match=rf"could not connect to NATS at {url}.*NATS_URL"):
        async with nats_session(NatsConfig(url=url, **FAST_FAIL)):
            pass


async def test_user_and_password_are_passed_through(make_nats_server: MakeNatsServer) -> None:
    server = await make_nats_server(extra_args=["--user", "alice", "--pass", "s3cret"])
    good = NatsConfig(url=server.url, user="alice", password="s3cret", **FAST_FAIL)
    async with nats_session(good) as session:
        assert session.nc.is_connected
    bad = NatsConfig(url=server.url, user="alice", password="wrong", **FAST_FAIL)
    with pytest.raises(NatsConnectError, match="uthorization"):
        async with nats_session(bad):
            pass


async def test_token_is_passed_through(make_nats_server: MakeNatsServer) -> None:
    server = await make_nats_server(extra_args=["--auth", "tok3n"])
    async with nats_session(NatsConfig(url=server.url, token="tok3n", **FAST_FAIL)) as session:
        assert session.nc.is_connected


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"),
            *("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_tls_ca_is_passed_through(make_nats_server: MakeNatsServer, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    tls_args = ["--tls", "--tlscert", str(cert), "--tlskey", str(key)]
    server = await make_nats_server(extra_args=tls_args)
    url = f"tls://127.0.0.1:{server.port}"
    settings: dict[str, Any] = {"url": url, "tls_ca": str(cert), **FAST_FAIL}
    async with nats_session(NatsConfig(**settings)) as session:
        assert session.nc.is_connected
    with pytest.raises(NatsConnectError):  # the system CAs do not trust our certificate
        async with nats_session(NatsConfig(url=url, **FAST_FAIL)):
            pass


def test_the_inbox_prefix_comes_from_the_environment() -> None:
    """A confined user may subscribe only under its own inbox (docs/nats-tenants.conf)."""
    environ = {"NATS_URL": "nats://x:4222", "NATS_INBOX_PREFIX": "_INBOX.billing"}
    assert connect_options(NatsConfig.from_env(environ))["inbox_prefix"] == "_INBOX.billing"
    assert "inbox_prefix" not in connect_options(NatsConfig(url="nats://x:4222"))


@pytest.mark.parametrize("prefix", ["topic.orders", "_INBOX.*", "$JS.API", "a b"])
def test_an_inbox_prefix_no_reply_may_use_names_the_variable(prefix: str) -> None:
    with pytest.raises(ConfigError, match="NATS_INBOX_PREFIX"):
        NatsConfig.from_env({"NATS_URL": "nats://x:4222", "NATS_INBOX_PREFIX": prefix})


def test_how_long_a_client_keeps_a_server_that_cannot_serve_comes_from_the_environment() -> None:
    """TXACTORS_LEAVE_SERVER_AFTER (nats/watchdog.py); 0, or an embedded server, never moves."""
    url = {"NATS_URL": "nats://a:4222,nats://b:4222"}
    watch = NatsConfig.from_env({**url, "TXACTORS_LEAVE_SERVER_AFTER": "5"}).server_watch
    assert watch is not None and watch.grace == 5
    assert NatsConfig.from_env(url).server_watch == DEFAULT_WATCH
    assert NatsConfig.from_env({**url, "TXACTORS_LEAVE_SERVER_AFTER": "0"}).server_watch is None
    assert NatsConfig().server_watch is None
    long_grace = NatsConfig.from_env({**url, "TXACTORS_LEAVE_SERVER_AFTER": "90"}).server_watch
    assert long_grace is not None and long_grace.max_grace == 90
    with pytest.raises(ConfigError, match="TXACTORS_LEAVE_SERVER_AFTER"):
        NatsConfig.from_env({**url, "TXACTORS_LEAVE_SERVER_AFTER": "-1"})
