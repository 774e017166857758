"""`topoagent serve`: run the agent as a service (HTTP API + Prometheus metrics)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from topoagent.commands.token import warn_if_readable_by_others
from topoagent.config import DEFAULT_LISTEN, Config, ConfigError, load_config
from topoagent.errors import UsageError
from topoagent.smallfile import read_small_file

if TYPE_CHECKING:
    from topoagent.service.agent import Agent

EPILOG = f"""\
examples:
  topoagent serve --config /etc/topoagent/topoagent.toml   # as systemd runs it
  # a recorded node, on a free port it prints:
  topoagent serve --root node.tar.gz --listen 127.0.0.1:0 --state-dir /tmp/ta
  curl -s 'http://{DEFAULT_LISTEN}/topology?format=matrix'
  curl -s -d '{{"gpus": 4}}' http://{DEFAULT_LISTEN}/place   # a dry run
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve",
        help="run the agent: /topology, /place, /leases and /metrics over HTTP",
        # Wrapped here: RawDescriptionHelpFormatter (for the examples) keeps lines as written.
        description=(
            "Discover the node (or replay a recorded one with --root), keep the topology\n"
            "current, and serve it over HTTP. Flags override the config file. SIGHUP\n"
            "reloads the config; SIGTERM drains requests and exits 0."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML configuration (see systemd/topoagent.toml)")
    parser.add_argument("--root", metavar="DIR|TARBALL", help='node to read: "/" (live, default) or a recorded snapshot')
    parser.add_argument("--listen", metavar="HOST:PORT", help=f"address to serve on (default {DEFAULT_LISTEN})")
    parser.add_argument("--state-dir", metavar="DIR", help="where leases are kept (default /var/lib/topoagent)")
    parser.add_argument("--token-file", metavar="FILE", help="bearer token for mutating endpoints; without it they are off")
    parser.add_argument("--probes", choices=("off", "cpu", "cuda"), help="measure links in a child process with this backend ([probes] in the config)")
    parser.set_defaults(run=run)


def _overrides(args: argparse.Namespace) -> dict:
    return {"root": args.root, "listen": args.listen, "state_dir": args.state_dir, "token_file": args.token_file, "probes": args.probes}


def with_credential_token(config: Config) -> Config:
    """No token_file set, but systemd handed us one (`LoadCredential=token:...`): use it.

    The unit runs as a DynamicUser, which cannot read a root-owned 0600 file; systemd
    copies the credential into $CREDENTIALS_DIRECTORY readable by the service alone."""
    if config.token_file is not None:
        return config
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return config
    candidate = Path(directory) / "token"
    return replace(config, token_file=str(candidate)) if candidate.is_file() else config


def read_token(path: str | None) -> bytes:
    """The bearer token from its file, refused (as sshd's StrictModes refuses an
    authorized_keys file) when anyone but this agent's user or root could have written
    it: whoever can write the token can reserve.  A token others may read is a leak too,
    but only warned about (``warn_if_readable_by_others``): Kubernetes Secret volumes are
    world-readable unless the manifest says otherwise."""
    if path is None:
        return b""
    try:
        raw, info = read_small_file(path, 64 * 1024)
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc.strerror}") from None
    problem = token_file_problem(info)
    if problem:
        raise ConfigError(f"token file {path}: {problem}")
    token = raw.strip()
    if len(token) > 64 * 1024:
        raise ConfigError(f"token file {path}: more than 64 KiB; expected one token")
    if len(token) < 16:
        raise ConfigError(f"token file {path}: the token must be at least 16 characters")
    warn_if_readable_by_others(path, info)
    return token


def token_file_problem(info: os.stat_result) -> str | None:
    """Why a token file cannot be trusted, or None."""
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    from topoagent.statefile import owner_or_mode_problem

    return owner_or_mode_problem(info, chown="chown it", chmod="chmod 0600 it")


def checked(config: Config, token: bytes) -> Config:
    """Settings that only make sense together."""
    if config.require_token_for_reads and not token:
        raise ConfigError("http.require_token_for_reads: set, but there is no token (http.token_file, --token-file or the systemd credential); reads would be open")
    return config


def setup_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        # journald adds time and unit; a <N> prefix sets the priority (sd-daemon(3)).
        class Journal(logging.Formatter):
            PRIO: ClassVar[dict[int, int]] = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

            def format(self, record: logging.LogRecord) -> str:
                return f"<{self.PRIO.get(record.levelno, 6)}>{record.getMessage()}"

        handler.setFormatter(Journal())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger("topoagent")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    # aiohttp's access log is one line per request: too loud for journald by default.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    from topoagent.connections import OneLineProtocolErrors

    logging.getLogger(HTTP_LOGGER).addFilter(OneLineProtocolErrors())


HTTP_LOGGER = "topoagent.http"  # aiohttp's server logger for this agent (AppRunner logger=)


def run(args: argparse.Namespace) -> int:
    from topoagent.log import level_named, log_event

    setup_logging(level_named(getattr(args, "log_level", None), logging.INFO))
    try:
        config = with_credential_token(load_config(args.config, _overrides(args)))
        token = read_token(config.token_file)
        checked(config, token)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    from topoagent.service.agent import RootError

    temporary = replaying_without_state_dir(config)
    if temporary:  # a recording's leases are the replay's alone: never the node's /var/lib/topoagent
        config = replace(config, state_dir=tempfile.mkdtemp(prefix="topoagent-replay-"))
        log_event("temporary_state_dir", state_dir=config.state_dir, reason="a replay (--root) without --state-dir")
    try:
        return asyncio.run(serve(config, token, args, temporary_state_dir=temporary))
    except RootError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:  # anything not caught in serve(): still name what failed
        raise UsageError(f"cannot start: {os_error_text(exc, '-')}") from None
    finally:
        if temporary:  # the replay's leases end with it
            shutil.rmtree(config.state_dir)


def replaying_without_state_dir(config: Config) -> bool:
    """A replay (--root a recording) whose state directory neither --state-dir nor the
    config file's [leases] state_dir chose."""
    return not config.live and "state_dir" not in config.given


def os_error_text(exc: OSError, context: str) -> str:
    """`PATH: reason`; the path from the error, else `context` (the state dir, the address)."""
    reason = exc.strerror or str(exc)
    if exc.filename is not None:
        target = f"{exc.filename} -> {exc.filename2}" if exc.filename2 is not None else str(exc.filename)
        return f"{target}: {reason}"
    if exc.strerror and exc.errno is not None and str(exc) != f"[Errno {exc.errno}] {exc.strerror}":
        reason = str(exc).removeprefix(f"[Errno {exc.errno}] ")  # asyncio's bind error names the address
    return f"{context}: {reason}"


async def print_reserve_example(agent: Agent, base: str, token_file: str | None) -> None:
    """The banner's reserve line, asking for as many GPUs as the node has, 4 at most."""
    await agent.board.has_snapshot.wait()
    snapshot = agent.snapshot
    gpus = min(4, len(snapshot.node.gpus)) if snapshot is not None else 0
    if gpus:
        example = f'{{"gpus": {gpus}, "reserve": {{"owner": "me", "ttl_s": 600}}}}'
        print(f"  reserve   curl -H \"Authorization: Bearer $(cat {token_file})\" -d '{example}' {base}/place", flush=True)


async def serve(config: Config, token: bytes, args: argparse.Namespace, *, temporary_state_dir: bool = False) -> int:
    from aiohttp import web

    from topoagent.connections import ConnectionGuard, Throttled, loop_exception_handler, raise_open_file_limit
    from topoagent.exporters.http import TOKEN, make_app
    from topoagent.log import log_event
    from topoagent.service.agent import Agent

    loop = asyncio.get_running_loop()
    # Out of descriptors (or buffers), asyncio reports every failed accept() with a
    # traceback, up to a backlog's worth a tick: one line a minute says it as well.
    loop.set_exception_handler(loop_exception_handler(Throttled()))
    guard = ConnectionGuard(
        max_connections=config.max_connections, header_timeout_s=config.header_timeout_s,
        keepalive_timeout_s=config.keepalive_timeout_s, open_files=raise_open_file_limit(),
    )
    agent = Agent(config)
    app = make_app(agent, token, guard=guard)
    runner = web.AppRunner(
        app, shutdown_timeout=config.drain_timeout_s, access_log=None, logger=logging.getLogger(HTTP_LOGGER),
        keepalive_timeout=config.keepalive_timeout_s,
        # After an early answer (413, 408) aiohttp reads and drops the unread body this
        # long before closing; a client sending it slowly is not waited on longer.
        lingering_time=min(10.0, config.header_timeout_s),
    )
    try:
        await runner.setup()  # starts the agent (cleanup_ctx): root, leases, discovery
    except OSError as exc:  # the state dir: missing parent, not a directory, read-only
        raise UsageError(f"cannot start: {os_error_text(exc, f'state dir {config.state_dir}')}") from None
    assert runner.server is not None
    try:
        # Our own listener (not web.TCPSite): every connection passes through the guard.
        listener = await guard.listen(runner.server, config.listen.host, config.listen.port)
    except OSError as exc:  # port in use, address not on this host
        await runner.cleanup()
        raise UsageError(f"cannot start: {os_error_text(exc, f'listen {config.listen}')}") from None
    port = listener.sockets[0].getsockname()[1] if listener.sockets else config.listen.port
    host = config.listen.host
    base = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    log_event("listening", url=base, root=config.root, state_dir=config.state_dir, token_file=config.token_file or "-")
    if not token:
        log_event("mutating_endpoints_off", logging.WARNING, reason="no --token-file: reservations, releases and refreshes are refused (403)")
    print(f"topoagent serving {config.root} on {base}", flush=True)
    for label, path in (("picture", "/"), ("topology", "/topology"), ("matrix", "/topology?format=matrix"), ("metrics", "/metrics"), ("leases", "/leases"), ("API", "/openapi.json")):
        print(f"  {label:9} {base}{path}", flush=True)
    if temporary_state_dir:
        print(f"  state     {config.state_dir} (a replay without --state-dir: a temporary directory)", flush=True)
    if not token:
        print("  (no --token-file: reservations are off; POST /place answers dry runs)", flush=True)
    if config.probes_enabled:
        print(f"  probes    {config.probe_backend} backend; POST {base}/probe (token) measures now", flush=True)
    print("  Ctrl-C or SIGTERM stops it; SIGHUP reloads the config", flush=True)
    # The example request once the node's GPUs are known: one that fits it.
    example = asyncio.create_task(print_reserve_example(agent, base, config.token_file)) if token else None

    stop = asyncio.Event()

    def on_hup() -> None:
        try:
            new = with_credential_token(load_config(args.config, _overrides(args)))
            if temporary_state_dir:  # still the replay's own
                new = replace(new, state_dir=config.state_dir)
            new_token = read_token(new.token_file)
            checked(new, new_token)
        except ConfigError as exc:
            log_event("reload_failed", logging.ERROR, error=exc, kept="the running configuration and token")
            return
        restart = agent.reload(new)
        guard.configure(max_connections=new.max_connections, header_timeout_s=new.header_timeout_s, keepalive_timeout_s=new.keepalive_timeout_s)
        app[TOKEN].value = new_token
        log_event("reloaded", config=args.config or "-", needs_restart=",".join(restart) or "none")

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, on_hup)
    await stop.wait()
    if example is not None:
        example.cancel()
    log_event("draining", timeout_s=config.drain_timeout_s)
    agent.begin_stop()  # requests waiting for capacity figures answer now
    listener.close()  # no new connections; those open are drained by the runner
    await runner.cleanup()  # closes idle connections, waits for in-flight requests, stops the agent
    log_event("stopped")
    if agent.abandoned_runs:
        # A discovery cut off by its timeout may still sit in a read that never returns
        # (a wedged device); Python would wait for that thread at exit forever.  Every
        # lease is already on disk, so leave now.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)
    return 0
