"""The agents' bearer token as a client command reads it (``extender --agent-token-file``,
``device-plugin --agent-token-file``, ``cluster-topology --token-file``).

The agent's own side, which also refuses a token file others could write, is
``topoagent.commands.serve.read_token``; a client only has to send the token intact.
Both warn (``readable_by_others``) when others could read the token: whoever reads it
can reserve and release GPUs.
"""

from __future__ import annotations

import logging
import os
import stat

from topoagent.errors import UsageError
from topoagent.log import log_event
from topoagent.smallfile import read_small_file

MAX_TOKEN_BYTES = 64 * 1024  # as the agent's read_token


def readable_by_others(info: os.stat_result) -> str | None:
    """Who besides the token's owner may read it by its mode: "anyone", "its group", or None.

    A file that root owns and this process does not is read through its group bit on
    purpose: root:GROUP 0440 as an administrator grants it, a Kubernetes Secret volume
    under the pod's fsGroup, a systemd credential (whose ACL mask shows as the group
    bits).  Its group bit is that grant, not a leak, as PostgreSQL accepts a root-owned
    key of mode 0640 and not one of its own.  Only the other bit counts there."""
    mode = info.st_mode
    if mode & stat.S_IROTH:
        return "anyone"
    granted_by_root = info.st_uid == 0 and os.geteuid() != 0
    if mode & stat.S_IRGRP and not granted_by_root:
        return "its group"
    return None


def warn_if_readable_by_others(path: str, info: os.stat_result) -> None:
    """One warning line when others may read the token at ``path`` (a leak, not refused:
    Kubernetes mounts Secrets 0644 unless told otherwise, and refusing would stop them)."""
    who = readable_by_others(info)
    if who is None:
        return
    fix = "chmod o-r" if who == "anyone" and info.st_uid == 0 and os.geteuid() != 0 else "chmod go-r"
    log_event("token_file_readable_by_others", logging.WARNING, file=path, mode=f"{stat.S_IMODE(info.st_mode):04o}",
              readable_by=who, fix=f"{fix} {path}")


def read_client_token(flag: str, path: str) -> str:
    """The token in ``path``, surrounding whitespace stripped.  UsageError naming ``flag``
    when the file cannot be read, holds no token, more than one token's bytes, or a
    character an HTTP header cannot carry (a line break would end the header)."""
    try:
        raw, info = read_small_file(path, MAX_TOKEN_BYTES)
    except OSError as exc:
        raise UsageError(f"{flag}: {exc.strerror}: {path}") from None
    if len(raw) > MAX_TOKEN_BYTES:
        raise UsageError(f"{flag}: {path}: more than {MAX_TOKEN_BYTES >> 10} KiB; expected one token")
    token = raw.strip()
    if not token:
        raise UsageError(f"{flag}: {path} holds no token")
    if any(b < 0x21 or b > 0x7E for b in token):
        raise UsageError(f"{flag}: {path}: the token holds a space, a line break or a non-ASCII byte; an HTTP header cannot carry it")
    warn_if_readable_by_others(path, info)
    return token.decode("ascii")
