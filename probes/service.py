"""Glue for the agent: the schedule picks a target, the runner measures it, and what the
figures mean is decided here.

``ProbeService.step(activity)`` is what the agent's loop calls (on a timer, or at once for
``POST /probe`` after ``request_round(force=True)``); ``figures()`` and
``verdicts(matrix)`` are what ``/metrics``, ``/topology`` and placement read.

Beyond measuring, the service follows the node's life:

- a lease granted records the figures its GPUs' links had (``on_lease_granted``); a lease
  released or expired, or processes that ended, make its GPUs due at once and
  *unverified* until probed (``on_gpus_released``), and the first figure after the lease
  is logged beside the one recorded with it (``event=probe_after_release``);
- a round forced while a busy GPU shared its PCIe path is *under load*: its figures
  are served but neither enter the matrix nor become findings nor move any baseline;
- every healthy figure feeds the long baselines (``topoagent.probes.history``), whose
  cumulative loss beyond the tolerance is a ``link_decay`` finding;
- a finding that a round of its target raises for the first time re-arms that target,
  so the next round confirms it or clears it; confirmed (``CONFIRM_ROUNDS`` in a row),
  NUMA mismatches and level contradictions change the matrix (``apply_verdicts``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from topoagent.log import log_event
from topoagent.node.matrix import DistanceMatrix
from topoagent.node.model import Finding
from topoagent.probes.figures import ProbeFigure, ProbeKind, ProbeSkip
from topoagent.probes.history import BaselineBook
from topoagent.probes.overlay import CONFIRM_ROUNDS, apply_verdicts, findings_for, overlay
from topoagent.probes.plan import PlanDefaults, numa_nodes_with_cpus, plan_for_target
from topoagent.probes.runner import ProbeRound, ProbeRunner
from topoagent.probes.schedule import GpuActivity, ProbeSchedule, ProbeTarget, Verdict
from topoagent.vocabulary import FindingKind, Severity

# Findings whose confirmation changes the matrix placement reads.
ACTED_ON = (FindingKind.NUMA_AFFINITY_MISMATCH, FindingKind.LEVEL_CONTRADICTION)


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


def target_subject(target: ProbeTarget, names: Mapping[int, str]) -> str:
    """How findings name this target's link: ``GPU0-GPU1``, ``GPU3 host link``."""
    if target.is_pair:
        return "-".join(names.get(g, f"GPU{g}") for g in target.gpus)
    return f"{names.get(target.gpus[0], f'GPU{target.gpus[0]}')} host link"


@dataclass
class ProbeService:
    schedule: ProbeSchedule
    runner: ProbeRunner
    backend: str = "cuda"
    numa_nodes: Iterable[int] = field(default_factory=numa_nodes_with_cpus)
    defaults: PlanDefaults | None = None  # sizes and counts; None: the backend's own
    book: BaselineBook = field(default_factory=BaselineBook)  # long baselines (no state dir: in memory)
    # Discovery's matrix, for judging each round as it ends (the agent sets it).
    matrix: DistanceMatrix | None = None
    last_verdict: Verdict | None = None
    # GPU sets of the targets whose newest figures were taken under load.
    under_load: set[frozenset[int]] = field(default_factory=set)
    # (kind, subject) -> rounds of its target in a row that raised it.
    confirmations: dict[tuple[FindingKind, str], int] = field(default_factory=dict)
    latest: dict[str, float] = field(default_factory=dict)  # target key -> its newest figure
    # target key -> its figure when the lease that just ended was granted.
    before_release: dict[str, float] = field(default_factory=dict)
    # Why no round can succeed here (torch missing: runner.torch_missing), said as a finding.
    unavailable: str | None = None

    async def step(
        self,
        activity: Mapping[int, GpuActivity] | None = None,
        on_record: Callable[[ProbeFigure | ProbeSkip], None] | None = None,
    ) -> ProbeRound | None:
        """Probe the next target if one may run now; None when nothing is due."""
        activity = activity or {}
        target = self.schedule.next_probe(activity)
        if target is None:
            return None
        forced = self.schedule.states[target].forced if target in self.schedule.states else False
        loaded = self.schedule.contended(target, activity)  # only a forced round gets here so
        plan = plan_for_target(target.gpus, self.backend, self.numa_nodes, self.defaults)
        probe_round = await self.runner.run(plan, force=forced, on_record=on_record)
        figure = target_figure(target, probe_round)
        self.last_verdict = self.schedule.record(
            target, duration_s=probe_round.duration_s, figure=figure, ok=probe_round.ok, under_load=loaded
        )
        if not probe_round.results:
            return probe_round
        if loaded:
            self.under_load.add(frozenset(target.gpus))
            return probe_round
        self.under_load.discard(frozenset(target.gpus))
        if probe_round.ok and figure is not None:
            self.latest[target.key] = figure
            self.book.observe(target.key, figure)
            self._compare_after_release(target, figure)
        self._judge(target, probe_round)
        return probe_round

    def _compare_after_release(self, target: ProbeTarget, figure: float) -> None:
        before = self.before_release.pop(target.key, None)
        if before is None:
            return
        change = figure / before - 1.0
        worse = change < -self.schedule.config.tolerance
        log_event(
            "probe_after_release", logging.WARNING if worse else logging.INFO,
            target=target.key, before_gbps=f"{before:.2f}", after_gbps=f"{figure:.2f}", change=f"{change:+.1%}",
        )

    def _judge(self, target: ProbeTarget, probe_round: ProbeRound) -> None:
        """Count this round's findings on its own target; re-arm it on a new one."""
        if self.matrix is None:
            return
        names = {g.index: g.name for g in self.matrix.gpus}
        subject = target_subject(target, names)
        raised = {
            (f.kind, f.subject) for f in findings_for(self.matrix, probe_round.figures()) if f.subject == subject
        }
        for key in [k for k in self.confirmations if k[1] == subject and k not in raised]:
            del self.confirmations[key]  # not seen this round: the streak is broken
        new = False
        for key in raised:
            self.confirmations[key] = self.confirmations.get(key, 0) + 1
            new = new or self.confirmations[key] == 1
        if new:
            self.schedule.rearm([target])

    # --- the node's life ----------------------------------------------------------------
    def on_topology_change(self, gpus: Iterable[int], changed: Iterable[ProbeTarget] | None) -> None:
        """Discovery saw new facts: re-arm the changed links and forget their baselines."""
        gpus = list(gpus)
        before = set(self.schedule.states)
        self.schedule.on_topology_change(gpus, changed)
        dropped = before - set(self.schedule.states)
        rearmed = set(changed) if changed is not None else before
        forget = {t.key for t in dropped | rearmed}
        self.book.forget(forget)
        for key in forget:
            self.latest.pop(key, None)

    def on_lease_granted(self, lease_id: str, gpus: Iterable[int]) -> dict[str, float]:
        """Record, with the lease, the newest figure of every link among its GPUs."""
        held = set(gpus)
        figures = {t.key: self.latest[t.key] for t in self.schedule.states if set(t.gpus) <= held and t.key in self.latest}
        self.book.record_lease(lease_id, figures)
        return figures

    def on_lease_ended(self, lease_id: str, gpus: Iterable[int]) -> set[ProbeTarget]:
        """A lease released or expired: its GPUs are probed before they are handed out again."""
        self.before_release.update(self.book.end_lease(lease_id))
        return self.on_gpus_released(gpus)

    def on_gpus_released(self, gpus: Iterable[int]) -> set[ProbeTarget]:
        return self.schedule.on_gpus_released(gpus)

    @property
    def unverified(self) -> frozenset[int]:
        """GPUs a job gave back that have not been probed since."""
        return self.schedule.unverified

    # --- what the figures mean ------------------------------------------------------------
    def figures(self) -> list[ProbeFigure]:
        """Newest figure per measurement and direction (for /metrics)."""
        return self.runner.latest_figures()

    def overlay(self, matrix: DistanceMatrix) -> DistanceMatrix:
        return self.verdicts(matrix)[0]

    def findings(self, matrix: DistanceMatrix) -> list[Finding]:
        return self.verdicts(matrix)[1]

    def verdicts(
        self, matrix: DistanceMatrix, figures: Iterable[ProbeFigure] | None = None, previous: DistanceMatrix | None = None
    ) -> tuple[DistanceMatrix, list[Finding]]:
        """The matrix placement reads (measurements overlaid, confirmed verdicts applied)
        and the findings the figures and the long baselines support; ``previous``: the
        matrix served before, for each pair's last verdict."""
        figures = list(self.figures() if figures is None else figures)
        measured = overlay(matrix, figures, previous, self.under_load)
        found = findings_for(measured, figures, under_load=self.under_load) + self.decay_findings(matrix)
        if self.unavailable is not None:
            found.append(Finding(FindingKind.PROBES_UNAVAILABLE, Severity.WARNING, "probes", self.unavailable, source="probe"))
        confirmed = [
            f for f in found if f.kind in ACTED_ON and self.confirmations.get((f.kind, f.subject), 0) >= CONFIRM_ROUNDS
        ]
        return apply_verdicts(measured, confirmed, figures), found

    def decay_findings(self, matrix: DistanceMatrix) -> list[Finding]:
        tolerance = self.schedule.config.tolerance
        names = {g.index: g.name for g in matrix.gpus}
        found = []
        for key, history in self.book.decayed(tolerance):
            target = next((t for t in self.schedule.states if t.key == key), None)
            if target is None or not all(g in names for g in target.gpus):
                continue
            subject = target_subject(target, names)
            found.append(
                Finding(
                    FindingKind.LINK_DECAY,
                    Severity.WARNING,
                    subject,
                    f"{subject} has lost {history.loss:.0%} since its first healthy figure: "
                    f"{history.first:.1f} GB/s then, {history.reference:.1f} GB/s on the slow average of "
                    f"{history.rounds} rounds (tolerance {tolerance:.0%}); a cable, retimer or slot going bad",
                    source="probe",
                    expected_gbps=round(history.first, 2),
                    measured_gbps=round(history.reference, 2),
                )
            )
        return found
