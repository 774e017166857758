"""Why an answer is what it is: typed reasons, rendered per door.

The core records *what* it found (a code and its figures, naming request fields, never
CLI flags); each door renders the words: JSON answers name fields (``include``), the
CLI's text names its flags (``--include``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class Door(enum.Enum):
    """Where an explanation is read, which decides how a request field is named."""

    JSON = "json"  # HTTP, place --json, place --batch: the field name
    CLI = "cli"  # place's text: the flag


class ReasonCode(enum.StrEnum):
    # A placement.
    BOTTLENECK = "bottleneck"  # shape, gbps, level, a_index, b_index, gpus, held[, time_us, alpha_us, message_bytes]
    ONE_NUMA_NODE = "one_numa_node"  # node
    SPANS_NUMA_BEST = "spans_numa_best"  # count
    SPANS_NUMA_INCLUDED_ALONE = "spans_numa_included_alone"  # count, field, held, included_span
    SPANS_NUMA_FORCED = "spans_numa_forced"  # count, field, held
    NICS_CLOSEST = "nics_closest"  # nics, names, served, sockets (the ranks' sockets, and those with a chosen NIC short of SYS)
    NCCL_HCA_LEAVES_OUT = "nccl_hca_leaves_out"  # names
    CPUS_SHARED = "cpus_shared"  # gpus (indices whose ranks share one CPU list unsplit)
    BREAKS_ZONES = "breaks_zones"  # zones
    KEEPS_ZONES = "keeps_zones"
    AFFINITY_FELL_BACK = "affinity_fell_back"  # asked, met
    UNHEALTHY_LEFT_OUT = "unhealthy_left_out"  # gpus (indices), why (one line per GPU)
    UNKNOWN_LINKS_TAKEN = "unknown_links_taken"  # gpus
    NOT_PROVEN = "not_proven"  # deadline_ms, bound_gbps (None: the search bounded no bandwidth)
    # Live signals, weighed at equal merit (placement.live).
    UNVERIFIED_TAKEN = "unverified_taken"  # gpus, named (those include names), held (include; absent when empty)
    UNVERIFIED_PASSED_OVER = "unverified_passed_over"  # gpus
    NIC_LESS_TRAFFIC = "nic_less_traffic"  # chosen, over, chosen_gbs, over_gbs
    BUSY_NICS_TAKEN = "busy_nics_taken"  # gpus, gbs (the most any of them has on its nearest NIC), named, unverified_first, held
    BUSY_NICS_PASSED_OVER = "busy_nics_passed_over"  # gpus, gbs (the least)
    # No fit: the ``constraint`` of a NoFit says which field cannot hold.
    INCLUDED_BUSY = "included_busy"  # index
    TOO_FEW_FREE = "too_few_free"  # gpus, free, size, excluded
    TOO_MANY_NICS = "too_many_nics"  # nics, node_nics
    MIN_LEVEL_UNREACHABLE = "min_level_unreachable"  # gpus, min_level, best_worst
    NO_NUMA_NODE_HOLDS = "no_numa_node_holds"  # gpus, most, node
    INCLUDE_UNREACHABLE = "include_unreachable"
    CONSTRAINTS_CONFLICT = "constraints_conflict"  # fields
    NOTHING_MEETS = "nothing_meets"
    AFFINITY_UNREACHABLE = "affinity_unreachable"  # gpus, affinity, met
    NONE_IN_TIME = "none_in_time"  # deadline_ms


@dataclass(frozen=True, slots=True)
class Reason:
    """One reason: its code and the figures it quotes.  A parameter called ``field``
    holds a request field's name; only rendering turns it into a flag."""

    code: ReasonCode
    params: dict[str, Any] = field(default_factory=dict)

    def render(self, door: Door = Door.JSON) -> str:
        return _TEMPLATES[self.code](_Params(self.params, door))


class _Params:
    def __init__(self, params: dict[str, Any], door: Door) -> None:
        self.params = params
        self.door = door

    def __getitem__(self, key: str) -> Any:
        return self.params[key]

    def field(self) -> str:
        return self.field_name(self.params["field"])

    def field_name(self, name: str) -> str:
        return "--" + name.replace("_", "-") if self.door is Door.CLI else name

    def gpus(self, key: str) -> str:
        return ",".join(str(i) for i in self.params[key])


# Reasons that say something of every set (none does better, none meets a tier): when a
# deadline stopped the search their ``proven`` parameter is False and they say only what
# the sets found in time show (placement._unclaimed).
CLAIMS = frozenset({
    ReasonCode.BOTTLENECK, ReasonCode.SPANS_NUMA_BEST, ReasonCode.SPANS_NUMA_FORCED, ReasonCode.AFFINITY_FELL_BACK,
    ReasonCode.UNKNOWN_LINKS_TAKEN, ReasonCode.AFFINITY_UNREACHABLE, ReasonCode.MIN_LEVEL_UNREACHABLE,
    ReasonCode.UNVERIFIED_TAKEN, ReasonCode.BUSY_NICS_TAKEN,
})


def _proven(p: _Params) -> bool:
    return bool(p.params.get("proven", True))


def _bottleneck(p: _Params) -> str:
    held = f" holding GPUs {p.gpus('held')}" if p["held"] else ""
    claim = f"no free set of {p['gpus']}{held} does better" if _proven(p) else "the best found in time, not proven"
    link = f"over {p['level']} (GPU{p['a_index']}-GPU{p['b_index']})"
    if "time_us" in p.params:  # a latency-bound pattern: ranked by one message's time (placement.latency)
        return (
            f"{p['shape']}: slowest link {p['time_us']:g} us per {p['message_bytes']}-byte message {link}: "
            f"{p['alpha_us']:g} us latency + {p['gbps']:g} GB/s; {claim}"
        )
    return f"{p['shape']} bottleneck {p['gbps']:g} GB/s {link}; {claim}"


def _spans(p: _Params) -> str:
    if not _proven(p):
        return f"spans {p['count']} NUMA nodes (fewer not ruled out in time)"
    if p.params.get("field") is None:
        return f"spans {p['count']} NUMA nodes: no set on fewer has the same bandwidth"
    return (
        f"spans {p['count']} NUMA nodes: forced by {p.field()} GPUs {p.gpus('held')}: "
        "no set on fewer that holds them has the same bandwidth"
    )


def _fell_back(p: _Params) -> str:
    asked = f"{p.field_name('affinity')} {p['asked']}"
    none = f"no free set meets {asked}" if _proven(p) else f"no free set meeting {asked} was found in time"
    return f"{none}; {p.field_name('fallback')}: answered at tier {p['met']}"


def _unknown_links(p: _Params) -> str:
    why = (
        "the GPUs whose links are known cannot hold the job" if _proven(p)
        else "no set of GPUs whose links are known was found in time"
    )
    return f"GPU(s) {p.gpus('gpus')} have unknown links (counted at no bandwidth): taken only because {why}"


def _named(p: _Params) -> str | None:
    """Why GPUs were taken when the request named every one of them (None: it did not)."""
    named = p.params.get("named", ())
    return f"{p.field_name('include')} names them" if named and set(named) == set(p["gpus"]) else None


def _unverified_taken(p: _Params) -> str:
    held = p.params.get("held")
    if _named(p):
        why = f"taken because {_named(p)}"
    elif held:  # every set holds what include names: compare only sets that hold it
        why = (
            f"taken because no set of equal merit holding GPUs {p.gpus('held')} has fewer unverified GPUs" if _proven(p)
            else f"no set of equal merit holding GPUs {p.gpus('held')} with fewer unverified GPUs was found in time"
        )
    else:
        why = (
            "taken because no set of verified GPUs has equal merit" if _proven(p)
            else "no set of verified GPUs of equal merit was found in time"
        )
    return f"GPU(s) {p.gpus('gpus')} unverified (a job gave them back; not probed since): {why}"


def _busy_nics_taken(p: _Params) -> str:
    merit = "equal merit and as few unverified GPUs" if p.params.get("unverified_first") else "equal merit"
    if p.params.get("held"):
        merit += f" holding GPUs {p.gpus('held')}"
    why = _named(p) or (
        f"no set of {merit} has quieter NICs" if _proven(p) else f"no set of {merit} with quieter NICs was found in time"
    )
    return f"GPU(s) {p.gpus('gpus')} taken although their nearest NICs carry up to {p['gbs']:g} GB/s of traffic now: {why}"


def _affinity_unreachable(p: _Params) -> str:
    if _proven(p):
        return f"no {p['gpus']} free GPUs meet affinity {p['affinity']}; the best set meets {p['met']}"
    return f"no {p['gpus']} free GPUs meeting affinity {p['affinity']} were found in time; the set found meets {p['met']}"


def _min_level_unreachable(p: _Params) -> str:
    if _proven(p):
        return (
            f"no {p['gpus']} free GPUs are all within {p['min_level']} of each other; "
            f"the best set has pairs at {p['best_worst']}"
        )
    return (
        f"no {p['gpus']} free GPUs all within {p['min_level']} of each other were found in time; "
        f"the set found has pairs at {p['best_worst']}"
    )


def _not_proven(p: _Params) -> str:
    bound = p["bound_gbps"]
    return (
        f"not proven optimal: the search stopped at the {p['deadline_ms']} ms {p.field_name('deadline_ms')} "
        "with the best set found so far"
        + (f"; bandwidth <= {bound:g} GB/s for every set" if bound is not None else "")
    )


def _too_few(p: _Params) -> str:
    if p["size"] == 0:  # not a matter of free GPUs: there are none at all (as export says)
        return f"{p['gpus']} GPUs requested; no GPUs found on this node"
    return (
        f"{p['gpus']} GPUs requested, {p['free']} free"
        + (f" of {p['size']}" if p["size"] else "")
        + (f" ({p['excluded']} excluded)" if p["excluded"] else "")
    )


_TEMPLATES = {
    ReasonCode.BOTTLENECK: _bottleneck,
    ReasonCode.ONE_NUMA_NODE: lambda p: f"stays on one NUMA node ({p['node']})",
    ReasonCode.SPANS_NUMA_BEST: _spans,
    ReasonCode.SPANS_NUMA_INCLUDED_ALONE: lambda p: (
        f"spans {p['count']} NUMA nodes: {p.field()} GPUs {p.gpus('held')} alone span {p['included_span']}"
    ),
    ReasonCode.SPANS_NUMA_FORCED: _spans,
    ReasonCode.NICS_CLOSEST: lambda p: (
        f"{p['nics']} NIC(s) nearest the ranks, one per socket before a second: {', '.join(p['names'])} "
        f"(a NIC on {p['served']} of the ranks' {p['sockets']} socket(s))"
    ),
    ReasonCode.NCCL_HCA_LEAVES_OUT: lambda p: (
        f"NCCL_IB_HCA leaves out {', '.join(p['names'])}: their RDMA device names are unknown "
        "(e.g. nvidia-smi output without its NIC Legend)"
    ),
    ReasonCode.CPUS_SHARED: lambda p: (
        f"the ranks of GPUs {p.gpus('gpus')} each get their GPU's whole CPU list: which CPUs are hyperthreads "
        "of one core is unknown (nvidia-smi text has no core map), so splitting it could put two ranks on one core; "
        + ("give the node (--root DIR, or run on it) to split it by cores" if p.door is Door.CLI
           else "a discovered node splits it by cores")
    ),
    ReasonCode.BREAKS_ZONES: lambda p: "breaks whole free zones: " + "; ".join(p["zones"]),
    ReasonCode.KEEPS_ZONES: lambda p: "keeps every whole free zone whole",
    ReasonCode.AFFINITY_FELL_BACK: _fell_back,
    ReasonCode.UNHEALTHY_LEFT_OUT: lambda p: (
        f"left out GPU(s) {p.gpus('gpus')} ({'; '.join(p['why'])}); {p.field_name('include')} names a GPU to use it anyway"
    ),
    ReasonCode.NOT_PROVEN: _not_proven,
    ReasonCode.NONE_IN_TIME: lambda p: (
        f"no set meeting the request was found within the {p['deadline_ms']} ms {p.field_name('deadline_ms')} "
        "(not proven that none exists)"
    ),
    ReasonCode.UNKNOWN_LINKS_TAKEN: _unknown_links,
    ReasonCode.UNVERIFIED_TAKEN: _unverified_taken,
    ReasonCode.UNVERIFIED_PASSED_OVER: lambda p: (
        f"verified GPUs preferred at equal merit: GPU(s) {p.gpus('gpus')} unverified (a job gave them back; not probed since)"
    ),
    ReasonCode.NIC_LESS_TRAFFIC: lambda p: (
        f"NIC {p['chosen']} chosen over {p['over']} (equally near): {p['chosen_gbs']:g} vs {p['over_gbs']:g} GB/s of traffic now"
    ),
    ReasonCode.BUSY_NICS_TAKEN: _busy_nics_taken,
    ReasonCode.BUSY_NICS_PASSED_OVER: lambda p: (
        f"GPUs with quieter NICs preferred at equal merit: the nearest NICs of GPU(s) {p.gpus('gpus')} "
        f"carry {p['gbs']:g} GB/s or more of traffic now"
    ),
    ReasonCode.INCLUDED_BUSY: lambda p: f"included GPU {p['index']} is busy",
    ReasonCode.TOO_FEW_FREE: _too_few,
    ReasonCode.TOO_MANY_NICS: lambda p: f"{p['nics']} NICs requested, the node has {p['node_nics']}",
    ReasonCode.MIN_LEVEL_UNREACHABLE: _min_level_unreachable,
    ReasonCode.NO_NUMA_NODE_HOLDS: lambda p: f"no NUMA node has {p['gpus']} free GPUs (most: {p['most']} on node {p['node']})",
    ReasonCode.INCLUDE_UNREACHABLE: lambda p: "the included GPUs cannot be part of any set meeting the other constraints",
    ReasonCode.CONSTRAINTS_CONFLICT: lambda p: (
        f"constraints {', '.join(p.field_name(name) for name in p['fields'])} cannot hold together"
    ),
    ReasonCode.NOTHING_MEETS: lambda p: "no set of free GPUs meets the request",
    ReasonCode.AFFINITY_UNREACHABLE: _affinity_unreachable,
}


def render(reasons: Iterable[Reason], door: Door = Door.JSON) -> tuple[str, ...]:
    return tuple(reason.render(door) for reason in reasons)
