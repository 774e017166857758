"""schemathesis holds the live service to its own /openapi.json: no 5xx, no drift."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from service_helpers import start_agent


def test_schemathesis_finds_no_server_error_and_no_schema_drift(tmp_path):
    agent = start_agent(tmp_path)
    schemathesis = Path(sys.executable).with_name("schemathesis")
    try:
        result = subprocess.run(
            [
                str(schemathesis), "--config-file", str(Path(__file__).with_name("schemathesis.toml")),
                "run", f"{agent.url}/openapi.json",
                "--checks", "all",
                "--max-examples", "12",
                "--workers", "1",
                "--seed", "1",
                "--header", f"Authorization: Bearer {agent.token}",
                "--warnings", "off",
            ],
            capture_output=True, text=True, timeout=120,
            cwd=tmp_path,  # its example cache stays out of the checkout
            env={**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_HOOKS": ""},
        )
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        assert "No issues found" in result.stdout
        assert agent.get("/healthz").status == 200
        assert "event=handler_crashed" not in agent.log()
    finally:
        assert agent.stop() == 0
