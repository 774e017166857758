"""The agents' bearer token as a client command reads it (``extender --agent-token-file``,
``device-plugin --agent-token-file``, ``cluster-topology --token-file``).

The agent's own side, which also refuses a token file others could write, is
``topoagent.commands.serve.read_token``; a client only has to send the token intact.
"""

from __future__ import annotations

import os

from topoagent.errors import UsageError

MAX_TOKEN_BYTES = 64 * 1024  # as the agent's read_token


def read_client_token(flag: str, path: str) -> str:
    """The token in ``path``, surrounding whitespace stripped.  UsageError naming ``flag``
    when the file cannot be read, holds no token, more than one token's bytes, or a
    character an HTTP header cannot carry (a line break would end the header)."""
    try:
        # O_NONBLOCK: a FIFO in the token's place reads as empty instead of hanging the start.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(MAX_TOKEN_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{flag}: {exc.strerror}: {path}") from None
    if len(raw) > MAX_TOKEN_BYTES:
        raise UsageError(f"{flag}: {path}: more than {MAX_TOKEN_BYTES >> 10} KiB; expected one token")
    token = raw.strip()
    if not token:
        raise UsageError(f"{flag}: {path} holds no token")
    if any(b < 0x21 or b > 0x7E for b in token):
        raise UsageError(f"{flag}: {path}: the token holds a space, a line break or a non-ASCII byte; an HTTP header cannot carry it")
    return token.decode("ascii")
