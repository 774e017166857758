"""Hand the memory a discovery's peak freed back to the kernel.

A swap builds a node's documents at once (a 128-GPU node's: tens of MiB of dicts and
strings, the pickled facts, the JSON) and frees them again; glibc's malloc keeps the freed
pages in its arenas, so the agent would sit at its peak for good.  ``malloc_trim(0)``
returns them: 8 MiB on the generated 128-GPU node (bench.footprint).  Where the C library
has no malloc_trim (musl, macOS) nothing happens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_trim: Callable[[int], Any] | bool | None = None  # libc's malloc_trim once looked up; False where there is none


def release_free_memory() -> None:
    """Return the C heap's free pages to the kernel (a few ms on a big node)."""
    global _trim
    if _trim is None:
        import ctypes  # only the service calls this

        try:
            _trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):  # not glibc
            _trim = False
    if callable(_trim):
        _trim(0)
