"""Writing a small JSON state file so that a crash never leaves half of it, and whether a
state directory can be trusted with such files.

The same steps as the lease book's ``leases.json``: a temporary file beside the target,
fsync, rename over the target, fsync of the directory (so the rename itself survives a
power cut).  On a write error the temporary file is removed and the error raised: the
old file stays whole.  The temporary file is created new (``O_CREAT|O_EXCL|O_NOFOLLOW``)
under a random name: a link or file planted at a name someone could guess is never
written through, and never followed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from topoagent.smallfile import open_no_link


def write_json_atomically(path: Path, document: Any, *, readable: bool = True, mode: int = 0o600) -> None:
    """``readable``: indented, keys sorted (files people read); else compact, as given.
    ``mode``: the file's permissions whatever the umask (0600: the agent's alone)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        fd = open_no_link(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            os.fchmod(handle.fileno(), mode)
            json.dump(document, handle, indent=1 if readable else None, sort_keys=readable)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if not isinstance(exc, FileExistsError):  # O_EXCL: the name was someone else's, leave it be
            with contextlib.suppress(OSError):
                tmp.unlink()  # a full disk: do not leave half a file to fill it further
        raise
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def state_dir_problem(path: str | os.PathLike[str], mode: str = "700") -> str | None:
    """Why a state directory cannot be trusted with the agent's files, or None: whoever
    else may write it can replace the lease book.  As ``serve``'s token-file rule: owned
    by this process's user or root, and no group or other write bit (sshd's StrictModes).
    ``mode`` is the one the fix names (755 for a directory others must read).  Raises
    OSError when it cannot be looked at."""
    info = os.stat(path)  # the directory a link names: systemd's StateDirectory= is one under DynamicUser
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory"
    return owner_or_mode_problem(info, chown=f"chown {os.geteuid()} {os.fspath(path)}", chmod=f"chmod {mode} {os.fspath(path)}")


def owner_or_mode_problem(info: os.stat_result, *, chown: str, chmod: str) -> str | None:
    """The rule for whatever the agent trusts on disk (its state directory, its token file):
    owned by this process's user or root, and no group or other write bit.  ``chown`` and
    ``chmod`` are the fix each failure names."""
    uid = os.geteuid()
    if info.st_uid not in (uid, 0):
        return f"owned by uid {info.st_uid}, not by this agent's user (uid {uid}) or root; {chown}"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "anyone" if info.st_mode & stat.S_IWOTH else "its group"
        return f"writable by {who} (mode {stat.S_IMODE(info.st_mode):04o}); {chmod}"
    return None
