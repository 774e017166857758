"""Reading a small file a command is handed at start: a token, a certificate, a key."""

from __future__ import annotations

import os


def read_small_file(path: str, limit: int) -> tuple[bytes, os.stat_result]:
    """At most ``limit + 1`` bytes of ``path`` (more than ``limit`` means too large) and the
    stat of the file opened, not of whatever the name points at by now.  Opened without
    blocking: a FIFO in the file's place reads as empty instead of hanging the start.
    Raises OSError as open() and read() do."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        return handle.read(limit + 1), info
