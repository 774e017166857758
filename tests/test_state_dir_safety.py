"""The agent's state directory as an attacker or a careless operator leaves it (issue #37,
items 1 and 2), through the real `topoagent serve` over loopback and the real writer on a
real directory: a FIFO, a link or a directory where the agent expects one of its files
never wedges or fools the store; a link planted where a write goes is never written
through; a directory others may write is refused at start, naming the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from service_helpers import DGX_A100, metric_value, start_agent

from topoagent import statefile
from topoagent.statefile import write_json_atomically


def reserve(agent, gpus: int, owner: str = "job"):
    return agent.post("/place", {"gpus": gpus, "reserve": {"owner": owner, "ttl_s": 3600}}, token=agent.token)


def serve_once(state: Path) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(DGX_A100), "--listen", "127.0.0.1:0", "--state-dir", str(state)]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


# -- item 1: every file the store opens is checked before use ---------------------------------

@pytest.mark.parametrize("kind", ["fifo", "directory", "link"])
def test_a_quarantine_file_that_is_no_regular_file_is_said_and_the_book_works_on(tmp_path, kind):
    """A FIFO there hung the agent before it listened (the quarantine file was opened plainly)."""
    state = tmp_path / "state"
    state.mkdir()
    path = state / "leases.quarantine.json"
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"schema": 1, "entries": [{"error": "planted", "held_by": None, "gpus": [7]}]}))
    {"fifo": lambda: os.mkfifo(path), "directory": path.mkdir, "link": lambda: path.symlink_to(elsewhere)}[kind]()
    agent = start_agent(tmp_path, state_dir=state)
    try:
        quarantined = agent.get("/leases").json()["quarantined"]
        expected = {"fifo": "a FIFO", "directory": "a directory", "link": "symbolic link"}[kind]
        assert expected in quarantined["unreadable"] and quarantined["entries"] == []  # the link's target is not read
        said = [line for line in agent.log().splitlines() if "event=lease_quarantine_unreadable" in line]
        assert len(said) == 1 and str(path) in said[0] and expected in said[0], said
        granted = reserve(agent, 2)
        assert granted.status == 200, granted.body
        released = agent.request("DELETE", f"/leases/{granted.json()['lease']['id']}", token=agent.token)
        assert released.status == 200
        assert agent.get("/readyz").status == 200
        assert json.loads(elsewhere.read_text())["entries"][0]["error"] == "planted"  # nothing written through
    finally:
        assert agent.stop() == 0


def test_a_fifo_put_at_the_quarantine_file_while_running_does_not_wedge_a_quarantine(tmp_path):
    """A bad entry is quarantined while a FIFO stands at the quarantine file: the store neither
    waits on it nor loses the entry's GPUs; the FIFO is replaced by the agent's own file."""
    agent = start_agent(tmp_path)
    try:
        first = reserve(agent, 1, owner="first")  # the book is on disk
        assert first.status == 200
        bad_gpu = next(g for g in range(8) if g not in first.json()["lease"]["gpus"])
        path = agent.state_dir / "leases.quarantine.json"
        os.mkfifo(path)
        book = agent.state_dir / "leases.json"
        doc = json.loads(book.read_text())
        doc["leases"].append({"id": "bad1", "owner": "job\x07", "gpus": [bad_gpu], "created_at": time.time(), "expires_at": time.time() + 600})
        book.write_text(json.dumps(doc))
        granted = reserve(agent, 1, owner="next")  # re-reads the book under the lock: quarantines
        assert granted.status == 200 and granted.json()["lease"]["gpus"] != [bad_gpu], granted.body
        leases = agent.get("/leases").json()
        holds = [lease for lease in leases["leases"] if lease["owner"] == "topoagent-quarantine"]
        assert len(leases["leases"]) == 3
        assert [h["gpus"] for h in holds] == [[bad_gpu]]
        assert path.is_file() and leases["quarantined"]["entries"][0]["held_by"] == holds[0]["id"]
    finally:
        assert agent.stop() == 0


def test_a_link_at_the_lease_book_is_not_followed(tmp_path):
    """The book a link names is not the agent's: its leases are not served, nothing is granted
    until the link is gone (503 naming the state directory), and its target is never written."""
    state = tmp_path / "state"
    state.mkdir()
    elsewhere = tmp_path / "someone-elses.json"
    now = time.time()
    planted = {"schema": 1, "leases": [{"id": "planted", "owner": "intruder", "gpus": [0, 1, 2, 3, 4, 5, 6, 7],
                                         "created_at": now, "expires_at": now + 3600}]}
    elsewhere.write_text(json.dumps(planted))
    (state / "leases.json").symlink_to(elsewhere)
    agent = start_agent(tmp_path, state_dir=state)
    try:
        assert [lease["owner"] for lease in agent.get("/leases").json()["leases"]] == []
        refused = reserve(agent, 1)
        assert refused.status == 503 and refused.json()["error"] == "state_unavailable", refused.body
        assert "symbolic link" in refused.json()["detail"] and str(state) in refused.json()["detail"]
        (state / "leases.json").unlink()
        granted = reserve(agent, 1)
        assert granted.status == 200, granted.body
        assert json.loads(elsewhere.read_text()) == planted
    finally:
        assert agent.stop() == 0


def test_a_link_at_the_lock_file_stops_the_start_in_one_line(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    target = tmp_path / "not-the-lock"
    (state / "leases.lock").symlink_to(target)
    done = serve_once(state)
    assert done.returncode == 2, (done.returncode, done.stderr)
    said = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert len(said) == 1 and "symbolic link" in said[0] and "leases.lock" in said[0], done.stderr
    assert not target.exists()  # not created through the link


# -- item 2: writes never go through a planted link, and the directory is the agent's ------------

def test_a_link_at_the_temporary_name_the_writer_used_is_not_written_through(tmp_path):
    """The old writer's temporary file was .NAME.<pid>.<thread>.tmp, visible in the directory:
    a link planted there made it truncate and overwrite the link's target."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / f".leases.json.{os.getpid()}.{threading.get_ident()}.tmp").symlink_to(victim)
    write_json_atomically(tmp_path / "leases.json", {"schema": 1, "leases": []})
    assert victim.read_text() == "precious"
    assert json.loads((tmp_path / "leases.json").read_text()) == {"schema": 1, "leases": []}
    assert (tmp_path / "leases.json").stat().st_mode & 0o777 == 0o600


def test_a_link_at_the_very_name_the_writer_picks_is_refused_not_followed(tmp_path, monkeypatch):
    """Were the random name guessed, O_EXCL|O_NOFOLLOW refuses it: the write fails, the
    target and the old file stay as they were."""
    monkeypatch.setattr(statefile.secrets, "token_hex", lambda n: "guessed")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "leases.json").write_text("old")
    (tmp_path / ".leases.json.guessed.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_json_atomically(tmp_path / "leases.json", {"schema": 1})
    assert victim.read_text() == "precious" and (tmp_path / "leases.json").read_text() == "old"


def test_two_writes_use_names_no_one_can_guess(tmp_path, monkeypatch):
    used = []
    real_replace = os.replace
    monkeypatch.setattr(statefile.os, "replace", lambda a, b: (used.append(Path(a).name), real_replace(a, b)))
    for _ in range(2):
        write_json_atomically(tmp_path / "leases.json", {})
    assert len(set(used)) == 2 and all(str(os.getpid()) not in name for name in used), used


@pytest.mark.parametrize("mode, who", [(0o770, "its group"), (0o757, "anyone"), (0o1777, "anyone")])
def test_a_state_directory_others_may_write_is_refused_naming_the_fix(tmp_path, mode, who):
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(mode)
    done = serve_once(state)
    assert done.returncode == 2, (done.returncode, done.stderr)
    said = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert len(said) == 1 and f"writable by {who}" in said[0] and f"chmod 700 {state}" in said[0], done.stderr
    assert not (state / "leases.lock").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_state_directory_another_user_owns_is_refused_naming_the_fix(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, 4242, 4242)
    done = serve_once(state)
    assert done.returncode == 2, (done.returncode, done.stderr)
    said = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert len(said) == 1 and "owned by uid 4242" in said[0] and "chown" in said[0], done.stderr


def test_a_new_state_directory_is_made_the_agents_alone(tmp_path):
    agent = start_agent(tmp_path, state_dir=tmp_path / "new" / "state")
    try:
        assert (agent.state_dir.stat().st_mode & 0o777) == 0o700
        assert reserve(agent, 1).status == 200
        assert (agent.state_dir / "leases.json").stat().st_mode & 0o777 == 0o600
        text = agent.get("/metrics").body.decode()
        assert metric_value(text, "topoagent_leased_gpus") == 1
    finally:
        assert agent.stop() == 0
