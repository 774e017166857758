"""The clock a search keeps to: a request's Deadline, and the step budgets of its cheap tries.

A search calls ``tick()`` once per step (a branch, or one extension of a ring or path;
a cheap try's steps of a few bit operations call StepBudget.tick_light, which ticks the
Deadline once in LIGHT_STEPS_PER_TICK); a Deadline reads the clocks every CHECK_EVERY steps (up to CHECK_EVERY_MOST while steps
are cheap and the stop far) and raises DeadlineReached when its time is up, a StepBudget
raises StepsSpent when its steps are.

A deadline is the wall-clock time the caller waits for the answer.  After the search
stops, building the answer takes CPU time of its own (ANSWER_RESERVE_*), and on a busy
node (a training job's data loaders on every core) the thread gets only a share of a
core, so that CPU time stretches on the wall clock -- and the thread may wait for a core
at any moment, for as long as the scheduler makes it.  The deadline reads the thread's CPU
clock beside the wall clock: their ratio since the request began is the share of a core
the thread gets, and the wall time between two reads less the CPU time between them is a
stretch it waited.  The search stops ``reserve / share`` plus the longest wait seen so
far before the deadline (half the deadline at most): the time the answer will take to
build at that share, should the thread wait once more as long.  The CPU clock also bounds
the search alone, at the deadline less the reserve.  Tests replace
``clock`` with one that counts steps and ``wall_clock`` with one that never moves, so
what a deadline stops is the same on any machine.
"""

from __future__ import annotations

from time import monotonic, thread_time
from typing import Protocol


class DeadlineReached(Exception):
    """The search's time is up: the caller answers with the best set found so far."""


clock = thread_time  # the CPU the searching thread gets; tests put a clock that counts steps here
wall_clock = monotonic  # the deadline itself; tests freeze it
LEAST_SHARE = 0.05  # below this share of a core the reserve is half the deadline anyway


class Deadline:
    """A wall-clock time a search stops before, leaving the time to build the answer at
    the share of a core the thread gets (module docstring).  The clocks are read every
    CHECK_EVERY steps (a step is one branch or one Hamiltonian extension: a few to a
    hundred microseconds at 128 GPUs): cheap next to the search, finer than 0.5 ms.
    Where steps are cheap and the stop is far, every up to CHECK_EVERY_MOST steps
    (about READ_EVERY_S of CPU apart): the CPU clock costs about half a microsecond a
    read, a few percent of a search.  The stop is far while the thread has more than
    FAR_S of CPU left before it -- more than CHECK_EVERY_MOST of the dearest steps take --
    so steps dearer than those measured are still read before it, and near it the reads
    are every CHECK_EVERY steps: no later than with that stride alone."""

    CHECK_EVERY = 4
    CHECK_EVERY_MOST = 16
    READ_EVERY_S = 0.0005
    FAR_S = 0.002
    # The CPU time building the answer from the set takes: ~0.1 ms for one GPU and 1-5 ms
    # for 64 (ranks, bindings, launch forms).
    ANSWER_RESERVE_S = 0.0015
    ANSWER_RESERVE_PER_GPU_S = 0.0001

    def __init__(self, seconds: float, gpus: int = 1):
        self.seconds = seconds
        self.reserve = min(self.ANSWER_RESERVE_S + gpus * self.ANSWER_RESERVE_PER_GPU_S, seconds / 2)
        self.cpu_from = self.cpu_read = clock()
        self.wall_from = self.wall_read = wall_clock()
        self.waited = 0.0  # the longest stretch between two reads the thread spent off a core
        self.at = self.cpu_from + seconds - self.reserve
        self.every = self.left = self.CHECK_EVERY  # steps between reads, and left to the next
        self.reached = False
        self.unread = 0.0  # steps left before the clocks are read again (a cheap first answer's)
        self.unread_to_deadline = False  # those steps stop at the deadline less the reserve all the same
        self.bound_gbps: float | None = None  # what the stopped search could still prove

    def tick(self) -> None:
        self.left -= 1
        if self.left <= 0:
            if self.unread > 0:
                self.unread -= self.every
                self.every = self.left = self.CHECK_EVERY  # (leave_unread)
                # Unhurried, but never past the deadline less the reserve where asked: a step
                # costs up to ~100 us at 128 GPUs, and thousands could run far past 20 ms.
                if self.unread_to_deadline and wall_clock() - self.wall_from >= self.seconds - self.reserve:
                    self.reached = True
                    raise DeadlineReached
                return
            self.check()

    def leave_unread(self, steps: float, to_deadline: bool = False) -> None:
        """Leave the CPU clock unread for the next ``steps`` steps (a cheap first answer's:
        Anytime._unhurried); ``to_deadline``: the wall clock still stops them at the deadline
        less the reserve.  That is read every CHECK_EVERY steps from now on: the stride a
        far stop allowed was measured on other steps, and these are not measured at all."""
        self.unread, self.unread_to_deadline = steps, to_deadline
        if steps > 0:
            self.every = self.left = min(self.left, self.CHECK_EVERY)

    def check(self) -> None:
        """Read the clocks now: for work in coarse steps (a GPU's row of a matrix's tables,
        about 0.4 ms at 128 GPUs), where every fourth step would be too late."""
        if self.reached:
            raise DeadlineReached
        cpu, now = clock(), wall_clock()
        steps = self.every - self.left  # since the last read: all of them from tick(), fewer from a coarse caller
        spent = cpu - self.cpu_read
        self.waited = max(self.waited, (now - self.wall_read) - spent)
        self.cpu_read, self.wall_read = cpu, now
        wall = now - self.wall_from
        share = max(min((cpu - self.cpu_from) / wall, 1.0), LEAST_SHARE) if wall > 0 else 1.0
        # The CPU time the thread has before the search must stop, by either clock.
        cpu_left = min(self.at - cpu, (self.seconds - wall - self.margin(share)) * share)
        if cpu_left <= 0:
            self.reached = True
            raise DeadlineReached
        every = self.CHECK_EVERY
        if cpu_left > self.FAR_S and steps > 0:
            every = self.CHECK_EVERY_MOST if spent <= 0 else int(self.READ_EVERY_S * steps / spent)
            every = max(self.CHECK_EVERY, min(every, self.CHECK_EVERY_MOST))
        self.every = self.left = every

    def margin(self, share: float) -> float:
        """How long before the deadline the search stops at this share of a core: the
        reserve of CPU time stretched by it, and the longest wait seen; half the deadline at most."""
        return min(self.reserve / share + self.waited, self.seconds / 2)


def no_check() -> None:
    """Deadline.check where there is no deadline (warm(), requests without one)."""


class StepsSpent(Exception):
    """A heuristic's step budget is spent: the search it serves goes on without its set."""


# A deadline's step is a branch or a ring's extension (up to ~100 us at 128 GPUs); this
# many light steps (StepBudget.tick_light) count as one: while a cheap set grows its clocks
# are still read every few tens of microseconds near the stop (Deadline.READ_EVERY_S apart at most far from it).
LIGHT_STEPS_PER_TICK = 4


class StepBudget:
    """A number of search steps for a cheap try (a first answer at a threshold), counted
    inside the search's own deadline: a deterministic bound, whatever the machine's load."""

    def __init__(self, steps: int, deadline: Deadline | None):
        self.left = steps
        self.spent = 0  # steps taken: ``left`` may be topped up (each start of a grown path)
        self.deadline = deadline

    def tick(self) -> None:
        self.spent += 1
        self.left -= 1
        if self.left < 0:
            raise StepsSpent
        if self.deadline is not None:
            self.deadline.tick()

    def tick_light(self) -> None:
        """tick() for a step of a few bit operations (a cheap set grown one GPU at a time,
        a few microseconds): the budget counts every one, the deadline one in
        LIGHT_STEPS_PER_TICK -- its clock reads (the CPU clock alone about half a
        microsecond) would otherwise cost a tenth or more of such steps."""
        self.spent += 1
        self.left -= 1
        if self.left < 0:
            raise StepsSpent
        if self.deadline is not None and not self.spent % LIGHT_STEPS_PER_TICK:
            self.deadline.tick()


class Ticker(Protocol):
    """What a search calls once per step: a Deadline or a StepBudget."""

    def tick(self) -> None: ...

