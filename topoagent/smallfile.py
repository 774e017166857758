"""Reading a small file: one a command is handed at start (a token, a certificate, a key)
or one of the agent's own state files; and naming what a path is when it is not a regular
file.

Every such file is opened without blocking (a FIFO in its place cannot hang the reader),
checked on the descriptor opened (a regular file, not whatever the name points at by now)
and read to a bound.  A state file is also opened without following a link (``O_NOFOLLOW``):
a link planted in a state directory must not make the agent read, or trust, another file.
"""

from __future__ import annotations

import errno
import os
import stat

# How every state file is opened: no wait on a FIFO or device, no link followed.
STATE_OPEN_FLAGS = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
LINK_REFUSED = f"{os.strerror(errno.ELOOP)} (a symbolic link: not followed in a state directory)"


class NotRegularFile(OSError):
    """The path is a directory, FIFO, socket or device: ``kind`` says which, in words."""

    def __init__(self, kind: str, path: str):
        super().__init__(errno.EINVAL, f"not a regular file ({kind})", path)
        self.kind = kind


def file_kind(mode: int) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def open_no_link(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    """``os.open`` with ``STATE_OPEN_FLAGS``: a link at ``path`` is refused (OSError ELOOP
    saying so), never followed."""
    try:
        return os.open(path, flags | STATE_OPEN_FLAGS, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, LINK_REFUSED, os.fspath(path)) from None
        raise


def read_small_file(path: str | os.PathLike[str], limit: int, *, follow_links: bool = True) -> tuple[bytes, os.stat_result]:
    """At most ``limit + 1`` bytes of ``path`` (more than ``limit`` means too large) and the
    stat of the file opened, not of whatever the name points at by now.  Opened without
    blocking, so that a FIFO in the file's place cannot hang the start: anything but a
    regular file is refused (``NotRegularFile``, an OSError EINVAL naming what it is).
    ``follow_links=False`` for the agent's state files: a link is refused (OSError ELOOP).
    Raises OSError as open() and read() do."""
    if follow_links:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    else:
        fd = open_no_link(path, os.O_RDONLY)
    try:
        info = os.fstat(fd)
        kind = file_kind(info.st_mode)
        if kind is not None:
            raise NotRegularFile(kind, os.fspath(path))
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as handle:
            return handle.read(limit + 1), info
    finally:
        os.close(fd)
