"""The real `topoagent serve` against hostile state files and a state directory that fails
under it (issue 14, class 6), and its background loops under failures (class 1, in part).

Disk errors are made for real without root's immunity to permissions: the state file is
replaced by a symbolic link to itself, so every open of it fails (ELOOP) -- the sweeper
sees what a read-only or full disk gives it: an OSError on each try.  (A directory or a
FIFO in its place is no disk error: it is moved aside as corrupt, tested below.)
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from service_helpers import DGX_A100, metric_value, start_agent, wait_for

from topoagent.config import Config
from topoagent.service import loop as loop_module
from topoagent.service.agent import Agent as Runtime
from topoagent.service.leases import MAX_STATE_BYTES
from topoagent.service.loop import LoopHealth

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



@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_serve_moves_aside_a_state_file_that_is_no_regular_file(tmp_path, kind):
    """A directory used to leave the agent with no leases, nothing said, and every
    reservation a 500; a FIFO hung it in open() before it listened."""
    state = tmp_path / "state"
    state.mkdir()
    path = state / "leases.json"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    agent = start_agent(tmp_path, state_dir=state)
    try:
        doc = agent.get("/leases").json()
        recovered = doc["recovered_from_corrupt_state"]
        assert "not a regular file" in recovered["error"] and Path(recovered["moved_to"]).exists()
        assert sum("event=leases_corrupt" in line for line in agent.log().splitlines()) == 1
        assert metric_value(agent.get("/metrics").body.decode(), "topoagent_leases_recovered_from_corrupt_state") == 1
        granted = agent.post("/place", {"gpus": 2, "reserve": {"owner": "job", "ttl_s": 60}}, token=agent.token)
        assert granted.status == 200, granted.body
        assert path.is_file()
    finally:
        assert agent.stop() == 0


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_serve_refuses_a_lock_file_that_is_no_regular_file_with_one_line(tmp_path, kind):
    state = tmp_path / "state"
    state.mkdir()
    lock = state / "leases.lock"
    lock.mkdir() if kind == "directory" else os.mkfifo(lock)
    args = [sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(DGX_A100), "--listen", "127.0.0.1:0", "--state-dir", str(state)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)  # a FIFO must not hang it
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    said = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert len(said) == 1 and str(lock) in said[0] and "not a regular file" in said[0], done.stderr
    assert "Traceback" not in done.stderr


def test_the_lease_sweeper_survives_a_state_directory_that_fails(tmp_path):
    agent = start_agent(tmp_path, config="[leases]\nsweep_s = 0.1\n")
    state_file = agent.state_dir / "leases.json"

    def failed_lines() -> list[str]:
        return [line for line in agent.log().splitlines() if "event=loop_failed" in line]

    try:
        held = agent.post("/place", {"gpus": 4, "reserve": {"owner": "job-a", "ttl_s": 3600}}, token=agent.token).json()["lease"]
        # From now on every read of the book fails (ELOOP): a link to itself takes the file's place
        # in one rename, so no sweep in between reads a missing book (that is, an empty one).
        shutil.copy2(state_file, state_file.with_name("kept"))
        loop = state_file.with_name("loop")
        loop.symlink_to(state_file.name)
        loop.rename(state_file)
        wait_for("the sweeps failing", failed_lines, agent)
        assert "loop=lease_sweep" in failed_lines()[0] and "Too many levels of symbolic links" in failed_lines()[0]
        refused = agent.post("/place", {"gpus": 1, "reserve": {"owner": "job-b", "ttl_s": 60}}, token=agent.token)
        assert refused.status != 200  # nothing is acknowledged that is not on disk
        # It keeps answering while the sweeper fails (and retries, once a second).
        for _ in range(10):
            assert agent.get("/healthz").status == 200
            assert [le["id"] for le in agent.get("/leases").json()["leases"]] == [held["id"]]  # served as it was

        state_file.unlink()
        state_file.with_name("kept").rename(state_file)
        wait_for("the sweeper recovered", lambda: "event=loop_recovered loop=lease_sweep failures=" in agent.log(), agent)
        # One line for the episode however many tries it took (a line a minute at most:
        # test_a_background_loop_outlives_every_kind_of_failure counts them on its own clock).
        assert len(failed_lines()) == 1, failed_lines()
        assert [le["id"] for le in agent.get("/leases").json()["leases"]] == [held["id"]]
        more = agent.post("/place", {"gpus": 4, "reserve": {"owner": "job-c", "ttl_s": 60}}, token=agent.token)
        assert more.status == 200 and not set(more.json()["lease"]["gpus"]) & set(held["gpus"])
    finally:
        assert agent.stop() == 0


def test_a_background_loop_outlives_every_kind_of_failure(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(loop_module, "LOOP_RETRY_MIN_S", 0.0)
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


# --- class 5: the wall clock steps under a running agent ---------------------------------------

# Loaded by the child before topoagent: its wall clock (time.time) reads the real one plus
# an offset the test sets with SIGUSR1.  The boot clock is left alone, as a step leaves it.
STEPPABLE_CLOCK = '''
import signal, time
_real, _offset = time.time, [0.0]
def _step(signum, frame):
    with open(__file__ + ".offset") as f:
        _offset[0] = float(f.read())
signal.signal(signal.SIGUSR1, _step)
time.time = lambda: _real() + _offset[0]
'''


def test_wall_clock_steps_neither_free_nor_stretch_a_running_agents_leases(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STEPPABLE_CLOCK)
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    agent = start_agent(tmp_path, config="[leases]\nsweep_s = 0.1\n", env=env)

    def step_to(offset: float) -> None:
        (site / "sitecustomize.py.offset").write_text(str(offset))
        agent.proc.send_signal(signal.SIGUSR1)

    def reserve(gpus: int, ttl_s: float):
        return agent.post("/place", {"gpus": gpus, "reserve": {"owner": "job", "ttl_s": ttl_s}}, token=agent.token)

    def listed() -> list[dict]:
        return agent.get("/leases").json()["leases"]

    try:
        job = reserve(8, 3600).json()["lease"]
        step_to(2 * 3600)  # +2 h: the step that handed a running job's 8 GPUs to the next caller
        # /leases follows the step (expires_at moves with it) once the sweeper has looked
        wait_for("the lease extended by the step", lambda: listed() and listed()[0]["expires_at"] > job["expires_at"] + 3600, agent)
        assert [le["id"] for le in listed()] == [job["id"]]
        assert reserve(1, 60).status == 409
        assert agent.get("/healthz").status == 200

        assert agent.request("DELETE", f"/leases/{job['id']}", token=agent.token).status == 200
        assert reserve(1, 2).status == 200
        step_to(-86400)  # -1 day: the step that made a 60 s lease last 2 h
        wait_for("the lease ended", lambda: not listed(), agent)  # ends on its own, within the bounded wait
        assert reserve(8, 60).status == 200  # its GPU is free again, with the others
        assert agent.get("/healthz").status == 200
    finally:
        assert agent.stop() == 0
