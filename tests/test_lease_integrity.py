"""The lease store cannot refuse its own writes, and one bad entry costs one entry (issue
#25, items 1 and 2), held to it through the real `topoagent serve` over loopback.

Each attack of the issue is made against an agent that already holds leases for other
jobs (the victims); what is checked is what those jobs would see: their leases still
there after a restart, their GPUs not handed out again, /metrics still answering.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from service_helpers import Agent, make_root, metric_value, start_agent, wait_for

VICTIMS = 3


def reserve(agent: Agent, gpus: int | dict, owner: str = "job", ttl_s: object = 3600):
    body = gpus if isinstance(gpus, dict) else {"gpus": gpus}
    return agent.post("/place", {**body, "reserve": {"owner": owner, "ttl_s": ttl_s}}, token=agent.token)


def hold_victims(agent: Agent) -> dict[str, list[int]]:
    held = {}
    for n in range(VICTIMS):
        granted = reserve(agent, 1, owner=f"victim-{n}")
        assert granted.status == 200, granted.body
        held[granted.json()["lease"]["id"]] = granted.json()["lease"]["gpus"]
    return held


def leases_of(agent: Agent) -> dict[str, list[int]]:
    return {le["id"]: le["gpus"] for le in agent.get("/leases").json()["leases"]}


# The bodies the issue found granted (or a 500), each with the field its 400 must name.
RAW = '{{"gpus": 1, "reserve": {{"owner": {owner}, "ttl_s": {ttl}}}}}'
ATTACKS = {
    "ttl 1e-9": (RAW.format(owner='"m"', ttl="1e-9"), "reserve.ttl_s"),
    "ttl 5e-324": (RAW.format(owner='"m"', ttl="5e-324"), "reserve.ttl_s"),
    "ttl 0.5": (RAW.format(owner='"m"', ttl="0.5"), "reserve.ttl_s"),
    "ttl of 400 digits": (RAW.format(owner='"m"', ttl="1" + "0" * 399), "reserve.ttl_s"),
    "ttl of -400 digits": (RAW.format(owner='"m"', ttl="-1" + "0" * 399), "reserve.ttl_s"),
    "lone surrogate owner": (RAW.format(owner='"\\ud800"', ttl="60"), "reserve.owner"),
    "U+2028 owner": (RAW.format(owner='"a\\u2028event=forged"', ttl="60"), "reserve.owner"),
    "NEL owner": (RAW.format(owner='"a\\u0085event=forged"', ttl="60"), "reserve.owner"),
    "U+202E owner": (RAW.format(owner='"job\\u202egnp.exe"', ttl="60"), "reserve.owner"),
}


def test_each_attack_is_a_clear_400_and_every_other_lease_survives_a_restart(tmp_path):
    agent = start_agent(tmp_path)
    try:
        victims = hold_victims(agent)
        for name, (body, field) in ATTACKS.items():
            refused = agent.post("/place", raw=body.encode(), token=agent.token)
            assert refused.status == 400, (name, refused.status, refused.body)
            assert refused.json()["detail"].startswith(field + ":"), (name, refused.json())
        assert agent.get("/metrics").status == 200
        # The least the store takes, and printable text beyond ASCII, are granted.
        least = reserve(agent, 1, owner="Zoë-Ω job", ttl_s=1)
        assert least.status == 200 and least.json()["lease"]["expires_at"] - least.json()["lease"]["created_at"] == pytest.approx(1)
        log = agent.log()
    finally:
        assert agent.stop() == 0
    assert "handler_crashed" not in log and "Traceback" not in log
    again = start_agent(tmp_path, state_dir=agent.state_dir, token_value=agent.token)
    try:
        after = leases_of(again)
        assert {lid: after.get(lid) for lid in victims} == victims  # 3 of 3 victims survive
        doc = again.get("/leases").json()
        assert "recovered_from_corrupt_state" not in doc and "quarantined" not in doc
        metrics = again.get("/metrics")
        assert metrics.status == 200 and metric_value(metrics.body.decode(), "topoagent_leases_quarantined") == 0
    finally:
        assert again.stop() == 0


def test_a_gpu_whose_uuid_cannot_be_stored_is_unleasable_with_a_finding(tmp_path):
    root = make_root(tmp_path)
    nvml_path = root / "nvml.json"
    nvml = json.loads(nvml_path.read_text())
    long_uuid, bell_uuid = "GPU-" + "a" * 200, "GPU-\x07bell-\nevent=forged"
    nvml["gpus"][3]["uuid"], nvml["gpus"][5]["uuid"] = long_uuid, bell_uuid
    nvml_path.write_text(json.dumps(nvml))
    agent = start_agent(tmp_path, root=root)
    try:
        victims = hold_victims(agent)
        findings = [f for f in agent.get("/topology", token=agent.token).json()["findings"] if f["kind"] == "gpu-unleasable"]
        assert sorted(f["subject"] for f in findings) == ["GPU3", "GPU5"] and all(f["severity"] == "critical" for f in findings)
        assert all("cannot be stored" in f["message"] for f in findings)
        # Named, the GPU is refused (409, not granted); unnamed, the lease goes elsewhere.
        for gpu in (3, 5):
            named = reserve(agent, {"gpus": 1, "include": [gpu]})
            assert named.status == 409, named.body
        rest = reserve(agent, 8 - VICTIMS - 2)
        assert rest.status == 200 and not {3, 5} & set(rest.json()["lease"]["gpus"])
        assert reserve(agent, 1).status == 409  # every leasable GPU is leased; 3 and 5 never are
        assert agent.get("/metrics").status == 200
    finally:
        assert agent.stop() == 0
    again = start_agent(tmp_path, root=root, state_dir=agent.state_dir, token_value=agent.token)
    try:
        after = leases_of(again)
        assert {lid: after.get(lid) for lid in victims} == victims and len(after) == VICTIMS + 1
        assert "recovered_from_corrupt_state" not in again.get("/leases").json()
    finally:
        assert again.stop() == 0


def test_one_bad_entry_among_good_ones_is_quarantined_and_reported(tmp_path):
    now = time.time()
    state = tmp_path / "state"
    state.mkdir()

    def entry(lid: str, owner: str, gpu: int, ttl: float = 3600.0) -> str:
        return json.dumps({"id": lid, "owner": owner, "gpus": [gpu], "created_at": now - 5, "expires_at": now - 5 + ttl})

    good = [entry(f"good{n}", f"victim-{n}", n) for n in range(VICTIMS)]
    surrogate = entry("bad1", "x", 3).replace('"owner": "x"', '"owner": "\\ud800"')  # the GPU stays held
    ended = json.dumps({"id": "bad2", "owner": "m", "gpus": [4], "created_at": now - 5, "expires_at": now - 5 + 1e-9})
    (state / "leases.json").write_text(f'{{"schema": 1, "leases": [{good[0]}, {surrogate}, {good[1]}, {ended}, {good[2]}]}}')
    agent = start_agent(tmp_path, state_dir=state)
    try:
        doc = agent.get("/leases").json()
        assert "recovered_from_corrupt_state" not in doc  # nothing moved aside
        listed = {le["id"]: le for le in doc["leases"]}
        assert {lid: listed[lid]["gpus"] for lid in ("good0", "good1", "good2")} == {"good0": [0], "good1": [1], "good2": [2]}
        (hold,) = [le for le in listed.values() if le["owner"] == "topoagent-quarantine"]
        assert hold["gpus"] == [3] and len(listed) == VICTIMS + 1  # GPU 4's entry had ended by its own word
        quarantined = doc["quarantined"]
        assert quarantined["file"] == str(state / "leases.quarantine.json")
        by_gpus = {tuple(e["gpus"]): e for e in quarantined["entries"]}
        assert set(by_gpus) == {(3,), ()}
        assert by_gpus[(3,)]["held_by"] == hold["id"] and "owner" in by_gpus[(3,)]["error"]
        assert by_gpus[()]["held_by"] is None and "ttl_s" in by_gpus[()]["error"]
        metrics = agent.get("/metrics")
        assert metrics.status == 200 and metric_value(metrics.body.decode(), "topoagent_leases_quarantined") == 2
        more = reserve(agent, 4).json()["lease"]
        assert sorted(more["gpus"]) == [4, 5, 6, 7]  # GPU 3 is not handed out
        lines = [line for line in agent.log().splitlines() if "event=lease_quarantined" in line]
        assert len(lines) == 2 and all(line.isprintable() for line in lines)
        kept = json.loads((state / "leases.quarantine.json").read_text())["entries"]
        assert sorted(e["entry"]["id"] for e in kept) == ["bad1", "bad2"]
    finally:
        assert agent.stop() == 0
    again = start_agent(tmp_path, state_dir=state, token_value=agent.token)
    try:
        assert set(leases_of(again)) == set(listed) | {more["id"]}
        assert len(again.get("/leases").json()["quarantined"]["entries"]) == 2  # nothing more quarantined
        assert "event=lease_quarantined" not in again.log()
        released = again.request("DELETE", f"/leases/{hold['id']}", token=again.token)  # the operator frees GPU 3
        assert released.status == 200 and reserve(again, {"gpus": 1, "include": [3]}).status == 200
    finally:
        assert again.stop() == 0


@contextlib.contextmanager
def read_only_switch(state: Path):
    """Yields a function that makes ``state`` read-only (True) or writable (False) for
    the agent: a read-only remount of a tmpfs as root (root writes through modes), the
    directory's mode otherwise."""
    if os.geteuid() != 0:
        yield lambda ro: state.chmod(0o555 if ro else 0o755)
        state.chmod(0o755)
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(state)], check=True)  # a tmpfs is 1777 unless told: refused
    try:
        yield lambda ro: subprocess.run(["mount", "-o", f"remount,{'ro' if ro else 'rw'}", str(state)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def test_a_read_only_state_dir_answers_503_with_retry_after(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    with read_only_switch(state) as read_only:
        agent = start_agent(tmp_path, state_dir=state)
        try:
            victims = hold_victims(agent)
            read_only(True)
            for _ in range(3):
                refused = reserve(agent, 1)
                assert refused.status == 503, refused.body
                assert int(refused.headers["retry-after"]) > 0
                assert refused.json()["error"] == "state_unavailable" and str(state) in refused.json()["detail"]
            gone = agent.request("DELETE", f"/leases/{next(iter(victims))}", token=agent.token)
            assert gone.status == 503 and "retry-after" in gone.headers and str(state) in gone.json()["detail"]
            assert leases_of(agent) == victims and agent.get("/metrics").status == 200
            log = agent.log()
            assert "handler_crashed" not in log and "Traceback" not in log  # no line per refused request
            read_only(False)
            assert reserve(agent, 1).status == 200  # and it works again, nothing lost
            assert set(victims) <= set(leases_of(agent))
        finally:
            assert agent.stop() == 0


def test_sigkill_in_the_middle_of_saves_ten_times_loses_no_acknowledged_lease(tmp_path):
    """Ten rounds: clients reserve and release as fast as the agent answers, the agent is
    SIGKILLed while saves are under way, and a new one starts on the same state dir."""
    state = tmp_path / "state"
    agent = start_agent(tmp_path, state_dir=state)
    token = agent.token
    acked: dict[str, list[int]] = {}  # 200 received
    releasing: set[str] = set()  # DELETE sent (the kill may land before its answer)
    released: set[str] = set()  # DELETE answered 200
    temp_left = 0
    started = time.monotonic()
    try:
        for round_no in range(10):
            for lid in list(leases_of(agent)):  # room for this round's clients
                releasing.add(lid)
                if agent.request("DELETE", f"/leases/{lid}", token=token).status == 200:
                    released.add(lid)
            stop = threading.Event()
            round_acks = [0]

            def client(n: int, current: Agent = agent) -> None:
                mine: list[str] = []
                while not stop.is_set():
                    try:
                        got = reserve(current, 1, owner=f"c{n}")
                        if got.status == 200:
                            lease = got.json()["lease"]
                            acked[lease["id"]] = lease["gpus"]
                            mine.append(lease["id"])
                            round_acks[0] += 1
                        elif mine:  # node full: release one of ours and go on
                            lid = mine.pop(0)
                            releasing.add(lid)
                            if current.request("DELETE", f"/leases/{lid}", token=token).status == 200:
                                released.add(lid)
                    except (OSError, ValueError):  # the agent died under the request
                        return

            workers = [threading.Thread(target=client, args=(n,)) for n in range(4)]
            for worker in workers:
                worker.start()
            wait_for("leases granted this round", lambda r=round_no: round_acks[0] >= 3 + r, agent, timeout=30, interval=0.001)
            os.kill(agent.proc.pid, signal.SIGKILL)
            stop.set()
            for worker in workers:
                worker.join(timeout=30)
            assert agent.proc.wait(timeout=10) == -signal.SIGKILL
            temp_left += bool(list(state.glob(".leases*.tmp")))
            agent = start_agent(tmp_path, state_dir=state, token_value=token)
            after = leases_of(agent)
            lost = {lid for lid in acked if lid not in releasing and after.get(lid) != acked[lid]}
            assert not lost, f"round {round_no}: acknowledged leases lost: {lost}"
            assert not released & set(after), f"round {round_no}: an acknowledged release came back"
            assert list(state.glob(".leases*.tmp")) == [], "a killed save's temp file outlived the restart"
            assert "recovered_from_corrupt_state" not in agent.get("/leases").json()
        assert len(acked) >= 10 * 3
    finally:
        agent.stop()
    print(f"\n10 SIGKILL rounds: {len(acked)} leases acknowledged, {len(released)} releases, "
          f"{temp_left} rounds left a temp file, {time.monotonic() - started:.1f} s")
