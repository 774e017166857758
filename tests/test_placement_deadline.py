"""A deadline on every search: where the exact search cannot finish in time the answer
still comes, valid and marked not proven; where it finishes, nothing changes."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

import topoagent.placement.deadline as deadline_module
from topoagent.collectors.nvidia_smi import parse_topo_matrix
from topoagent.documents.agent import answer_document
from topoagent.node.matrix import DistanceMatrix
from topoagent.placement import Live, NoFit, Placement, Request, place
from topoagent.placement.ksets import small_table_if_built
from topoagent.placement.search import warm
from topoagent.placement.synthetic import irregular_mesh, nvswitch_16
from topoagent.placement.tables import prepare
from topoagent.vocabulary import Detail, Pattern

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parents[0].parent / "shared" / "corpus" / "nvidia-smi-topo"
# Answers of place() before deadlines existed, one row per (busy, pattern, k) and corpus file.
BEFORE = json.loads((HERE / "data" / "placement_answers_before_deadlines.json").read_text())
# Answers on every recorded snapshot (the 16-GPU DGX-2 is answered by branch and bound),
# recorded by tests/data/record_snapshot_answers.py before the anytime search's incumbents.
SNAPSHOT_ANSWERS = json.loads((HERE / "data" / "placement_answers_snapshots.json").read_text())

MESH = irregular_mesh(128)  # no symmetry to exploit: the exact search takes far longer than 1 ms


class StepClock:
    """A clock that moves a fixed amount each time it is read: a deadline becomes a count
    of search steps, the same on an idle laptop and a loaded CI machine."""

    def __init__(self, per_read_s: float):
        self.now = 0.0
        self.per_read_s = per_read_s

    def __call__(self) -> float:
        self.now += self.per_read_s
        return self.now


def frozen_clock() -> float:
    """A clock that never moves: a deadline is never reached, whatever the machine's load,
    and the search still takes its anytime path (the deadline is set)."""
    return 0.0


@pytest.fixture(autouse=True)
def wall_clock_stands_still(monkeypatch):
    """The deadlines here count steps (StepClock) or never end (frozen_clock): the wall-clock
    cap, which a loaded machine could reach first, must not decide what a test sees."""
    monkeypatch.setattr(deadline_module, "wall_clock", frozen_clock)


def test_a_deadline_is_the_wall_clock_less_the_answer_at_the_share_of_a_core_the_search_gets(monkeypatch):
    """The caller waits by the wall clock: the search stops before the deadline by the time
    building the answer will take -- its CPU reserve stretched by the share of a core the
    thread has had -- and by the longest wait for a core seen between two reads (half the
    deadline at most, for a thread starved outright).  With the wall clock frozen (as these
    tests run) the CPU clock alone stops it where a search with a core to itself stops."""
    def reads_until_reached(deadline: deadline_module.Deadline) -> int:
        for reads in range(1, 100_000):
            try:
                deadline.check()
            except deadline_module.DeadlineReached:
                return reads
        raise AssertionError("never reached")

    usable_ms = 20 - 1.5 - 0.1  # less the reserve for building the answer (1 GPU)
    # A core: no wait.  Half of one: the reserve doubled, and 0.5 ms waited between reads.
    for cpu_per_read, stops_at_ms in ((1e-3, usable_ms), (0.5e-3, 20 - 2 * 1.6 - 0.5), (0.0, 20 / 2)):
        monkeypatch.setattr(deadline_module, "clock", StepClock(cpu_per_read))  # a core, half of one, none
        monkeypatch.setattr(deadline_module, "wall_clock", StepClock(1e-3))
        assert reads_until_reached(deadline_module.Deadline(0.02)) == pytest.approx(stops_at_ms, abs=1.5), cpu_per_read

    monkeypatch.setattr(deadline_module, "clock", StepClock(1e-3))  # the CPU clock alone
    monkeypatch.setattr(deadline_module, "wall_clock", frozen_clock)
    assert reads_until_reached(deadline_module.Deadline(0.02)) == pytest.approx(usable_ms, abs=1.5)


def test_a_search_that_once_waited_for_a_core_stops_that_much_sooner(monkeypatch):
    """A thread the scheduler kept off a core for 5 ms may be kept off as long again just
    before the answer: it stops at least 5 ms sooner than one that never waited."""
    def stops_at_ms(wait_at_read: int | None) -> int:
        cpu, wall = StepClock(1e-3), StepClock(1e-3)
        reads = [0]

        def waiting_wall() -> float:
            reads[0] += 1
            if reads[0] == wait_at_read:
                wall.now += 5e-3  # 5 ms off a core between two reads
            return wall()

        monkeypatch.setattr(deadline_module, "clock", cpu)
        monkeypatch.setattr(deadline_module, "wall_clock", waiting_wall)
        deadline = deadline_module.Deadline(0.02)
        try:
            while True:
                deadline.check()
        except deadline_module.DeadlineReached:
            return round((wall.now - deadline.wall_from) * 1000)

    never, once = stops_at_ms(None), stops_at_ms(4)
    assert never == pytest.approx(20 - 1.6, abs=1.5)
    assert 20 / 2 <= once <= never - 5  # (its share of a core fell too: the reserve grew)


def test_the_clocks_left_unread_for_a_first_answer_are_read_after_its_steps(monkeypatch):
    """A cheap first answer's steps do not read the clocks (Anytime._unhurried), but only
    that many: a search that runs on past them is stopped as any other."""
    monkeypatch.setattr(deadline_module, "clock", StepClock(1.0))  # every read is past the deadline
    deadline = deadline_module.Deadline(0.02)
    deadline.leave_unread(40)
    for _ in range(40):
        deadline.tick()  # not read: no DeadlineReached
    with pytest.raises(deadline_module.DeadlineReached):
        for _ in range(deadline_module.Deadline.CHECK_EVERY):
            deadline.tick()


def test_unread_steps_that_run_to_the_deadline_stop_there(monkeypatch):
    """The cheap tries' unread steps (to_deadline) stop at the deadline by the wall clock
    all the same: at 128 GPUs a step costs up to ~100 us, and thousands of them would answer
    far past it."""
    wall = StepClock(0.0)  # moved by hand
    monkeypatch.setattr(deadline_module, "clock", StepClock(0.0))  # the CPU clock never says stop
    monkeypatch.setattr(deadline_module, "wall_clock", wall)
    deadline = deadline_module.Deadline(0.02)
    deadline.leave_unread(10_000, to_deadline=True)
    for _ in range(40):
        deadline.tick()
    wall.now += 0.02
    with pytest.raises(deadline_module.DeadlineReached):
        for _ in range(deadline_module.Deadline.CHECK_EVERY):
            deadline.tick()


def test_unread_steps_after_cheap_steps_stop_at_the_deadline_as_soon(monkeypatch):
    """Cheap steps far from the stop stretch the reads to CHECK_EVERY_MOST steps apart; the
    cheap tries' unread steps that follow (Anytime._unhurried, to_deadline) still see the
    wall clock's stop within CHECK_EVERY steps: they are not read by the CPU clock, so the
    stride the CPU clock allowed says nothing of what they cost (up to ~100 us each)."""
    from types import SimpleNamespace

    from topoagent.placement.anytime import Anytime

    wall = StepClock(0.0)  # moved by hand
    monkeypatch.setattr(deadline_module, "clock", StepClock(1e-6))  # a microsecond a read: far from the stop
    monkeypatch.setattr(deadline_module, "wall_clock", wall)
    deadline = deadline_module.Deadline(0.02)
    while deadline.every < deadline_module.Deadline.CHECK_EVERY_MOST:
        deadline.tick()
    assert deadline.left == deadline.every  # just read, the next read is a whole stride away
    with Anytime._unhurried(SimpleNamespace(deadline=deadline), 10_000, to_deadline=True):
        for _ in range(3):
            deadline.tick()
        wall.now += 0.02
        with pytest.raises(deadline_module.DeadlineReached):
            for _ in range(deadline_module.Deadline.CHECK_EVERY):
                deadline.tick()


@pytest.mark.parametrize("dear_s", [1e-6, 3e-5, 1e-4])
def test_cheap_steps_read_the_clocks_less_often_and_still_stop_in_time(monkeypatch, dear_s):
    """Steps of a microsecond read the CPU clock every CHECK_EVERY_MOST steps while the stop
    is far, and every CHECK_EVERY near it; steps that turn dearer half way (30 us, a branch
    at 64 GPUs; 100 us, one at 128) are read before the stop all the same: the search stops
    no later past it than CHECK_EVERY such steps, as when every fourth step read it."""
    cpu = {"now": 0.0, "reads": 0}

    def clock() -> float:
        cpu["reads"] += 1
        return cpu["now"]

    monkeypatch.setattr(deadline_module, "clock", clock)
    deadline = deadline_module.Deadline(0.02)
    steps = 0
    with pytest.raises(deadline_module.DeadlineReached):
        while True:
            cpu["now"] += 1e-6 if cpu["now"] < 0.01 else dear_s
            steps += 1
            deadline.tick()
    assert deadline.at <= cpu["now"] <= deadline.at + deadline_module.Deadline.CHECK_EVERY * dear_s
    if dear_s == 1e-6:
        assert cpu["reads"] < steps / deadline_module.Deadline.CHECK_EVERY / 2


def assert_valid(matrix: DistanceMatrix, request: Request, busy: list[int], answer: Placement) -> None:
    """Every GPU free, k distinct ones, include and exclude met."""
    assert len(set(answer.indices)) == request.gpus
    assert set(answer.indices) <= {g.index for g in matrix.gpus}
    assert not set(answer.indices) & set(busy)
    assert set(request.include) <= set(answer.indices)
    assert not set(request.exclude) & set(answer.indices)


@pytest.mark.parametrize("pattern", [Pattern.ALLREDUCE, Pattern.PIPELINE, Pattern.ALLTOALL])
def test_adversarial_mesh_answers_by_the_deadline_with_a_valid_set_marked_not_proven(monkeypatch, pattern):
    monkeypatch.setattr(deadline_module, "clock", StepClock(1e-5))  # 1 ms: about 400 steps, on any machine
    busy = list(range(0, 128, 5))
    request = Request(gpus=32, pattern=pattern, include=(1, 2), exclude=(3, 4), deadline_ms=1, detail=(Detail.EXPLAIN,))
    answer = place(MESH, request, busy)
    assert isinstance(answer, Placement)
    assert_valid(MESH, request, busy, answer)
    assert answer.proven_optimal is False
    # The bound holds the answer's own bandwidth: no set beats it, this one included.
    assert answer.bandwidth_bound_gbps is not None
    assert answer.bandwidth_gbps is not None and answer.bandwidth_gbps <= answer.bandwidth_bound_gbps
    assert answer.explain[0].startswith("not proven optimal: the search stopped at the 1 ms deadline_ms")
    assert f"bandwidth <= {answer.bandwidth_bound_gbps:g} GB/s" in answer.explain[0]
    assert not any("does better" in line for line in answer.explain)  # no claim of the best
    doc = answer_document(answer)
    assert doc["proven_optimal"] is False and doc["bandwidth_bound_gbps"] == answer.bandwidth_bound_gbps
    assert doc["request"]["deadline_ms"] == 1


def test_a_deadline_answer_has_the_bound_bandwidth_and_more_time_improves_it(monkeypatch):
    """Not proven is not arbitrary: in a few hundred steps the answer's links already reach
    the bound (no set has better ones); more steps only improve the later terms."""
    monkeypatch.setattr(deadline_module, "clock", StepClock(1e-5))
    quick = place(MESH, Request(gpus=8, deadline_ms=2))
    longer = place(MESH, Request(gpus=8, deadline_ms=50))
    assert isinstance(quick, Placement) and isinstance(longer, Placement)
    assert not quick.proven_optimal and quick.bandwidth_gbps == quick.bandwidth_bound_gbps
    assert longer.bandwidth_gbps == quick.bandwidth_gbps
    terms = ("numa_distance", "numa_nodes", "nic_cost", "damage")
    assert [getattr(longer.objective, t) for t in terms] <= [getattr(quick.objective, t) for t in terms]


def test_the_same_request_with_time_to_finish_is_proven(monkeypatch):
    monkeypatch.setattr(deadline_module, "clock", frozen_clock)
    node = nvswitch_16()
    answer = place(node, Request(gpus=6, deadline_ms=60_000), busy=[0, 9])
    assert isinstance(answer, Placement)
    assert answer.proven_optimal is True and answer.bandwidth_bound_gbps is None
    assert not answer.explain[0].startswith("not proven")
    assert answer.indices == place(node, Request(gpus=6), busy=[0, 9]).indices


def test_deadline_answers_on_an_irregular_mesh_have_the_exact_bandwidth(monkeypatch):
    """Where the exact search cannot finish in its steps, the answer is still at the best
    bandwidth any set has (the later terms -- NUMA nodes, damage -- not proven)."""
    mesh = irregular_mesh(32)
    rng = random.Random(2)
    cases = []
    for _ in range(30):
        k = rng.choice([8, 16])
        cases.append((k, rng.choice(["allreduce", "pipeline", "alltoall"]), rng.sample(range(32), rng.randint(0, 28 - k))))
    exact = [place(mesh, Request(gpus=k, pattern=pattern), busy) for k, pattern, busy in cases]
    monkeypatch.setattr(deadline_module, "clock", StepClock(4e-5))  # 20 ms: about 1,800 steps
    # (A read every CHECK_EVERY steps throughout: a clock that moves per read, not per step,
    # would otherwise look cheap to the deadline's stride and give more steps.)
    monkeypatch.setattr(deadline_module.Deadline, "CHECK_EVERY_MOST", deadline_module.Deadline.CHECK_EVERY)
    unproven = 0
    for (k, pattern, busy), best in zip(cases, exact):
        request = Request(gpus=k, pattern=pattern, deadline_ms=20)
        answer = place(mesh, request, busy)
        assert isinstance(answer, Placement) and isinstance(best, Placement)
        assert_valid(mesh, request, busy, answer)
        assert answer.bandwidth_gbps == best.bandwidth_gbps, (k, pattern, busy)
        unproven += not answer.proven_optimal
    assert unproven >= 5  # the steps were too few to prove them: the case this is about


def test_an_answer_the_deadline_cuts_short_has_nearly_the_optimums_bandwidth(monkeypatch):
    """A busy node leaves the search a millisecond or two of a core: the answer it is cut
    to is the cheap bandwidth-first set's, at 0.9 of the optimum's bandwidth or better --
    not the lowest threshold's first set (under a quarter of it in the loaded study once)."""
    mesh = irregular_mesh(32)
    rng = random.Random(11)  # bench.placement's loaded study draws
    cases = []
    for _ in range(30):
        k = rng.choice([2, 4, 8, 16])
        cases.append((k, rng.sample(range(32), rng.randint(0, 32 - k))))
    exact = [place(mesh, Request(gpus=k), busy) for k, busy in cases]
    monkeypatch.setattr(deadline_module, "clock", StepClock(1e-5))  # 1 ms: about 400 steps
    unproven = 0
    for (k, busy), best in zip(cases, exact):
        request = Request(gpus=k, deadline_ms=1)
        answer = place(mesh, request, busy)
        assert isinstance(answer, Placement) and isinstance(best, Placement)
        assert_valid(mesh, request, busy, answer)
        assert answer.bandwidth_gbps is not None and best.bandwidth_gbps is not None
        assert answer.bandwidth_gbps >= 0.9 * best.bandwidth_gbps, (k, busy)
        unproven += not answer.proven_optimal
    assert unproven >= 5, unproven  # the deadline cut searches short: the case this is about


CLAIMS_OF_THE_BEST = (
    "does better", "no set on fewer", "no free set meets", "cannot hold", "the best set has", "the best set meets",
    "free GPUs meet affinity", "free GPUs are all within", "has equal merit", "has quieter NICs",
    "has fewer unverified GPUs",
)


@pytest.mark.parametrize("request_", [
    Request(gpus=12),
    Request(gpus=12, include=(0, 31), pattern="pipeline"),
    Request(gpus=6, affinity="best", fallback=True, pattern="alltoall"),
    Request(gpus=9, affinity="best"),
    Request(gpus=6, min_level="NV2", pattern="alltoall"),
], ids=["plain", "include", "fallback", "affinity", "min_level"])
def test_no_line_claims_the_best_when_not_proven(monkeypatch, request_):
    """Time runs out at the first look at the clock: whatever comes back -- a placement
    or no fit -- says what was found in time, never that no set does better."""
    mesh = irregular_mesh(32)
    prepare(mesh, None)
    monkeypatch.setattr(deadline_module, "clock", StepClock(1.0))
    answer = place(mesh, replace(request_, deadline_ms=20), busy=[3, 17])
    if isinstance(answer, Placement):
        assert answer.proven_optimal is False
        lines = answer.explain
    else:
        lines = (answer.reason,) + (answer.best_available.explain if answer.best_available else ())
    for line in lines:
        assert not any(claim in line for claim in CLAIMS_OF_THE_BEST), line
        assert "optimal" not in line or line.startswith("not proven optimal"), line


def test_live_lines_claim_no_set_of_equal_merit_when_not_proven(monkeypatch):
    """Unverified GPUs (term 6) taken by a search the deadline stopped: the line says no
    set of verified GPUs of equal merit was found in time, not that none exists."""
    mesh = irregular_mesh(32)
    prepare(mesh, None)
    live = Live(unverified=frozenset(range(0, 32, 2)))
    monkeypatch.setattr(deadline_module, "clock", StepClock(1.0))
    answer = place(mesh, Request(gpus=12, deadline_ms=20), busy=[3, 17], live=live)
    assert isinstance(answer, Placement) and answer.proven_optimal is False
    assert answer.unverified
    assert any("no set of verified GPUs of equal merit was found in time" in line for line in answer.explain)
    for line in answer.explain:
        assert not any(claim in line for claim in CLAIMS_OF_THE_BEST), line


def corpus(name: str) -> DistanceMatrix:
    return DistanceMatrix.from_topo_matrix(parse_topo_matrix((CORPUS / name).read_text()))


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_every_recorded_answer_is_proven_and_the_same_as_before(monkeypatch, name):
    monkeypatch.setattr(deadline_module, "clock", frozen_clock)
    matrix = corpus(name)
    for busy, pattern, k, before in BEFORE[name]:
        answer = place(matrix, Request(gpus=k, pattern=pattern, deadline_ms=60_000), busy)
        got = list(answer.indices) if isinstance(answer, Placement) else None
        assert got == before, (busy, pattern, k)
        if isinstance(answer, Placement):
            assert answer.proven_optimal, (busy, pattern, k)
        else:
            assert isinstance(answer, NoFit) and answer.constraint != "deadline_ms"


@pytest.mark.parametrize("name", sorted(SNAPSHOT_ANSWERS["answers"]))
def test_every_snapshot_answer_is_proven_and_the_same_as_recorded(monkeypatch, name):
    monkeypatch.setattr(deadline_module, "clock", frozen_clock)
    from topoagent.commands.discover import discover_root

    matrix = discover_root(str(HERE.parent / "fixtures" / "snapshots" / name)).distance_matrix()
    for busy, pattern, k, nics, before in SNAPSHOT_ANSWERS["answers"][name]:
        answer = place(matrix, Request(gpus=k, pattern=pattern, nics=nics, deadline_ms=60_000), busy)
        got = list(answer.indices) if isinstance(answer, Placement) else None
        assert got == before, (busy, pattern, k, nics)
        assert not isinstance(answer, Placement) or answer.proven_optimal, (busy, pattern, k, nics)


def test_warm_builds_the_tables_requests_read():
    """After warm(), a request reads the matrix's tables instead of building them."""
    node = nvswitch_16()
    prep = warm(node)
    assert prepare(node, None) is prep
    for pattern in Pattern:
        assert small_table_if_built(prep, pattern, 1) is not None
        assert small_table_if_built(prep, pattern, 15) is not None


def steps_taken_inside(monkeypatch, method: str) -> list[int]:
    """The steps of a step budget (StepBudget.tick or tick_light calls, the last one that
    finds the budget spent left out) taken inside each call of ``Anytime.<method>``, one
    entry per call, as the calls come."""
    from topoagent.placement import anytime

    per_call: list[int] = []
    inside = [False]
    counted = getattr(anytime.Anytime, method)

    def counting(tick):
        def counting_tick(self):
            tick(self)
            if inside[0]:
                per_call[-1] += 1
        return counting_tick

    def counting_call(self, *args):
        inside[0] = True
        per_call.append(0)
        try:
            return counted(self, *args)
        finally:
            inside[0] = False

    monkeypatch.setattr(deadline_module.StepBudget, "tick", counting(deadline_module.StepBudget.tick))
    monkeypatch.setattr(deadline_module.StepBudget, "tick_light", counting(deadline_module.StepBudget.tick_light))
    monkeypatch.setattr(anytime.Anytime, method, counting_call)
    return per_call


def test_the_cheap_tries_on_groups_of_numa_nodes_keep_to_their_steps(monkeypatch):
    """The cheap first sets tried on groups of NUMA nodes (Anytime._first_set_at) take
    FIRST_SET_UNION_STEPS steps in all, and the try under way at most its own more -- a
    grown path tops its steps up at each start, which must not hide what it took.  The
    requests are the 64-GPU mesh study's (bench.placement_versus --mesh), where one took
    nearly twice that budget before."""
    from topoagent.placement import anytime

    steps = steps_taken_inside(monkeypatch, "_first_set_at")
    matrix = irregular_mesh(64)
    rng = random.Random(5)  # bench.placement_versus's draws
    most_allowed = (
        anytime.FIRST_SET_NODES * anytime.FIRST_SET_STEPS  # a best-fit descent on each NUMA node alone
        + anytime.FIRST_SET_UNION_STEPS  # the groups
        + anytime.FIRST_SET_NODES * anytime.FIRST_SET_STEPS + anytime.FIRST_SET_STEPS  # the last group's try
    )
    for _ in range(72):
        k = rng.choice((1, 2, 4, 8, 16, 32))
        busy = rng.sample(range(64), rng.randint(0, 64 - k))
        place(matrix, Request(gpus=k, deadline_ms=10_000), busy)
    assert anytime.FIRST_SET_UNION_STEPS < max(steps) <= most_allowed, max(steps)


def test_the_idle_nodes_check_of_a_threshold_keeps_to_its_steps_and_changes_no_answer(monkeypatch):
    """Before the search at a threshold, Anytime asks whether the idle node has any set there
    at all (remembered per matrix).  The idle node has more sets than a busy one: for 26 of
    64 GPUs of the mesh its check cost more than the request's whole deadline, unremembered,
    so every such request ran out of time on it.  It has IDLE_CHECK_STEPS now, past which it
    rules nothing out (remembered too), and the answer is the one found without a deadline."""
    from topoagent.placement import anytime

    busy = [0, 1, 2, 4, 5, 6, 7, 10, 11, 15, 16, 19, 23, 24, 25, 26, 28, 30, 31, 32, 33, 35, 40, 42, 43, 44, 45,
            47, 48, 49, 51, 52, 54, 56, 58, 60, 62]
    request = Request(gpus=26, deadline_ms=10_000)  # the clock stands still: only the steps stop a check
    exact = place(irregular_mesh(64), replace(request, deadline_ms=None), busy)
    assert isinstance(exact, Placement)

    steps = steps_taken_inside(monkeypatch, "_feasible_on_idle_node")
    mesh = irregular_mesh(64)  # a matrix of its own: nothing remembered yet
    first = place(mesh, request, busy)
    assert len(steps) >= 1
    assert 0 < sum(steps) <= anytime.IDLE_CHECK_STEPS
    assert first.proven_optimal and first.indices == exact.indices
    steps.clear()
    again = place(mesh, request, busy)  # what the check found, or that it ran out, is remembered
    assert sum(steps) == 0
    assert again.proven_optimal and again.indices == exact.indices

    shipped = anytime.IDLE_CHECK_STEPS
    monkeypatch.setattr(anytime, "IDLE_CHECK_STEPS", 10**9)  # the check as it was: to the end
    steps.clear()
    whole = place(irregular_mesh(64), request, busy)
    assert sum(steps) > 10 * shipped  # tens of thousands of steps: a deadline's worth many times over
    assert whole.indices == exact.indices
