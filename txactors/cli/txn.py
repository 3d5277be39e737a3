"""The `txactors` command. Each command is a thin function here; its work lives in a module.

To add one, write `@app.command()` below with its options and import the implementation inside
the function, so `txactors --help` stays fast and one command's imports cannot break another.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

from txactors.config import DATA_DIR_ENV, FSYNC_ENV, FSYNC_INTERVAL_ENV
from txactors.errors import ConfigError, NatsServerError
from txactors.logs import LOG_FORMAT_ENV, LogFormat, configure_logging, get_logger
from txactors.settings import CONFIG_ENV, SETTINGS, CoordinatorSettings, load_settings

if TYPE_CHECKING:
    from nats.aio.client import Client

    from txactors.metrics import CoordinatorMetrics
    from txactors.protocol import Ended, ListTransactions, TransactionInfo
    from txactors.server import Fsync

T = TypeVar("T")

log = get_logger(__name__)

app = typer.Typer(
    help="Transactional messages on NATS JetStream, built from asyncio actors.",
    no_args_is_help=True,
    add_completion=False,
)


# -- options of every command: --version, --log-format ------------------------------------


def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"txactors {version('txactors')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("txactors (not installed: no version)")
        raise typer.Exit()


@app.callback()
def _main(
    log_format: Annotated[
        LogFormat | None,
        typer.Option(
            envvar=LOG_FORMAT_ENV,
            case_sensitive=False,
            help="Log lines as JSON or for the console. Default: JSON unless stderr is a terminal.",
        ),
    ] = None,
    _version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """Options of every command, given before it: `txactors --log-format json coordinator`."""
    if log_format is not None:
        # Every command configures its own logging (and its children inherit the
        # environment): the variable is how the choice reaches them all.
        os.environ[LOG_FORMAT_ENV] = log_format.value


@app.command()
def server(
    port: Annotated[
        int, typer.Option(help="Client port; 0 picks a free one.", min=0, max=65535)
    ] = 0,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="JetStream store directory (kept). Default: a temporary one, removed on exit.",
            envvar=DATA_DIR_ENV,
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    fsync: Annotated[
        str,
        typer.Option(
            metavar="[always|interval]",
            help="always: every JetStream write is on disk before it is acknowledged. "
            "interval: acknowledged at once, flushed every --fsync-interval seconds (faster; "
            "a power cut or kernel crash loses acknowledged writes).",
            envvar=FSYNC_ENV,
        ),
    ] = "always",
    fsync_interval: Annotated[
        float,
        typer.Option(
            help="Seconds between flushes with --fsync interval.", envvar=FSYNC_INTERVAL_ENV
        ),
    ] = 120.0,
) -> None:
    """Run an embedded nats-server with JetStream in the foreground until Ctrl-C or SIGTERM.

    The first line on stdout is the URL to connect to (e.g. NATS_URL for other processes).
    """
    from txactors.server import check_fsync, check_fsync_interval

    try:
        check_fsync(fsync)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--fsync") from None
    try:
        check_fsync_interval(fsync_interval)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--fsync-interval") from None
    configure_logging()
    try:
        code = asyncio.run(
            _run_server(
                port=port,
                data_dir=data_dir,
                host=host,
                fsync=fsync,  # type: ignore[arg-type]  # checked above
                fsync_interval=fsync_interval,
            )
        )
    except NatsServerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    raise typer.Exit(code)


async def _run_server(
    *, port: int, data_dir: Path | None, host: str, fsync: Fsync, fsync_interval: float
) -> int:
    from txactors.server import EmbeddedNatsServer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with EmbeddedNatsServer(
        data_dir, port=port, host=host, fsync=fsync, fsync_interval=fsync_interval
    ) as nats_server:
        typer.echo(nats_server.url)
        kept = "" if data_dir is not None else " (temporary; --data-dir to keep it)"
        flushed = (
            "fsync before every ack"
            if fsync == "always"
            else f"fsync every {fsync_interval:g}s (acked writes can be lost on a power cut)"
        )
        typer.echo(f"data dir: {nats_server.data_dir}{kept}; {flushed}; Ctrl-C to stop", err=True)
        while not stop.is_set():
            if not nats_server.running:
                typer.echo(
                    f"error: nats-server exited unexpectedly; its log:\n{nats_server.log_tail()}",
                    err=True,
                )
                return 1
            # Wake on a signal at once; otherwise look at the child twice a second.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
    return 0


def coordinator(config: Path | None = None, **flags: str | None) -> None:
    """Run the transaction coordinator (and checker) on NATS_URL, or an embedded server.

    Each setting is a flag, TXACTORS_<NAME> or a key of the --config file (in that order of
    precedence); times are in seconds.

    Stops within two seconds on Ctrl-C or SIGTERM; a crash at any point loses nothing (it
    recovers from its streams on the next start).
    """
    from txactors.metrics import CoordinatorMetrics, serve_metrics

    settings = load_settings(flags, os.environ, config)
    configure_logging(settings.process.log_level)
    port = settings.process.metrics_port
    metrics: CoordinatorMetrics | None = None
    http = None
    if port is not None:
        metrics = CoordinatorMetrics()
        try:
            http = serve_metrics(metrics.registry, port)
        except ConfigError as error:
            raise ConfigError(f"{error} (set by {settings.source('metrics_port')})") from error
    try:
        asyncio.run(_run_coordinator(settings, metrics))
    finally:
        if http is not None:
            http.shutdown()
            http.server_close()


# Typer reads a command's options from its signature: give `coordinator` one `--flag` per
# setting (text, None when not given, so the environment or the file can fill it in).
coordinator.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter(
            "config",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[
                Path | None,
                typer.Option(
                    "--config",
                    envvar=CONFIG_ENV,
                    dir_okay=False,
                    help="A TOML file of settings, e.g. `check_max = 20` (keys as in the table "
                    "of docs/operations.md).",
                ),
            ],
        ),
        *(
            inspect.Parameter(
                setting.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[
                    str | None,
                    typer.Option(
                        setting.flag,
                        metavar=setting.metavar,
                        show_default=False,
                        help=f"{setting.help} (default {setting.shown_default}; env {setting.env})",
                    ),
                ],
            )
            for setting in SETTINGS
        ),
    ]
)
app.command()(coordinator)

STOP_GRACE = 1.0
"""Seconds a stopping coordinator has to leave cleanly (give its leases back)."""
STOP_CUT = 0.5
"""Further seconds a cancelled one has to unwind before the process exits regardless."""


async def _run_coordinator(
    settings: CoordinatorSettings, metrics: CoordinatorMetrics | None
) -> None:
    from txactors.config import NatsConfig
    from txactors.connection import nats_session
    from txactors.coordinator.service import run_coordinator

    process = settings.process
    nats_config = NatsConfig.from_env(fsync=process.fsync, fsync_interval=process.fsync_interval)

    async def serve(stop: asyncio.Event) -> None:
        # Its own requests (check-backs) use the inbox prefix it answers, as the account's do.
        inbox_prefix = settings.options.inbox_prefix.removesuffix(".")
        async with (
            nats_session(nats_config, inbox_prefix=inbox_prefix) as session,
            run_coordinator(
                session.nc, config=settings.config, options=settings.options, metrics=metrics
            ),
        ):
            typer.echo(f"coordinator ready on {session.url}", err=True)
            await stop.wait()

    await _until_stopped(serve)


async def _until_stopped(work: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Run `work` until it returns, or until SIGINT/SIGTERM, which ends it in ~STOP_GRACE s.

    On a signal, `work` sees its event set and leaves cleanly. With the server gone, that
    cleanup (or a start-up still waiting for the server) would sit out NATS timeouts and
    reconnects, so after STOP_GRACE it is cancelled, and if even that does not end it within
    STOP_CUT the process exits at once: a coordinator killed at any point loses nothing.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    task = asyncio.create_task(work(stop))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        await asyncio.wait({task}, timeout=STOP_GRACE)
    if not task.done():
        log.warning("stop_cut_short", after=STOP_GRACE)
        task.cancel()
        await asyncio.wait({task}, timeout=STOP_CUT)
    if not task.done():
        log.warning("stop_forced", after=STOP_GRACE + STOP_CUT)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if not task.cancelled():
        task.result()  # its error, if it failed


# -- txactors txn: operators inspect and resolve transactions -------------------------------

txn_app = typer.Typer(
    help="Inspect and resolve transactions held by a running coordinator (`txactors coordinator`).",
    no_args_is_help=True,
)
app.add_typer(txn_app, name="txn")

TxidArgument = Annotated[str, typer.Argument(help="The transaction id.", show_default=False)]
UrlOption = Annotated[
    str | None,
    typer.Option(help="NATS server the coordinator runs on. Default: NATS_URL (one is required)."),
]
PartitionsOption = Annotated[
    int, typer.Option(help="The coordinator's partition count (its --partitions).", min=1)
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON, for scripts.")]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]


StateFilter = Annotated[
    list[str] | None,
    typer.Option(help="Only transactions in this state (repeatable), e.g. discarded."),
]
GroupFilter = Annotated[str | None, typer.Option(help="Only transactions of this producer group.")]
TopicFilter = Annotated[
    str | None, typer.Option(help="Only transactions with a message for this topic.")
]
OlderThanFilter = Annotated[
    str | None,
    typer.Option(
        metavar="AGE", help="Only transactions at least this old, e.g. 90s, 10m, 1h30m, 2d."
    ),
]
LimitOption = Annotated[
    int, typer.Option(help="At most this many, oldest first.", min=1, max=100_000)
]


def _filters(
    state: list[str] | None,
    group: str | None,
    topic: str | None,
    older_than: str | None,
    limit: int,
) -> ListTransactions:
    """The coordinator's query for these options; a bad one is a usage error naming it."""
    from txactors import admin, layout
    from txactors.coordinator.lifecycle import TxnState
    from txactors.protocol import ListTransactions

    states = state or []
    known = [s.value for s in TxnState]
    unknown = [s for s in states if s not in known]
    if unknown:
        raise typer.BadParameter(
            f"{', '.join(unknown)}; states are {', '.join(known)}", param_hint="--state"
        )
    for hint, kind, name in (("--group", "group", group), ("--topic", "topic", topic)):
        problem = None if name is None else layout.name_problem(kind, name)
        if problem is not None:
            raise typer.BadParameter(problem, param_hint=hint)
    try:
        age = None if older_than is None else admin.parse_duration(older_than)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--older-than") from None
    return ListTransactions(states=states, group=group, topic=topic, older_than=age, limit=limit)


def _described(where: ListTransactions) -> str:
    """The filters in words, for "no transaction matches (…)"."""
    from txactors.admin import human_duration

    parts = [" or ".join(where.states)] if where.states else []
    parts += [f"group {where.group}"] if where.group else []
    parts += [f"topic {where.topic}"] if where.topic else []
    if where.older_than is not None:
        parts.append(f"older than {human_duration(where.older_than)}")
    return ", ".join(parts) or "no filter"


@txn_app.command("list")
def txn_list(
    state: StateFilter = None,
    group: GroupFilter = None,
    topic: TopicFilter = None,
    older_than: OlderThanFilter = None,
    limit: LimitOption = 1000,
    partitions: PartitionsOption = 1,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """List open (prepared, checking, being decided) and discarded transactions, oldest first.

    Filters (--state, --group, --topic, --older-than) are applied by the coordinator.
    """
    from txactors import admin

    where = _filters(state, group, topic, older_than, limit)
    found = _admin_call(url, lambda nc: admin.find_transactions(nc, where, partitions=partitions))
    if as_json:
        typer.echo(admin.to_json(found.transactions))
    elif found.transactions:
        _print(admin.render_list(found.transactions))
    else:
        typer.echo(f"no open or discarded transaction matches ({_described(where)})")
    if found.more:
        typer.echo(f"{found.more} more match: raise --limit or narrow the filters", err=True)


@txn_app.command("show")
def txn_show(
    txid: TxidArgument,
    partitions: PartitionsOption = 1,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """Show everything about one open or discarded transaction."""
    from txactors import admin

    info = _admin_call(url, lambda nc: admin.show(nc, txid, partitions=partitions))
    if as_json:
        typer.echo(admin.to_json(info))
    else:
        _print(admin.render_detail(info))


@txn_app.command("resume")
def txn_resume(
    txid: TxidArgument,
    partitions: PartitionsOption = 1,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """Put a discarded or pending transaction back to prepared, with a fresh check count.

    The checker then asks its producer again; nothing is published by this command.
    """
    from txactors import admin

    ended = _admin_call(url, lambda nc: admin.resume(nc, txid, partitions=partitions))
    _print_ended(ended, as_json)


@txn_app.command("commit")
def txn_commit(
    txid: TxidArgument,
    yes: YesOption = False,
    partitions: PartitionsOption = 1,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """Commit a transaction by hand: its messages are published to their topics.

    Commit only what the producer's local transaction committed (check its database first).
    """
    from txactors import admin

    if not yes:
        _confirm(url, txid, partitions, "commit", "publishes its messages to their topics")
    ended = _admin_call(url, lambda nc: admin.commit(nc, txid, partitions=partitions))
    _print_ended(ended, as_json)


@txn_app.command("rollback")
def txn_rollback(
    txid: TxidArgument,
    yes: YesOption = False,
    partitions: PartitionsOption = 1,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """Roll a transaction back by hand: none of its messages is ever delivered."""
    from txactors import admin

    if not yes:
        _confirm(url, txid, partitions, "roll back", "means none of its messages is delivered")
    ended = _admin_call(url, lambda nc: admin.rollback(nc, txid, partitions=partitions))
    _print_ended(ended, as_json)


_EFFECTS: dict[str, str] = {
    "resume": "puts them back to prepared: the checker asks their producers again",
    "commit": "publishes their messages to their topics",
    "rollback": "means none of their messages is ever delivered",
}


@txn_app.command("resolve")
def txn_resolve(
    commit: Annotated[bool, typer.Option("--commit", help="Commit each one.")] = False,
    rollback: Annotated[bool, typer.Option("--rollback", help="Roll each one back.")] = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Resume each one (fresh check count).")
    ] = False,
    state: StateFilter = None,
    group: GroupFilter = None,
    topic: TopicFilter = None,
    older_than: OlderThanFilter = None,
    limit: LimitOption = 1000,
    yes: YesOption = False,
    partitions: PartitionsOption = 1,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """Resume, commit or roll back every transaction the filters match, e.g. all discarded ones
    of a group: shows them, asks (unless --yes), then prints each one's outcome.

    At least one filter is required. Exit 1 if any of them failed (the others are done).
    """
    from rich.console import Console

    from txactors import admin

    flags = {
        admin.Resolution.RESUME: resume,
        admin.Resolution.COMMIT: commit,
        admin.Resolution.ROLLBACK: rollback,
    }
    chosen = [resolution for resolution, on in flags.items() if on]
    if len(chosen) != 1:
        raise typer.BadParameter("give exactly one of --commit, --rollback, --resume")
    [resolution] = chosen
    if not (state or group or topic or older_than):
        raise typer.BadParameter(
            "give at least one of --state, --group, --topic, --older-than (every open "
            "transaction at once is too easy to regret)"
        )
    where = _filters(state, group, topic, older_than, limit)
    found = _admin_call(url, lambda nc: admin.find_transactions(nc, where, partitions=partitions))
    if not found.transactions:
        typer.echo(f"no transaction matches ({_described(where)}): nothing to do", err=True)
        if as_json:
            typer.echo("[]")
        return
    Console(stderr=True, width=None if sys.stderr.isatty() else 200).print(
        admin.render_list(found.transactions)
    )
    if found.more:
        typer.echo(f"{found.more} more match beyond --limit {limit}: not touched", err=True)
    count = len(found.transactions)
    question = f"{resolution.value.capitalize()} these {count} transaction(s)? "
    if not yes and not _yes(f"{question}This {_EFFECTS[resolution]} [y/N] "):
        typer.echo("not done: nothing was changed", err=True)
        raise typer.Exit(1)
    batch = admin.new_batch_id()
    txids = [info.txid for info in found.transactions]
    results = _admin_call(
        url,
        lambda nc: admin.resolve_all(nc, txids, resolution, partitions=partitions, batch=batch),
    )
    failed = [r for r in results if r.error is not None]
    if as_json:
        typer.echo(admin.to_json(results))
    else:
        for result in results:
            typer.echo(f"{result.txid}: {result.state or result.error}")
    typer.echo(
        f"{batch}: {len(results) - len(failed)} done, {len(failed)} failed "
        "(the coordinator logs each as operator_action with this batch)",
        err=True,
    )
    if failed:
        raise typer.Exit(1)


def _admin_call(url: str | None, work: Callable[[Client], Awaitable[T]]) -> T:
    """One exchange with the coordinator; exit 1 when it refuses, 2 when it cannot be asked."""
    from txactors.admin import CoordinatorUnavailable, admin_session
    from txactors.dlq_admin import DeadLetterError
    from txactors.errors import CommandError, ConfigError, NatsConnectError
    from txactors.lease_admin import NoLeases

    # Operator output stays clean; connection trouble is reported once, below.
    configure_logging(default="ERROR")

    async def run() -> T:
        async with admin_session(url) as nc:
            return await work(nc)

    try:
        return asyncio.run(run())
    except CommandError as exc:
        typer.echo(f"{exc.code}: {exc.message}", err=True)
        raise typer.Exit(1) from exc
    except (DeadLetterError, NoLeases) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    except (ConfigError, NatsConnectError, CoordinatorUnavailable) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


def _confirm(url: str | None, txid: str, partitions: int, action: str, effect: str) -> None:
    """Show what is about to be decided (on stderr, so --json output stays clean) and ask."""
    from rich.console import Console

    from txactors import admin
    from txactors.errors import CommandError

    async def find(nc: Client) -> TransactionInfo | str:
        try:
            return await admin.show(nc, txid, partitions=partitions)
        except CommandError as exc:
            return exc.message

    found = _admin_call(url, find)
    if isinstance(found, str):
        typer.echo(f"note: {found}", err=True)
    else:
        Console(stderr=True).print(admin.render_detail(found))
    if not _yes(f"{action.capitalize()} transaction {txid}? This {effect} [y/N] "):
        typer.echo(f"not done: {txid} was left as it is", err=True)
        raise typer.Exit(1)


def _yes(question: str) -> bool:
    """Ask on stderr; only `y` or `yes` is a yes."""
    # Not typer.confirm: click's prompt writes a space to stdout, which would spoil --json.
    typer.echo(question, nl=False, err=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _print(renderable: object) -> None:
    """Print to a terminal at its width; into a pipe or file, wide enough not to wrap rows."""
    from rich.console import Console

    Console(width=None if sys.stdout.isatty() else 200).print(renderable)


def _print_ended(ended: Ended, as_json: bool) -> None:
    from txactors.admin import to_json

    typer.echo(to_json(ended) if as_json else f"{ended.txid}: {ended.state}")


# -- txactors dlq: dead letters of consumer groups ------------------------------------------

dlq_app = typer.Typer(
    help="Inspect and replay dead letters: messages a consumer group gave up on (DLQ_<group>).",
    no_args_is_help=True,
)
app.add_typer(dlq_app, name="dlq")

GroupArgument = Annotated[str, typer.Argument(help="The consumer group.", show_default=False)]
NatsUrlOption = Annotated[
    str | None, typer.Option(help="The NATS server. Default: NATS_URL (one is required).")
]


@dlq_app.command("list")
def dlq_list(
    group: Annotated[
        str | None,
        typer.Argument(help="The consumer group. Without it: every group's DLQ and its size."),
    ] = None,
    start: Annotated[int, typer.Option("--from", help="First DLQ sequence to show.", min=1)] = 1,
    limit: Annotated[int, typer.Option(help="At most this many entries.", min=1)] = 100,
    as_json: JsonOption = False,
    url: NatsUrlOption = None,
) -> None:
    """List a group's dead letters, oldest first (or, without GROUP, the groups that have some)."""
    from txactors import admin, dlq_admin

    if group is None:
        summaries = _admin_call(url, dlq_admin.dlq_summaries)
        if as_json:
            typer.echo(admin.to_json(summaries))
        elif summaries:
            _print(dlq_admin.render_summaries(summaries))
        else:
            typer.echo("no dead-letter streams on this server")
        return
    page = _admin_call(
        url, lambda nc: dlq_admin.list_dead_letters(nc, group, start=start, limit=limit)
    )
    if as_json:
        typer.echo(admin.to_json(page))
    elif page.entries:
        _print(dlq_admin.render_list(page))
    else:
        typer.echo(f"no dead letters of group {group} from seq {start} on")


@dlq_app.command("show")
def dlq_show(
    group: GroupArgument,
    seq: Annotated[int, typer.Argument(help="The entry's DLQ sequence.", min=1)],
    as_json: JsonOption = False,
    url: NatsUrlOption = None,
) -> None:
    """Show one dead letter in full: the error, every header and the body."""
    from txactors import admin, dlq_admin

    entry = _admin_call(url, lambda nc: dlq_admin.show_dead_letter(nc, group, seq))
    if as_json:
        typer.echo(admin.to_json(entry))
    else:
        _print(dlq_admin.render_detail(entry))


@dlq_app.command("replay")
def dlq_replay(
    group: GroupArgument,
    seqs: Annotated[
        list[int] | None, typer.Argument(help="DLQ sequences to replay.", show_default=False)
    ] = None,
    replay_all: Annotated[
        bool, typer.Option("--all", help="Replay every entry now in the DLQ.")
    ] = False,
    yes: YesOption = False,
    as_json: JsonOption = False,
    url: NatsUrlOption = None,
) -> None:
    """Publish dead letters again to their topics, for GROUP only, and delete them from the DLQ.

    Fix the cause first: a replayed message that fails again is dead-lettered again. A replay
    repeated soon after (the entry was not deleted) is dropped by the topic stream. Exit 1 if
    any entry could not be replayed (it stays in the DLQ).
    """
    from txactors import admin, dlq_admin

    if bool(seqs) == replay_all:
        raise typer.BadParameter("give the DLQ sequences to replay, or --all (not both)")
    if replay_all:
        wanted = _admin_call(url, lambda nc: dlq_admin.all_sequences(nc, group))
        if not wanted:
            typer.echo(f"no dead letters of group {group}: nothing to replay", err=True)
            if as_json:
                typer.echo("[]")
            return
        question = f"Replay all {len(wanted)} dead letter(s) of group {group} to their topics? "
        if not yes and not _yes(f"{question}[y/N] "):
            typer.echo("not done: nothing was replayed", err=True)
            raise typer.Exit(1)
    else:
        wanted = list(seqs or [])
    results = _admin_call(url, lambda nc: dlq_admin.replay(nc, group, wanted))
    if as_json:
        typer.echo(admin.to_json(results))
    else:
        for line in dlq_admin.replay_lines(results, group):
            typer.echo(line)
    if any(result.error is not None for result in results):
        raise typer.Exit(1)


# -- txactors lease: who owns which partition -----------------------------------------------

lease_app = typer.Typer(
    help="See which coordinator owns which partition (the TXN_LEASE bucket).",
    no_args_is_help=True,
)
app.add_typer(lease_app, name="lease")


@lease_app.command("list")
def lease_list(
    partitions: Annotated[
        int | None,
        typer.Option(help="The coordinators' --partitions: also list the free ones.", min=1),
    ] = None,
    as_json: JsonOption = False,
    url: NatsUrlOption = None,
) -> None:
    """List each partition's lease: owner, revision, last renewal and when it expires."""
    from txactors import admin, lease_admin

    leases = _admin_call(url, lambda nc: lease_admin.list_leases(nc, partitions=partitions))
    if as_json:
        typer.echo(admin.to_json(leases))
    elif leases.leases:
        _print(lease_admin.render_leases(leases))
    else:
        typer.echo("no partition is leased: no coordinator is running")


# -- txactors protocol: the wire protocol, machine-readable (txactors/asyncapi.py) --------

protocol_app = typer.Typer(
    help="Describe the wire protocol for clients in other languages.", no_args_is_help=True
)
app.add_typer(protocol_app, name="protocol")


@protocol_app.command("asyncapi")
def protocol_asyncapi(
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write the document here instead of stdout."),
    ] = None,
) -> None:
    """Print the AsyncAPI 3.0 document (JSON) of every subject, message and header."""
    from txactors import asyncapi

    text = asyncapi.render()
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text, encoding="utf-8")
        typer.echo(f"wrote {output}", err=True)


# -- txactors sink: committed topics into Spark tables (spark_sinks/, the `spark` extra) ----

sink_app = typer.Typer(
    help="Stream committed topics into Parquet tables with Spark, exactly once (needs Java 17+).",
    no_args_is_help=True,
)
app.add_typer(sink_app, name="sink")

WarehouseOption = Annotated[
    Path,
    typer.Option(
        help="Tables, checkpoints and the catalog live here.", envvar="TXACTORS_WAREHOUSE"
    ),
]


@sink_app.command("run")
def sink_run(
    topics: Annotated[
        list[str], typer.Option(help="Topics to sink (comma separated or repeated).")
    ],
    warehouse: WarehouseOption = Path("warehouse"),
    schema: Annotated[
        list[str] | None,
        typer.Option(help="TOPIC=module:Struct decodes the payload into columns (repeatable)."),
    ] = None,
    once: Annotated[
        bool, typer.Option("--once", help="Catch up with the streams, then stop.")
    ] = False,
    interval: Annotated[float, typer.Option(help="Seconds between micro-batches.")] = 10.0,
    checkpoint_location: Annotated[
        Path | None,
        typer.Option(help="Query checkpoints, one per topic [default: WAREHOUSE/_checkpoints]."),
    ] = None,
    starting_offsets: Annotated[
        str,
        typer.Option(
            help='Where a new query starts: earliest, latest or {"topic": first seq} (JSON).'
        ),
    ] = "earliest",
    fail_on_data_loss: Annotated[
        bool,
        typer.Option(help="Fail when retention purged sequences not yet sunk (else skip)."),
    ] = True,
    max_offsets_per_trigger: Annotated[
        int | None, typer.Option(min=1, help="At most this many sequences per micro-batch.")
    ] = None,
    query: Annotated[str | None, typer.Option(help="SQL to show after the run.")] = None,
) -> None:
    """Sink topics from NATS_URL (or an embedded server over TXACTORS_DATA_DIR) into tables.

    Prints each batch's rows and lag; a rerun continues where the last one stopped. Options
    are those of Structured Streaming's Kafka source (docs/spark.md).
    """
    configure_logging(default="WARNING")
    with _sink_errors():
        from spark_sinks import cli as sink_cli

        sink_cli.sink_and_show(
            sink_cli.parse_schemas(topics, schema or []),
            warehouse,
            once=once,
            interval=interval,
            checkpoint_location=checkpoint_location,
            starting_offsets=starting_offsets,
            fail_on_data_loss=fail_on_data_loss,
            max_offsets_per_trigger=max_offsets_per_trigger,
            sql=query,
        )


@sink_app.command("query")
def sink_query(
    sql: Annotated[str, typer.Argument(help='e.g. "select count(*) from transfers"')],
    warehouse: WarehouseOption = Path("warehouse"),
    limit: Annotated[int, typer.Option(help="Rows to show.", min=1)] = 20,
) -> None:
    """Run SQL on the sunk tables (`<topic>`, `_rejects`) and print the result."""
    with _sink_errors():
        from spark_sinks import cli as sink_cli

        sink_cli.query(sql, warehouse, limit)


@contextlib.contextmanager
def _sink_errors() -> Iterator[None]:
    """A missing Java, a bad schema or an unreachable server: one line and exit 2."""
    from txactors.errors import TxActorsError

    try:
        yield
    except ModuleNotFoundError as exc:
        if exc.name not in ("pyspark", "pyarrow"):
            raise
        typer.echo(f"error: the sink needs {exc.name}: pip install 'txactors[spark]'", err=True)
        raise typer.Exit(2) from exc
    except TxActorsError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


# -- every command line of ours: foreseen failures are one line and an exit code ------------

# -- txactors run: a TxApp as a worker process ----------------------------------------------


@app.command()
def run(
    target: Annotated[
        str,
        typer.Argument(
            metavar="MODULE:APP",
            help="The TxApp to run, e.g. `orders.service:app` (`:app` may be left out).",
            show_default=False,
        ),
    ],
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Serve the consumers' Prometheus metrics on this port.", min=0),
    ] = None,
) -> None:
    """Run a TxApp's consumers on NATS_URL (or an embedded server) until Ctrl-C or SIGTERM.

    A signal stops them gracefully: running handlers finish and ack, then exit 0. A second
    signal stops at once (their messages are redelivered).
    """
    from txactors.metrics import serve_metrics
    from txactors.worker import load_app, run_worker

    configure_logging()
    worker = load_app(target)
    http = None if metrics_port is None else serve_metrics(worker.metrics.registry, metrics_port)
    try:
        code = asyncio.run(run_worker(worker))
    finally:
        if http is not None:
            http.shutdown()
            http.server_close()
    raise typer.Exit(code)


# The parser's own errors (a bad or unknown flag): click's ClickException, which typer vendors.
_ParserError: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"
)


def run_cli(command_line: typer.Typer) -> NoReturn:
    """Run `command_line`; each failure an operator can fix is one line on stderr, no traceback.

    Exit 2: a bad flag, environment variable, config file or setting. Exit 1: NATS could not be
    reached (or its embedded server not started). Anything else is a bug: it keeps its traceback.
    """
    try:
        code = typer.main.get_command(command_line).main(standalone_mode=False)
    except typer.Abort:
        _fail("aborted", 1)
    except Exception as error:
        known = _operator_error(error)
        if known is None:
            raise
        _fail(*known)
    sys.exit(code if isinstance(code, int) else 0)


def main() -> NoReturn:
    """The `txactors` command."""
    run_cli(app)


def _operator_error(error: BaseException) -> tuple[str, int] | None:
    """What to tell the operator about `error` and the exit code, if it is theirs to fix."""
    import nats.errors

    from txactors.errors import NatsConnectError

    if isinstance(error, BaseExceptionGroup):  # raised out of a task group
        return next(filter(None, map(_operator_error, error.exceptions)), None)
    if isinstance(error, _ParserError):
        context = getattr(error, "ctx", None)  # a UsageError knows its command
        hint = f" (see {context.command_path} --help)" if context is not None else ""
        message: str = error.format_message()  # type: ignore[attr-defined]
        return f"{message}{hint}", getattr(error, "exit_code", 2)
    if isinstance(error, ConfigError):
        return str(error), 2
    if isinstance(error, NatsConnectError | NatsServerError):
        return str(error), 1
    if isinstance(error, nats.errors.Error):
        return f"NATS: {error}", 1
    return None


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
