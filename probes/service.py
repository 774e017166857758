"""Glue for the agent: the schedule picks a target, the runner measures it.

``ProbeService.step(activity)`` is what the agent's loop calls (on a timer, or at once for
``POST /probe`` after ``request_round(force=True)``); ``figures()`` and ``findings(matrix)``
are what ``/metrics``, ``/topology`` and the overlay read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from topoagent.matrix import DistanceMatrix
from topoagent.model import Finding
from topoagent.probes.figures import ProbeFigure, ProbeKind, ProbeSkip
from topoagent.probes.overlay import findings_for, overlay
from topoagent.probes.plan import PlanDefaults, numa_nodes_with_cpus, plan_for_target
from topoagent.probes.runner import ProbeRound, ProbeRunner
from topoagent.probes.schedule import GpuActivity, ProbeSchedule, ProbeTarget, Verdict


def target_figure(target: ProbeTarget, probe_round: ProbeRound) -> float | None:
    """The one number the schedule compares across rounds for this target (GB/s)."""
    figures = probe_round.figures()

    def medians(kind: ProbeKind) -> list[float]:
        return [f.median for f in figures if f.kind is kind and f.median is not None]

    if target.is_pair:
        values = medians(ProbeKind.P2P)
        return min(values) if values else None  # the slower direction
    values = medians(ProbeKind.H2D) or medians(ProbeKind.LOCAL_COPY)
    return max(values) if values else None  # the best host link


@dataclass
class ProbeService:
    schedule: ProbeSchedule
    runner: ProbeRunner
    backend: str = "cuda"
    numa_nodes: Iterable[int] = field(default_factory=numa_nodes_with_cpus)
    defaults: PlanDefaults | None = None  # sizes and counts; None: the backend's own
    last_verdict: Verdict | None = None

    async def step(
        self,
        activity: Mapping[int, GpuActivity] | None = None,
        on_record: Callable[[ProbeFigure | ProbeSkip], None] | None = None,
    ) -> ProbeRound | None:
        """Probe the next target if one may run now; None when nothing is due."""
        target = self.schedule.next_probe(activity or {})
        if target is None:
            return None
        forced = self.schedule.states[target].forced if target in self.schedule.states else False
        plan = plan_for_target(target.gpus, self.backend, self.numa_nodes, self.defaults)
        probe_round = await self.runner.run(plan, force=forced, on_record=on_record)
        self.last_verdict = self.schedule.record(
            target,
            duration_s=probe_round.duration_s,
            figure=target_figure(target, probe_round),
            ok=probe_round.ok,
        )
        return probe_round

    def figures(self) -> list[ProbeFigure]:
        """Newest figure per measurement and direction (for /metrics)."""
        return self.runner.latest_figures()

    def overlay(self, matrix: DistanceMatrix) -> DistanceMatrix:
        return overlay(matrix, self.figures())

    def findings(self, matrix: DistanceMatrix) -> list[Finding]:
        return findings_for(matrix, self.figures())
