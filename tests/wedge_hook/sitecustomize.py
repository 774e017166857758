"""Test-only: a node file whose read never returns, like a hung device's sysfs attribute.

The Host refuses FIFOs (they hung one-shot commands), and no regular file blocks a read,
so the agents the tests start (tests/service_helpers.py puts this folder on their
PYTHONPATH with TOPOAGENT_TEST_WEDGE=1) read through this hook: a file that holds
exactly WEDGE blocks its reader forever, as a wedged device would.  With
TOPOAGENT_TEST_WEDGE_SEEN set, each read appends its node path to that file as it
blocks: the test's witness that the read is stuck now (not a pause that guesses it is).
"""

from __future__ import annotations

import os

WEDGE = b"topoagent-test: this read never returns\n"

if os.environ.get("TOPOAGENT_TEST_WEDGE") == "1":
    import threading

    from topoagent.node import host as _host

    _read_bytes = _host.Host.read_bytes
    _seen = os.environ.get("TOPOAGENT_TEST_WEDGE_SEEN")

    def _wedged_read_bytes(self: _host.Host, path: str, limit: int = _host.MAX_FILE_BYTES) -> bytes:
        data = _read_bytes(self, path, limit)
        if data == WEDGE:
            if _seen:
                with open(_seen, "a") as seen:  # one short append: whole lines, from any process
                    seen.write(f"{path}\n")
            threading.Event().wait()
        return data

    _host.Host.read_bytes = _wedged_read_bytes  # type: ignore[method-assign]
