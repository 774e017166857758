"""kube-scheduler's scheduling queue in simulated time, for issue #39's stream (holds and guards).

Shared by the in-process replay (bench/cluster_replay.py: the extender's own ``Holds`` class
and ranking, in process) and the real cluster bench (bench/cluster.py: real agents, the real
extender over loopback): each subclass says how one pod is scheduled (``schedule``), what a
pod's end frees (``release``), and what kube-scheduler's ``Unschedulable`` mark tells the
extender (``unschedulable``).

Modelled: the active queue sorted by PrioritySort (equal priorities: the time the pod was
queued, refreshed at each failure); one pod per cycle, cycles taking no simulated time; a
failed pod goes to the unschedulable pods with backoff 1 s doubling to 10 s per failure; a
pod ending moves every unschedulable pod back (AssignedPodDelete: to the backoff queue while
its backoff runs, else to the active queue); the backoff queue popped when the active queue
is empty (SchedulerPopFromBackoffQ, ``pop_from_backoff``); the 5-minute flush.  Not
modelled: scheduling and binding taking time, the Node updates the extender's requeue
writes (they move pods the extender rejected; here only pod ends do), other queueing hints,
preemption (equal priorities: nothing to preempt).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.stats import percentile
from topoagent.cluster.extender import HOLD_GUARD_S

if TYPE_CHECKING:  # bench.cluster imports this module
    from bench.cluster import Job, Placed

INITIAL_BACKOFF_S, MAX_BACKOFF_S = 1.0, 10.0  # kube-scheduler's podInitialBackoffSeconds, podMaxBackoffSeconds
UNSCHEDULABLE_FLUSH_S = 300.0  # podMaxInUnschedulablePodsDuration: moved back even without an event
DEFAULT_SETTINGS = "off,guard,guard+30,guard+10,30"


@dataclass
class Queued:
    """A pod in kube-scheduler's queue: its sort time (arrival, then its last failure: the
    queue refreshes it when a pod comes back), its tries and the end of its backoff."""

    job: Job
    stamp: float
    where: str = "active"  # active | backoff | unschedulable
    tries: int = 0
    backoff_until: float = 0.0
    failed_at: float = 0.0


class KubeQueue:
    """The queue and its cycles; ``free_count`` is kube-scheduler's own count of each node's
    GPUs (NodeResourcesFit), kept by ``bound`` and the pods' ends."""

    def __init__(self, free_count: dict[str, int], pop_from_backoff: bool = True) -> None:
        self.free_count, self.pop_from_backoff = dict(free_count), pop_from_backoff
        self.now = 0.0
        self.queue: dict[int, Queued] = {}
        self.bound_at: dict[int, float] = {}  # job id -> bind time
        self.bound_to: dict[int, str] = {}  # job id -> node
        self.running: list[tuple[float, int, Placed]] = []

    def clock(self) -> float:
        return self.now

    # -- the backend's part --------------------------------------------------------------------

    def schedule(self, q: Queued) -> Placed | None:
        """One scheduling cycle for the pod: where it was bound, or None."""
        raise NotImplementedError

    def release(self, placed: Placed) -> None:
        """The pod ended: its GPUs free on its node."""
        raise NotImplementedError

    def unschedulable(self, q: Queued) -> None:
        """kube-scheduler marked the pod PodScheduled=False, Unschedulable."""

    def wake_times(self) -> list[float]:
        """Times the backend wants to run at (``tick``) besides the queue's own."""
        return []

    def tick(self) -> None:
        """Each step of simulated time, before the pods' ends and arrivals."""

    # -- the queue -------------------------------------------------------------------------------

    def run(self, jobs: list[Job]) -> dict[int, float]:
        """Each job's wait (bind time - arrival)."""
        arrivals = list(jobs)
        while arrivals or self.queue or self.running:
            times = [arrivals[0].arrive] if arrivals else []
            times += [min(e for e, _, _ in self.running)] if self.running else []
            times += [q.backoff_until for q in self.queue.values() if q.where == "backoff"]
            times += [q.failed_at + UNSCHEDULABLE_FLUSH_S for q in self.queue.values() if q.where == "unschedulable"]
            times += self.wake_times()
            if not times:
                raise AssertionError(f"pods {sorted(self.queue)} wait with nothing to wake them")
            self.now = max(self.now, min(times))
            self.tick()
            while self.running and min(e for e, _, _ in self.running) <= self.now:
                self._end(min(self.running, key=lambda r: (r[0], r[1])))
            while arrivals and arrivals[0].arrive <= self.now:
                job = arrivals.pop(0)
                self.queue[job.id] = Queued(job, job.arrive)
            for q in self.queue.values():
                if q.where == "backoff" and q.backoff_until <= self.now:
                    q.where = "active"
                elif q.where == "unschedulable" and q.failed_at + UNSCHEDULABLE_FLUSH_S <= self.now:
                    q.where = "active" if q.backoff_until <= self.now else "backoff"
            self._cycles()
        return {job.id: self.bound_at[job.id] - job.arrive for job in jobs}

    def _end(self, entry: tuple[float, int, Placed]) -> None:
        self.running.remove(entry)
        placed = entry[2]
        self.release(placed)
        self.free_count[placed.node] += placed.job.gpus
        for q in self.queue.values():  # AssignedPodDelete moves every unschedulable pod
            if q.where == "unschedulable":
                q.where = "active" if q.backoff_until <= self.now else "backoff"

    def _cycles(self) -> None:
        while True:
            active = [q for q in self.queue.values() if q.where == "active"]
            if active:
                q = min(active, key=lambda q: (q.stamp, q.job.id))
            elif self.pop_from_backoff and (waiting := [q for q in self.queue.values() if q.where == "backoff"]):
                q = min(waiting, key=lambda q: (q.backoff_until, q.job.id))  # SchedulerPopFromBackoffQ
            else:
                return
            placed = self.schedule(q)
            if placed is None:
                q.tries += 1
                q.where, q.stamp, q.failed_at = "unschedulable", self.now, self.now
                q.backoff_until = self.now + min(MAX_BACKOFF_S, INITIAL_BACKOFF_S * 2 ** (q.tries - 1))
                self.unschedulable(q)
                continue
            self.free_count[placed.node] -= placed.job.gpus
            self.bound_at[placed.job.id] = self.now
            self.bound_to[placed.job.id] = placed.node
            del self.queue[placed.job.id]
            self.running.append((self.now + placed.job.duration, placed.job.id, placed))


# --- the settings compared and the figures -------------------------------------------------------


@dataclass(frozen=True)
class HoldSetting:
    """One column: the extender's ``--hold-after`` and ``--hold-guard`` (both 0: the extender
    without holds)."""

    after_s: float
    guard_s: float

    @classmethod
    def parse(cls, text: str) -> HoldSetting:
        """``off``, ``guard`` (guards alone), ``guard+T`` (guards and holds after T s), ``T`` (holds after T s alone)."""
        guard, _, after = text.partition("+") if text.startswith("guard") else ("", "", text)
        try:
            if guard not in ("", "guard") or (guard and text != "guard" and not after):
                raise ValueError
            after_s = 0.0 if after in ("", "off") else float(after)
            if after_s < 0 or (after == "off" and guard):
                raise ValueError
        except ValueError:
            raise ValueError(f"not a hold setting: {text!r} (off, guard, guard+T or T)") from None
        return cls(after_s, HOLD_GUARD_S if guard else 0.0)  # "guard": at the extender's default

    def name(self) -> str:
        parts = (["guard"] if self.guard_s else []) + ([f"hold after {self.after_s:g} s"] if self.after_s else [])
        return " + ".join(parts) or "no holds"


def settings_list(text: str) -> list[HoldSetting]:
    return [HoldSetting.parse(t) for t in text.split(",")]


@dataclass(frozen=True)
class StarveFigures:
    big_p95_s: float  # nearest rank: of 6 pods, the largest
    big_max_s: float
    small_median_s: float
    small_mean_s: float


def starve_figures(jobs: list[Job], waits: dict[int, float], big_gpus: int = 8) -> StarveFigures:
    big = [waits[j.id] for j in jobs if j.gpus >= big_gpus]
    small = [waits[j.id] for j in jobs if j.gpus < big_gpus]
    return StarveFigures(percentile(big, 0.95), max(big), statistics.median(small), statistics.mean(small))


FIGURES = (("8-GPU pods' wait p95 s", "big_p95_s"), ("8-GPU pods' wait max s", "big_max_s"),
           ("1-GPU pods' wait median s", "small_median_s"), ("1-GPU pods' wait mean s", "small_mean_s"))


def starve_table(loads: dict[str, float], seeds: list[int], settings: list[HoldSetting],
                 run: Callable[[str, int, HoldSetting], StarveFigures]) -> str:
    """Per load (its name, its 1-GPU pods' life), under each setting: medians over the seeds
    of ``run(load, seed, setting)``."""
    lines = [f"| load (1-GPU pods live) | figure (median of {len(seeds)} seeds) | " + " | ".join(s.name() for s in settings) + " |",
             "|---|---|" + "---:|" * len(settings)]
    for load, life in loads.items():
        runs = {s: [run(load, seed, s) for seed in seeds] for s in settings}
        for label, figure in FIGURES:
            cells = [f"{statistics.median(getattr(f, figure) for f in runs[s]):.1f}" for s in settings]
            lines.append(f"| {load} ({life:g} s) | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
