"""The clock a search keeps to: a request's Deadline, and the step budgets of its cheap tries.

A search calls ``tick()`` once per step (a branch, or one extension of a ring or path);
a Deadline reads the clock every CHECK_EVERY steps and raises DeadlineReached when its
time is up, a StepBudget raises StepsSpent when its steps are.

A deadline counts the CPU time the searching thread gets, not the wall clock: on a busy
node (a training job's data loaders on every core) a search that gets a tenth of a core
would otherwise answer small problems from a tenth of its budget, far from the optimum.
The wall clock still bounds it, at WALL_CAP times the deadline, so an answer never waits
on a starved thread for long.  Tests replace ``clock`` with one that counts steps and
``wall_clock`` with one that never moves, so what a deadline stops is the same on any
machine.
"""

from __future__ import annotations

from time import monotonic, thread_time
from typing import Protocol


class DeadlineReached(Exception):
    """The search's time is up: the caller answers with the best set found so far."""


clock = thread_time  # the budget: this thread's CPU time; tests put a clock that counts steps here
wall_clock = monotonic  # the cap on the wall clock; tests freeze it
WALL_CAP = 5  # a deadline of d seconds of CPU ends at 5 d seconds of wall time at the latest


class Deadline:
    """A budget of CPU time a search stops at (and WALL_CAP times it on the wall clock, the
    first reached).  The clocks are read every CHECK_EVERY steps (a step is one branch or
    one Hamiltonian extension: a few to a hundred microseconds at 128 GPUs): cheap next to
    the search, finer than 0.5 ms."""

    CHECK_EVERY = 4
    # The search stops this much before the deadline (half of it at most): building the
    # answer from the set takes ~0.1 ms for one GPU and 1-5 ms for 64 (ranks, bindings,
    # launch forms; the more the busier the machine).
    ANSWER_RESERVE_S = 0.0015
    ANSWER_RESERVE_PER_GPU_S = 0.0001

    def __init__(self, seconds: float, gpus: int = 1):
        self.seconds = seconds
        reserve = self.ANSWER_RESERVE_S + gpus * self.ANSWER_RESERVE_PER_GPU_S
        usable = seconds - min(reserve, seconds / 2)
        self.at = clock() + usable
        self.wall_at = wall_clock() + WALL_CAP * usable
        self.left = self.CHECK_EVERY
        self.reached = False
        self.suspended = False  # while a search finds its first, cheap answer
        self.bound_gbps: float | None = None  # what the stopped search could still prove

    def tick(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.left = self.CHECK_EVERY
            if self.suspended:
                return
            self.check()

    def check(self) -> None:
        """Read the clock now: for work in coarse steps (a GPU's row of a matrix's tables,
        about 0.4 ms at 128 GPUs), where every fourth step would be too late."""
        if self.reached or clock() >= self.at or wall_clock() >= self.wall_at:
            self.reached = True
            raise DeadlineReached


def no_check() -> None:
    """Deadline.check where there is no deadline (warm(), requests without one)."""


class StepsSpent(Exception):
    """A heuristic's step budget is spent: the search it serves goes on without its set."""


class StepBudget:
    """A number of search steps for a cheap try (a first answer at a threshold), counted
    inside the search's own deadline: a deterministic bound, whatever the machine's load."""

    def __init__(self, steps: int, deadline: Deadline | None):
        self.left = steps
        self.deadline = deadline

    def tick(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise StepsSpent
        if self.deadline is not None:
            self.deadline.tick()


class Ticker(Protocol):
    """What a search calls once per step: a Deadline or a StepBudget."""

    def tick(self) -> None: ...

