"""Text from the machine, made safe where it enters, and values shown in messages, cut
where they are shown: the one place for both.

Whatever the machine says (NVML strings, sysfs and procfs files, recorded command outputs
and JSON, link targets) passes ``machine_text`` (``machine_data`` for parsed JSON) once, in
the Host and the NVML reader: a lone surrogate (which no encoder writes: a whole /metrics
page or HTML page would fail), a NUL or other control character (which ends a C string in
Slurm and breaks XML), a bidi override (which turns a name around in a terminal or a
browser) becomes U+FFFD, one character each.  One hostile string costs one value, and
every output downstream can count on text it can encode.
"""

from __future__ import annotations

import json
import re
from typing import Any

# C0 controls but tab, newline and carriage return (a file's lines stay lines), DEL and C1
# controls, the bidi marks, embeddings, overrides and isolates (Unicode TR9), lone surrogates.
_UNSAFE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
# The same and tab, newline and carriage return: for a value an output keeps on one line.
_UNSAFE_IN_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
REPLACEMENT = "\ufffd"
# Terminal escape sequences (ECMA-48, 7-bit).  nvidia-smi underlines its header line
# ('\x1b[4m' ... '\x1b[0m': driver 580.159.04 does), and a paste from a coloured terminal
# may carry others.  None of them is text: each is dropped whole (not replaced, or the
# header would no longer read as one), and none spans a line end, so line numbers stay.
_ESCAPE_SEQUENCE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: SGR (colour, underline), cursor moves, erases
    r"|\x1b[\]P^_X][^\x07\x1b\n]*(?:\x07|\x1b\\)?"  # OSC, DCS, PM, APC, SOS: up to BEL or ST
    r"|\x1b[ -/]*[0-~]"  # the rest: ESC then a final byte ('\x1b(B', '\x1b7', '\x1b=')
)


def without_terminal_escapes(text: str) -> str:
    return _ESCAPE_SEQUENCE.sub("", text) if "\x1b" in text else text


def machine_text(text: str) -> str:
    """``text`` with terminal escape sequences dropped, and every other character that
    cannot be safe in an output replaced by U+FFFD."""
    text = without_terminal_escapes(text)
    return _UNSAFE.sub(REPLACEMENT, text) if _UNSAFE.search(text) else text


def one_line(text: str) -> str:
    """``machine_text``, and tabs and line ends replaced too: an output's own last guard for a
    value it keeps on one line (a metric's label, an XML attribute)."""
    text = without_terminal_escapes(text)
    return _UNSAFE_IN_LINE.sub(REPLACEMENT, text) if _UNSAFE_IN_LINE.search(text) else text


def printable_line(text: str) -> str:
    """``text`` as one line of printable characters: every other character a space, runs of
    spaces one (for a message that must read as a line: a Node condition, an error)."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


def is_safe(text: str) -> bool:
    """Whether ``machine_text`` leaves ``text`` as it is."""
    return _UNSAFE.search(text) is None and "\x1b" not in text


def machine_data(value: Any) -> Any:
    """Parsed JSON from the machine (a recording's nvml.json, a tool's JSON output) with
    every string in it, keys too, through ``machine_text``; numbers and the rest as they are."""
    if isinstance(value, str):
        return machine_text(value)
    if isinstance(value, dict):
        return {machine_text(k) if isinstance(k, str) else k: machine_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [machine_data(v) for v in value]
    return value


def machine_json(text: str | bytes) -> Any:
    """JSON from the machine, parsed and through ``machine_data``; json.loads's errors
    (ValueError, RecursionError) as they are.  A text without an escape (no backslash) and
    with nothing unsafe in it holds strings that are safe as they stand: it is returned as
    parsed, not walked string by string again (which took twice the parse of nvml.json)."""
    # Bytes decoded as json.loads decodes them (surrogatepass: UTF-8 bytes can carry a lone
    # surrogate), so the check reads exactly the text that is parsed.
    raw = text.decode(json.detect_encoding(text), "surrogatepass") if isinstance(text, bytes) else text
    data = json.loads(raw)
    return data if "\\" not in raw and is_safe(raw) else machine_data(data)


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
