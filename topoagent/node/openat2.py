"""Linux's openat2(2): open a path below a directory in one system call, the kernel
confining the walk (``RESOLVE_IN_ROOT``) and refusing any symlink on the way
(``RESOLVE_NO_SYMLINKS``).

Host replays a recording through it: one open per file read, where walking the path
one ``openat(O_NOFOLLOW)`` per component costs ten.  Linux 5.6 and later have it; an
older kernel, or a seccomp filter that refuses the call, leaves ``available()`` False
and Host walks the path as before.
"""

from __future__ import annotations

import os
from collections.abc import Callable

# include/uapi/linux/openat2.h
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_IN_ROOT = 0x10
# The syscall's number on the architectures whose tables were unified before it came (alpha
# and MIPS number it otherwise: there the walk is used).
_SYS_OPENAT2 = 437
_ARCHITECTURES = frozenset({"x86_64", "i686", "i386", "aarch64", "armv7l", "ppc64le", "ppc64", "s390x", "riscv64", "loongarch64"})

_Call = Callable[[int, bytes, int, int], int]  # (dir_fd, path, flags, resolve) -> fd or -errno
_call: _Call | bool | None = None  # the bound syscall, once looked up; False when the kernel has none


def _bind() -> _Call | None:
    import ctypes  # only a replayed node needs it (a few ms of start-up)

    if os.uname().machine not in _ARCHITECTURES:
        return None

    class OpenHow(ctypes.Structure):
        _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except (OSError, AttributeError):  # not a C library that has syscall(2)
        return None
    syscall.restype = ctypes.c_long
    # The arguments are passed as ready-made C values rather than converted through
    # argtypes on every call (a replay opens a thousand files): syscall(2)'s number, a
    # long, and the struct's size, a size_t, made once; an open_how per (flags, resolve),
    # of which a replay uses a handful, made the first time each is asked for.
    number, size = ctypes.c_long(_SYS_OPENAT2), ctypes.c_size_t(ctypes.sizeof(OpenHow))
    hows: dict[tuple[int, int], tuple[OpenHow, object]] = {}  # the struct, and a pointer to it

    def call(dir_fd: int, path: bytes, flags: int, resolve: int) -> int:
        how = hows.get((flags, resolve))
        if how is None:
            made = OpenHow(flags, 0, resolve)
            how = hows[(flags, resolve)] = (made, ctypes.byref(made))
        fd: int = syscall(number, ctypes.c_int(dir_fd), path, how[1], size)
        if fd < 0:
            return -ctypes.get_errno()
        return fd

    return call


def available(dir_fd: int) -> bool:
    """Whether openat2 works here: tried once, on ``dir_fd`` itself."""
    global _call
    if _call is None:
        call = _bind() if os.uname().sysname == "Linux" else None
        # ENOSYS: a kernel before 5.6; EPERM (or anything else): a filter refusing it.
        probe = call(dir_fd, b".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, RESOLVE_IN_ROOT) if call else -1
        if probe >= 0:
            os.close(probe)
        _call = call if probe >= 0 else False
    return bool(_call)


def open_in_root(root_fd: int, path: str, flags: int) -> int:
    """A descriptor for ``path`` (relative, below ``root_fd``) opened with ``flags``.

    No symlink is followed, the last component's included (ELOOP); ``..`` cannot climb
    above the root.  Raises OSError with the errno (and ``path`` as its filename).
    Only after ``available()`` said True.
    """
    assert callable(_call)
    fd = _call(root_fd, os.fsencode(path), flags | os.O_CLOEXEC,
               RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    if fd < 0:
        raise OSError(-fd, os.strerror(-fd), path)
    return fd
