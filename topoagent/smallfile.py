"""Reading a small file a command is handed at start (a token, a certificate, a key), and
naming what a path is when it is not a regular file."""

from __future__ import annotations

import errno
import os
import stat


def file_kind(mode: int) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def read_small_file(path: str, limit: int) -> tuple[bytes, os.stat_result]:
    """At most ``limit + 1`` bytes of ``path`` (more than ``limit`` means too large) and the
    stat of the file opened, not of whatever the name points at by now.  Opened without
    blocking, so that a FIFO in the file's place cannot hang the start: anything but a
    regular file is refused (OSError EINVAL naming what it is).  Raises OSError as open()
    and read() do."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        kind = file_kind(info.st_mode)
        if kind is not None:
            raise OSError(errno.EINVAL, f"not a regular file ({kind})")
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as handle:
            return handle.read(limit + 1), info
    finally:
        os.close(fd)
