"""Values shown in messages: the one place that cuts them, so a huge or hostile value can
never flood an error line or a log."""

from __future__ import annotations

import json
from typing import Any


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, marked with an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def quoted(value: Any, limit: int = 40) -> str:
    """A value as JSON (as a client sent it), cut to ``limit`` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return cut(text, limit)


def shown(text: str, limit: int = 40) -> str:
    """A piece of a file or command output as a Python literal (so control characters show),
    cut to ``limit`` characters."""
    return cut(repr(text), limit)
