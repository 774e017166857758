"""One GPU, one live lease, on every load and every grant (issue #37, item 3), held through
the real `topoagent serve` over loopback on a real state directory: books an older agent,
a careless operator or an attacker could leave, and what /leases and /metrics then say."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from service_helpers import DGX_A100, metric_value, start_agent, wait_for

from topoagent.commands.discover import discover_root
from topoagent.service.leases import LeaseStore

QUARANTINE_OWNER = "topoagent-quarantine"


@pytest.fixture(scope="module")
def uuids() -> dict[int, str]:
    return {g.index: g.uuid for g in discover_root(str(DGX_A100)).gpus}


def entry(lid: str, owner: str, gpus: list, uuids: list | None = None) -> dict:
    now = time.time()
    doc = {"id": lid, "owner": owner, "gpus": gpus, "created_at": now, "expires_at": now + 3600}
    if uuids is not None:
        doc["gpu_uuids"] = uuids
    return doc


def write_book(state: Path, *entries: dict) -> None:
    state.mkdir(exist_ok=True)
    (state / "leases.json").write_text(json.dumps({"schema": 1, "leases": list(entries)}))


def held_gpus(agent) -> list[int]:
    """Every GPU index the live leases name, as often as they name it."""
    return sorted(g for lease in agent.get("/leases").json()["leases"] for g in lease["gpus"])


def quarantine_lines(agent) -> list[str]:
    return [line for line in agent.log().splitlines() if "event=lease_quarantined" in line]


SWEEP = "[leases]\nsweep_s = 0.1\n"  # a read of the book soon after discovery says where each GPU sits


def quarantined(agent) -> list[dict]:
    """The quarantine records, once a read of the book after discovery has made one."""
    return wait_for("an entry quarantined", lambda: agent.get("/leases").json().get("quarantined", {}).get("entries"), agent)


def test_one_gpu_by_uuid_and_by_index_is_held_once(tmp_path, uuids):
    """An entry by UUID and one by index alone, both GPU 0, used to load side by side:
    /leases listed GPU 0 under two owners and topoagent_leased_gpus counted it twice."""
    state = tmp_path / "state"
    write_book(state, entry("byuuid", "job-a", [0, 1], [uuids[0], uuids[1]]), entry("byindex", "job-b", [0]))
    agent = start_agent(tmp_path, state_dir=state, config=SWEEP)
    try:
        (record,) = quarantined(agent)
        doc = agent.get("/leases").json()
        assert held_gpus(agent) == [0, 1], doc
        assert [lease["owner"] for lease in doc["leases"]] == ["job-a"]
        assert "GPU 0 is also in lease byuuid" in record["error"] and record["held_by"] is None  # its GPU is held already
        text = agent.get("/metrics").body.decode()
        assert metric_value(text, "topoagent_leased_gpus") == 2
        assert metric_value(text, "topoagent_leases") == 1
        # The GPU stays taken: by index or by placement.
        taken = agent.post("/place", {"gpus": 1, "include": [0], "reserve": {"owner": "job-c", "ttl_s": 60}}, token=agent.token)
        assert taken.status == 409, taken.body
    finally:
        assert agent.stop() == 0


def test_the_index_entry_first_still_holds_the_gpu_once(tmp_path, uuids):
    state = tmp_path / "state"
    write_book(state, entry("byindex", "job-b", [3]), entry("byuuid", "job-a", [3], [uuids[3]]))
    agent = start_agent(tmp_path, state_dir=state, config=SWEEP)
    try:
        quarantined(agent)
        assert held_gpus(agent) == [3]
        assert [lease["owner"] for lease in agent.get("/leases").json()["leases"]] == ["job-b"]
    finally:
        assert agent.stop() == 0


def test_a_lease_whose_gpu_was_renumbered_keeps_it_beside_one_by_index(tmp_path, uuids):
    """Not a clash: the UUID lease was recorded at index 3, but its GPU sits at 5 now (a
    renumbering), and the lease by index holds whatever GPU is at 3.  Both stay, each GPU
    held once: quarantining one would free a GPU its job holds."""
    state = tmp_path / "state"
    write_book(state, entry("byuuid", "job-a", [3], [uuids[5]]), entry("byindex", "job-b", [3]))
    agent = start_agent(tmp_path, state_dir=state, config=SWEEP)
    try:
        taken = agent.post("/place", {"gpus": 6, "reserve": {"owner": "job-c", "ttl_s": 60}}, token=agent.token)
        assert taken.status == 200 and not {3, 5} & set(taken.json()["lease"]["gpus"]), taken.body
        doc = agent.get("/leases").json()
        assert {lease["id"] for lease in doc["leases"]} >= {"byuuid", "byindex"} and "quarantined" not in doc
        assert metric_value(agent.get("/metrics").body.decode(), "topoagent_leased_gpus") == 8
    finally:
        assert agent.stop() == 0


def test_one_uuid_named_twice_in_an_entry_is_quarantined(tmp_path, uuids):
    state = tmp_path / "state"
    write_book(state, entry("twice", "job-a", [0, 1], [uuids[0], uuids[0]]))
    agent = start_agent(tmp_path, state_dir=state)
    try:
        doc = agent.get("/leases").json()
        (hold,) = doc["leases"]
        assert hold["owner"] == QUARANTINE_OWNER and hold["gpus"] == [0]  # GPU 0 by its UUID, once; index 1 is not it
        assert "UUID is listed twice" in doc["quarantined"]["entries"][0]["error"]
    finally:
        assert agent.stop() == 0


def test_a_hold_for_a_gpu_named_twice_names_it_once_survives_its_reread_and_is_released_by_its_id(tmp_path):
    """An entry with "gpus": [2, 2] became a hold [2, 2] that re-quarantined itself at every
    read (an ERROR line and an fsync'd rewrite each, a new id each time), and DELETE of the
    id /leases showed answered 404."""
    state = tmp_path / "state"
    write_book(state, entry("dup", "job", [2, 2]))
    agent = start_agent(tmp_path, state_dir=state, config="[leases]\nsweep_s = 0.1\n")
    try:
        doc = agent.get("/leases").json()
        (hold,) = doc["leases"]
        assert hold["owner"] == QUARANTINE_OWNER and hold["gpus"] == [2]
        # Each reserve and release re-reads the book under the lock: the hold must load as written.
        for n in range(3):
            granted = agent.post("/place", {"gpus": 1, "reserve": {"owner": f"j{n}", "ttl_s": 60}}, token=agent.token)
            assert granted.status == 200 and granted.json()["lease"]["gpus"] != [2], granted.body
            assert agent.request("DELETE", f"/leases/{granted.json()['lease']['id']}", token=agent.token).status == 200
        doc = agent.get("/leases").json()
        assert [lease["id"] for lease in doc["leases"]] == [hold["id"]]
        assert len(doc["quarantined"]["entries"]) == 1 and len(quarantine_lines(agent)) == 1
        assert metric_value(agent.get("/metrics").body.decode(), "topoagent_leased_gpus") == 1
        released = agent.request("DELETE", f"/leases/{hold['id']}", token=agent.token)
        assert released.status == 200, released.body
        assert agent.get("/leases").json()["leases"] == []
        granted = agent.post("/place", {"gpus": 1, "include": [2], "reserve": {"owner": "next", "ttl_s": 60}}, token=agent.token)
        assert granted.status == 200, granted.body
    finally:
        assert agent.stop() == 0


def test_a_grant_never_writes_what_the_next_load_would_quarantine(tmp_path, uuids):
    """A lease by UUID recorded at index 4: a grant of index 4 by hand is refused, not written
    beside it (the store's own rule, as loading applies it)."""
    store = LeaseStore(tmp_path)
    write_book(tmp_path, entry("byuuid", "job-a", [4], [uuids[4]]))
    from topoagent.service.leases import LeaseConflict

    with pytest.raises(LeaseConflict, match="GPU 4 is leased to job-a"):
        store.reserve("job-b", [4], 60)
    assert [lease.id for lease in store.leases()] == ["byuuid"] and store.quarantined == []


def test_an_orphaned_lease_holds_the_gpus_it_still_has_through_every_door(tmp_path, uuids):
    """A lease whose other GPU left the node is listed as orphaned, and its GPU still on the
    node stays held: busy to the dry run, to a reserve and to /capacity alike (the dry run
    offered it while the book refused a reserve of it: one question, two answers)."""
    state = tmp_path / "state"
    gone = "GPU-00000000-0000-0000-0000-00000000dead"  # a UUID this node does not show
    write_book(state, entry("split", "job-a", [0, 1], [uuids[0], gone]))
    agent = start_agent(tmp_path, state_dir=state)
    try:
        assert agent.get("/leases").json()["orphaned"] == ["split"]
        asked = {"gpus": 1, "include": [0]}
        dry = agent.post("/place", asked)
        taken = agent.post("/place", {**asked, "reserve": {"owner": "job-b", "ttl_s": 60}}, token=agent.token)
        for reply in (dry, taken):
            assert reply.status == 409 and reply.json()["error"] == "no_fit", reply.body
            assert reply.json()["detail"] == "include: included GPU 0 is busy (GPU 0 is leased to job-a until lease split ends)"
        assert [lease["id"] for lease in agent.get("/leases").json()["leases"]] == ["split"]  # nothing granted
        other = agent.post("/place", {"gpus": 1, "reserve": {"owner": "job-b", "ttl_s": 60}}, token=agent.token)
        assert other.status == 200 and other.json()["gpus"] != [0], other.body
        capacity = wait_for("capacity figures", lambda: (r := agent.get("/capacity")).status == 200 and r.json())
        assert 0 not in capacity["free"] and len(capacity["free"]) == 6, capacity["free"]  # 8 less split's GPU 0, less job-b's
    finally:
        assert agent.stop() == 0
