"""The extender's /metrics: what it was asked, what it asked the agents, what the cache saved.

Built from the live counters at each scrape (a custom collector, as the agent's own page
is), so there are no global gauges to keep in step.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from topoagent.cluster.extender.nodes import Agents

NS = "topoagent_extender"


class ExtenderCollector(Collector):
    def __init__(self, agents: Agents, verbs: dict[str, int], binds: dict[str, int]) -> None:
        self.agents, self.verbs, self.binds = agents, verbs, binds

    def collect(self) -> Iterator[Metric]:
        asked = self.agents.asked
        requests = CounterMetricFamily(f"{NS}_requests", "kube-scheduler's calls, by verb", labels=["verb"])
        for verb, count in sorted(self.verbs.items()):
            requests.add_metric([verb], count)
        yield requests
        capacity = CounterMetricFamily(f"{NS}_capacity_requests", "GET /capacity asked of agents, by answer (not_modified: the ETag still held)",
                                       labels=["answer"])
        capacity.add_metric(["changed"], asked["capacity_changed"])
        capacity.add_metric(["not_modified"], asked["capacity_not_modified"])
        yield capacity
        placements = CounterMetricFamily(f"{NS}_dry_runs", "dry-run placements needed, by where the answer came from (cache: same node ETag, same request)",
                                         labels=["source"])
        placements.add_metric(["agent"], asked["dry_run_agent"])
        placements.add_metric(["cache"], asked["dry_run_cache"])
        yield placements
        yield CounterMetricFamily(f"{NS}_unanswered_nodes", "nodes whose agent did not answer in time or with its document", value=asked["unanswered"])
        binds = CounterMetricFamily(f"{NS}_binds", "binds, by result (failed: the lease was released, or could not be taken)", labels=["result"])
        for result, count in sorted(self.binds.items()):
            binds.add_metric([result], count)
        yield binds


def render(collector: ExtenderCollector) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)
