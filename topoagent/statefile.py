"""Writing a small JSON state file so that a crash never leaves half of it.

The same steps as the lease book's ``leases.json``: a temporary file beside the target,
fsync, rename over the target, fsync of the directory (so the rename itself survives a
power cut).  On a write error the temporary file is removed and the error raised: the
old file stays whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any


def write_json_atomically(path: Path, document: Any, *, readable: bool = True) -> None:
    """``readable``: indented, keys sorted (files people read); else compact, as given."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=1 if readable else None, sort_keys=readable)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()  # a full disk: do not leave half a file to fill it further
        raise
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
