"""The real `topoagent serve` against hostile state files and a state directory that fails
under it (issue 14, class 6), and its background loops under failures (class 1, in part).

Disk errors are made for real without root's immunity to permissions: the state file is
replaced by a directory, so every read and every rename onto it fails (EISDIR) -- the
sweeper sees what a read-only or full disk gives it: an OSError on each try.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from pathlib import Path

import pytest
from service_helpers import DGX_A100, Agent, metric_value, start_agent

from topoagent import agent as agent_module
from topoagent.agent import Agent as Runtime
from topoagent.agent import LoopHealth
from topoagent.config import Config
from topoagent.leases import MAX_STATE_BYTES

HOSTILE = {
    "nested": b'{"schema": 1, "leases": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "Infinity": b'{"schema": 1, "leases": [{"id": "a1", "owner": "job", "gpus": [0], "created_at": 1, "expires_at": Infinity}]}',
    "oversized": b'{"schema": 1, "leases": []}' + b" " * MAX_STATE_BYTES,
}


@pytest.mark.parametrize("name", HOSTILE)
def test_serve_starts_on_a_hostile_state_file_and_says_it_recovered(tmp_path, name):
    state = tmp_path / "state"
    state.mkdir()
    (state / "leases.json").write_bytes(HOSTILE[name])
    agent = start_agent(tmp_path, state_dir=state)  # RecursionError used to stop it here
    try:
        assert agent.get("/healthz").status == 200
        doc = agent.get("/leases").json()
        assert doc["leases"] == []  # Infinity is never served
        moved = Path(doc["recovered_from_corrupt_state"]["moved_to"])
        assert moved.read_bytes() == HOSTILE[name]
        assert sum("event=leases_corrupt" in line for line in agent.log().splitlines()) == 1
        granted = agent.post("/place", {"gpus": 8, "reserve": {"owner": "job", "ttl_s": 60}}, token=agent.token)
        assert granted.status == 200 and sorted(granted.json()["lease"]["gpus"]) == list(range(8))
    finally:
        assert agent.stop() == 0


def _wait_for(what, agent: Agent, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out; log:\n" + agent.log()[-3000:])


def test_the_lease_sweeper_survives_a_state_directory_that_fails(tmp_path):
    agent = start_agent(tmp_path, config="[leases]\nsweep_s = 0.1\n")
    state_file = agent.state_dir / "leases.json"
    sweep = {"loop": "lease_sweep"}

    def metric(name: str) -> float | None:
        return metric_value(agent.get("/metrics").body.decode(), name, sweep)

    try:
        held = agent.post("/place", {"gpus": 4, "reserve": {"owner": "job-a", "ttl_s": 3600}}, token=agent.token).json()["lease"]
        state_file.rename(state_file.with_name("kept"))
        state_file.mkdir()  # from now on every read and write of the book fails
        _wait_for(lambda: (metric("topoagent_background_loop_failures_total") or 0) >= 3, agent)
        assert metric("topoagent_background_loop_failing") == 1
        assert agent.get("/healthz").status == 200
        assert [le["id"] for le in agent.get("/leases").json()["leases"]] == [held["id"]]  # served as it was
        refused = agent.post("/place", {"gpus": 1, "reserve": {"owner": "job-b", "ttl_s": 60}}, token=agent.token)
        assert refused.status != 200  # nothing is acknowledged that is not on disk
        failed_lines = [line for line in agent.log().splitlines() if "event=loop_failed" in line]
        assert failed_lines and "loop=lease_sweep" in failed_lines[0] and "IsADirectoryError" in failed_lines[0]
        assert len(failed_lines) < (metric("topoagent_background_loop_failures_total") or 0)  # not a line per try

        state_file.rmdir()
        state_file.with_name("kept").rename(state_file)
        _wait_for(lambda: metric("topoagent_background_loop_failing") == 0, agent)
        assert "event=loop_recovered loop=lease_sweep" in agent.log()
        assert [le["id"] for le in agent.get("/leases").json()["leases"]] == [held["id"]]
        more = agent.post("/place", {"gpus": 4, "reserve": {"owner": "job-c", "ttl_s": 60}}, token=agent.token)
        assert more.status == 200 and not set(more.json()["lease"]["gpus"]) & set(held["gpus"])
    finally:
        assert agent.stop() == 0


def test_a_background_loop_outlives_every_kind_of_failure(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(agent_module, "LOOP_RETRY_MIN_S", 0.0)
    caplog.set_level(logging.INFO, logger="topoagent")
    runtime = Runtime(Config(root=str(DGX_A100), state_dir=str(tmp_path / "s")))
    now = [0.0]
    runtime.loops["lease_sweep"] = health = LoopHealth("lease_sweep", clock=lambda: now[0])
    failures: list[BaseException] = [
        OSError(errno.EROFS, os.strerror(errno.EROFS)),
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
        OSError(errno.EMFILE, os.strerror(errno.EMFILE)),
        RuntimeError("a bug"),
    ]
    calls = 0

    async def iteration() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            now[0] += 61  # a minute later: worth a line again
        if calls <= len(failures):
            raise failures[calls - 1]

    async def main() -> None:
        task = asyncio.create_task(runtime._keep_running("lease_sweep", iteration, lambda: 0.0))
        async with asyncio.timeout(10):
            while calls < 8:
                await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert health.failures == 4 and not health.failing
    said = [r.getMessage() for r in caplog.records if "event=loop_" in r.getMessage()]
    assert len(said) == 3, said  # the first failure, one a minute later, the recovery
    assert "Read-only file system" in said[0] and "Too many open files" in said[1]
    assert said[2] == "event=loop_recovered loop=lease_sweep failures=4"
