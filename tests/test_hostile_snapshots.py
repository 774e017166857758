"""Poisoned recordings, a --root that is not confined, old kernels (issue 14, classes 2, 4, 7).

Each attack runs against the real `topoagent serve` or the real CLI, loopback only: the
agent must keep answering /healthz, stay within a memory bound, leak no byte of a file
outside its root, and keep its leases.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import resource
import signal
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest
from fakenode import FakeNode
from service_helpers import TOPO_RECORDING, Agent, make_root, start_agent, wait_for, wedge

from topoagent.collectors.numa import read_numa
from topoagent.node import host as host_module
from topoagent.node.cpulist import MAX_CPUS, CpuListError, parse_cpulist, parse_cpumask
from topoagent.node.host import Host, HostError

NODE0 = "sys/devices/system/node/node0"
SECRET = "s3cret-root:$6$not-for-your-eyes"
# The agent serving the DGX A100 recording sits at ~45 MB; the attacks below cost 2 to
# 15 GB before they were bounded.  Peak RSS (VmHWM) must stay under this.
SERVE_MEMORY_BOUND_MB = 200
# `topoagent discover` runs under this address-space limit, so a regression fails with a
# MemoryError instead of taking the test machine's memory.
CLI_ADDRESS_SPACE = 2 << 30


def proc_status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as handle:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in handle)}


def peak_rss_mb(agent: Agent) -> int:
    return int(proc_status(agent.proc.pid)["VmHWM"].split()[0]) // 1024


def children_of(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(p) for p in (task / "children").read_text().split()}
    return found


def every_response(agent: Agent) -> str:
    """What an unauthenticated reader (and an operator) can see."""
    bodies = [agent.get(p).body.decode(errors="replace") for p in ("/topology", "/metrics", "/leases", "/")]
    return "\n".join(bodies) + agent.log()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CLI_ADDRESS_SPACE, CLI_ADDRESS_SPACE))

    return subprocess.run([sys.executable, "-P", "-m", "topoagent", *args], capture_output=True, text=True,
                          timeout=120, preexec_fn=limit)


@pytest.fixture
def secret(tmp_path) -> Path:
    path = tmp_path / "outside" / "shadow"
    path.parent.mkdir()
    path.write_text(SECRET + "\nsecond line " + SECRET + "\n")
    return path


def lease_one(agent: Agent) -> dict:
    reply = agent.post("/place", {"gpus": 2, "reserve": {"owner": "job-7", "ttl_s": 600}}, token=agent.token)
    assert reply.status == 200, reply.body
    return reply.json()["lease"]


def assert_held(agent: Agent, lease: dict) -> None:
    assert agent.get("/healthz").status == 200
    leases = agent.get("/leases").json()["leases"]
    assert [(entry["id"], entry["gpus"]) for entry in leases] == [(lease["id"], lease["gpus"])]
    assert agent.post("/place", {"gpus": 2}).status == 200  # still placing on the last good facts


# --- class 2: poisoned contents --------------------------------------------------------------


def test_cpu_lists_are_bounded_with_a_clear_error():
    assert parse_cpulist(f"0-{MAX_CPUS - 1}") == frozenset(range(MAX_CPUS))
    for text, words in [
        ("0-4000000000", "CPU '4000000000' is not below 65,536"),
        ("7" + "0" * 5000, r"CPU '70000.*… is not below 65,536"),
        (",".join(["0-60000"] * 3), "names more than 65,536 CPUs"),
        ("+1", "is not a CPU number"),
    ]:
        with pytest.raises(CpuListError, match=words) as caught:
            parse_cpulist(text)
        assert len(str(caught.value)) < 200
    assert parse_cpumask("00000000,0000ffff") == frozenset(range(16))
    with pytest.raises(CpuListError, match="at most 2,048"):
        parse_cpumask(",".join(["ffffffff"] * 4096))
    with pytest.raises(CpuListError, match="not a 32-bit hexadecimal word"):
        parse_cpumask("1" * 5000)


def test_discover_refuses_a_poisoned_cpulist_naming_the_file(tmp_path):
    root = make_root(tmp_path)
    (root / NODE0 / "cpulist").write_text("0-4000000000")
    result = run_cli("discover", "--json", "--root", str(root))
    assert result.returncode == 0, result.stderr[-2000:]
    numa = json.loads(result.stdout)["collectors"]["numa"]
    assert numa["status"] == "error"
    assert numa["message"].startswith("/sys/devices/system/node/node0/cpulist: ")
    assert "4000000000" in numa["message"] and "65,536" in numa["message"]


def test_serve_survives_a_poisoned_cpulist_and_keeps_its_leases(tmp_path):
    agent = start_agent(tmp_path, root=make_root(tmp_path))
    try:
        lease = lease_one(agent)
        (agent.root / NODE0 / "cpulist").write_text("0-4000000000")
        reply = agent.post("/refresh", token=agent.token).json()
        assert reply["stale"] is True
        assert "node0/cpulist" in reply["error"] and "65,536" in reply["error"]
        assert_held(agent, lease)
        assert peak_rss_mb(agent) < SERVE_MEMORY_BOUND_MB
    finally:
        assert agent.stop() == 0


def test_timed_out_discoveries_leave_no_thread_and_no_process_behind(tmp_path):
    agent = start_agent(tmp_path, root=make_root(tmp_path), config="[discovery]\ntimeout_s = 30\ninterval_s = 3600\n")
    try:
        lease = lease_one(agent)
        threads = int(proc_status(agent.proc.pid)["Threads"])
        # Short timeouts from now on (SIGHUP), and a read that never returns.
        (tmp_path / "topoagent.toml").write_text("[discovery]\ntimeout_s = 0.5\ninterval_s = 3600\n")
        agent.proc.send_signal(signal.SIGHUP)
        wait_for("the reload", lambda: "event=reloaded" in agent.log(), agent)
        wedge(agent.root)
        for _ in range(10):
            reply = agent.post("/refresh", token=agent.token).json()
            assert reply["stale"] is True and "timed out" in reply["error"]
        # A thread per timed-out run would be 10 more (the old runner left ~4 each); the
        # pool asyncio keeps for short blocking calls may grow by one or two under load.
        assert int(proc_status(agent.proc.pid)["Threads"]) <= threads + 2
        assert children_of(agent.proc.pid) == set()  # every run's process was killed and reaped
        assert_held(agent, lease)
        assert peak_rss_mb(agent) < SERVE_MEMORY_BOUND_MB
    finally:
        assert agent.stop() == 0


def test_tarballs_are_capped_in_members_and_size(tmp_path, monkeypatch):
    many = tmp_path / "many.tar.gz"
    with tarfile.open(many, "w:gz") as archive:
        for n in range(30):
            member = tarfile.TarInfo(f"node/sys/f{n}")
            archive.addfile(member)
    big = tmp_path / "big.tar.gz"
    with tarfile.open(big, "w:gz") as archive:
        member = tarfile.TarInfo("node/sys/blob")
        member.size = 4096
        archive.addfile(member, fileobj=BytesIO(b"\0" * 4096))
    monkeypatch.setattr(host_module, "MAX_TARBALL_MEMBERS", 20)
    monkeypatch.setattr(host_module, "MAX_TARBALL_BYTES", 1024)
    with pytest.raises(HostError, match="more than 20 members"):
        Host(many)
    with pytest.raises(HostError, match="unpacks to more than"):
        Host(big)


def header_bomb(path: Path, kind: bytes, size: int) -> Path:
    """A gzip tarball of one extended header of ``size`` bytes (``kind``: a PAX header, a GNU
    long name or long link) before one empty file: a few hundred KB that tarfile would read
    whole into memory."""
    header = tarfile.TarInfo("././@PaxHeader" if kind in (tarfile.XHDTYPE, tarfile.XGLTYPE) else "././@LongLink")
    header.type, header.size = kind, size
    if kind in (tarfile.XHDTYPE, tarfile.XGLTYPE):  # one well-formed record: "LEN comment=aaa...\n"
        head, filler = f"{size} comment=".encode(), size - len(f"{size} comment=") - 1
        tail = b"\n"
    else:
        head, filler, tail = b"", size - 1, b"\0"
    chunk = b"a" * (1 << 20)
    with gzip.open(path, "wb", compresslevel=1) as out:
        out.write(header.tobuf(tarfile.USTAR_FORMAT))
        out.write(head)
        while filler > 0:
            out.write(chunk[: min(filler, len(chunk))])
            filler -= len(chunk)
        out.write(tail + b"\0" * (-size % tarfile.BLOCKSIZE))
        out.write(tarfile.TarInfo("node/sys/after").tobuf(tarfile.USTAR_FORMAT) + b"\0" * (2 * tarfile.BLOCKSIZE))
    return path


def peak_rss_of_cli_mb(*args: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """`topoagent ARGS` run from a fresh process whose only child it is: (its result, the
    child's peak RSS in MB, from that process's RUSAGE_CHILDREN)."""
    measure = (
        "import resource, subprocess, sys, json\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=120)\n"
        "print(json.dumps([done.returncode, done.stdout[-2000:], done.stderr[-2000:],"
        " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))\n"
    )

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CLI_ADDRESS_SPACE, CLI_ADDRESS_SPACE))

    ran = subprocess.run([sys.executable, "-c", measure, sys.executable, "-P", "-m", "topoagent", *args],
                         capture_output=True, text=True, timeout=180, preexec_fn=limit, check=True)
    code, out, err, peak_kb = json.loads(ran.stdout)
    return subprocess.CompletedProcess(args, code, out, err), peak_kb // 1024


# A `topoagent discover` of a small recording peaks at ~40 MB; the bombs below are 200 MB.
CLI_MEMORY_BOUND_MB = 150


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK],
                         ids=["pax", "gnu-long-name", "gnu-long-link"])
def test_a_200_mb_extended_header_is_refused_before_it_is_read(tmp_path, kind):
    bomb = header_bomb(tmp_path / "bomb.tar.gz", kind, 200 << 20)
    assert bomb.stat().st_size < 2 << 20
    done, peak_mb = peak_rss_of_cli_mb("discover", "--root", str(bomb))
    assert peak_mb < CLI_MEMORY_BOUND_MB, f"discover of a {bomb.stat().st_size:,}-byte bomb peaked at {peak_mb} MB"
    assert done.returncode != 0
    assert "headers" in done.stderr and "not a recorded node" in done.stderr, done.stderr[-300:]
    assert "Traceback" not in done.stderr


def pax_record(key: str, value: str) -> bytes:
    """One PAX record, "LEN key=value\\n", LEN counting its own digits too."""
    body = f" {key}={value}\n"
    length = len(body) + 1
    while len(f"{length}{body}") != length:
        length += 1
    return f"{length}{body}".encode()


def test_a_sparse_map_without_end_is_refused_within_the_header_bound(tmp_path):
    # A PAX 1.0 sparse member: its map (count, then offset/size pairs) opens its data, and
    # tarfile reads it block by block until the count is reached: here 10^9 entries, 50 MB.
    bomb = tmp_path / "sparse.tar.gz"
    pax = tarfile.TarInfo("././@PaxHeader")
    records = b"".join(pax_record(k, v) for k, v in (("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0")))
    pax.type, pax.size = tarfile.XHDTYPE, len(records)
    member = tarfile.TarInfo("node/sys/sparse")
    member.size = 50 << 20
    with gzip.open(bomb, "wb", compresslevel=1) as out:
        out.write(pax.tobuf(tarfile.USTAR_FORMAT) + records + b"\0" * (-len(records) % tarfile.BLOCKSIZE))
        out.write(member.tobuf(tarfile.USTAR_FORMAT))
        out.write(b"100000000\n" + b"1\n" * 251)
        block = b"1\n" * (tarfile.BLOCKSIZE // 2)
        for _ in range((50 << 20) // tarfile.BLOCKSIZE):
            out.write(block)
    with pytest.raises(HostError, match=r"headers .* exceed 64 KiB; not a recorded node"):
        Host(bomb)


def test_extended_headers_count_in_the_unpacked_size(tmp_path, monkeypatch):
    # 40 members of 100 bytes each, with 4 KiB of PAX headers each: 160 KiB of headers.
    padded = tmp_path / "padded.tar.gz"
    with tarfile.open(padded, "w:gz", format=tarfile.PAX_FORMAT) as archive:
        for n in range(40):
            member = tarfile.TarInfo(f"node/sys/f{n}")
            member.size, member.pax_headers = 100, {"comment": "x" * 4000}
            archive.addfile(member, fileobj=BytesIO(b"y" * 100))
    monkeypatch.setattr(host_module, "MAX_TARBALL_BYTES", 64 << 10)
    with pytest.raises(HostError, match="unpacks to more than"):
        Host(padded)
    monkeypatch.setattr(host_module, "MAX_TARBALL_BYTES", 1 << 20)
    with Host(padded) as host:
        assert host.read_text("/sys/f0") == "y" * 100


# --- class 4: --root confined ----------------------------------------------------------------


def test_a_symlinked_err_file_cannot_read_outside_the_root(tmp_path, secret):
    agent = start_agent(tmp_path, root=make_root(tmp_path))
    try:
        lease = lease_one(agent)
        recording = agent.root / TOPO_RECORDING
        os.symlink(secret, recording.with_suffix(".err"))
        recording.with_suffix(".rc").write_text("3\n")
        reply = agent.post("/refresh", token=agent.token).json()
        assert reply["stale"] is True and "collector nvidia_smi" in reply["error"]
        assert SECRET not in every_response(agent)
        assert_held(agent, lease)
    finally:
        assert agent.stop() == 0


def test_a_proc_link_planted_after_start_up_stays_inside_the_root(tmp_path, secret):
    evil = tmp_path / "evil"
    (evil / "sys/kernel").mkdir(parents=True)
    os.symlink(secret, evil / "sys/kernel/hostname")
    agent = start_agent(tmp_path, root=make_root(tmp_path))
    try:
        lease = lease_one(agent)
        recorded = json.loads((agent.root / "snapshot.json").read_text())["hostname"]
        assert agent.get("/topology").json()["hostname"] == recorded  # no proc/: snapshot.json's
        assert agent.root.parent / "evil" == evil
        for planted in (str(evil), "../evil"):  # absolute, and climbing out of the root
            with contextlib.suppress(FileNotFoundError):
                (agent.root / "proc").unlink()
            os.symlink(planted, agent.root / "proc")
            assert agent.post("/refresh", token=agent.token).status == 200
            assert agent.get("/topology").json()["hostname"] == recorded  # inside the root: no such file
            assert SECRET not in every_response(agent)
        assert_held(agent, lease)
    finally:
        assert agent.stop() == 0


def test_a_huge_nvml_json_costs_an_error_not_its_size(tmp_path):
    agent = start_agent(tmp_path, root=make_root(tmp_path))
    try:
        lease = lease_one(agent)
        nvml = agent.root / "nvml.json"
        nvml.unlink()
        with open(nvml, "wb") as handle:  # 1 GB, sparse: no disk spent
            handle.truncate(1 << 30)
        reply = agent.post("/refresh", token=agent.token).json()
        assert reply["stale"] is True
        assert "nvml.json: larger than 4,194,304 bytes" in reply["error"]
        assert_held(agent, lease)
        assert peak_rss_mb(agent) < SERVE_MEMORY_BOUND_MB
    finally:
        assert agent.stop() == 0


def test_a_symlinked_nvml_json_outside_the_root_is_not_read(tmp_path, secret):
    root = make_root(tmp_path)
    (root / "nvml.json").unlink()
    os.symlink(secret, root / "nvml.json")
    with Host(root) as host:
        assert host.nvml() is None  # resolved inside the root, where there is no such file
    result = run_cli("discover", "--json", "--root", str(root))
    assert result.returncode == 0 and SECRET not in result.stdout + result.stderr


# --- class 7: old kernels --------------------------------------------------------------------


def test_numa_nodes_with_only_cpumap_are_read(tmp_path):
    node = FakeNode(tmp_path, numa={0: "0-3", 1: "4-7"})
    cpulist = tmp_path / "sys/devices/system/node/node1/cpulist"
    cpulist.unlink()
    (cpulist.parent / "cpumap").write_text("00000000,000000f0\n")
    with Host(node.root) as host:
        topology, warnings = read_numa(host)
    assert {n.id: n.cpulist for n in topology.nodes} == {0: "0-3", 1: "4-7"}
    assert warnings == ()


def test_discover_reads_a_recording_from_an_old_kernel_as_the_new_one(tmp_path):
    root = make_root(tmp_path)
    expected = run_cli("discover", "--json", "--root", str(root))
    for cpulist in root.glob("sys/devices/system/node/node*/cpulist"):
        mask = sum(1 << cpu for cpu in parse_cpulist(cpulist.read_text()))
        words = [f"{(mask >> shift) & 0xFFFFFFFF:08x}" for shift in range(224, -1, -32)]
        (cpulist.parent / "cpumap").write_text(",".join(words) + "\n")
        cpulist.unlink()
    old_kernel = run_cli("discover", "--json", "--root", str(root))
    assert old_kernel.returncode == 0, old_kernel.stderr
    before, after = json.loads(expected.stdout), json.loads(old_kernel.stdout)
    assert after["collectors"]["numa"]["status"] == "ok"
    assert after["numa_nodes"] == before["numa_nodes"] and after["gpus"] == before["gpus"]
