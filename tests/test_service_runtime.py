"""The runtime's own rules: hotplug bursts are debounced, tarball roots replay, stale marks."""

from __future__ import annotations

import asyncio
import tarfile
from pathlib import Path

from service_helpers import make_root, start_agent
from topoagent.agent import Agent, discover_facts
from topoagent.config import Config


def test_a_burst_of_device_events_triggers_one_rediscovery(tmp_path):
    root = make_root(tmp_path)
    runs: list[float] = []

    async def counting(root_dir: Path):
        runs.append(asyncio.get_running_loop().time())
        return await discover_facts(root_dir)

    async def scenario() -> None:
        agent = Agent(Config(root=str(root), state_dir=str(tmp_path / "s"), udev_debounce_s=0.2, interval_s=3600), discover=counting)
        await agent.start()
        await asyncio.sleep(0.1)
        assert len(runs) == 1  # startup
        # a NIC reset: remove + add + a flurry of changes on net and infiniband
        for n in range(30):
            agent.on_device_event("net" if n % 2 else "infiniband", "change", f"ibp{n}s0")
            await asyncio.sleep(0.01)
        assert len(runs) == 1  # still settling
        await asyncio.sleep(0.5)
        assert len(runs) == 2
        assert agent.snapshot.version == 2 and not agent.snapshot.stale
        await agent.stop()

    asyncio.run(scenario())


def test_failure_keeps_facts_and_records_error(tmp_path):
    root = make_root(tmp_path)
    calls = {"n": 0}

    async def flaky(root_dir: Path):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("sysfs read failed: Input/output error")
        return await discover_facts(root_dir)

    async def scenario() -> None:
        agent = Agent(Config(root=str(root), state_dir=str(tmp_path / "s"), interval_s=3600), discover=flaky)
        await agent.start()
        await asyncio.sleep(0.1)
        first = agent.snapshot
        await agent.request_refresh("test")
        stale = agent.snapshot
        assert stale.stale and "Input/output error" in stale.error
        assert stale.facts is first.facts and stale.version > first.version
        assert first.stale is False  # the old value was not changed, a new one swapped in
        await agent.request_refresh("test")
        assert agent.snapshot.stale is False and agent.snapshot.error is None
        await agent.stop()

    asyncio.run(scenario())


def test_serves_a_snapshot_tarball(tmp_path):
    make_root(tmp_path / "src")
    tarball = tmp_path / "node.tar.gz"
    with tarfile.open(tarball, "w:gz") as archive:
        archive.add(tmp_path / "src" / "root", arcname="h20-node")
    agent = start_agent(tmp_path, root=tarball)
    try:
        doc = agent.get("/topology").json()
        assert len(doc["gpus"]) == 8
    finally:
        assert agent.stop() == 0
