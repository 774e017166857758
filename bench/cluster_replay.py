"""The cluster benchmark's job stream, replayed in process: hundreds of seeds in minutes.

    python -m bench.cluster_replay --seeds 1-200     # means, medians, and seeds where topoagent waits more
    python -m bench.cluster_replay --seeds 1,2,3 --tables   # bench.cluster's table for each seed too

bench/cluster.py runs real agents and the real extender over loopback: the figures a user
can trust, at a few minutes a seed on two cores.  A score is judged over many streams,
not five, so this replays the same stream (``bench.cluster.job_stream``) through the same
three policies without HTTP:

* each node is its fixture as the agent serves it once its counters are read: the matrix
  marks unhealthy the GPUs a critical finding names (discovery's and the recorded
  counters'), ``/capacity`` leaves them out, placement weighs the NICs' recorded traffic
  (``agent_view``); a lease is a set of GPUs the node's placement treats as busy;
* the agents' answers are the placement core's (``topoagent.placement.place``) for the
  request the extender sends (``wire.pod_request``: ``{"gpus": k}``) under the agent's
  bench deadline, reduced to what the extender reads (``nodes.ranked``);
* ``topoagent``: the extender's own code ranks the nodes (``nodes.Verdict`` from what
  ``Agents._ask`` reads, ``nodes.scores``), kube-scheduler's part as bench.cluster plays
  it (count filter, highest score, lowest name among equals), bind takes the agent's
  placement; ``count-only`` and ``zone-first`` are bench.cluster's own classes, their
  agent calls answered here.

It matched bench.cluster figure for figure on seeds 1-5 (every figure of the table but the
extender's cycle times, which only the real run measures), under the score before issue #28
item 3 and under its new one; tests/test_extender.py checks its choices against the real
extender's on a short stream.  Rerun ``--tables`` beside ``python -m bench.cluster --seeds
...`` after changing what the extender reads or the agents answer.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from bench.cluster import (
    BIG_LIFE_S,
    MIX,
    SMALL_LIFE_S,
    SNAPSHOTS,
    STARVE_FIXTURES,
    STARVE_PATTERN,
    STARVE_ROUNDS,
    CountOnly,
    Job,
    Outcome,
    Placed,
    Scheduler,
    ZoneFirst,
    fixtures_for,
    job_stream,
    median_table,
    replay,
    seed_list,
    starve_stream,
    table,
)
from bench.kube_queue import (
    DEFAULT_SETTINGS,
    HoldSetting,
    KubeQueue,
    Queued,
    StarveFigures,
    settings_list,
    starve_figures,
    starve_table,
)
from bench.stats import percentile
from topoagent.cluster.extender import HOLD_GUARD_S
from topoagent.cluster.extender.holds import Holds, NodeLoad
from topoagent.cluster.extender.nodes import Verdict, all_local, by_count, follow_ups, ranked, scores
from topoagent.cluster.extender.wire import PodRef
from topoagent.commands.discover import open_host
from topoagent.documents.agent import answer_document
from topoagent.node.discovery import COUNTER_SOURCES, discover_sync
from topoagent.node.matrix import DistanceMatrix
from topoagent.placement import Live, Placement, place
from topoagent.placement.request import parse_request
from topoagent.service.telemetry import History, nic_traffic, recorded_samples, served

AGENT_DEADLINE_MS = 60_000  # the bench agents' [placement] deadline_ms (bench.cluster.cluster)


def agent_view(fixture: str) -> tuple[DistanceMatrix, Live]:
    """The matrix and live signals the fixture's agent places with after its first counters'
    read (service.served.Snapshot.with_health, counter_loop, agent.live; no probes run)."""
    with open_host(str(SNAPSHOTS / fixture)) as host:
        node = discover_sync(host)
        samples = recorded_samples(host) or []
    parsers = {s.name: s.parse for s in COUNTER_SOURCES}
    history = History()
    for sample in samples:
        if sample.source in parsers:
            history.add(sample, parsers[sample.source])
    telemetry = served(history, {}, node)
    unhealthy = node.unhealthy_gpus(telemetry.findings)
    matrix = node.distance_matrix()
    matrix = replace(matrix, gpus=tuple(replace(g, unhealthy=unhealthy.get(g.name)) for g in matrix.gpus))
    return matrix, Live(frozenset(), nic_traffic(telemetry))


@dataclass
class LocalNode:
    """One node as its agent sees it: the fixture's matrix and the GPUs leased on it."""

    name: str
    fixture: str
    matrix: DistanceMatrix
    live: Live
    answers: dict[tuple[str, frozenset[int]], Any]  # shared by the nodes of one fixture
    leases: dict[str, tuple[int, ...]] = field(default_factory=dict)
    gpus: int = 0  # healthy GPUs (the agent's free_gpus when idle)

    def __post_init__(self) -> None:
        self.gpus = len(self.free())

    def busy(self) -> frozenset[int]:
        return frozenset(g for held in self.leases.values() for g in held)

    def free(self) -> list[int]:
        """``/capacity``'s ``free``: not leased, no critical finding."""
        busy = self.busy()
        return [g.index for g in self.matrix.gpus if g.index not in busy and g.unhealthy is None]

    def answer(self, body: dict[str, Any]) -> Any:
        """The agent's ``POST /place`` answer (a Placement or a NoFit) for ``body`` now."""
        key = (repr(sorted(body.items())), self.busy())
        if key not in self.answers:
            request = parse_request({**body, "deadline_ms": AGENT_DEADLINE_MS}, gpu_indices={g.index for g in self.matrix.gpus})
            self.answers[key] = place(self.matrix, request, key[1], live=self.live)
        return self.answers[key]

    def reserve(self, body: dict[str, Any], owner: str) -> tuple[tuple[int, ...], str]:
        answer = self.answer(body)
        if not isinstance(answer, Placement):
            raise AssertionError(f"reserve {body} on {self.name}: {answer.reason}")
        lease = f"{owner}@{self.name}"
        self.leases[lease] = answer.indices
        return answer.indices, lease


@dataclass
class LocalCluster:
    nodes: list[LocalNode]

    def node(self, name: str) -> LocalNode:
        return next(n for n in self.nodes if n.name == name)


def local_cluster(fixtures: list[str]) -> LocalCluster:
    """node-01, node-02, ... on ``fixtures``, as bench.cluster.cluster names them."""
    views = {f: agent_view(f) for f in set(fixtures)}
    answers: dict[str, dict] = {f: {} for f in views}
    return LocalCluster([LocalNode(f"node-{n:02d}", f, *views[f], answers[f]) for n, f in enumerate(fixtures, start=1)])


class InProcess(Scheduler):
    """bench.cluster's agent calls (capacity, reserve, release) answered in process."""

    c: Any  # a LocalCluster

    def release(self, placed: Placed) -> None:
        del self.c.node(placed.node).leases[placed.lease]
        self.free_count[placed.node] += placed.job.gpus

    def _reserve(self, job: Job, node: Any, gpus: tuple[int, ...]) -> Placed:
        got, lease = node.reserve({"gpus": job.gpus, "include": list(gpus)}, f"{self.name}/job-{job.id}")
        self.free_count[node.name] -= job.gpus
        return Placed(job, node.name, got, lease)

    def _free(self, node: Any) -> list[int]:
        return node.free()


class LocalCountOnly(InProcess, CountOnly):
    pass


class LocalZoneFirst(InProcess, ZoneFirst):
    pass


def verdict(node: LocalNode, request: dict[str, Any]) -> Verdict:
    """What ``nodes.Agents._ask`` makes of the node's answers (its agent always answers here)."""
    wanted, free, total = request["gpus"], len(node.free()), node.matrix.size
    refused_by_count = by_count(node.name, wanted, free, total)
    if refused_by_count is not None:
        return refused_by_count
    answer = node.answer(request)
    if not isinstance(answer, Placement):
        return Verdict(node.name, False, answer.reason)
    whole_request, pair_request = follow_ups(wanted, free, total)
    pair_value = 0.0
    if pair_request is not None:
        pair = node.answer(pair_request)
        if isinstance(pair, Placement):
            pair_value = float(pair.bandwidth_gbps or 0.0)
    breaks_whole = False
    if whole_request is not None:
        whole = node.answer(whole_request)
        breaks_whole = isinstance(whole, Placement) and all_local(ranked(answer_document(whole)))
    return Verdict(node.name, True, answer=ranked(answer_document(answer)), pair_value=pair_value, free=free, wanted=wanted,
                   breaks_whole=breaks_whole)


class LocalExtender(InProcess):
    """bench.cluster.ThroughExtender's cycle: kube-scheduler's count filter, the extender's
    filter and prioritize (its own Verdict and scores), the highest score, the lowest name
    among equals, then bind's reservation of the agent's placement."""

    name = "topoagent"

    def place(self, job: Job) -> Placed | None:
        request = {"gpus": job.gpus}
        fits = [n for n in sorted(self.c.nodes, key=lambda n: n.name) if self.free_count[n.name] >= job.gpus]
        if not fits:
            return None
        verdicts = [verdict(n, request) for n in fits]
        failed = {v.node: v.reason for v in verdicts if not v.fits}
        if failed:  # as bench.cluster: a node with enough free GPUs must fit
            raise AssertionError(f"the extender would fail nodes with enough free GPUs for job-{job.id}: {failed}")
        score = scores(verdicts)
        best = max(verdicts, key=lambda v: (score[v.node], [-ord(ch) for ch in v.node])).node
        node = self.c.node(best)
        got, lease = node.reserve(request, f"{self.name}/job-{job.id}")
        self.free_count[best] -= job.gpus
        return Placed(job, best, got, lease)


POLICIES = (LocalExtender, LocalCountOnly, LocalZoneFirst)


def run(nodes: int, pods: int, load: float, seeds: list[int]) -> tuple[dict[int, list[Outcome]], int]:
    """bench.cluster.run's figures, in process."""
    c = local_cluster(fixtures_for(nodes))
    total = sum(n.gpus for n in c.nodes)
    outcomes = {}
    for seed in seeds:
        jobs = job_stream(pods, total, load, seed)
        outcomes[seed] = [replay(c, policy(c), jobs) for policy in POLICIES]  # type: ignore[arg-type]  (a LocalCluster)
        if any(n.leases for n in c.nodes):
            raise AssertionError(f"seed {seed}: leases left after the replay")
    return outcomes, total


def summary(outcomes: dict[int, list[Outcome]]) -> str:
    """Per policy over the seeds: waits (mean, median), ring GB/s (median of the seeds'
    medians and p10s), jobs never placed; then the seeds where topoagent waits more."""
    seeds = sorted(outcomes)
    lines = [
        f"| policy ({len(seeds)} seeds) | waited mean | waited median | ring GB/s median (median) | ring GB/s p10 (median)"
        " | ring GB/s mean (mean) | never placed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n, first in enumerate(outcomes[seeds[0]]):
        runs = [outcomes[s][n] for s in seeds]

        def fig(figure: Callable[[Outcome], float], runs: list[Outcome] = runs) -> list[float]:
            return [figure(o) for o in runs]

        waits = fig(lambda o: o.waited)
        lines.append(
            f"| {first.policy} | {statistics.mean(waits):.2f} | {statistics.median(waits):g}"
            f" | {statistics.median(fig(lambda o: statistics.median(o.ring_gbps))):.1f}"
            f" | {statistics.median(fig(lambda o: percentile(o.ring_gbps, 0.10))):.1f}"
            f" | {statistics.mean(fig(lambda o: statistics.mean(o.ring_gbps))):.1f} | {sum(fig(lambda o: o.never)):g} |"
        )
    ours = {s: outcomes[s][0].waited for s in seeds}
    more = {o.policy: [s for s in seeds if ours[s] > outcomes[s][n].waited] for n, o in enumerate(outcomes[seeds[0]]) if n}
    either = sorted({s for worse in more.values() for s in worse})
    lines.append("")
    for policy, worse in more.items():
        lines.append(f"topoagent waited more than {policy} on {len(worse)} of {len(seeds)} seeds{_some(worse)}")
    lines.append(f"topoagent waited more than either on {len(either)} of {len(seeds)} seeds{_some(either)}")
    return "\n".join(lines)


def _some(seeds: list[int], shown: int = 20) -> str:
    if not seeds:
        return ""
    return ": " + ",".join(map(str, seeds[:shown])) + (f", ... ({len(seeds) - shown} more)" if len(seeds) > shown else "")


# --- issue #39: small pods' pressure against a whole-node pod, through kube-scheduler's queue ---


class MostFreeHolds(Holds):
    """Holds choosing the node with the most GPUs free, the leases' ages not read (``--hold-choice
    most-free``): does the extender's choice by the leases' ages matter?"""

    @staticmethod
    def rank(node: str, load: NodeLoad, gpus: int) -> tuple[float, int, int, str]:
        return 0.0, -load.free, load.gpus, node


HOLD_CHOICES = {"ages": Holds, "most-free": MostFreeHolds}


class ReplayQueue(KubeQueue):
    """kube-scheduler's queue (bench.kube_queue) with the extender in process: the count filter
    (NodeResourcesFit on nvidia.com/gpu) before the extender, which is not called when it
    leaves no node; the extender's filter and prioritize (``verdict``, ``scores``) and the
    holds (``holds.Holds``, the extender's own class, on simulated time: its filter part with
    the guards, its keeper's take and expire every ``interval_s``, the bind releasing);
    kube-scheduler writing PodScheduled=Unschedulable taken as the pod watch seeing it at once.
    The extender's and the agents' latency are not modelled."""

    def __init__(self, c: LocalCluster, setting: HoldSetting, pop_from_backoff: bool = True, choice: str = "ages") -> None:
        super().__init__({n.name: n.gpus for n in c.nodes}, pop_from_backoff)
        self.c = c
        self.holds = None
        if setting.after_s or setting.guard_s:
            self.holds = HOLD_CHOICES[choice](min_gpus=8, after_s=setting.after_s, ttl_s=300.0, guard_s=setting.guard_s, clock=self.clock)
        self.next_keep = 0.0

    @staticmethod
    def ref(job: Job) -> PodRef:
        return PodRef("bench", f"job-{job.id}", f"uid-{job.id}")

    def wake_times(self) -> list[float]:
        return [self.next_keep] if self.holds is not None and self.holds.busy() else []

    def tick(self) -> None:
        """The extender's keeper loop (holds.keep), one pass every ``interval_s``."""
        if self.holds is None or self.now < self.next_keep:
            return
        self.next_keep = self.now + self.holds.interval_s()
        self.holds.expire()
        if self.holds.due():
            granted = {p.lease: self.bound_at[p.job.id] for _, _, p in self.running}
            self.holds.take({n.name: NodeLoad(n.matrix.size, len(n.free()), tuple((granted[lease], len(gpus)) for lease, gpus in n.leases.items()))
                             for n in self.c.nodes})

    def release(self, placed: Placed) -> None:
        del self.c.node(placed.node).leases[placed.lease]

    def unschedulable(self, q: Queued) -> None:
        if self.holds is not None:  # PodScheduled=Unschedulable, through the pod watch
            self.holds.unplaced(self.ref(q.job), q.job.gpus)

    def schedule(self, q: Queued) -> Placed | None:
        job, ref = q.job, self.ref(q.job)
        fits = [n for n in sorted(self.c.nodes, key=lambda n: n.name) if self.free_count[n.name] >= job.gpus]
        if not fits:
            return None  # the count filter leaves no node: no extender call
        request = {"gpus": job.gpus}
        verdicts = [verdict(n, request) for n in fits]
        passed = [v.node for v in verdicts if v.fits]
        if self.holds is not None:
            self.holds.honour(ref, job.gpus, passed, {}, {v.node: v.free for v in verdicts if v.fits})
        if not passed:
            return None
        score = scores(v for v in verdicts if v.node in passed)
        best = max(passed, key=lambda name: (score[name], [-ord(ch) for ch in name]))
        got, lease = self.c.node(best).reserve(request, f"job-{job.id}")
        if self.holds is not None:
            self.holds.forget(ref.uid, "bound")
        return Placed(job, best, got, lease)


def replay_starve(c: LocalCluster, jobs: list[Job], setting: HoldSetting, pop_from_backoff: bool, choice: str) -> tuple[dict[int, float], dict[int, str]]:
    """One stream under one setting through kube-scheduler's queue: each pod's wait and the
    node it was bound to."""
    logging.getLogger("topoagent").setLevel(logging.ERROR)  # the holds' log lines: thousands of runs
    queue = ReplayQueue(c, setting, pop_from_backoff, choice)
    waits = queue.run(jobs)
    if any(n.leases for n in c.nodes):
        raise AssertionError("leases left after the replay")
    return waits, queue.bound_to


def starve_run(c: LocalCluster, jobs: list[Job], setting: HoldSetting, pop_from_backoff: bool = True, choice: str = "ages") -> StarveFigures:
    """The figures of one stream under one setting."""
    waits, _ = replay_starve(c, jobs, setting, pop_from_backoff, choice)
    return starve_figures(jobs, waits)


def starve_waits(c: LocalCluster, load: str, seed: int, rounds: int, settings: list[HoldSetting], pop_from_backoff: bool,
                 choice: str) -> str:
    """Each pod of one stream under each setting: its wait and the node it was bound to, a
    markdown table (what the medians of ``starve_table`` are made of)."""
    jobs = starve_stream(load, seed, rounds)
    runs = [replay_starve(c, jobs, setting, pop_from_backoff, choice) for setting in settings]
    lines = ["| pod | GPUs | arrives s | " + " | ".join(f"{s.name()}: wait s, node" for s in settings) + " |",
             "|---:|---:|---:|" + "---:|" * len(settings)]
    for job in sorted(jobs, key=lambda j: j.id):
        cells = [f"{waits[job.id]:.1f} {c.node(bound_to[job.id]).fixture}" for waits, bound_to in runs]
        lines.append(f"| {job.id} | {job.gpus} | {job.arrive:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=seed_list, default=seed_list("1-200"), metavar="1-200",
                        help="the streams' seeds: a range, a list, or both (default 1-200)")
    parser.add_argument("--nodes", type=int, default=16, help="nodes (default 16, as bench.cluster)")
    parser.add_argument("--pods", type=int, default=300, help="pods in each stream (default 300)")
    parser.add_argument("--load", type=float, default=0.9, help="offered load, share of the cluster's GPUs (default 0.9)")
    parser.add_argument("--tables", action="store_true", help="bench.cluster's table for each seed, and its medians table")
    parser.add_argument("--starve", action="store_true",
                        help="issue #39 instead: [1,1,1,1,8] x --rounds, one pod a second, on dgx-a100 + pcie-2socket, through "
                             "kube-scheduler's queue (KubeQueue), under each of --holds (seed 0: no jitter)")
    parser.add_argument("--rounds", type=int, default=STARVE_ROUNDS, help=f"with --starve: rounds of the pattern (default {STARVE_ROUNDS})")
    parser.add_argument("--holds", type=settings_list, default=settings_list(DEFAULT_SETTINGS), metavar=DEFAULT_SETTINGS,
                        help=f"with --starve: the extender's settings to compare: off, guard (--hold-after 0: guards alone, "
                             f"--hold-guard {HOLD_GUARD_S:g}), guard+T (guards and --hold-after T), T (--hold-after T, --hold-guard 0) "
                             f"(default {DEFAULT_SETTINGS})")
    parser.add_argument("--no-pop-from-backoff", dest="pop_from_backoff", action="store_false",
                        help="with --starve: kube-scheduler without SchedulerPopFromBackoffQ (a pod in backoff waits it out "
                             "even when the active queue is empty)")
    parser.add_argument("--hold-choice", choices=sorted(HOLD_CHOICES), default="ages",
                        help="with --starve: the node a hold takes: the extender's (ages: the soonest to free up by its leases' "
                             "ages) or the one with the most GPUs free (most-free)")
    parser.add_argument("--markdown", action="store_true", help="with --starve: the table as docs/benchmarks.md holds it (no heading)")
    parser.add_argument("--waits", choices=sorted(SMALL_LIFE_S),
                        help="with --starve: every pod's wait and node under each of --holds at this load, for each of --seeds, "
                             "instead of the medians (e.g. --waits overload --seeds 0)")
    args = parser.parse_args()
    if args.starve and args.waits:
        c = local_cluster(list(STARVE_FIXTURES))
        for seed in args.seeds:
            heading = "" if args.markdown else "## "
            print(f"{heading}{list(STARVE_PATTERN)} x {args.rounds}, one a second, {', '.join(STARVE_FIXTURES)}; {args.waits} "
                  f"(1-GPU pods live {SMALL_LIFE_S[args.waits]:g} s, 8-GPU pods {BIG_LIFE_S:g} s); seed {seed}; each pod's wait "
                  f"and the node it was bound to"
                  f"\n\n{starve_waits(c, args.waits, seed, args.rounds, args.holds, args.pop_from_backoff, args.hold_choice)}\n")
        return
    if args.starve:
        heading = "" if args.markdown else "## Holds (issue #39): "
        queue = "" if args.pop_from_backoff else "; kube-scheduler without SchedulerPopFromBackoffQ"
        queue += "" if args.hold_choice == "ages" else f"; a hold takes the node with the most GPUs free ({args.hold_choice})"
        print(f"{heading}{list(STARVE_PATTERN)} x {args.rounds}, one a second, {', '.join(STARVE_FIXTURES)}; "
              f"8-GPU pods live {BIG_LIFE_S:g} s; seeds {args.seeds[0]}..{args.seeds[-1]} ({len(args.seeds)}){queue}\n")
        c = local_cluster(list(STARVE_FIXTURES))
        print(starve_table(SMALL_LIFE_S, args.seeds, args.holds,
                           lambda load, seed, s: starve_run(c, starve_stream(load, seed, args.rounds), s, args.pop_from_backoff,
                                                            args.hold_choice)))
        return
    outcomes, total = run(args.nodes, args.pods, args.load, args.seeds)
    print(f"## Cluster replay in process: {args.nodes} nodes ({', '.join(MIX)} in turn; {total} GPUs), {args.pods} pods,"
          f" load {args.load:g}, seeds {args.seeds[0]}..{args.seeds[-1]} ({len(args.seeds)})\n")
    if args.tables:
        for seed in args.seeds:
            print(f"### seed {seed}\n\n{table(outcomes[seed], args.nodes, args.pods)}\n")
        if len(args.seeds) > 1:
            print(f"### Medians over the seeds\n\n{median_table(outcomes, args.nodes, args.pods)}\n")
    print(summary(outcomes))


if __name__ == "__main__":
    sys.exit(main())
