"""The adaptive probe schedule, driven by a fake clock."""

import pytest

from topoagent.probes.schedule import (
    GpuActivity,
    ProbeSchedule,
    ProbeTarget,
    ScheduleConfig,
    targets_for,
)


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


PAIR = ProbeTarget((0, 1))
CONFIG = ScheduleConfig(
    startup_delay_s=30, change_delay_s=5, min_interval_s=600, max_interval_s=4800,
    backoff_factor=2, tolerance=0.1, duty_cycle=0.01, duty_window_s=3600,
)


def schedule_for(gpus=(0, 1), config=CONFIG):
    clock = FakeClock()
    return ProbeSchedule(gpus, config, clock), clock


def probe(schedule, clock, figure, duration=1.0, activity=None):
    target = schedule.next_probe(activity or {})
    assert target is not None
    clock.advance(duration)
    return target, schedule.record(target, duration_s=duration, figure=figure)


def test_targets_are_every_pair_then_every_gpu():
    assert [t.key for t in targets_for([2, 0, 1])] == [
        "pair:0-1", "pair:0-2", "pair:1-2", "gpu:0", "gpu:1", "gpu:2"
    ]


def test_first_probe_soon_after_start_not_before():
    schedule, clock = schedule_for()
    assert schedule.next_probe({}) is None
    clock.advance(29)
    assert schedule.next_probe({}) is None
    clock.advance(1)
    assert schedule.next_probe({}) == PAIR


def test_one_probe_at_a_time():
    schedule, clock = schedule_for()
    clock.advance(30)
    first = schedule.next_probe({})
    assert first is not None
    assert schedule.next_probe({}) is None  # three targets due, one in flight
    schedule.record(first, duration_s=0.5, figure=20.0)
    assert schedule.next_probe({}) not in (None, first)


def test_stable_results_back_off_geometrically_up_to_the_cap():
    schedule, clock = schedule_for(gpus=(0, 1))
    clock.advance(30)
    intervals = []
    for _ in range(6):
        while True:  # take targets until the pair comes up
            target = schedule.next_probe({})
            if target is None:
                clock.advance(schedule.next_wakeup() - clock.now)
                continue
            clock.advance(1)
            verdict = schedule.record(target, duration_s=1, figure=50.0 if target == PAIR else 20.0)
            if target == PAIR:
                intervals.append((verdict.outcome, verdict.next_due_in_s))
                break
    assert intervals == [
        ("first", 600), ("stable", 1200), ("stable", 2400), ("stable", 4800),
        ("stable", 4800), ("stable", 4800),
    ]


def test_drift_tightens_the_interval_and_moves_the_baseline():
    schedule, clock = schedule_for(gpus=(0, 1))
    clock.advance(30)
    assert schedule.next_probe({}) == PAIR
    outcomes = []
    for figure in (50.0, 52.0, 48.0, 30.0, 31.0):  # the fourth: the link lost 40%
        clock.advance(1)
        verdict = schedule.record(PAIR, duration_s=1, figure=figure)
        outcomes.append((verdict.outcome, verdict.next_due_in_s, verdict.baseline))
    assert outcomes == [
        ("first", 600, 50.0),
        ("stable", 1200, 50.0),
        ("stable", 2400, 50.0),
        ("drift", 600, 30.0),
        ("stable", 1200, 30.0),
    ]
    assert schedule.states[PAIR].due_at == clock.now + 1200


def test_busy_gpus_are_never_probed_unless_forced():
    schedule, clock = schedule_for(gpus=(0, 1, 2))
    clock.advance(30)
    busy = {0: GpuActivity(utilization_percent=97), 2: GpuActivity(utilization_percent=0, other_processes=1)}
    taken = []
    while (target := schedule.next_probe(busy)) is not None:
        taken.append(target)
        clock.advance(1)
        schedule.record(target, duration_s=1, figure=10.0)
    assert taken == [ProbeTarget((1,))]  # the only target on idle GPUs only
    schedule.request_round(force=True)
    forced = []
    while (target := schedule.next_probe(busy)) is not None:
        forced.append(target)
        schedule.record(target, duration_s=1, figure=10.0)
    assert set(forced) == set(targets_for((0, 1, 2)))


def test_idle_below_threshold_is_not_busy():
    schedule, clock = schedule_for()
    clock.advance(30)
    assert schedule.next_probe({0: GpuActivity(utilization_percent=2), 1: GpuActivity()}) is not None


def test_duty_cycle_caps_probe_time_per_gpu_per_window():
    # 1% of an hour = 36 s per GPU.  Probes of 10 s each: three fit, the fourth waits.
    config = ScheduleConfig(
        startup_delay_s=0, min_interval_s=1, max_interval_s=1, backoff_factor=1,
        duty_cycle=0.01, duty_window_s=3600, default_duration_s=10,
    )
    schedule, clock = schedule_for(gpus=(0,), config=config)
    done = []
    for _ in range(10):
        target = schedule.next_probe({})
        if target is None:
            clock.advance(1)
            continue
        clock.advance(10)
        schedule.record(target, duration_s=10, figure=20.0)
        done.append(clock.now)
    assert len(done) == 3
    assert schedule.duty_used_s(0) == pytest.approx(30)
    # The fourth runs once the first probe has slid out of the window.
    first_end = done[0]
    clock.now = first_end + 3600 - 10 - 1
    assert schedule.next_probe({}) is None
    clock.now = first_end + 3600
    assert schedule.next_probe({}) == ProbeTarget((0,))


def test_duty_cycle_over_a_long_run_stays_under_one_percent():
    config = ScheduleConfig(startup_delay_s=0, min_interval_s=1, max_interval_s=1, backoff_factor=1)
    schedule, clock = schedule_for(gpus=(0, 1), config=config)
    probing = {0: 0.0, 1: 0.0}
    start = clock.now
    while clock.now - start < 6 * 3600:
        target = schedule.next_probe({})
        if target is None:
            clock.advance(5)
            continue
        clock.advance(3)
        schedule.record(target, duration_s=3, figure=20.0)
        for gpu in target.gpus:
            probing[gpu] += 3
    for seconds in probing.values():
        assert 0 < seconds <= 0.01 * (clock.now - start) + 36  # + one window's burst


def test_forced_round_ignores_the_duty_cap():
    config = ScheduleConfig(startup_delay_s=0, duty_cycle=0.01, duty_window_s=100, default_duration_s=5)
    schedule, _clock = schedule_for(gpus=(0,), config=config)
    assert schedule.next_probe({}) is None  # 5 s > 1% of 100 s
    schedule.request_round(force=True)
    assert schedule.next_probe({}) == ProbeTarget((0,))


def test_topology_change_makes_new_and_old_targets_due_soon():
    schedule, clock = schedule_for(gpus=(0, 1))
    clock.advance(30)
    while (target := schedule.next_probe({})) is not None:
        schedule.record(target, duration_s=0.1, figure=20.0)
    assert schedule.next_probe({}) is None
    schedule.on_topology_change([0, 1, 2])  # hotplug: GPU2 appears
    clock.advance(4)
    assert schedule.next_probe({}) is None
    clock.advance(1)
    due = []
    while (target := schedule.next_probe({})) is not None:
        due.append(target)
        schedule.record(target, duration_s=0.1, figure=20.0)
    assert set(due) == set(targets_for((0, 1, 2)))
    assert all(v.baseline == 20.0 for v in (schedule.states[t] for t in due))


def test_failures_back_off_too():
    schedule, clock = schedule_for()
    clock.advance(30)
    target = schedule.next_probe({})
    first = schedule.record(target, duration_s=1, figure=None, ok=False)
    second = schedule.record(target, duration_s=1, figure=None, ok=False)
    assert (first.outcome, first.next_due_in_s) == ("failed", 300)
    assert second.next_due_in_s == 600
