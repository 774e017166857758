"""Leases: reserve, release, expiry, durability across SIGKILL, corrupt state, concurrency."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_placement import H20

from topoagent.placement import NoFit, Request
from topoagent.service.leases import LeaseConflict, LeaseError, LeaseStore


class Clock:
    """A wall clock (call it) and a boot clock (``monotonic``) that tests move apart."""

    def __init__(self, t: float = 1000.0, boot: float = 50.0):
        self.t = t
        self.boot = boot

    def __call__(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.boot

    def advance(self, seconds: float) -> None:
        """Time passes: both clocks move."""
        self.t += seconds
        self.boot += seconds

    def step(self, seconds: float) -> None:
        """Someone sets the wall clock: only it moves."""
        self.t += seconds


def fake_store(path, clock: Clock, boot_id: str = "boot-1") -> LeaseStore:
    return LeaseStore(path, clock=clock, monotonic=clock.monotonic, boot_id=boot_id)


def test_reserve_release_and_expiry(tmp_path):
    clock = Clock()
    store = fake_store(tmp_path, clock)
    lease = store.reserve("job-a", [0, 1], ttl_s=60)
    assert store.leased_gpus() == {0, 1}
    with pytest.raises(LeaseConflict, match="GPU 1 is leased to job-a"):
        store.reserve("job-b", [1, 2], ttl_s=60)
    clock.advance(61)
    assert store.leased_gpus() == set()
    again = store.reserve("job-b", [1, 2], ttl_s=60)
    assert store.release(again.id) is True
    assert store.release(again.id) is False
    assert store.release(lease.id) is False  # expired already


def test_leases_survive_a_new_store(tmp_path):
    clock = Clock()
    store = fake_store(tmp_path, clock)
    lease = store.reserve("job-a", [3], ttl_s=60)
    reopened = fake_store(tmp_path, clock)
    assert [le.id for le in reopened.leases()] == [lease.id]
    assert reopened.recovered_from is None


def test_placement_around_leases_and_processes(tmp_path):
    store = fake_store(tmp_path, Clock())
    lease, placement = store.reserve_placement(H20, Request(gpus=4), "job-a", ttl_s=60)
    assert set(lease.gpus) == set(placement.indices)
    second = store.reserve_placement(H20, Request(gpus=4), "job-b", ttl_s=60)
    assert set(second[0].gpus).isdisjoint(lease.gpus)
    third = store.reserve_placement(H20, Request(gpus=1), "job-c", ttl_s=60)
    assert isinstance(third, NoFit) and third.constraint == "gpus"
    store.release(lease.id)
    fourth = store.reserve_placement(H20, Request(gpus=2), "job-d", ttl_s=60, gpus_with_processes=lease.gpus[:3])
    assert isinstance(fourth, NoFit)  # one GPU of the released four is left; 2 wanted
    busy = store.busy(gpus_with_processes=[lease.gpus[0]])
    assert lease.gpus[0] in busy


# A bad entry in a good file is quarantined alone (tests/test_lease_clocks_and_state.py).
@pytest.mark.parametrize("content", [b"{not json", b'{"schema": 99, "leases": []}', b'{"schema": 1, "leases": {"id": 1}}', b""])
def test_corrupt_state_is_moved_aside_and_recorded(tmp_path, content):
    (tmp_path / "leases.json").write_bytes(content)
    store = LeaseStore(tmp_path)
    assert store.recovered_from is not None and store.recovered_from.read_bytes() == content
    assert not (tmp_path / "leases.json").exists()
    assert store.recovery_error and "\n" not in store.recovery_error
    store.reserve("job", [0], ttl_s=5)  # and it keeps working
    assert json.loads((tmp_path / "leases.json").read_text())["leases"][0]["gpus"] == [0]


def test_bad_arguments(tmp_path):
    store = LeaseStore(tmp_path)
    with pytest.raises(LeaseError):
        store.reserve("", [0], ttl_s=5)
    with pytest.raises(LeaseError):
        store.reserve("a", [0], ttl_s=0)
    with pytest.raises(LeaseError):
        store.reserve("a", [0, 0], ttl_s=5)


def test_concurrent_placements_never_share_a_gpu(tmp_path):
    store = LeaseStore(tmp_path)
    granted = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        for _ in range(3):
            answer = store.reserve_placement(H20, Request(gpus=2), f"job-{n}", ttl_s=600)
            if not isinstance(answer, NoFit):
                with lock:
                    granted.append(answer[0])

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gpus = [g for lease in granted for g in lease.gpus]
    assert len(gpus) == len(set(gpus)) == 8
    assert {g for le in LeaseStore(tmp_path).leases() for g in le.gpus} == set(range(8))


CHILD = """
import sys
import time
from topoagent.service.leases import LeaseStore
store = LeaseStore(sys.argv[1])
for i in range(1000):  # GPU indices up to the largest node's; then wait to be killed
    lease = store.reserve(f"job-{i}", [i], ttl_s=3600)
    print(lease.id, flush=True)
time.sleep(3600)
"""


def test_every_acknowledged_lease_survives_sigkill(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-P", "-c", CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    acked = []
    assert child.stdout is not None
    for line in child.stdout:
        acked.append(line.strip())
        if len(acked) == 40:
            os.kill(child.pid, signal.SIGKILL)
            break
    child.wait()
    # Lines still in the pipe were acknowledged too.
    acked += [line.strip() for line in child.stdout.read().splitlines() if line.strip()]
    assert child.returncode == -signal.SIGKILL
    store = LeaseStore(tmp_path)
    assert store.recovered_from is None
    held = {lease.id for lease in store.leases()}
    assert set(acked) <= held
    assert not [p for p in Path(tmp_path).iterdir() if p.name.startswith("leases.json.corrupt")]
