"""The listener's bounds: how many connections the agent holds, and how long a silent one stays.

A client that connects and sends nothing, or sends a request head a byte at a time, costs
the agent a file descriptor for as long as the connection lives; enough of them used to
exhaust the open-file limit, after which every accept failed (a traceback each) and even
/healthz timed out.  So every connection passes through `ConnectionGuard`:

* a connection must deliver a whole request head within `header_timeout_s` of connecting,
  and the next one within `keepalive_timeout_s` of the previous answer, or it is closed
  (aiohttp's own keep-alive timer is set as well; this one holds whichever aiohttp runs);
* at most `cap` connections are held.  A new one past the cap closes the connection idle
  the longest (waiting for a request head), so a health check always gets in while stalled
  clients hold the slots; when every connection is busy in a request the new one is told
  503 and closed;
* the cap stays below the process' open-file limit, so accept() itself never runs out.

What was closed is counted (`stats`, on /metrics) and logged at most once a minute, never
a line per connection.  `Throttled` gives the same bound to resource errors the event
loop reports (EMFILE, ENFILE on accept).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from topoagent.log import event_line, log_event

if TYPE_CHECKING:
    from ssl import SSLContext

# Descriptors kept for everything but client connections: the listener, leases and their
# lock, sysfs reads in discovery threads, udev's netlink socket, probe worker pipes, logs;
# and room for what asyncio holds before the guard can act.  It accepts up to BACKLOG
# connections per wake-up, and a connection reaches the guard (connection_made) two loop
# turns after its accept, a closed one frees its descriptor a turn after that: under a
# flood up to four batches are in flight beyond the connections the guard counts.
BACKLOG = 64
FD_RESERVE = 64 + 4 * BACKLOG
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
LOG_INTERVAL_S = 60.0

_BUSY_BODY = b'{"error": "unavailable", "detail": "the agent holds as many connections as it is allowed; retry"}'
BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY
)


class Throttled:
    """Log an event at most once per `interval_s` per key; the next line that is let
    through says how many were held back (`suppressed=N`)."""

    MAX_KEYS = 64

    def __init__(self, interval_s: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._state: dict[Any, tuple[float, int]] = {}

    def __call__(self, key: Any, event: str, level: int = logging.WARNING, **fields: Any) -> bool:
        now = self._clock()
        last, held = self._state.get(key, (None, 0))
        if last is not None and now - last < self.interval_s:
            self._state[key] = (last, held + 1)
            return False
        if held:
            fields["suppressed"] = held
        if key not in self._state and len(self._state) >= self.MAX_KEYS:
            self._state.pop(next(iter(self._state)))
        self._state[key] = (now, 0)
        log_event(event, level, **fields)
        return True


def loop_exception_handler(throttled: Throttled) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """An event-loop exception handler: a resource error (out of file descriptors, of
    buffers) is one line per interval and kind instead of a traceback per occurrence;
    everything else goes to asyncio's default handler unchanged."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
            where = str(context.get("message") or "-")
            throttled((exc.errno, where), "resource_exhausted", logging.ERROR, error=f"{type(exc).__name__}: {exc}", where=where)
            return
        loop.default_exception_handler(context)

    return handle


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (systemd starts services at 1024 soft);
    returns the soft limit now in force.  Under a seccomp filter that forbids setrlimit
    the limit stays as it is: the unit sets LimitNOFILE itself."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class _Connection(asyncio.Protocol):
    """One client connection: admitted (or refused) by the guard, then handed to aiohttp."""

    __slots__ = ("guard", "handler", "timer", "transport")

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard
        self.handler: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.guard.admit(self):
            self.handler = self.guard.new_handler()
            self.handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        if self.handler is not None:
            self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.handler is not None:
            self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()


class ConnectionGuard:
    """Admits connections up to a cap and closes those that stay silent too long."""

    def __init__(self, *, max_connections: int, header_timeout_s: float, keepalive_timeout_s: float, open_files: int | None = None) -> None:
        self._server: web.Server | None = None
        self._conns: dict[asyncio.Transport, _Connection] = {}
        # Connections waiting for a request head, longest-waiting first.
        self._idle: OrderedDict[_Connection, float] = OrderedDict()
        self.stats = {"accepted": 0, "header_timeout": 0, "keepalive_timeout": 0, "evicted": 0, "refused": 0}
        self._throttled = Throttled()
        self.configure(max_connections=max_connections, header_timeout_s=header_timeout_s, keepalive_timeout_s=keepalive_timeout_s, open_files=open_files)

    def configure(self, *, max_connections: int, header_timeout_s: float, keepalive_timeout_s: float, open_files: int | None = None) -> None:
        """Set the bounds (start-up, SIGHUP); `open_files` is the process' descriptor limit."""
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.keepalive_timeout_s = keepalive_timeout_s
        if open_files is not None:
            self.open_files = open_files
        limit = getattr(self, "open_files", None)
        self.cap = max_connections if limit is None else max(1, min(max_connections, limit - FD_RESERVE))
        if self.cap < max_connections:
            log_event("connection_cap_lowered", logging.WARNING, max_connections=max_connections, open_files_limit=limit, cap=self.cap,
                      reason=f"the open-file limit holds {FD_RESERVE} descriptors back for the agent itself and for accepting; raise LimitNOFILE")

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    # -- the listener ---------------------------------------------------------------------
    async def listen(self, server: web.Server, host: str, port: int, ssl: SSLContext | None = None) -> asyncio.Server:
        """Serve `server` (the runner's aiohttp server) on host:port through this guard;
        with `ssl`, over TLS, whose handshake has `header_timeout_s` too (a connection
        reaches the guard once its handshake is done)."""
        self._server = server
        loop = asyncio.get_running_loop()
        tls: dict[str, Any] = {"ssl": ssl, "ssl_handshake_timeout": self.header_timeout_s} if ssl is not None else {}
        return await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True, backlog=BACKLOG, **tls)

    def new_handler(self) -> asyncio.Protocol:
        assert self._server is not None
        return self._server()

    def admit(self, conn: _Connection) -> bool:
        transport = conn.transport
        assert transport is not None
        if len(self._conns) >= self.cap and not self._evict_one():
            self.stats["refused"] += 1
            self._throttled("refused", "connections_refused", logging.WARNING, cap=self.cap, open=len(self._conns),
                            reason="every connection is busy in a request")
            transport.write(BUSY_RESPONSE)
            transport.close()
            return False
        self.stats["accepted"] += 1
        self._conns[transport] = conn
        self._wait_for_head(conn, self.header_timeout_s, "header_timeout")
        return True

    def forget(self, conn: _Connection) -> None:
        if conn.transport is not None:
            self._conns.pop(conn.transport, None)
        self._idle.pop(conn, None)
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None

    # -- request boundaries (the app's middleware calls these) ---------------------------
    def request_started(self, transport: asyncio.BaseTransport | None) -> None:
        conn = self._conns.get(transport) if isinstance(transport, asyncio.Transport) else None
        if conn is None:
            return
        self._idle.pop(conn, None)
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None

    def request_finished(self, transport: asyncio.BaseTransport | None) -> None:
        conn = self._conns.get(transport) if isinstance(transport, asyncio.Transport) else None
        if conn is not None:
            self._wait_for_head(conn, self.keepalive_timeout_s, "keepalive_timeout")

    def middleware(self) -> Any:
        guard = self

        @web.middleware
        async def track_requests(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
            guard.request_started(request.transport)
            try:
                return await handler(request)
            finally:
                guard.request_finished(request.transport)

        return track_requests

    # -- internals -----------------------------------------------------------------------
    def _wait_for_head(self, conn: _Connection, timeout_s: float, reason: str) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
        loop = asyncio.get_running_loop()
        self._idle.pop(conn, None)
        self._idle[conn] = loop.time()
        conn.timer = loop.call_later(timeout_s, self._close_silent, conn, reason)

    def _close_silent(self, conn: _Connection, reason: str) -> None:
        conn.timer = None
        if conn not in self._idle:
            return  # a request started meanwhile
        self.stats[reason] += 1
        self._throttled(reason, "slow_clients_closed", logging.INFO, reason=reason, closed_total=self.stats[reason],
                        timeout_s=self.header_timeout_s if reason == "header_timeout" else self.keepalive_timeout_s)
        self._drop(conn)

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest for a request head, if any."""
        if not self._idle:
            return False
        conn = next(iter(self._idle))
        self.stats["evicted"] += 1
        self._throttled("evicted", "connections_at_cap", logging.WARNING, cap=self.cap, evicted_total=self.stats["evicted"],
                        reason="closing the longest-idle connection for a new one")
        self._drop(conn)
        return True

    def _drop(self, conn: _Connection) -> None:
        transport = conn.transport
        self.forget(conn)
        if transport is not None:
            transport.abort()  # close() would wait for a client that never reads


class OneLineProtocolErrors(logging.Filter):
    """aiohttp logs a request its parser rejects (a bad Content-Length, a malformed
    request line) with a multi-line traceback, before any handler or middleware runs,
    and answers it itself in plain text.  Keep such a line to one `event=` line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "-"
        first = " ".join(str(getattr(exc, "message", "") or exc).split())
        status = getattr(exc, "code", "")
        level = logging.WARNING if status == 400 else record.levelno
        record.msg = event_line("http_protocol_error", remote=remote, status=status, error=f"{type(exc).__name__}: {first}"[:300])
        record.args = ()
        record.exc_info = None
        record.exc_text = None
        record.levelno, record.levelname = level, logging.getLevelName(level)
        return True
