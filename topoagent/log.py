"""One line per event, `event=NAME key=value ...`: what journald and grep both read."""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

log = logging.getLogger("topoagent")

# `--log-level` names, quietest last; serve defaults to info, one-shot commands to warning.
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def level_named(name: str | None, default: int) -> int:
    return LEVELS[name] if name else default


def log_to_stderr(level: int) -> None:
    """One-shot commands: events at ``level`` and above on stderr, one line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False

CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def event_line(event: str, **fields: Any) -> str:
    """`event=NAME key=value ...` on one line; values with spaces, quotes or newlines quoted."""
    parts = [f"event={event}"]
    for key, value in fields.items():
        text = str(value)
        # Not printable (controls, NEL, U+2028, bidi overrides, lone surrogates): quoted,
        # and json.dumps escapes every non-ASCII character, so the line stays one line that
        # says what it holds.
        if not text or any(c in text for c in ' "=') or not text.isprintable():
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    log.log(level, event_line(event, **fields))
