"""The extender's /metrics: what it was asked, what it asked the agents, what the cache saved,
and what it refused or lost (nodes it does not know, nodes the call's time ran out on,
Node patches that failed, Node watches that broke, events it could not read).

Built from the live counters at each scrape (a custom collector, as the agent's own page
is), so there are no global gauges to keep in step.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from topoagent.cluster.extender.holds import RELEASES, Holds
from topoagent.cluster.extender.nodes import Agents
from topoagent.cluster.extender.nodetable import RESTARTS
from topoagent.cluster.extender.requeue import RESULTS, Requeue

NS = "topoagent_extender"


class ExtenderCollector(Collector):
    def __init__(self, agents: Agents, verbs: dict[str, int], binds: dict[str, int], requeue: Requeue | None = None,
                 holds: Holds | None = None) -> None:
        self.agents, self.verbs, self.binds, self.requeue, self.holds = agents, verbs, binds, requeue, holds

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
        yield CounterMetricFamily(f"{NS}_unknown_nodes", "candidate nodes refused unasked: not among the API server's Node objects, or without a usable address there",
                                  value=asked["unknown"])
        yield CounterMetricFamily(f"{NS}_out_of_time_nodes", "candidate nodes left unanswered because the call's time (--call-timeout) ran out before their turn or answer",
                                  value=asked["out_of_time"])
        patches = CounterMetricFamily(f"{NS}_requeue_patches", "capacity changes written on Nodes, by result (failed: the API server refused; "
                                      "skipped: the node left the API server's table)", labels=["result"])
        for result, count in sorted((self.requeue.patches if self.requeue is not None else dict.fromkeys(RESULTS, 0)).items()):
            patches.add_metric([result], count)
        yield patches
        table = self.agents.table
        restarts = CounterMetricFamily(f"{NS}_node_watch_restarts", "Node watches started again, by why (ended: the API server's timeout, "
                                       "went on without a list; expired: 410 Gone; broken: the stream broke or could not open; error: an "
                                       "ERROR event; list_failed: the list before it failed)", labels=["reason"])
        for reason in RESTARTS:
            restarts.add_metric([reason], table.restarts[reason])
        yield restarts
        yield CounterMetricFamily(f"{NS}_node_watch_malformed_events", "Node watch events skipped unread (not a watch event, or too large)",
                                  value=table.malformed)
        binds = CounterMetricFamily(f"{NS}_binds", "binds, by result (failed: the lease was released, or could not be taken)", labels=["result"])
        for result, count in sorted(self.binds.items()):
            binds.add_metric([result], count)
        yield binds
        if self.holds is not None:
            yield from self._holds(self.holds)

    def _holds(self, holds: Holds) -> Iterator[Metric]:
        yield GaugeMetricFamily(f"{NS}_holds", "nodes held now for a large pod that fit no node (GET /holds lists them)", value=len(holds.held))
        yield GaugeMetricFamily(f"{NS}_pods_waiting", "large pods fitting no node now that hold no node (yet)",
                                value=len(holds.waiting))
        yield GaugeMetricFamily(f"{NS}_guards", "guards in force: a node kept for a waiting large pod that fits it now "
                                "(GET /holds lists them)", value=len(holds.guards_now()))
        yield CounterMetricFamily(f"{NS}_guarded", "nodes a guard kept a pod off, one per node per filter call", value=holds.guarded)
        yield CounterMetricFamily(f"{NS}_holds_taken", "holds taken", value=holds.taken)
        yield CounterMetricFamily(f"{NS}_hold_expired", "holds that ended at --hold-for, their pod still unbound", value=holds.expired)
        released = CounterMetricFamily(f"{NS}_holds_released", "holds that ended with their pod, by why (bound, deleted, ended)", labels=["reason"])
        for reason in RELEASES:
            released.add_metric([reason], holds.released[reason])
        yield released


def render(collector: ExtenderCollector) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)
