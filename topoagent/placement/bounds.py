"""The objective's terms (2)-(5) as the branch and bound counts and bounds them: a set's
NUMA distance and NIC cost (kept per tables, in a ``Terms`` per ``Prepared``), its damage
to the free zones, and the least each can be when a partial set is completed.

See placement.objective for the terms and why bounding them keeps the search exact.
"""

from __future__ import annotations

from topoagent.placement.tables import NO_NIC, PerTables, Prepared, bits

NIC_COST_MAX = 50_000  # past this the memo starts again empty, costing time, never answers


class Terms:
    """Per tables: term (2) per set of NUMA groups, term (4) per set of GPUs and NICs asked.

    Holds the tables' arrays, never the tables themselves (a memo kept per tables
    must not keep them alive)."""

    __slots__ = ("_nic_cost", "_span", "nic_rate", "nic_steps", "nic_usable", "numa_dist")

    def __init__(self, prep: Prepared):
        self.numa_dist = prep.numa_dist
        self.nic_steps = prep.nic_steps
        self.nic_rate = prep.nic_rate
        self.nic_usable = prep.nic_usable
        self._span: dict[int, int] = {0: 0}
        self._nic_cost: dict[tuple[int, int], tuple[int, float]] = {}

    def numa_span(self, groups: int) -> int:
        """Term (2) for a set touching these NUMA groups (a bitmask of group numbers): the
        largest distance between two of them, a group with itself included; 0 when the
        node has no distances (or no group is touched)."""
        got = self._span.get(groups)
        if got is None:
            dist = self.numa_dist
            got = 0
            if dist is not None:
                touched = list(bits(groups))
                got = max(dist[a][b] for a in touched for b in touched)
            self._span[groups] = got
        return got

    def nic_cost(self, mask: int, wanted: int) -> tuple[int, float]:
        """Term (4): the link kinds of the ``wanted`` NICs closest to these GPUs, summed,
        then (at equal closeness) the most port rate: (kinds, -Gb/s).  NICs are taken
        closest first, faster first at equal closeness.  Only falls as GPUs are added
        (each NIC's kind can only fall), which the branch and bound's bound relies on."""
        key = (mask, wanted)
        got = self._nic_cost.get(key)
        if got is None:
            if len(self._nic_cost) > NIC_COST_MAX:
                self._nic_cost.clear()
            got = self._nic_cost[key] = self._nic_cost_of(mask, wanted)
        return got

    def _nic_cost_of(self, mask: int, wanted: int) -> tuple[int, float]:
        dists = []
        for j, steps in enumerate(self.nic_steps):
            for kv, m in steps:
                if m & mask:
                    dists.append((kv, -self.nic_rate[j]))
                    break
            else:
                if self.nic_usable[j]:
                    dists.append((NO_NIC, -self.nic_rate[j]))
        dists.sort()
        chosen = dists[:wanted]
        return sum(kv for kv, _ in chosen), sum(rate for _, rate in chosen)


TERMS: PerTables[Terms] = PerTables(Terms)
terms = TERMS.of  # terms(prep): the term memo of these tables


class Bounds:
    """One search's damage (term 5, measured against the GPUs not busy) and the least
    terms (2), (3) and (5) can be once a partial set is completed."""

    def __init__(self, prep: Prepared, free_all: int):
        self.prep = prep
        self.terms = terms(prep)
        self.free_all = free_all
        self.zone_free_count: dict[int, int] = {}  # zone mask -> its free GPUs
        self.zone_f2: list[tuple[int, int]] | None = None  # (zone, 2 x its free GPUs)

    def free_in(self, zone: int) -> int:
        got = self.zone_free_count.get(zone)
        if got is None:
            got = self.zone_free_count[zone] = (zone & self.free_all).bit_count()
        return got

    def damage_add(self, taken: int, add: int) -> int:
        """Damage of taking ``add`` on top of ``taken``: sum of f^2 - (f-s)^2 increments."""
        cost = 0
        for _, zone_of in self.prep.zone_levels:
            t = taken
            for v in bits(add):
                z = zone_of[v]
                cost += 2 * (self.free_in(z) - (t & z).bit_count()) - 1
                t |= 1 << v
        return cost

    def damage_of(self, mask: int) -> int:
        """Damage of taking ``mask``: sum over zones of f^2 - (f-s)^2 = s * (2f - s);
        a zone of one GPU costs 1 when taken."""
        zone_f2 = self.zone_f2
        if zone_f2 is None:
            zone_f2 = self.zone_f2 = [(z, 2 * (z & self.free_all).bit_count()) for z in self.prep.multi_zones]
        cost = 0
        for z, f2 in zone_f2:
            s = (z & mask).bit_count()
            if s:
                cost += s * (f2 - s)
        for single in self.prep.single_zones:
            cost += (single & mask).bit_count()
        return cost

    def class_damage(self, zones: tuple[int, ...], taken: int, c: int) -> int:
        """Damage of taking ``c`` GPUs of one class on top of ``taken``."""
        cost = 0
        for z in zones:
            if z:
                cost += c * (2 * (self.free_in(z) - (taken & z).bit_count()) - c)
            else:
                cost += c  # each member is a zone of its own at this level
        return cost

    def damage_bound(self, taken: int, cand: int, rem: int) -> int:
        """Least damage of adding ``rem`` more GPUs from ``cand`` (per level; levels add).

        Taking a of the c candidates left in a zone with L = f - s free and untaken costs
        g(a) = a * (2L - a), concave in a.  A concave sum over "take rem in all" is least
        at a vertex: every zone taken whole or not at all, except at most one.  With up to
        three zones in play the vertices are few and we try them all (exact); otherwise
        g(a) >= a * (2L - c), the per-GPU cost of taking the whole zone, and filling the
        cheapest zones first with those rates is a lower bound.
        """
        total = 0
        counts = self.zone_free_count
        for zones in self.prep.zones_by_level:
            parts = []
            for z in zones:
                c = (z & cand).bit_count()
                if c:
                    f = counts.get(z)
                    if f is None:
                        f = counts[z] = (z & self.free_all).bit_count()
                    parts.append((2 * (f - (taken & z).bit_count()) - c, c))  # (rate, c)
            if len(parts) <= 3:
                total += least_concave_fill(parts, rem)
                continue
            parts.sort()
            need = rem
            for rate, c in parts:
                if c >= need:
                    total += need * rate
                    break
                total += c * rate
                need -= c
        return total

    def distance_bound(self, taken: int, cand: int, rem: int) -> int:
        """Least NUMA distance of adding ``rem`` more GPUs from ``cand``: the span of what
        is taken (it only grows), or, when the groups already touched cannot hold the
        rest, the least span of those plus one more group."""
        prep, terms = self.prep, self.terms
        touched = prep.groups_of(taken)
        span = terms.numa_span(touched)
        cap = 0
        for gi in bits(touched):
            cap += (prep.numa_masks[gi] & cand).bit_count()
        if rem <= cap:
            return span
        least = 1 << 30
        for gi, g in enumerate(prep.numa_masks):
            if g & cand and not touched >> gi & 1:
                least = min(least, terms.numa_span(touched | 1 << gi))
        return least

    def numa_bound(self, taken: int, cand: int, rem: int) -> int:
        touched = 0
        cap = 0
        others = []
        for g in self.prep.numa_masks:
            if g & taken:
                touched += 1
                cap += (g & cand).bit_count()
            else:
                c = (g & cand).bit_count()
                if c:
                    others.append(c)
        need = rem - cap
        if need > 0:
            others.sort(reverse=True)
            for c in others:
                touched += 1
                need -= c
                if need <= 0:
                    break
            else:
                return 1 << 30
        return touched


def least_concave_fill(parts: list[tuple[int, int]], rem: int) -> int:
    """min sum of a_i * (rate_i + c_i - a_i) over 0 <= a_i <= c_i, sum a_i = rem, by
    trying the vertices (all zones whole or empty but one); 0 if rem cannot be met
    (the caller's other checks reject that case)."""
    m = len(parts)
    if m <= 2:  # the common case (two NUMA nodes), directly: the concave cost of one
        # zone's share is least at an end of its range
        if m == 0:
            return 0
        (rate0, c0), (rate1, c1) = parts if m == 2 else (parts[0], (0, 0))
        lo, hi = max(0, rem - c1), min(c0, rem)
        if lo > hi:
            return 0
        return min(a * (rate0 + c0 - a) + (rem - a) * (rate1 + c1 - rem + a) for a in (lo, hi))
    best = None
    for subset in range(1 << m):
        whole = 0
        cost = 0
        for i in range(m):
            if subset >> i & 1:
                rate, c = parts[i]
                whole += c
                cost += c * rate
        left = rem - whole
        if left < 0:
            continue
        if left == 0:
            best = cost if best is None or cost < best else best
            continue
        for i in range(m):
            if not subset >> i & 1:
                rate, c = parts[i]
                if left < c:
                    value = cost + left * (rate + c - left)
                    best = value if best is None or value < best else best
    return best if best is not None else 0

