"""Every duration in topoagent.toml has a floor and a ceiling, as max_connections has (issue
#37, item 6): a SIGHUP reload outside them is refused in one log line and the running
config kept; at start-up the same bounds stop the agent in one line, exit 2."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from service_helpers import DGX_A100, start_agent, wait_for

from topoagent.config import SCHEMA, SECONDS_BOUNDS, ConfigError, config_from_toml

DURATION_KEYS = sorted(f"{section}.{key}" for section, table in SCHEMA.items() for key in table
                       if key.endswith("_s") and not key.endswith("_per_s"))  # "_per_s": a rate


def toml(key: str, value: float) -> str:
    section, name = key.split(".")
    return f"[{section}]\n{name} = {value!r}\n"


def test_every_duration_has_its_bounds():
    assert sorted(SECONDS_BOUNDS) == DURATION_KEYS


@pytest.mark.parametrize("key", DURATION_KEYS)
def test_a_duration_outside_its_bounds_is_refused_and_its_bounds_are_accepted(key):
    floor, ceiling = SECONDS_BOUNDS[key]
    for bad in (floor / 10, ceiling * 2, 0.000001, 0, -1):
        if floor <= bad <= ceiling:
            continue
        with pytest.raises(ConfigError) as caught:
            config_from_toml(toml(key, bad))
        assert str(caught.value).startswith(f"{key}: expected a number of seconds from {floor:g} to {ceiling:g}"), str(caught.value)
    if key != "probes.max_interval_s":  # it must not fall below probes.min_interval_s's default
        config_from_toml(toml(key, floor))
    if key != "probes.min_interval_s":
        config_from_toml(toml(key, ceiling))


def test_a_reload_of_a_microsecond_header_timeout_is_refused_and_every_request_still_answered(tmp_path):
    """It used to be accepted; then every request got an empty reply until another reload."""
    agent = start_agent(tmp_path, config="[http]\nheader_timeout_s = 10\n")
    try:
        (tmp_path / "topoagent.toml").write_text("[http]\nheader_timeout_s = 0.000001\n")
        agent.proc.send_signal(signal.SIGHUP)
        line = wait_for("the reload refused", lambda: next((l for l in agent.log().splitlines() if "event=reload_failed" in l), None), agent)
        assert "http.header_timeout_s" in line and "from 0.5 to 600" in line, line
        assert "event=reloaded" not in agent.log()
        for _ in range(5):
            assert agent.get("/healthz").status == 200
            assert agent.get("/topology").status == 200
    finally:
        assert agent.stop() == 0


def test_a_microsecond_header_timeout_stops_the_start_in_one_line(tmp_path):
    config = tmp_path / "topoagent.toml"
    config.write_text("[http]\nheader_timeout_s = 0.000001\n")
    args = [sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(DGX_A100), "--listen", "127.0.0.1:0",
            "--state-dir", str(tmp_path / "state"), "--config", str(config)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "http.header_timeout_s: expected a number of seconds from 0.5 to 600" in lines[0], done.stderr


def test_docs_list_every_durations_bounds():
    from conftest import REPO

    text = (REPO / "docs" / "service.md").read_text()
    for key, (floor, ceiling) in SECONDS_BOUNDS.items():
        assert f"| `{key}` | {floor:g} | {ceiling:g} |" in text, key
