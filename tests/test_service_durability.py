"""Leases under load and across crashes; signals as systemd sends them."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import aiohttp
from service_helpers import make_root, metric_value, start_agent, wait_for, wedge

# 50 clients on one address making 1000 changes in seconds: past the default rate limit
# per client address (tests/test_service_doors.py holds that limit), which is not what
# these tests measure.
UNLIMITED = "[http]\nrate_limit_burst = 100000\nrate_limit_per_s = 10000\n"


async def _reserve(session: aiohttp.ClientSession, url: str, token: str, gpus: int, owner: str):
    body = {"gpus": gpus, "reserve": {"owner": owner, "ttl_s": 3600}}
    async with session.post(f"{url}/place", json=body, headers={"Authorization": f"Bearer {token}"}) as resp:
        return resp.status, (await resp.json())


def test_1000_concurrent_reservations_from_50_clients_never_share_a_gpu(tmp_path):
    agent = start_agent(tmp_path, config=UNLIMITED)
    held_intervals: list[tuple[float, float, frozenset[int]]] = []
    statuses: list[int] = []

    async def client(n: int) -> None:
        async with aiohttp.ClientSession() as session:
            for k in range(20):
                status, doc = await _reserve(session, agent.url, agent.token, 1 + (n + k) % 3, f"c{n}")
                statuses.append(status)
                if status == 200:
                    got = time.monotonic()
                    lease = doc["lease"]
                    await asyncio.sleep(0.002 * (k % 3))
                    released_at = time.monotonic()  # before the DELETE is sent
                    async with session.delete(f"{agent.url}/leases/{lease['id']}", headers={"Authorization": f"Bearer {agent.token}"}) as resp:
                        assert resp.status == 200
                    held_intervals.append((got, released_at, frozenset(lease["gpus"])))

    async def main() -> None:
        await asyncio.gather(*(client(n) for n in range(50)))

    try:
        asyncio.run(main())
        assert len(statuses) == 1000
        assert set(statuses) <= {200, 409}
        assert statuses.count(200) >= 8
        # Two leases that were held at the same moment (as the clients saw it) never
        # share a GPU; the server held each at least as long.
        held_intervals.sort()
        for i, (_start, end, gpus) in enumerate(held_intervals):
            for start2, _end2, gpus2 in held_intervals[i + 1 :]:
                if start2 >= end:
                    break
                assert not gpus & gpus2, "a GPU was leased twice"
        assert agent.get("/leases").json() == {"leases": [], "orphaned": []}
    finally:
        agent.stop()


def test_without_releases_exactly_the_node_is_handed_out(tmp_path):
    agent = start_agent(tmp_path, config=UNLIMITED)

    async def main() -> list[tuple[int, dict]]:
        async def client(n: int):
            async with aiohttp.ClientSession() as session:
                return [await _reserve(session, agent.url, agent.token, 1, f"c{n}") for _ in range(20)]

        results = await asyncio.gather(*(client(n) for n in range(50)))
        return [r for rs in results for r in rs]

    try:
        results = asyncio.run(main())
        granted = [doc["lease"]["gpus"][0] for status, doc in results if status == 200]
        assert sorted(granted) == list(range(8))
        assert sum(1 for status, _ in results if status == 409) == 992
    finally:
        agent.stop()


def test_kill_9_mid_stream_loses_no_acknowledged_lease(tmp_path):
    agent = start_agent(tmp_path)
    acked: dict[str, list[int]] = {}
    released: set[str] = set()  # release acknowledged
    releasing: set[str] = set()  # release sent (the kill may land before the answer)
    stop = threading.Event()

    async def client(n: int) -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                try:
                    status, doc = await _reserve(session, agent.url, agent.token, 1, f"c{n}")
                    if status == 200:
                        acked[doc["lease"]["id"]] = doc["lease"]["gpus"]
                        if len(acked) % 3 == 0:  # release some, so the book churns
                            lid = doc["lease"]["id"]
                            releasing.add(lid)
                            async with session.delete(f"{agent.url}/leases/{lid}", headers={"Authorization": f"Bearer {agent.token}"}) as resp:
                                if resp.status == 200:
                                    released.add(lid)
                    else:
                        # node full: free the oldest we know of and go on
                        for lid in list(acked):
                            if lid not in releasing:
                                releasing.add(lid)
                                async with session.delete(f"{agent.url}/leases/{lid}", headers={"Authorization": f"Bearer {agent.token}"}) as resp:
                                    if resp.status == 200:
                                        released.add(lid)
                                break
                except (TimeoutError, aiohttp.ClientError):
                    return

    async def main() -> None:
        tasks = [asyncio.create_task(client(n)) for n in range(8)]
        # Mid-stream: once the stream has granted a good many (not after a fixed time, which a
        # loaded machine turns into a handful), bounded so a stuck agent still fails the test.
        give_up = time.monotonic() + 60
        while len(acked) <= 12 and time.monotonic() < give_up:
            await asyncio.sleep(0.01)
        os.kill(agent.proc.pid, signal.SIGKILL)
        stop.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert agent.proc.wait(timeout=10) == -signal.SIGKILL
    assert len(acked) > 8, "the stream should have granted many leases before the kill"
    again = start_agent(tmp_path, state_dir=agent.state_dir, token_value=agent.token)
    try:
        after = {l["id"]: l["gpus"] for l in again.get("/leases").json()["leases"]}
        for lid, gpus in acked.items():
            if lid not in releasing:
                assert after.get(lid) == gpus, f"acknowledged lease {lid} lost"
        assert not (released & set(after)), "an acknowledged release came back"
    finally:
        again.stop()


def test_sigterm_drains_in_flight_requests_and_exits_0(tmp_path):
    agent = start_agent(tmp_path, root=make_root(tmp_path), config="[discovery]\ntimeout_s = 3\n")
    wedge(agent.root)
    result: dict = {}

    def slow_request() -> None:
        result["reply"] = agent.post("/refresh", token=agent.token)

    worker = threading.Thread(target=slow_request)
    worker.start()
    wait_for("the refresh's discovery stuck on the wedged read", agent.wedged_reads, agent)
    agent.proc.send_signal(signal.SIGTERM)
    worker.join(timeout=20)
    assert agent.proc.wait(timeout=20) == 0
    assert result["reply"].status == 200
    assert result["reply"].json()["stale"] is True
    log = agent.log()
    assert "event=draining" in log and "event=stopped" in log


def test_sighup_reloads_config(tmp_path):
    agent = start_agent(tmp_path, config="[http]\nrequire_token_for_reads = false\n")
    try:
        assert agent.get("/topology").status == 200
        (tmp_path / "topoagent.toml").write_text("[http]\nrequire_token_for_reads = true\n")
        agent.proc.send_signal(signal.SIGHUP)
        wait_for("reads refused without the token", lambda: agent.get("/topology").status == 401, agent)
        assert agent.get("/topology", token=agent.token).status == 200
        # a broken file is refused and the running config stays
        (tmp_path / "topoagent.toml").write_text("[http]\nrequire_token_for_reads = 3\n")
        agent.proc.send_signal(signal.SIGHUP)
        wait_for("the broken file refused", lambda: "event=reload_failed" in agent.log(), agent)
        assert "http.require_token_for_reads" in agent.log()
        assert agent.get("/topology").status == 401
    finally:
        assert agent.stop() == 0


def test_corrupt_lease_state_is_moved_aside_said_once_and_exposed(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "leases.json").write_bytes(b'{"schema": 1, "leases": [{"id": ')
    a = start_agent(tmp_path, state_dir=state)
    try:
        assert a.get("/readyz").status == 200  # it still serves, with no leases
        doc = a.get("/leases").json()
        assert doc["leases"] == []
        recovered = doc["recovered_from_corrupt_state"]
        assert recovered["file"] == str(state / "leases.json")
        moved = Path(recovered["moved_to"])
        assert moved.parent == state and moved.read_bytes() == b'{"schema": 1, "leases": [{"id": '
        text = a.get("/metrics").body.decode()
        assert metric_value(text, "topoagent_leases_recovered_from_corrupt_state") == 1
        log = a.log().splitlines()
        lines = [l for l in log if "event=leases_corrupt" in l]
        assert len(lines) == 1 and all(" event=" in l for l in log), a.log()  # one line, no stray text
        assert "event=leases_corrupt" in lines[0] and f"file={state / 'leases.json'}" in lines[0] and f"moved_to={moved}" in lines[0]
    finally:
        a.stop()
    # The next start finds a good (empty or rewritten) file and says nothing of it.
    b = start_agent(tmp_path, state_dir=state)
    try:
        assert "recovered_from_corrupt_state" not in b.get("/leases").json()
        assert metric_value(b.get("/metrics").body.decode(), "topoagent_leases_recovered_from_corrupt_state") == 0
    finally:
        b.stop()
