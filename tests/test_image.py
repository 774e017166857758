"""The image Containerfile describes builds without a registry and runs as uid 65534.

scripts/image-smoke does the work (mmdebstrap base, wheels built here, `podman build`, then
`--version`, `discover --root`, `place --root` and `serve` answering /readyz on loopback in
the image); this test runs it so the image counts in the suite.  It fails, never skips,
where podman or mmdebstrap is missing: scripts/test installs both.
"""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO


def test_the_image_builds_offline_and_serves_a_recorded_node_as_nobody() -> None:
    env = {**os.environ, "PYTHON": sys.executable}  # wheels for this Python, which matches the base's
    done = subprocess.run(["bash", str(REPO / "scripts" / "image-smoke")], capture_output=True, text=True, timeout=900, env=env)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    for line in ("ok: --version (topoagent ", "ok: discover --root (8 GPUs)", "ok: place --root (4 GPUs)",
                 "ok: serve answers http://127.0.0.1:", "ok: serve stopped on SIGTERM", "image-smoke: passed"):
        assert line in done.stdout, report
