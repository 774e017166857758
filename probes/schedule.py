"""When to probe what: an adaptive schedule that never gets in a training job's way.

Pure: no I/O, no threads; time comes from an injected ``clock`` (seconds, monotonic) so
tests drive it with a fake one.  The rules:

- **Soon after a change.**  Every target is due ``startup_delay_s`` after start-up, and
  ``change_delay_s`` after ``on_topology_change`` (hotplug, a new topology snapshot).
- **Back off while nothing changes.**  A result within ``tolerance`` of the target's
  baseline multiplies its interval by ``backoff_factor``, up to ``max_interval_s``.
- **Tighten on drift.**  A result outside the tolerance becomes the new baseline and the
  interval drops back to ``min_interval_s``.
- **Never disturb a busy GPU.**  A target touching a GPU whose utilization is at or above
  ``busy_utilization_percent`` or that runs other processes is not started, unless the
  round was forced (``request_round(force=True)``, e.g. ``POST /probe``).
- **Cap the duty cycle.**  Probing may use at most ``duty_cycle`` of any GPU's wall time
  over a sliding ``duty_window_s`` (1% of an hour = 36 s by default); a target whose
  expected duration would overrun it waits.  Forced rounds are not capped.
- **One at a time.**  While a probe is in flight ``next_probe`` returns nothing.
- **Follow the node's life.**  GPUs a job gave back (``on_gpus_released``: a lease
  released or expired, the processes NVML saw ended) are *unverified* until their own
  target and the pairs among them have run again; their targets are due now and go
  first (still within the duty cycle).  ``rearm`` makes chosen targets due soon with a
  tight interval (a finding on the link); ``on_topology_change`` re-arms only the links
  whose facts changed and keeps the others' baselines.
- **Mind shared paths.**  A target whose PCIe path (``paths``: switch uplinks, host
  bridges, socket links; see ``topoagent.probes.paths``) is shared with a busy GPU's
  (``footprints``) is postponed like a busy one; a forced round runs it anyway and the
  caller marks its figures as taken under load (``contended``), which ``record`` does
  not turn into a baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, order=True)
class ProbeTarget:
    """What one probe measures: a GPU pair (P2P both ways, latency) or one GPU alone
    (on-device copy, host↔device from each NUMA node)."""

    gpus: tuple[int, ...]

    @property
    def is_pair(self) -> bool:
        return len(self.gpus) == 2

    @property
    def key(self) -> str:
        return "pair:" + "-".join(map(str, self.gpus)) if self.is_pair else f"gpu:{self.gpus[0]}"


def targets_for(gpus: Iterable[int]) -> list[ProbeTarget]:
    devices = sorted(set(gpus))
    pairs = [ProbeTarget((a, b)) for i, a in enumerate(devices) for b in devices[i + 1 :]]
    return pairs + [ProbeTarget((g,)) for g in devices]


@dataclass(frozen=True, slots=True)
class GpuActivity:
    """What NVML says a GPU is doing (the service fills this in)."""

    utilization_percent: float | None = None
    other_processes: int = 0


@dataclass(frozen=True, slots=True)
class ScheduleConfig:
    startup_delay_s: float = 30.0
    change_delay_s: float = 10.0
    min_interval_s: float = 900.0
    max_interval_s: float = 24 * 3600.0
    backoff_factor: float = 2.0
    tolerance: float = 0.10
    duty_cycle: float = 0.01
    duty_window_s: float = 3600.0
    busy_utilization_percent: float = 5.0
    default_duration_s: float = 2.0  # assumed length of a target's first probe
    failure_retry_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.duty_cycle <= 1:
            raise ValueError("duty_cycle must be in (0, 1]")
        if self.backoff_factor < 1:
            raise ValueError("backoff_factor must be >= 1")
        if not 0 < self.min_interval_s <= self.max_interval_s:
            raise ValueError("need 0 < min_interval_s <= max_interval_s")


@dataclass(slots=True)
class TargetState:
    target: ProbeTarget
    due_at: float
    interval_s: float
    baseline: float | None = None
    last_duration_s: float | None = None
    failures: int = 0
    forced: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one result did to its target's schedule."""

    target: ProbeTarget
    outcome: str  # "first" | "stable" | "drift" | "failed" | "under_load"
    next_due_in_s: float
    baseline: float | None


@dataclass
class ProbeSchedule:
    gpus: Iterable[int]
    config: ScheduleConfig = field(default_factory=ScheduleConfig)
    clock: Callable[[], float] = time.monotonic
    states: dict[ProbeTarget, TargetState] = field(init=False)
    in_flight: ProbeTarget | None = field(init=False, default=None)
    in_flight_since: float = field(init=False, default=0.0)
    # gpu -> [(start, end)] of probes inside the duty window
    history: dict[int, list[tuple[float, float]]] = field(init=False, default_factory=dict)

    # Targets that check GPUs a job gave back (their own target, pairs among the
    # released), each with the GPUs it clears of ``unverified`` once it ran.
    verifying: dict[ProbeTarget, set[int]] = field(init=False, default_factory=dict)
    # target -> the shared path segments its copies cross; gpu -> the segments its own
    # traffic may load (topoagent.probes.paths).  Empty: contention is not considered.
    paths: Mapping[ProbeTarget, frozenset[str]] = field(init=False, default_factory=dict)
    footprints: Mapping[int, frozenset[str]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        now = self.clock()
        self.states = {
            t: TargetState(t, now + self.config.startup_delay_s, self.config.min_interval_s)
            for t in targets_for(self.gpus)
        }

    # --- events -------------------------------------------------------------------

    def on_topology_change(self, gpus: Iterable[int] | None = None, changed: Iterable[ProbeTarget] | None = None) -> None:
        """Hotplug or a changed topology: new targets appear and are due soon.

        ``changed`` names the targets whose facts changed (None: all of them); those are
        re-armed with their baselines dropped (the old figures say nothing about the new
        link), the others keep their state and schedule.
        """
        now = self.clock()
        due = now + self.config.change_delay_s
        wanted = targets_for(gpus if gpus is not None else {g for t in self.states for g in t.gpus})
        rearm = set(wanted) if changed is None else set(changed)
        kept = {t: s for t, s in self.states.items() if t in wanted and t not in rearm}
        self.states = {t: kept.get(t) or TargetState(t, due, self.config.min_interval_s) for t in wanted}
        self.verifying = {t: gs for t, gs in self.verifying.items() if t in self.states}

    def rearm(self, targets: Iterable[ProbeTarget]) -> None:
        """Probe these targets again soon, at the tightest interval (a finding on the link)."""
        due = self.clock() + self.config.change_delay_s
        for target in targets:
            state = self.states.get(target)
            if state is not None:
                state.due_at = min(state.due_at, due)
                state.interval_s = self.config.min_interval_s

    def on_gpus_released(self, gpus: Iterable[int]) -> set[ProbeTarget]:
        """A job gave these GPUs back: check them before the next job gets them.

        Every target touching them is due now; each GPU stays in ``unverified`` until its
        own target and the pairs among the released GPUs have run.  Returns the targets
        that verify them.
        """
        released = {g for g in gpus if ProbeTarget((g,)) in self.states}
        if not released:
            return set()
        now = self.clock()
        for state in self.states.values():
            if released & set(state.target.gpus):
                state.due_at = min(state.due_at, now)
        checks = {ProbeTarget((g,)) for g in released} | {
            t for t in self.states if t.is_pair and set(t.gpus) <= released
        }
        for target in checks:
            self.verifying.setdefault(target, set()).update(set(target.gpus) & released)
        return checks

    @property
    def unverified(self) -> frozenset[int]:
        """GPUs a job gave back that have not been probed since: placement may prefer others."""
        return frozenset(g for gpus in self.verifying.values() for g in gpus)

    def request_round(self, *, force: bool = False) -> None:
        """Make every target due now; ``force`` also overrides busy GPUs and the duty cap."""
        now = self.clock()
        for state in self.states.values():
            state.due_at = min(state.due_at, now)
            state.forced = state.forced or force

    # --- choosing -----------------------------------------------------------------

    def is_busy(self, gpu: int, activity: Mapping[int, GpuActivity]) -> bool:
        seen = activity.get(gpu)
        if seen is None:
            return False
        util = seen.utilization_percent
        return seen.other_processes > 0 or (util is not None and util >= self.config.busy_utilization_percent)

    def duty_used_s(self, gpu: int, now: float | None = None) -> float:
        """Seconds of probing on ``gpu`` inside the sliding window ending now."""
        now = self.clock() if now is None else now
        start = now - self.config.duty_window_s
        return sum(max(0.0, min(e, now) - max(s, start)) for s, e in self.history.get(gpu, ()))

    def fits_duty(self, state: TargetState, now: float) -> bool:
        budget = self.config.duty_cycle * self.config.duty_window_s
        expected = state.last_duration_s if state.last_duration_s is not None else self.config.default_duration_s
        return all(self.duty_used_s(g, now) + expected <= budget for g in state.target.gpus)

    def contended(self, target: ProbeTarget, activity: Mapping[int, GpuActivity]) -> bool:
        """Whether a busy GPU outside the target loads a path segment the target's copies
        cross, or a GPU of the target is busy itself: its figure would read congestion."""
        if any(self.is_busy(g, activity) for g in target.gpus):
            return True
        path = self.paths.get(target, frozenset())
        if not path:
            return False
        return any(
            path & self.footprints.get(gpu, frozenset())
            for gpu in activity
            if gpu not in target.gpus and self.is_busy(gpu, activity)
        )

    def next_probe(self, activity: Mapping[int, GpuActivity] | None = None) -> ProbeTarget | None:
        """The target to probe now, claimed until ``record``; None if nothing may run."""
        if self.in_flight is not None:
            return None
        activity = activity or {}
        now = self.clock()
        due = sorted(
            (s for s in self.states.values() if s.due_at <= now),
            # Forced first, then GPUs a job gave back (the next placement waits on them),
            # then the oldest due; pairs before single GPUs: placement needs them.
            key=lambda s: (not s.forced, s.target not in self.verifying, s.due_at, not s.target.is_pair, s.target),
        )
        for state in due:
            if not state.forced:
                if self.contended(state.target, activity):
                    continue
                if not self.fits_duty(state, now):
                    continue
            self.in_flight = state.target
            self.in_flight_since = now
            return state.target
        return None

    def next_wakeup(self) -> float | None:
        """Clock time at which the next target falls due (None if none)."""
        if not self.states:
            return None
        return min(s.due_at for s in self.states.values())

    # --- results ------------------------------------------------------------------

    def record(
        self, target: ProbeTarget, *, duration_s: float, figure: float | None, ok: bool = True, under_load: bool = False
    ) -> Verdict:
        """Account a finished probe and reschedule its target.

        ``figure`` is the one number compared across rounds (for a pair: the slower
        direction's P2P bandwidth; for a GPU: its host link), GB/s.  A figure taken
        ``under_load`` (a forced round over a shared path) neither sets nor moves the
        baseline: the target is due again at the tightest interval.
        """
        now = self.clock()
        if self.in_flight == target:
            self.in_flight = None
        for gpu in target.gpus:
            spans = [(s, e) for s, e in self.history.get(gpu, ()) if e > now - self.config.duty_window_s]
            spans.append((now - max(duration_s, 0.0), now))
            self.history[gpu] = spans
        state = self.states.get(target)
        if state is None:  # the topology changed while it ran; nothing to reschedule
            return Verdict(target, "failed" if not ok else "stable", 0.0, None)
        cfg = self.config
        state.forced = False
        state.last_duration_s = duration_s
        if ok and figure is not None and not under_load:
            self.verifying.pop(target, None)
        if ok and figure is not None and under_load:
            state.failures = 0
            state.interval_s = cfg.min_interval_s
            state.due_at = now + state.interval_s
            return Verdict(target, "under_load", state.interval_s, state.baseline)
        if not ok or figure is None:
            state.failures += 1
            state.interval_s = min(cfg.failure_retry_s * cfg.backoff_factor ** (state.failures - 1), cfg.max_interval_s)
            outcome = "failed"
        else:
            state.failures = 0
            if state.baseline is None:
                state.baseline = figure
                state.interval_s = cfg.min_interval_s
                outcome = "first"
            elif abs(figure - state.baseline) <= cfg.tolerance * state.baseline:
                state.interval_s = min(state.interval_s * cfg.backoff_factor, cfg.max_interval_s)
                outcome = "stable"
            else:
                state.baseline = figure
                state.interval_s = cfg.min_interval_s
                outcome = "drift"
        state.due_at = now + state.interval_s
        return Verdict(target, outcome, state.interval_s, state.baseline)
