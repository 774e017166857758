"""The holds keeper asks the agents only when it may take a hold: while a due pod can take
none (every node that could is held for another pod), it asked every agent's /capacity at
each of its looks, about once a second, for as long as the pod waited."""

from __future__ import annotations

import asyncio

from topoagent.cluster.extender.holds import Holds, NodeLoad, keep
from topoagent.cluster.extender.wire import PodRef

AFTER_S = 0.625  # the keeper then looks every 0.125 s of real time (in eighths: sums exact); the holds' own clock is the test's


def test_a_due_pod_that_can_take_no_hold_is_asked_for_on_a_change_or_after_a_doubling_pause() -> None:
    async def main() -> None:
        now, looks = [0.0], [0]
        holds = Holds(min_gpus=8, after_s=AFTER_S, ttl_s=3600, clock=lambda: now[0])
        expire = holds.expire

        def counted_expire() -> list:
            looks[0] += 1  # each look of the keeper ends the expired holds first: the test's witness that it looked
            return expire()

        holds.expire = counted_expire
        asked = []

        async def loads() -> dict[str, NodeLoad]:
            asked.append(now[0])
            return {"a": NodeLoad(8, 0)}  # one node that can take an 8-GPU pod

        async def looked(times: int) -> None:
            """Until the keeper has looked ``times`` more times (it looks every 0.125 s)."""
            target = looks[0] + times
            async with asyncio.timeout(60):  # however slow a loaded machine is
                while looks[0] < target:
                    await asyncio.sleep(0.01)

        keeper = asyncio.ensure_future(keep(holds, loads))
        try:
            holds.unplaced(PodRef("jobs", "first", "uid-1"), 8)
            now[0] = AFTER_S
            await looked(3)
            assert [h.pod.name for h in holds.held.values()] == ["first"] and asked == [AFTER_S]
            holds.unplaced(PodRef("jobs", "second", "uid-2"), 8)
            now[0] = 2 * AFTER_S  # due: node a is held for "first", so "second" takes no hold
            await looked(3)
            assert asked == [AFTER_S, 2 * AFTER_S]
            await looked(20)  # seconds of looks, the holds' clock standing still
            assert len(asked) == 2  # not asked again: nothing changed, no pause passed
            pause = holds.interval_s()
            for _ in range(4):  # each pause passed asks once more, the pause doubling up to after_s
                now[0] += pause
                await looked(3)
                assert asked[-1] == now[0]
                pause = min(2 * pause, AFTER_S)
                now[0] += pause / 2
                await looked(3)
                assert asked[-1] != now[0]  # half the pause: not yet
                now[0] -= pause / 2
            assert pause == AFTER_S
            count = len(asked)
            holds.forget("uid-1", "bound")  # a change: node a is free of its hold
            await looked(3)
            assert len(asked) == count + 1 and [h.pod.name for h in holds.held.values()] == ["second"]
        finally:
            keeper.cancel()

    asyncio.run(main())
