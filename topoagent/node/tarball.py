"""A recorded node's tarball opened for reading with every header bounded before it is read.

tarfile reads a member's extended headers whole into memory: a PAX header (``x``, ``g``),
a GNU long name or long link (``L``, ``K``) of any size its 12-byte size field allows, and
a GNU sparse map block after block.  A 300 KB gzip can hold a 200 MB PAX header of one
repeated byte.  So tarfile reads through ``HeaderBudget``, which refuses any read past
``MAX_MEMBER_HEADER_BYTES`` while one member's headers are read, *before* it is made,
and counts the extended bytes (all but each member's own 512-byte block) of the whole
archive against ``MAX_TARBALL_HEADER_BYTES``: they stay in memory as the members' names
and PAX records.  Member data is read in tarfile's own small chunks, unbudgeted.

Imported only when a recording is a tarball (tarfile costs 6 ms of every start-up).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# One member's headers together: its 512-byte block, PAX records, GNU long name and link,
# sparse map.  A path and a link target of PATH_MAX (4 KiB) each, in PAX records, are
# ~8.5 KB; a recorded node's are a few hundred bytes.
MAX_MEMBER_HEADER_BYTES = 64 << 10
# Every member's extended headers together: what the names and PAX records of a recording
# of MAX_TARBALL_MEMBERS entries of ~80 bytes each would take.
MAX_TARBALL_HEADER_BYTES = 16 << 20


class HeadersTooLarge(tarfile.TarError):
    """A member's headers, or all members' together, exceed their bound; nothing was read."""


class HeaderBudget:
    """The decompressed tar stream, as tarfile reads it: while ``member_left`` is set (a
    member's headers are being read) every read is counted against it and refused past it."""

    def __init__(self, stream: io.BufferedIOBase) -> None:
        self._stream = stream
        self.member_left: int | None = None  # None: member data is being read
        self.extended = 0  # header bytes beyond each member's own block, all members together

    def read(self, size: int = -1) -> bytes:
        if self.member_left is not None:
            if size < 0 or size > self.member_left:
                raise HeadersTooLarge(f"a member's headers (PAX, GNU long name or link, sparse map) exceed "
                                      f"{MAX_MEMBER_HEADER_BYTES >> 10} KiB")
            self.member_left -= size
        return self._stream.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._stream.seek(offset, whence)

    def tell(self) -> int:
        return self._stream.tell()


class BoundedTarFile(tarfile.TarFile):
    """A TarFile whose every member's headers are read within ``HeaderBudget``'s bounds."""

    fileobj: Any

    @property
    def extended_header_bytes(self) -> int:
        """The members' header bytes read so far beyond each one's own 512-byte block."""
        return self.fileobj.extended

    def next(self) -> tarfile.TarInfo | None:
        budget: HeaderBudget = self.fileobj
        budget.member_left = MAX_MEMBER_HEADER_BYTES
        try:
            member = super().next()
            used = MAX_MEMBER_HEADER_BYTES - budget.member_left
        finally:
            budget.member_left = None
        if member is not None:
            budget.extended += max(0, used - tarfile.BLOCKSIZE)
            if budget.extended > MAX_TARBALL_HEADER_BYTES:
                raise HeadersTooLarge(f"its members' headers (PAX, GNU long names and links) exceed "
                                      f"{MAX_TARBALL_HEADER_BYTES >> 20} MiB together")
        return member


@contextlib.contextmanager
def open_bounded(path: Path) -> Iterator[BoundedTarFile]:
    """``path`` (a gzip or bzip2 tarball, told by its first bytes, else a plain one) opened
    for reading; closed, with its stream, on the way out."""
    with open(path, "rb") as raw:
        magic = raw.read(3)
    with contextlib.ExitStack() as stack:
        stream: io.BufferedIOBase
        if magic.startswith(b"\x1f\x8b"):
            stream = stack.enter_context(gzip.open(path, "rb"))
        elif magic == b"BZh":
            stream = stack.enter_context(bz2.open(path, "rb"))
        else:
            stream = stack.enter_context(open(path, "rb"))
        yield stack.enter_context(BoundedTarFile(fileobj=HeaderBudget(stream), mode="r"))  # type: ignore[arg-type]
