"""Linux CPU lists (``0-3,8,10-11``) and masks (``00000000,0000ffff``), one reading for all.

sysfs, nvidia-smi, NVML, numactl and Slurm all speak these; every module parses and
prints them through here.
"""

from __future__ import annotations

from collections.abc import Iterable

from topoagent.errors import TopoagentError


class CpuListError(TopoagentError, ValueError):  # ValueError: older callers catch that
    """The text is not a CPU list or mask."""


def parse_cpulist(text: str) -> frozenset[int]:
    """``0-3,8,10-11`` -> {0,1,2,3,8,10,11}; empty text -> empty set."""
    cpus: set[int] = set()
    text = text.strip()
    if not text:
        return frozenset()
    for chunk in text.split(","):
        chunk = chunk.strip()
        if not chunk:
            continue
        if "-" in chunk:
            low, _, high = chunk.partition("-")
            first, last = _number(low, chunk), _number(high, chunk)
            if last < first:
                raise CpuListError(f"cpulist range {chunk!r} runs backwards")
            cpus.update(range(first, last + 1))
        else:
            cpus.add(_number(chunk, chunk))
    return frozenset(cpus)


# Linux builds for at most 8192 CPUs (NR_CPUS); the bound keeps a hostile '0-4000000000'
# from expanding into billions of ints.
MAX_CPU_ID = 65535


def _number(text: str, chunk: str) -> int:
    text = text.strip()
    if not text.isascii() or not text.isdigit() or len(text.lstrip("0")) > len(str(MAX_CPU_ID)):
        shown = chunk if len(chunk) <= 24 else chunk[:21] + "..."
        raise CpuListError(f"cpulist {shown!r}: not a CPU number from 0 to {MAX_CPU_ID}")
    number = int(text)
    if number > MAX_CPU_ID:
        raise CpuListError(f"cpulist {chunk!r}: CPU {number} is above {MAX_CPU_ID}")
    return number


def parse_cpumask(text: str) -> frozenset[int]:
    """sysfs ``local_cpus`` (``00000000,0000ffff``, 32-bit words, high first) -> CPU set."""
    words = text.strip().split(",")
    if len(words) > (MAX_CPU_ID + 1) // 32:
        raise CpuListError(f"cpumask of {len(words)} words names CPUs above {MAX_CPU_ID}")
    value = 0
    for word in words:
        try:
            if len(word) > 8:  # a word is 32 bits
                raise ValueError(word)
            value = (value << 32) | int(word or "0", 16)
        except ValueError:
            shown = word if len(word) <= 12 else word[:9] + "..."
            raise CpuListError(f"cpumask word {shown!r} is not up to 8 hexadecimal digits") from None
    return frozenset(i for i in range(value.bit_length()) if value >> i & 1)


def format_cpulist(cpus: Iterable[int]) -> str:
    """{0,1,2,3,8} -> ``0-3,8``."""
    ordered = sorted(set(cpus))
    ranges: list[str] = []
    start = prev = None
    for cpu in ordered:
        if start is None:
            start = prev = cpu
        elif cpu == prev + 1:  # type: ignore[operator]
            prev = cpu
        else:
            ranges.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = cpu
    if start is not None:
        ranges.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(ranges)
