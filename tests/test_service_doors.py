"""Hostile clients at the agent's doors: slow and idle sockets, a foreign Host, a flood of
changes, stray bytes in a header, a token file others may write.  Each is met with a
bounded cost and a clear answer, never a traceback or an agent taken offline."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time

import pytest
from service_helpers import DGX_A100, Agent, metric_value, start_agent, wait_for

from topoagent.config import Config, Listen
from topoagent.connections import FD_RESERVE, ConnectionGuard, Throttled, loop_exception_handler
from topoagent.exporters.http import AllowedHosts
from topoagent.exporters.ratelimit import RateLimiter, client_key

# A health check's bound: far above an answer's milliseconds, so only an agent taken
# offline (its loop held, its descriptors spent) misses it; a miss fails the test.
HEALTHZ_TIMEOUT_S = 10.0


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fds_within(pid: int, bound: int) -> int | None:
    """The process' descriptor count when it is at most ``bound`` (for wait_for)."""
    count = fd_count(pid)
    return count if count <= bound else None


def raw(agent: Agent, data: bytes, timeout: float = 10.0, until: bytes | None = None) -> bytes:
    """Send bytes as they are; read until the agent closes (or `until` arrives)."""
    with socket.create_connection((agent.host, agent.port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
                if until is not None and until in out:
                    break
        except (TimeoutError, ConnectionResetError):
            pass
    return out


def status_of(reply: bytes) -> int:
    match = re.match(rb"HTTP/1\.[01] (\d{3}) ", reply)
    assert match, reply[:200]
    return int(match.group(1))


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# -- slow and idle clients ------------------------------------------------------------------

def test_idle_and_stalled_sockets_cannot_take_the_agent_offline(tmp_path):
    """The agent runs under an open-file limit of 384 (as a unit without LimitNOFILE runs
    under 1024); 400 sockets connect and stall, half never sending a byte, half a request
    head cut off mid-header.  Health checks still answer, the agent's descriptors stay under
    its limit, the stalled sockets are closed (evicted at the cap, or at header_timeout_s),
    and the whole episode costs the log a handful of lines."""
    limit, n, timeout_s = 384, 400, 4
    cap = limit - FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2 * n:  # this test's own end of the sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * n), hard))
    a = start_agent(tmp_path, config=f"[http]\nheader_timeout_s = {timeout_s}\nkeepalive_timeout_s = {timeout_s}\n", nofile=limit)
    socks: list[socket.socket] = []
    try:
        assert f"event=connection_cap_lowered max_connections=512 open_files_limit={limit} cap={cap}" in a.log()
        lines_before = len(a.log().splitlines())
        fds_before = fd_count(a.proc.pid)
        for i in range(n):
            sock = socket.create_connection((a.host, a.port), timeout=5)
            if i % 2:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            socks.append(sock)
        fds_peak = fd_count(a.proc.pid)  # asyncio accepts a backlog's worth before the guard sees them
        assert fds_peak < limit, (fds_before, fds_peak)
        # Once the guard has seen them: at most its cap held.
        fds_held = wait_for("the agent holding no more than its cap", lambda: fds_within(a.proc.pid, fds_before + cap + 2), a)
        # Health checks still answer, each within a liveness probe's kind of bound.
        checks = [a.get("/healthz", timeout=HEALTHZ_TIMEOUT_S).status for _ in range(10)]
        assert checks == [200] * 10, checks
        # Each stalled socket is closed by the agent (header_timeout_s, or evicted at the cap);
        # the wait is bounded, so one left open fails the test.
        give_up = time.monotonic() + timeout_s + 30
        for sock in socks:
            sock.settimeout(max(0.01, give_up - time.monotonic()))
        closed = sum(closed_by_peer(sock) for sock in socks)
        assert closed == n, f"{n - closed} stalled sockets still open long after header_timeout_s"
        fds_after = wait_for("the agent's descriptors back to where they were", lambda: fds_within(a.proc.pid, fds_before + 2), a)
        log = a.log()
        added = log.splitlines()[lines_before:]
        assert "Traceback" not in log and "Too many open files" not in log, log[-3000:]
        assert len(added) <= 6, added
        text = a.get("/metrics").body.decode()
        evicted = metric_value(text, "topoagent_http_connections_closed_total", {"reason": "evicted"})
        timed_out = metric_value(text, "topoagent_http_connections_closed_total", {"reason": "header_timeout"})
        assert evicted and evicted >= 1, text  # and those that timed out before the cap was reached
        assert timed_out and evicted + timed_out >= n, text
        assert metric_value(text, "topoagent_http_connections_limit") == cap
        print(f"\nslow clients: {n} sockets against a cap of {cap} (open-file limit {limit}): agent held {fds_held} fds "
              f"(from {fds_before}, peak seen {fds_peak}), {int(evicted)} evicted, {int(timed_out)} timed out, "
              f"fds after {fds_after}, {len(added)} log lines: {[line.split(' ', 3)[-1][:60] for line in added]}")
    finally:
        for sock in socks:
            sock.close()
        assert a.stop() == 0


def test_a_body_that_never_arrives_is_408(tmp_path):
    a = start_agent(tmp_path, config="[http]\nheader_timeout_s = 1\n")
    try:
        head = (
            "POST /place HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {a.token}\r\nContent-Length: 50\r\n\r\n"
        ).encode()
        reply = raw(a, head + b'{"gpus":', until=b"}")  # the answer comes by header_timeout_s, or raw's timeout ends it
        assert status_of(reply) == 408, reply
        assert b'"request_timeout"' in reply
        assert a.get("/leases").json() == {"leases": [], "orphaned": []}
    finally:
        assert a.stop() == 0


async def _guarded_server(cap: int, header_timeout_s: float = 5.0, keepalive_timeout_s: float = 5.0):
    """A bare aiohttp app behind the guard: /block waits until released, /ok answers."""
    from aiohttp import web

    guard = ConnectionGuard(max_connections=cap, header_timeout_s=header_timeout_s, keepalive_timeout_s=keepalive_timeout_s)
    release = asyncio.Event()
    entered: list[int] = []

    async def block(request: web.Request) -> web.Response:
        entered.append(1)
        await release.wait()
        return web.Response(text="done")

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[guard.middleware()])
    app.router.add_get("/block", block)
    app.router.add_get("/ok", ok)
    runner = web.AppRunner(app, keepalive_timeout=keepalive_timeout_s)
    await runner.setup()
    assert runner.server is not None
    listener = await guard.listen(runner.server, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    return guard, runner, listener, port, release, entered


async def _read_all(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout)


def test_past_the_cap_the_longest_idle_connection_makes_room():
    async def scenario() -> None:
        guard, runner, listener, port, _release, _entered = await _guarded_server(cap=4)
        try:
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
            await asyncio.sleep(0.1)
            assert guard.open_connections == 4
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /ok HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert (await _read_all(reader)).startswith(b"HTTP/1.1 200 ")
            assert await _read_all(idle[0][0]) == b""  # the oldest idle one was closed for it
            assert guard.stats["evicted"] == 1 and guard.stats["refused"] == 0
            for _, w in idle:
                w.close()
        finally:
            listener.close()
            await runner.cleanup()

    asyncio.run(scenario())


def test_past_the_cap_with_every_connection_busy_the_new_one_is_told_503():
    async def scenario() -> None:
        guard, runner, listener, port, release, entered = await _guarded_server(cap=3)
        try:
            busy = []
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /block HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                busy.append((reader, writer))
            while len(entered) < 3:
                await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            reply = await _read_all(reader)
            assert reply.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in reply, reply
            assert guard.stats["refused"] == 1 and guard.stats["evicted"] == 0
            release.set()
            for r, w in busy:
                assert (await asyncio.wait_for(r.readuntil(b"done"), 5)).startswith(b"HTTP/1.1 200 ")
                w.close()
        finally:
            listener.close()
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_kept_alive_connection_left_idle_is_closed():
    async def scenario() -> None:
        # The header timeout is far past the read's bound: only the keep-alive timeout can close it in time.
        guard, runner, listener, port, _release, _entered = await _guarded_server(cap=8, header_timeout_s=600, keepalive_timeout_s=2)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(2):  # kept alive: a second request on the same connection is answered
                writer.write(b"GET /ok HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert (await asyncio.wait_for(reader.readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200 ")
            assert await _read_all(reader, timeout=60) == b""
            assert guard.stats["header_timeout"] == 0 and guard.open_connections == 0, guard.stats
            writer.close()
        finally:
            listener.close()
            await runner.cleanup()

    asyncio.run(scenario())


def test_resource_errors_from_the_event_loop_are_one_line_per_interval(caplog):
    """asyncio reports each failed accept() (EMFILE) with a traceback, up to a backlog's
    worth per loop tick; the agent's handler logs one line per interval instead."""
    now = [0.0]
    handler = loop_exception_handler(Throttled(interval_s=60, clock=lambda: now[0]))
    loop = asyncio.new_event_loop()
    try:
        error = OSError(24, "Too many open files")
        with caplog.at_level(logging.INFO, logger="topoagent"):
            for _ in range(10_000):
                handler(loop, {"message": "socket.accept() out of system resource", "exception": error})
            now[0] = 61.0
            handler(loop, {"message": "socket.accept() out of system resource", "exception": error})
    finally:
        loop.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "topoagent"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("event=resource_exhausted") and "Too many open files" in lines[0]
    assert "suppressed=9999" in lines[1]


# -- the Host header ------------------------------------------------------------------------

def test_host_names_a_dns_rebinding_page_would_send_are_refused():
    hosts = AllowedHosts(Config(listen=Listen("0.0.0.0", 9477), allowed_hosts=("node7.example.org",)), hostname="gpu-node-3.cluster.local")
    for ok in ("127.0.0.1", "127.0.0.1:9477", "[::1]:9477", "[::1]", "localhost", "LOCALHOST:9477", "10.0.0.5:9477",
               "gpu-node-3", "gpu-node-3.cluster.local:9477", "node7.example.org", "node7.example.org.:9477", None):
        assert hosts.allows(ok), ok
    for bad in ("evil.example", "evil.example:9477", "127.0.0.1.evil.example", "localhost.evil.example", "[evil]:9477",
                "[::1]x", "node7.example.org:http", "", "\udce9", "10.0.0.5:9477:1"):
        assert not hosts.allows(bad), bad
    assert AllowedHosts(Config(allowed_hosts=("*",)), hostname="h").allows("anything.example")


def test_a_foreign_host_header_is_421_naming_it(tmp_path):
    a = start_agent(tmp_path, config='[http]\nallowed_hosts = ["node7.example.org"]\n', token=False)
    try:
        reply = a.get("/topology", headers={"Host": "rebind.attacker.example"})
        assert reply.status == 421
        body = reply.json()
        assert body["error"] == "misdirected_request" and "rebind.attacker.example" in body["detail"]
        assert "allowed_hosts" in body["detail"]
        for host in (f"127.0.0.1:{a.port}", f"localhost:{a.port}", "node7.example.org", socket.gethostname()):
            assert a.get("/topology", headers={"Host": host}).status == 200, host
        assert raw(a, b"GET /healthz HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 200 ")  # no Host at all: no browser
        text = a.get("/metrics").body.decode()
        assert metric_value(text, "topoagent_http_requests_refused_total", {"reason": "misdirected_host"}) == 1
    finally:
        assert a.stop() == 0


# -- the rate of changes --------------------------------------------------------------------

def test_rate_limiter_keys_refills_and_stays_bounded():
    now = [0.0]
    limiter = RateLimiter(rate_per_s=1.0, burst=2, max_clients=100, clock=lambda: now[0])
    assert limiter.take("a") == 0 and limiter.take("a") == 0
    wait = limiter.take("a")
    assert wait == pytest.approx(1.0) and RateLimiter.retry_after(wait) == 1
    now[0] += 1.0
    assert limiter.take("a") == 0
    for i in range(10_000):
        limiter.take(f"client-{i}")
    assert len(limiter) == 100
    assert client_key("2001:db8::1") == client_key("2001:db8::ffff") == "2001:db8::/64"
    assert client_key("2001:db8:0:1::1") != client_key("2001:db8::1")
    assert client_key("::ffff:10.1.2.3") == "10.1.2.3"
    assert client_key("10.1.2.3") == "10.1.2.3" and client_key(None) == "-"


def test_changes_past_the_rate_are_429_with_retry_after(tmp_path):
    # One token back every 1,000 s: three refreshes (a rediscovery each, seconds on a loaded
    # machine) cannot earn the fourth its token back before it is asked.
    a = start_agent(tmp_path, config="[http]\nrate_limit_burst = 3\nrate_limit_per_s = 0.001\n")
    try:
        for _ in range(3):
            assert a.post("/refresh", token=a.token).status == 200
        reply = a.post("/refresh", token=a.token)
        assert reply.status == 429
        assert reply.json()["error"] == "too_many_requests" and "127.0.0.1" in reply.json()["detail"]
        assert 1 <= int(reply.headers["retry-after"]) <= 1000
        body = {"gpus": 2, "reserve": {"owner": "j", "ttl_s": 60}}
        assert a.post("/place", body, token=a.token).status == 429
        assert a.request("DELETE", "/leases/nope", token=a.token).status == 429
        assert a.post("/place", body).status == 401  # no token: told so, not to wait
        assert a.post("/place", {"gpus": 2}).status == 200  # dry runs change nothing: never limited
        assert a.get("/healthz").status == 200
        text = a.get("/metrics").body.decode()
        assert metric_value(text, "topoagent_http_requests_refused_total", {"reason": "rate_limited"}) == 3
        assert a.get("/leases").json() == {"leases": [], "orphaned": []}
    finally:
        assert a.stop() == 0


# -- small doors ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def guarded(tmp_path_factory) -> Agent:
    a = start_agent(tmp_path_factory.mktemp("guarded"), config="[http]\nrequire_token_for_reads = true\n")
    yield a
    a.stop()


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("POST", "/place", b'{"gpus": 2, "reserve": {"owner": "j", "ttl_s": 60}}'),
        ("DELETE", "/leases/abc", b""),
        ("POST", "/refresh", b""),
        ("POST", "/probe", b""),
        ("GET", "/topology", b""),
        ("GET", "/metrics", b""),
    ],
)
def test_a_token_that_is_not_utf8_is_401_not_500(guarded, method, path, body):
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {len(body)}\r\n".encode()
    reply = raw(guarded, head + b"Authorization: Bearer \xe9\xff\x80\r\n\r\n" + body)
    assert status_of(reply) == 401, reply[:300]
    assert b'"unauthorized"' in reply
    log = guarded.log()
    assert " ERROR " not in log and "handler_crashed" not in log, log[-2000:]


@pytest.mark.parametrize("level", ["NV" + "1" * 4301, "NV1000", "nv" + "0" * 5000 + "7777"])
def test_an_nvlink_count_past_999_is_400_naming_min_level(guarded, level):
    reply = guarded.post("/place", {"gpus": 2, "min_level": level}, token=guarded.token)
    assert reply.status == 400, reply.body[:300]
    detail = reply.json()["detail"]
    assert detail.startswith("min_level: ") and "1 to 999" in detail and len(detail) < 300
    assert guarded.post("/place", {"gpus": 2, "min_level": "nv0012"}, token=guarded.token).status == 200


def _serve(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(DGX_A100), "--listen", "127.0.0.1:0",
         "--state-dir", str(tmp_path / "state"), *extra],
        capture_output=True, text=True, timeout=30,
    )


@pytest.mark.parametrize(
    "mode, owner, message",
    [
        (0o666, None, "writable by anyone (mode 0666); chmod 0600 it"),
        (0o620, None, "writable by its group (mode 0620); chmod 0600 it"),
        (0o600, 12345, "owned by uid 12345, not by this agent's user"),
    ],
)
def test_a_token_file_others_may_write_is_refused_at_start(tmp_path, mode, owner, message):
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    token.chmod(mode)
    if owner is not None:
        if os.geteuid() != 0:
            pytest.skip(reason="chown to another user needs root (CI runs as root)")
        os.chown(token, owner, owner)
    result = _serve(tmp_path, "--token-file", str(token))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"topoagent serve: token file {token}: ") and message in lines[0], result.stderr


def test_a_fifo_for_a_token_file_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "token"
    os.mkfifo(fifo, 0o600)
    result = _serve(tmp_path, "--token-file", str(fifo))
    assert result.returncode == 2 and "not a regular file" in result.stderr, result.stderr


def test_requiring_a_token_for_reads_without_a_token_is_refused(tmp_path):
    config = tmp_path / "t.toml"
    config.write_text("[http]\nrequire_token_for_reads = true\n")
    result = _serve(tmp_path, "--config", str(config))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("topoagent serve: http.require_token_for_reads: "), result.stderr


def test_reload_refuses_a_token_file_others_may_write_and_keeps_the_old_token(tmp_path):
    a = start_agent(tmp_path)
    token = tmp_path / "token"
    try:
        token.write_text("a-new-token-0123456789abcdef\n")
        token.chmod(0o666)
        a.proc.send_signal(signal.SIGHUP)
        line = wait_for("the reload refused", lambda: next((l for l in a.log().splitlines() if "event=reload_failed" in l), None), a)
        assert str(token) in line and "writable by anyone" in line, line
        body = {"gpus": 1, "reserve": {"owner": "j", "ttl_s": 60}}
        assert a.post("/place", body, token=a.token).status == 200  # the old token still holds
        assert a.post("/place", body, token="a-new-token-0123456789abcdef").status == 401
        token.chmod(0o600)
        a.proc.send_signal(signal.SIGHUP)
        wait_for("the reload", lambda: "event=reloaded" in a.log(), a)
        assert a.post("/place", body, token="a-new-token-0123456789abcdef").status == 200
    finally:
        assert a.stop() == 0


def test_openapi_documents_the_new_refusals(guarded):
    doc = json.loads(guarded.get("/openapi.json", token=guarded.token).body)
    for path, method in (("/place", "post"), ("/leases/{lease_id}", "delete"), ("/refresh", "post"), ("/probe", "post")):
        responses = doc["paths"][path][method]["responses"]
        assert "429" in responses and "Retry-After" in responses["429"]["headers"], path
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            assert "421" in operation["responses"], (path, method)
    assert "408" in doc["paths"]["/place"]["post"]["responses"]
