"""Linux CPU lists (``0-3,8,10-11``) and masks (``00000000,0000ffff``), one reading for all.

sysfs, nvidia-smi, NVML, numactl and Slurm all speak these; every module parses and
prints them through here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import compress

from topoagent.errors import TopoagentError
from topoagent.text import shown


class CpuListError(TopoagentError, ValueError):  # ValueError: older callers catch that
    """The text is not a CPU list or mask."""


# The most CPUs one list or mask may name.  Linux's largest NR_CPUS is 8,192 (x86 MAXSMP,
# powerpc; arm64 stops at 4,096): 65,536 leaves room for machines to come, while a
# poisoned file (``0-4000000000``) is refused before it is expanded: a full list is a
# set of at most 65,536 numbers (about 4 MB), and parsing one is bounded work.
MAX_CPUS = 65_536
_MAX_MASK_WORDS = MAX_CPUS // 32
_MASK_WORD = re.compile(r"[0-9a-fA-F]{0,8}")  # ASCII hex digits only, as int(word, 16) must not see '_' or '+'
_BINARY_DIGITS = bytes.maketrans(b"01", b"\x00\x01")


def parse_cpulist(text: str) -> frozenset[int]:
    """``0-3,8,10-11`` -> {0,1,2,3,8,10,11}; empty text -> empty set."""
    cpus: set[int] = set()
    text = text.strip()
    if not text:
        return frozenset()
    named = 0  # CPUs the chunks name, repeats included: bounds the work, not just the set
    for chunk in text.split(","):
        chunk = chunk.strip()
        if not chunk:
            continue
        if "-" in chunk:
            low, _, high = chunk.partition("-")
            first, last = _number(low, chunk), _number(high, chunk)
            if last < first:
                raise CpuListError(f"cpulist range {chunk!r} runs backwards")
        else:
            first = last = _number(chunk, chunk)
        named += last - first + 1
        if named > MAX_CPUS:
            raise CpuListError(f"cpulist names more than {MAX_CPUS:,} CPUs")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def _number(text: str, chunk: str) -> int:
    text = text.strip()
    # isdigit first: int() would take '+1' and '1_0'; the length check keeps a 5,000-digit
    # "CPU number" from reaching int() at all.
    if not (text.isascii() and text.isdigit()):
        raise CpuListError(f"cpulist {shown(chunk)}: {shown(text)} is not a CPU number")
    if len(text) > len(str(MAX_CPUS)) or int(text) >= MAX_CPUS:
        raise CpuListError(f"cpulist {shown(chunk)}: CPU {shown(text)} is not below {MAX_CPUS:,}")
    return int(text)



def parse_cpumask(text: str) -> frozenset[int]:
    """sysfs ``local_cpus`` (``00000000,0000ffff``, 32-bit words, high first) -> CPU set."""
    words = text.strip().split(",")
    if len(words) > _MAX_MASK_WORDS:
        raise CpuListError(f"cpumask has {len(words):,} words; at most {_MAX_MASK_WORDS:,} ({MAX_CPUS:,} CPUs)")
    value = 0
    for word in words:
        word = word.strip()
        if not _MASK_WORD.fullmatch(word):
            raise CpuListError(f"cpumask word {shown(word)} is not a 32-bit hexadecimal word")
        value = (value << 32) | int(word or "0", 16)
    # The bits from the lowest up, as bytes 0 and 1, and the places of the ones: a shift of
    # the whole number per bit cost a PCI device as much as its file reads (256 CPUs).
    bits = bin(value)[:1:-1].encode().translate(_BINARY_DIGITS)
    return frozenset(compress(range(len(bits)), bits))


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
