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

from topoagent import leases as leases_module
from topoagent.leases import MAX_STATE_BYTES, TTL_MAX_S, LeaseConflict, LeaseStore, StateUnusable

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


HOSTILE = {
    "nested": b'{"schema": 1, "leases": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "Infinity": _state(expires_at=float("inf")),  # json.dumps writes Infinity
    "NaN": _state(created_at=float("nan")),
    "1e999": _state().replace(str(NOW + 50).encode(), b"1e999"),
    "huge integer": _state().replace(str(NOW + 50).encode(), b"1" + b"0" * 400),
    "oversized": _state() + b" " * MAX_STATE_BYTES,
    "ttl over the maximum": _state(expires_at=NOW + TTL_MAX_S + 60),
    "expires before created": _state(expires_at=NOW - 20),
    "negative GPU": _state(gpus=[-1]),
    "boolean GPU": _state(gpus=[True]),
    "no GPUs": _state(gpus=[]),
    "owner with a newline": _state(owner="job\nevent=forged"),
    "id with a slash": _state(id="../x"),
    "deadline Infinity": _state(deadline_boottime_s=float("inf")),
    "GPU in two leases": json.dumps({"schema": 1, "leases": [
        {"id": "a", "owner": "x", "gpus": [0, 1], "created_at": NOW, "expires_at": NOW + 60},
        {"id": "b", "owner": "y", "gpus": [1], "created_at": NOW, "expires_at": NOW + 60},
    ]}).encode(),
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


def test_the_store_grants_nothing_it_would_refuse_to_load(tmp_path):
    store = fake_store(tmp_path, Clock(t=NOW))
    for owner, gpus, ttl in [("job", [0], TTL_MAX_S + 1), ("job\n", [0], 60), ("x" * 129, [0], 60), ("job", [1024], 60), ("job", [], 60)]:
        with pytest.raises(leases_module.LeaseError):
            store.reserve(owner, gpus, ttl_s=ttl)
    lease = store.reserve("x" * 128, [1023], ttl_s=TTL_MAX_S)
    assert [le.id for le in fake_store(tmp_path, Clock(t=NOW)).leases()] == [lease.id]


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
