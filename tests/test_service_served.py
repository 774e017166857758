"""The doors read one served value and the narrow Service interface, nothing else."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

from service_helpers import DGX_A100, metric_value

from topoagent.config import Config
from topoagent.exporters.prometheus import MetricsPage
from topoagent.placement import Request
from topoagent.service.agent import Agent
from topoagent.service.interface import Service

REPO = Path(__file__).resolve().parents[1]


def test_a_served_value_taken_before_a_lease_stays_as_it_was(tmp_path):
    """A door renders a whole page from the value it took: a lease granted meanwhile shows
    in the next value, never half in this one."""

    async def scenario() -> tuple:
        agent = Agent(Config(root=str(DGX_A100), state_dir=str(tmp_path / "s"), udev=False, interval_s=3600))
        await agent.start()
        try:
            await agent.request_refresh("test")
            before = agent.served()
            _, lease = await agent.reserve(Request(gpus=2), "job-a", 600)
            after = agent.served()
            page = MetricsPage(agent).render().decode()
            return before, after, lease, page
        finally:
            await agent.stop()

    before, after, lease, page = asyncio.run(scenario())
    assert lease is not None
    assert before.active_leases() == [] and not before.holding().holder
    assert [l.id for l in after.active_leases()] == [lease.id] and set(after.holding().holder) == set(lease.gpus)
    assert before.placement_requests.get("reserved", 0) == 0 and after.placement_requests["reserved"] == 1
    assert metric_value(page, "topoagent_leased_gpus") == 2


def _members_used(path: Path, names: set[str]) -> set[str]:
    """Attributes the door reads on the agent: `agent.x`, `request.app[AGENT].x`, `self.service.x`."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        on_agent = (
            (isinstance(value, ast.Name) and value.id in names)
            or (isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Name) and value.slice.id == "AGENT")
            or (isinstance(value, ast.Attribute) and value.attr in names and isinstance(value.value, ast.Name) and value.value.id == "self")
        )
        if on_agent:
            used.add(node.attr)
    return used


def test_the_doors_use_only_the_service_interface():
    interface = {name for name, _ in inspect.getmembers(Service) if not name.startswith("_")}
    http = _members_used(REPO / "exporters" / "http.py", {"agent"})
    prometheus = _members_used(REPO / "exporters" / "prometheus.py", {"agent", "service"})
    assert http and http <= interface, sorted(http - interface)
    assert prometheus <= {"served", "config"} and "served" in prometheus  # the value, and which series the operator opted into
