"""Leases under clock steps, hostile state files and disk errors (issue 14, classes 5 and 6).

The store is driven with fake clocks -- a wall clock and a boot clock that a test moves
apart -- so a step of hours costs no time.
"""

from __future__ import annotations

import errno
import json
import os

import pytest
from test_leases import Clock, fake_store

from topoagent.documents.lease import TTL_MAX_S
from topoagent.service import leases as leases_module
from topoagent.service.leases import MAX_STATE_BYTES, LeaseConflict, LeaseStore, StateUnusable

HOUR, DAY = 3600.0, 86400.0


def remaining(store: LeaseStore, lease_id: str) -> float:
    (lease,) = [le for le in store.leases() if le.id == lease_id]
    return lease.deadline - store.monotonic()


# --- class 5: wall-clock steps ------------------------------------------------------------


def test_a_clock_step_forward_while_running_frees_no_gpu(tmp_path):
    clock = Clock()
    store = fake_store(tmp_path, clock)
    lease = store.reserve("job-a", range(8), ttl_s=HOUR)
    clock.advance(60)
    clock.step(2 * HOUR)  # the +2 h step that freed a running job's 8 GPUs
    assert [le.id for le in store.leases()] == [lease.id]
    with pytest.raises(LeaseConflict):
        store.reserve("next-caller", [0], ttl_s=60)
    # /leases still says when it ends, by the clock as it reads now
    (shown,) = store.leases()
    assert shown.expires_at == pytest.approx(clock.t + HOUR - 60)
    clock.advance(HOUR - 61)
    assert store.leased_gpus() == set(range(8))
    clock.advance(2)
    assert store.leased_gpus() == set()


def test_a_clock_step_back_while_running_extends_no_lease(tmp_path):
    clock = Clock(t=1_700_000_000.0)
    store = fake_store(tmp_path, clock)
    store.reserve("job-a", [0], ttl_s=60)
    clock.step(-DAY)  # the -1 day step that made a 60 s lease last 2 h
    clock.advance(59)
    assert store.leased_gpus() == {0}
    clock.advance(2)
    assert store.leased_gpus() == set()
    store.reserve("job-b", [0], ttl_s=60)  # free for the next caller


def test_a_restart_after_a_clock_step_keeps_each_lease_to_its_deadline(tmp_path):
    clock = Clock(t=1_700_000_000.0)
    lease = fake_store(tmp_path, clock).reserve("job-a", [0, 1], ttl_s=600)
    clock.advance(100)
    for step in (2 * HOUR, -DAY):
        clock.step(step)
        restarted = fake_store(tmp_path, clock)  # same boot: the boot clock did not move
        assert remaining(restarted, lease.id) == pytest.approx(500)
        assert restarted.expire() == 1
        on_disk = json.loads((tmp_path / "leases.json").read_text())["leases"][0]
        assert on_disk["expires_at"] == pytest.approx(clock.t + 500)  # written back as it now reads


def test_two_processes_sharing_the_directory_agree_across_a_step(tmp_path):
    clock = Clock()
    a, b = fake_store(tmp_path, clock), fake_store(tmp_path, clock)
    lease = a.reserve("job-a", [0, 1, 2, 3], ttl_s=HOUR)
    clock.step(2 * HOUR)
    assert [le.id for le in b.leases()] == [lease.id]
    with pytest.raises(LeaseConflict):
        b.reserve("job-b", [3], ttl_s=60)


@pytest.mark.parametrize(
    ("step", "left"),
    [
        (100.0, 500.0),  # a plain reboot: 100 s passed by both clocks
        (-DAY, 600.0),  # the clock was set back while down: at most the TTL again
        (2 * HOUR, None),  # set forward while down: ended
    ],
)
def test_a_restart_after_a_reboot_takes_the_wall_clock_capped_by_the_ttl(tmp_path, step, left):
    clock = Clock(t=1_700_000_000.0, boot=90_000.0)
    lease = fake_store(tmp_path, clock, boot_id="boot-1").reserve("job-a", [5], ttl_s=600)
    after = Clock(t=clock.t + step, boot=30.0)  # the boot clock starts again
    rebooted = fake_store(tmp_path, after, boot_id="boot-2")
    if left is None:
        assert rebooted.leases() == []
    else:
        assert remaining(rebooted, lease.id) == pytest.approx(left)
    rebooted.expire()  # the sweep writes the new boot's deadlines back
    assert json.loads((tmp_path / "leases.json").read_text())["boot_id"] == "boot-2"


def test_a_file_from_an_older_agent_is_read_by_the_wall_clock(tmp_path):
    clock = Clock(t=1_700_000_000.0)
    old = {"schema": 1, "leases": [{"id": "abc123", "owner": "job", "gpus": [2], "created_at": clock.t - 10, "expires_at": clock.t + 50}]}
    (tmp_path / "leases.json").write_text(json.dumps(old))
    store = fake_store(tmp_path, clock)
    assert store.recovered_from is None
    assert remaining(store, "abc123") == pytest.approx(50)


# --- class 6: hostile state files ---------------------------------------------------------

NOW = 1_700_000_000.0


def _state(**lease_fields: object) -> bytes:
    lease = {"id": "abc123", "owner": "job", "gpus": [0], "created_at": NOW - 10, "expires_at": NOW + 50, **lease_fields}
    return json.dumps({"schema": 1, "leases": [lease]}).encode()


# What is not a JSON document of our schema at all: disk corruption, the file is moved aside.
HOSTILE = {
    "nested": b'{"schema": 1, "leases": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "Infinity": _state(expires_at=float("inf")),  # json.dumps writes Infinity
    "NaN": _state(created_at=float("nan")),
    "oversized": _state() + b" " * MAX_STATE_BYTES,
    "leases not a list": b'{"schema": 1, "leases": {"id": "abc123"}}',
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_state_file_is_moved_aside_and_the_store_goes_on(tmp_path, name):
    content = HOSTILE[name]
    (tmp_path / "leases.json").write_bytes(content)
    store = fake_store(tmp_path, Clock(t=NOW))
    assert store.recovered_from is not None and store.recovered_from.read_bytes() == content
    assert store.recovery_error and "\n" not in store.recovery_error and len(store.recovery_error) <= 500
    assert store.leases() == []
    store.reserve("job", [0], ttl_s=5)  # and it keeps working
    assert [le.gpus for le in store.leases()] == [(0,)]


GOOD = {"id": "good1", "owner": "victim", "gpus": [5], "gpu_uuids": ["GPU-5"], "created_at": NOW - 10, "expires_at": NOW + 3600}


def _entry(**fields: object) -> dict:
    return {"id": "abc123", "owner": "job", "gpus": [0], "created_at": NOW - 10, "expires_at": NOW + 50, **fields}


# One bad entry among good ones: (the entry, the GPUs still held for it, for how long).
BAD_ENTRIES = {
    "1e999": ('{"id": "abc123", "owner": "job", "gpus": [0], "created_at": 1, "expires_at": 1e999}', (0,), TTL_MAX_S),
    "huge integer": ('{"id": "abc123", "owner": "job", "gpus": [0], "created_at": 1, "expires_at": 1' + "0" * 400 + "}", (0,), TTL_MAX_S),
    "ttl over the maximum": (_entry(expires_at=NOW + TTL_MAX_S + 60), (0,), TTL_MAX_S),
    "ttl under the minimum": (_entry(created_at=NOW - 0.25, expires_at=NOW + 0.25), (0,), 1.0),  # held at least 1 s
    "ttl below float resolution": (_entry(created_at=NOW, expires_at=NOW + 1e-9), (), None),  # ends now, by its word
    "expires before created": (_entry(expires_at=NOW - 20), (), None),  # ended by its own word
    "negative GPU": (_entry(gpus=[-1]), (), None),
    "boolean GPU": (_entry(gpus=[True]), (), None),
    "no GPUs": (_entry(gpus=[]), (), None),
    "one GPU of two legible": (_entry(gpus=[0, "1"]), (0,), 50.0),
    "owner with a newline": (_entry(owner="job\nevent=forged"), (0,), 50.0),
    "owner with a lone surrogate": (_entry(owner="\ud800"), (0,), 50.0),
    "owner with U+2028": (_entry(owner="a\u2028b"), (0,), 50.0),
    "owner with U+202E": (_entry(owner="a\u202eb"), (0,), 50.0),
    "UUID of 200 characters": (_entry(gpu_uuids=["G" * 200]), (0,), 50.0),  # held by index
    "id with a slash": (_entry(id="../x"), (0,), 50.0),
    "deadline Infinity": (json.dumps(_entry(deadline_boottime_s=0)).replace('"deadline_boottime_s": 0', '"deadline_boottime_s": 1e999'), (0,), 50.0),
    "id listed twice": (dict(GOOD, gpus=[0], gpu_uuids=["GPU-0"]), (0,), 3600.0),
    "GPU in an earlier lease": (_entry(gpus=[5, 6], gpu_uuids=["GPU-5", "GPU-6"]), (6,), 50.0),
}


@pytest.mark.parametrize("name", BAD_ENTRIES)
def test_one_bad_entry_costs_one_entry_and_its_gpus_stay_held(tmp_path, name):
    bad, held, ttl = BAD_ENTRIES[name]
    bad_text = bad if isinstance(bad, str) else json.dumps(bad)
    (tmp_path / "leases.json").write_text(f'{{"schema": 1, "leases": [{json.dumps(GOOD)}, {bad_text}]}}')
    clock = Clock(t=NOW)
    store = fake_store(tmp_path, clock)
    assert store.recovered_from is None  # nothing moved aside
    listed = {le.id: le for le in store.leases()}
    assert listed.pop("good1").gpus == (5,)  # the good lease is kept as it was
    holds = list(listed.values())
    if held:
        (hold,) = holds
        assert hold.owner == "topoagent-quarantine" and hold.gpus == held
        assert hold.deadline - clock.monotonic() == pytest.approx(ttl)
        with pytest.raises(LeaseConflict):
            store.reserve("next", list(held), ttl_s=60)  # fail-closed: not handed out again
    else:
        assert holds == []
    (record,) = store.quarantined
    assert record["held_by"] == (holds[0].id if held else None) and record["error"]
    kept = json.loads((tmp_path / "leases.quarantine.json").read_text())["entries"]
    assert len(kept) == 1 and kept[0]["error"] == record["error"]
    assert kept[0]["entry"] == json.loads(bad_text) if "entry" in kept[0] else kept[0]["entry_text"].startswith('{"id": "abc123"')
    # Written back without the entry: the next load quarantines nothing more.
    again = fake_store(tmp_path, clock)
    assert sorted(le.id for le in again.leases()) == sorted(le.id for le in store.leases())
    assert len(again.quarantined) == 1
    assert store.reserve("next", [7], ttl_s=60).gpus == (7,)  # and the store keeps working


def test_a_quarantine_hold_is_released_like_any_lease(tmp_path):
    (tmp_path / "leases.json").write_text(json.dumps({"schema": 1, "leases": [GOOD, _entry(owner="\x85")]}))
    store = fake_store(tmp_path, Clock(t=NOW))
    (hold,) = [le for le in store.leases() if le.owner == "topoagent-quarantine"]
    assert store.release(hold.id)
    assert store.reserve("next", [0], ttl_s=60).gpus == (0,)


def test_stale_temporary_files_are_removed_at_start(tmp_path):
    store = fake_store(tmp_path, Clock(t=NOW))
    store.reserve("job", [0], ttl_s=60)
    for name in (".leases.json.4242.139.tmp", ".leases.quarantine.json.4242.139.tmp"):
        (tmp_path / name).write_text('{"schema": 1, "lea')  # a writer killed mid-write
    (tmp_path / "other.tmp").write_text("not ours")
    again = fake_store(tmp_path, Clock(t=NOW))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["leases.json", "leases.lock", "other.tmp"]
    assert [le.gpus for le in again.leases()] == [(0,)]


BAD_GRANTS = [
    ("job", [0], TTL_MAX_S + 1), ("job", [0], 1e-9), ("job", [0], 5e-324), ("job", [0], 0.5), ("job", [0], 10**400),
    ("job", [0], float("nan")), ("job\n", [0], 60), ("x" * 129, [0], 60), ("\ud800", [0], 60), ("a\u2028b", [0], 60),
    ("a\x85b", [0], 60), ("a\u202eb", [0], 60), ("  ", [0], 60), ("job", [1024], 60), ("job", [], 60),
]


def test_the_store_grants_nothing_it_would_refuse_to_load(tmp_path):
    store = fake_store(tmp_path, Clock(t=NOW))
    for owner, gpus, ttl in BAD_GRANTS:
        with pytest.raises(leases_module.LeaseError):
            store.reserve(owner, gpus, ttl_s=ttl)
    lease = store.reserve("x" * 128, [1023], ttl_s=TTL_MAX_S)
    short = store.reserve("Zoë Ω-job", [0], ttl_s=leases_module.TTL_MIN_S)
    reloaded = fake_store(tmp_path, Clock(t=NOW))
    assert sorted(le.id for le in reloaded.leases()) == sorted([lease.id, short.id])
    assert reloaded.quarantined == [] and reloaded.recovered_from is None


# --- class 6: disk errors are not corruption --------------------------------------------


def test_a_full_disk_refuses_the_lease_and_loses_nothing(tmp_path, monkeypatch):
    clock = Clock()
    store = fake_store(tmp_path, clock)
    kept = store.reserve("job-a", [0], ttl_s=600)
    before = (tmp_path / "leases.json").read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(leases_module.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        store.reserve("job-b", [1], ttl_s=600)
    assert (tmp_path / "leases.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["leases.json", "leases.lock"]  # no half-written file left
    monkeypatch.undo()
    assert [le.id for le in store.leases()] == [kept.id]  # the refused one was never held
    store.reserve("job-b", [1], ttl_s=600)


def test_an_unreadable_state_file_is_an_error_not_corruption(tmp_path):
    (tmp_path / "leases.json").symlink_to("leases.json")  # every open of the file fails (ELOOP)
    store = fake_store(tmp_path, Clock())  # starts
    with pytest.raises(OSError):
        store.leases()
    with pytest.raises(OSError):
        store.reserve("job", [0], ttl_s=60)
    assert store.recovered_from is None and (tmp_path / "leases.json").is_symlink()  # nothing moved aside


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_state_file_that_is_no_regular_file_is_moved_aside_as_corrupt(tmp_path, kind):
    path = tmp_path / "leases.json"
    path.mkdir() if kind == "directory" else os.mkfifo(path)  # a FIFO used to hang open()
    store = fake_store(tmp_path, Clock())
    assert store.recovered_from is not None and "not a regular file" in (store.recovery_error or "")
    assert store.recovered_from.is_dir() if kind == "directory" else store.recovered_from.is_fifo()
    assert store.leases() == [] and store.reserve("job", [0], ttl_s=60).gpus == (0,)  # works again
    assert path.is_file()


def test_a_state_file_that_cannot_be_moved_aside_refuses_to_work(tmp_path, monkeypatch):
    (tmp_path / "leases.json").mkdir()
    real_replace = leases_module.os.replace

    def refuse(src, dst):
        if str(src).endswith("leases.json"):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        real_replace(src, dst)

    monkeypatch.setattr(leases_module.os, "replace", refuse)
    with pytest.raises(StateUnusable, match="a directory, not a regular file, and it cannot be moved aside"):
        fake_store(tmp_path, Clock())


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_lock_file_that_is_no_regular_file_is_refused_not_waited_on(tmp_path, kind):
    path = tmp_path / "leases.lock"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    with pytest.raises(StateUnusable, match=f"a {kind.replace('fifo', 'FIFO')}, not a regular file") as refused:
        fake_store(tmp_path, Clock())
    assert refused.value.filename == str(path)  # serve's one line names it


def test_a_sweep_that_read_the_book_before_a_release_does_not_publish_the_lease_again(tmp_path):
    """The sweep reads the store in a thread; a release may finish (and publish) while that
    read is on its way back.  What the doors serve must not go back to the older book: a
    released lease reappearing, or a granted one vanishing, until the next change."""
    import asyncio
    import threading

    from topoagent.service.lease_loop import LeaseLoop
    from topoagent.service.loop import LoopHealth
    from topoagent.service.served import Board

    async def ended(lease):
        pass

    async def scenario() -> tuple[list[str], list[str]]:
        board = Board()
        loop = LeaseLoop(board, ended)
        loop.open(str(tmp_path), LoopHealth("leases"))
        store = loop.store
        assert store is not None
        lease = store.reserve("job-a", [0, 1], 3600)
        loop._took(store.numbered_leases())  # published as a reserve would
        read_done, release_done = threading.Event(), threading.Event()
        original = store.numbered_leases

        def slow_first_read():  # the sweep's read: taken now, handed back after the release
            store.numbered_leases = original
            book = original()
            read_done.set()
            release_done.wait(10)
            return book

        store.numbered_leases = slow_first_read
        sweep = asyncio.ensure_future(loop.sweep())
        await asyncio.to_thread(read_done.wait, 10)
        assert await loop.release(lease.id) is not None
        after_release = [x.id for x in board.served.leases or ()]
        release_done.set()
        await sweep
        return after_release, [x.id for x in board.served.leases or ()]

    after_release, after_sweep = asyncio.run(scenario())
    assert after_release == []
    assert after_sweep == [], "the sweep's older read put a released lease back on view"
