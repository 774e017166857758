"""Live signals placement weighs at equal merit: GPUs a job gave back that the probes have
not checked since (*unverified*, issue #19), and the traffic each NIC's ports carry now
(the telemetry loop's counter rates, issue #12).

They change every telemetry interval, so they never enter the matrix (its tables, and
every cache keyed on it, would be rebuilt every 10 s): ``place()`` takes them beside
``busy``, as a ``Live`` value.  They only break ties: a set's live cost is compared after
every term of the objective (placement.objective, term 6), so they never trade bandwidth,
NUMA locality, NIC distance or damage for a quieter NIC.

Traffic is compared in steps of ``LOAD_STEP`` of the port's line rate (10 %: 2.5 GB/s on
a 200 Gb/s HDR port), so noise between two reads does not flip an answer.  A port's
traffic is its busier direction (the bytes it sends or receives per second, whichever is
more); a NIC's is its ports' summed.  A port of unknown rate is stepped as a 100 Gb/s one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from topoagent.placement.tables import PerTables, Prepared

LOAD_STEP = 0.10  # of the port's line rate
UNKNOWN_RATE_GBPS = 100.0  # Gb/s, for stepping a port whose rate is not known


@dataclass(frozen=True, slots=True)
class Live:
    """What the node is doing now, as placement reads it."""

    unverified: frozenset[int] = frozenset()  # nvidia-smi indices: given back, not probed since
    nic_traffic: Mapping[str, float] = field(default_factory=dict)  # RDMA device -> bytes/s now

    def __bool__(self) -> bool:
        return bool(self.unverified) or any(self.nic_traffic.values())


NO_LIVE = Live()


def load_steps(bytes_per_s: float, rate_gbps: float | None) -> int:
    """Traffic in whole steps of LOAD_STEP of the line rate (module docstring)."""
    line = (rate_gbps or UNKNOWN_RATE_GBPS) * 1e9 / 8
    return int(bytes_per_s / (LOAD_STEP * line))


class LiveCosts:
    """``Live`` over one matrix's positions: per NIC its load in steps, per GPU whether it
    is unverified and the load of its least loaded nearest NIC (what its rank would use)."""

    def __init__(self, prep: Prepared, live: Live, nic_load: list[int]):
        matrix = prep.matrix
        self.live = live
        self.nic_names = prep.nic_names
        self.nic_load = nic_load
        nearest = self.nearest = prep.nearest_nics
        self.unverified = sum(1 << pos for pos, g in enumerate(matrix.gpus) if g.index in live.unverified)
        self.gpu_load = [min((self.nic_load[j] for j in nearest[pos][1]), default=0) for pos in range(matrix.size)]
        # Per GPU: (unverified, load steps), the order a set's live cost sums in.
        self.of = [(self.unverified >> pos & 1, self.gpu_load[pos]) for pos in range(matrix.size)]
        # The answer cache keys bindings by the loads (None: no NIC carries a step of traffic).
        self.loads_key = tuple(self.nic_load) if any(self.nic_load) else None

    def cost(self, mask: int) -> tuple[int, int]:
        """Term (6) of the objective for the GPUs ``mask``: (unverified GPUs, load steps)."""
        unverified = (mask & self.unverified).bit_count()
        load = 0
        while mask:
            low = mask & -mask
            load += self.gpu_load[low.bit_length() - 1]
            mask ^= low
        return unverified, load

    def gbs(self, nic: int) -> float:
        """A NIC's traffic now in GB/s, for reasons."""
        return self.live.nic_traffic.get(self.nic_names[nic], 0.0) / 1e9

    def gpu_gbs(self, pos: int) -> float:
        """The traffic of the least loaded of GPU ``pos``'s nearest NICs, GB/s."""
        return min((self.gbs(j) for j in self.nearest[pos][1] if self.nic_load[j] == self.gpu_load[pos]), default=0.0)


LiveKey = tuple[frozenset[int], tuple[int, ...]]  # (unverified GPU indices, per NIC its traffic in steps)


# Per tables: the last request's live costs (holding arrays of the tables, never the tables).
_last = PerTables[dict[LiveKey, LiveCosts]](lambda _prep: {}).of


def live_costs(prep: Prepared, live: Live | None) -> LiveCosts | None:
    """The live costs, or None when nothing live could change an answer (no GPU of the
    node unverified, no NIC carrying a step of traffic).  The last one is kept per table:
    the agent's requests between two counter reads share it."""
    if not live:
        return None
    nic_load = [load_steps(live.nic_traffic.get(name, 0.0), nic.rate_gbps) for name, nic in zip(prep.nic_names, prep.matrix.nics)]
    unverified = frozenset(live.unverified & prep.pos_of.keys())
    if not unverified and not any(nic_load):
        return None
    key: LiveKey = (unverified, tuple(nic_load))
    last = _last(prep)
    got = last.get(key)
    if got is None or got.live.nic_traffic is not live.nic_traffic:  # the reasons quote this read's GB/s
        last.clear()
        got = last[key] = LiveCosts(prep, live, nic_load)
    return got
