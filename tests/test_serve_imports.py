"""What `topoagent serve` loads before anyone asks for it: not the doors nobody opened
(the picture, the OpenAPI document), nor what only other commands use (#38 item 3)."""

from __future__ import annotations

import json
import subprocess
import sys

# Loaded on the first request that needs them, or by other commands only.
NOT_AT_START = ("topoagent.exporters.svg", "topoagent.exporters.openapi", "topoagent.exporters.nccl_xml",
                "topoagent.exporters.gres", "topoagent.exporters.nfd", "topoagent.cluster", "topoagent.probes.runner",
                "torch", "tarfile", "psutil")


def test_serve_s_imports_leave_out_the_doors_nobody_opened():
    # What `topoagent serve` imports to run: its command, the HTTP API it builds, the agent.
    code = ("import sys, json; import topoagent.commands.serve, topoagent.exporters.http, topoagent.service.agent; "
            "print(json.dumps(sorted(sys.modules)))")
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout))
    assert "aiohttp" in loaded and "topoagent.exporters.prometheus" in loaded  # what it serves with
    assert not {m for m in loaded for never in NOT_AT_START if m == never or m.startswith(never + ".")}
