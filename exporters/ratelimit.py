"""A token bucket per client address, for the endpoints that change something.

Reserving, releasing, refreshing and probing each cost the node real work (a lease file
written with fsync, a discovery run, a probe round); one client must not be able to
spend it all.  Memory is bounded: at most `max_clients` buckets are kept, the least
recently used dropped first (a dropped bucket had, most likely, filled up again anyway).
IPv6 clients are counted per /64, the block one host is usually given.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable

MAX_CLIENTS = 4096


def client_key(remote: str | None) -> str:
    """The bucket a request's peer address spends from: the IPv4 address, an IPv6 /64."""
    if not remote:
        return "-"
    try:
        address = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return remote[:64]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(address) >> 64 << 64, 64)))
    return str(address)


class RateLimiter:
    """`take(client)` -> 0.0 when the request may go ahead, else the seconds to wait."""

    def __init__(self, rate_per_s: float, burst: int, *, max_clients: int = MAX_CLIENTS, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_clients = max_clients
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, when)

    def configure(self, rate_per_s: float, burst: int) -> None:
        self.rate_per_s, self.burst = rate_per_s, burst

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, client: str) -> float:
        now = self._clock()
        tokens, when = self._buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - when) * self.rate_per_s)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate_per_s
        self._buckets[client] = (tokens, now)  # most recently used last
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return wait

    @staticmethod
    def retry_after(wait_s: float) -> int:
        """Whole seconds for a Retry-After header (never 0: the client must wait)."""
        return max(1, math.ceil(wait_s))
