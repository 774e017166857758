"""The runtime's own rules: hotplug bursts are debounced, lost sources keep old facts, a replay
keeps its leases to itself."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import select
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from service_helpers import DGX_A100, FIXTURES, start_agent

from topoagent.config import Config
from topoagent.node.discovery_process import discover_in_child
from topoagent.node.host import Host
from topoagent.service.agent import Agent
from topoagent.vocabulary import Status


@pytest.fixture(scope="module")
def facts():
    with Host(str(DGX_A100)) as host:
        return asyncio.run(discover_in_child(host))



async def first_snapshot(agent: Agent) -> None:
    """Wait for the agent's first discovery (at most 30 s): a loaded machine takes longer
    than any fixed pause, and a fixed pause is what made these tests flaky."""
    async with asyncio.timeout(30):  # past it, TimeoutError fails the test
        while agent.snapshot is None:
            await asyncio.sleep(0.01)

def test_a_burst_of_device_events_triggers_one_rediscovery(tmp_path, facts):
    runs: list[float] = []

    async def counting(host: Host):
        runs.append(asyncio.get_running_loop().time())
        return facts

    async def scenario() -> None:
        # The debounce is long beside the gaps between events (0.02 s), so a loaded machine
        # stretching one gap cannot end the burst early; the checks below poll, never race.
        debounce = 1.0
        # No counters: their reads swap in snapshots too, and this counts discovery's.
        agent = Agent(Config(root=str(DGX_A100), state_dir=str(tmp_path / "s"), udev_debounce_s=debounce, interval_s=3600,
                             telemetry_enabled=False), discover=counting)
        await agent.start()
        loop = asyncio.get_running_loop()
        await first_snapshot(agent)
        assert len(runs) == 1  # startup
        # a NIC reset: a flurry of changes on net and infiniband, spread over 0.6 s
        for n in range(30):
            agent.on_device_event("net" if n % 2 else "infiniband", "change", f"ibp{n}s0")
            await asyncio.sleep(0.02)  # the burst's own pace
        assert len(runs) == 1  # still settling: each event restarted the debounce
        # Due after every debounce timer the burst could have left: had it wrongly left
        # more than one, their runs have started by the time this one fires.
        settled = asyncio.Event()
        loop.call_later(debounce, settled.set)
        async with asyncio.timeout(30):
            await settled.wait()
            while len(runs) < 2 or agent.snapshot.version < len(runs):  # each run started has published
                await asyncio.sleep(0.05)
        assert len(runs) == 2
        assert agent.snapshot.version == 2 and not agent.snapshot.stale
        await agent.stop()

    asyncio.run(scenario())


def test_a_source_lost_keeps_the_old_facts_and_says_why(tmp_path, facts):
    without_smi = replace(
        facts,
        collectors=tuple(replace(c, status=Status.ERROR, message="exit 9") if c.name == "nvidia_smi" else c for c in facts.collectors),
    )
    answers = iter([facts, without_smi, OSError("sysfs read failed: Input/output error"), facts])

    async def scripted(host: Host):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def scenario() -> None:
        agent = Agent(Config(root=str(DGX_A100), state_dir=str(tmp_path / "s"), interval_s=3600), discover=scripted)
        await agent.start()
        await first_snapshot(agent)
        first = agent.snapshot
        assert not first.stale
        await agent.request_refresh("test")
        lost = agent.snapshot
        assert lost.stale and "collector nvidia_smi: error: exit 9" in lost.error
        assert lost.node is first.node and lost.version > first.version
        smi = {c.name: c for c in lost.collectors}["nvidia_smi"]
        assert smi.status == "error" and lost.last_success_at["nvidia_smi"] == first.last_success_at["nvidia_smi"]
        assert first.stale is False  # the old value was not changed: a new one swapped in
        await agent.request_refresh("test")
        assert agent.snapshot.stale and "Input/output error" in agent.snapshot.error
        assert all(c.status == "error" for c in agent.snapshot.collectors)
        await agent.request_refresh("test")
        assert agent.snapshot.stale is False and agent.snapshot.error is None
        await agent.stop()

    asyncio.run(scenario())


def test_serves_a_snapshot_tarball(tmp_path):
    tarball = tmp_path / "node.tar.gz"
    with tarfile.open(tarball, "w:gz") as archive:
        archive.add(DGX_A100, arcname="dgx-a100")
    agent = start_agent(tmp_path, root=tarball)
    try:
        doc = agent.get("/topology").json()
        assert len(doc["gpus"]) == 8 and doc["gpus"][0]["model"] == "NVIDIA A100-SXM4-40GB"
    finally:
        assert agent.stop() == 0


def test_a_changed_topology_tells_the_probe_schedule_to_probe_soon(tmp_path, facts):
    # An NVLink that went down between two discoveries: old measurements say nothing now.
    gpu = facts.gpus[0]
    first = next(n for n in gpu.nvlinks if n.active)
    down = replace(gpu, nvlinks=tuple(replace(n, active=False) if n == first else n for n in gpu.nvlinks))
    link_down = replace(facts, gpus=(down, *facts.gpus[1:]))
    answers = iter([facts, facts, link_down])

    async def scripted(host: Host):
        return next(answers)

    async def scenario() -> None:
        config = Config(root=str(DGX_A100), state_dir=str(tmp_path / "s"), interval_s=3600,
                        probes_enabled=True, probe_backend="cpu", probe_startup_delay_s=3600)
        agent = Agent(config, discover=scripted)
        await agent.start()
        await first_snapshot(agent)
        schedule = agent.probes.schedule
        assert len(schedule.states) == 28 + 8  # every pair, every GPU
        assert schedule.next_wakeup() - schedule.clock() > 3000  # start-up delay
        await agent.request_refresh("test")  # same wiring: nothing to re-measure
        assert schedule.next_wakeup() - schedule.clock() > 3000
        await agent.request_refresh("test")  # the link is down
        assert agent.probes.schedule.next_wakeup() - schedule.clock() <= 10
        await agent.stop()

    asyncio.run(scenario())


VM_1GPU = FIXTURES / "snapshots" / "vm-1gpu"


def banner_lines(proc: subprocess.Popen, until: str) -> list[str]:
    """serve's start-up lines, up to and including the one starting with ``until``."""
    lines: list[str] = []
    while not lines or not lines[-1].lstrip().startswith(until):
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        assert line, f"no {until!r} line; printed: {lines}"
        lines.append(line)
    return lines


def test_a_replay_without_state_dir_keeps_its_leases_in_a_temporary_directory_it_names(tmp_path):
    """Issue #36: a replay (--root a recording) made /var/lib/topoagent; and its banner
    suggested reserving 4 GPUs on a 1-GPU node."""
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(24))
    token.chmod(0o600)
    proc = subprocess.Popen([sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(VM_1GPU), "--listen", "127.0.0.1:0",
                             "--token-file", str(token)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = banner_lines(proc, "reserve")
        (state,) = [line.split()[1] for line in lines if line.lstrip().startswith("state ")]
        assert Path(state).parent == Path(tempfile.gettempdir()) and Path(state).is_dir()
        assert (Path(state).stat().st_mode & 0o077) == 0  # the agent's own, as any state directory
        # The example reserves what the node has (one GPU), and the lease lands in the named directory.
        example = re.search(r"-d '([^']+)' (http://\S+)", lines[-1])
        assert example and json.loads(example[1])["gpus"] == 1
        request = urllib.request.Request(example[2], data=example[1].encode(), headers={"Authorization": f"Bearer {token.read_text()}"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert reply.status == 200 and json.load(reply)["lease"]["gpus"] == [0]
        assert any(Path(state).iterdir())
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert f"state_dir={state}" in err and not Path(state).exists()  # logged, and gone with the replay
