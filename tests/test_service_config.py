"""Configuration: TOML, flags on top, and one clear line for every mistake."""

from __future__ import annotations

import subprocess
import sys

import pytest
from service_helpers import DGX_A100

from topoagent.commands.serve import replaying_without_state_dir
from topoagent.config import DEFAULT_PORT, ConfigError, Listen, config_from_toml, load_config


def test_defaults_listen_on_loopback_fixed_port():
    config = load_config(None)
    assert config.listen == Listen("127.0.0.1", DEFAULT_PORT)
    assert config.root == "/" and config.live
    assert config.token_file is None


def test_file_then_flags(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[http]\nlisten = "0.0.0.0:9000"\nrequire_token_for_reads = true\n[discovery]\ninterval_s = 30\n')
    config = load_config(path, {"listen": "[::1]:9100", "root": "/snap", "state_dir": None})
    assert config.listen == Listen("::1", 9100)
    assert config.require_token_for_reads is True
    assert config.interval_s == 30.0
    assert config.root == "/snap" and not config.live


@pytest.mark.parametrize(
    "text, flag, temporary",
    [
        ("", None, True),  # a replay's leases are its own
        ("[leases]\nstate_dir = '/srv/replay-state'\n", None, False),
        ("", "/srv/replay-state", False),
        ("[leases]\nsweep_s = 1\n[http]\nlisten = '127.0.0.1:9000'\n", None, True),  # other keys choose no directory
    ],
)
def test_a_replay_keeps_its_leases_apart_unless_a_state_dir_was_chosen(tmp_path, text, flag, temporary):
    """serve learns from the loaded config, not by reading the file again, whether the file
    or --state-dir chose the state directory."""
    path = tmp_path / "t.toml"
    path.write_text(text)
    config = load_config(path, {"root": str(DGX_A100), "state_dir": flag})
    assert replaying_without_state_dir(config) is temporary
    assert not replaying_without_state_dir(load_config(path, {"state_dir": flag}))  # the live node's is its own


@pytest.mark.parametrize(
    "text, named",
    [
        ('[http]\nlisten = "localhost"\n', "http.listen"),
        ('[http]\nlisten = "1.2.3.4:99999"\n', "http.listen"),
        ('[http]\nlisten = "example.com:80"\n', "http.listen"),
        ("[http]\nmax_body_bytes = 10\n", "http.max_body_bytes"),
        ('[discovery]\ninterval_s = "5m"\n', "discovery.interval_s"),
        ("[discovery]\ntimeout_s = -1\n", "discovery.timeout_s"),
        ("[discovery]\nudev = 1\n", "discovery.udev"),
        ("[discovery]\nrooot = '/'\n", "discovery.rooot"),
        ("[cache]\nsize = 1\n", "cache"),
        ('[probes]\nbackend = "rocm"\n', "probes.backend"),
        ("[probes]\nenabled = \"yes\"\n", "probes.enabled"),
        ("[probes]\nduty_cycle = 5\n", "probes.duty_cycle"),
        ("[probes]\nsizes_bytes = []\n", "probes.sizes_bytes"),
        ("[probes]\nmin_interval_s = 100\nmax_interval_s = 10\n", "probes.min_interval_s"),
        ("http = 3\n", "http"),
        ("[http\n", "not valid TOML"),
    ],
)
def test_bad_values_name_the_key(text, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        config_from_toml(text)


def test_probes_are_off_unless_asked_for_by_file_or_flag(tmp_path):
    assert load_config(None).probes_enabled is False
    path = tmp_path / "t.toml"
    path.write_text('[probes]\nenabled = true\nbackend = "cpu"\nduty_cycle = 0.005\nsizes_bytes = [4096, 65536]\n')
    config = load_config(path)
    assert (config.probes_enabled, config.probe_backend, config.probe_duty_cycle) == (True, "cpu", 0.005)
    assert config.probe_sizes_bytes == (4096, 65536)
    assert load_config(path, {"probes": "off"}).probes_enabled is False
    flagged = load_config(None, {"probes": "cuda"})
    assert flagged.probes_enabled and flagged.probe_backend == "cuda"


def test_example_config_is_valid():
    from conftest import REPO

    config = load_config(REPO / "systemd" / "topoagent.toml")
    assert config.listen.port == DEFAULT_PORT
    assert config.state_dir == "/var/lib/topoagent"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--listen", "nowhere"], "--listen: expected HOST:PORT"),
        (["--config", "/no/such.toml"], "cannot read config /no/such.toml"),
        (["--token-file", "/no/such/token"], "cannot read token file"),
        (["--root", "/no/such/root"], "no such file or directory"),
        (["--state-dir", "/proc/nope"], "cannot start: /proc/nope: No such file or directory"),
        (["--state-dir", "{tmp}/file"], "cannot start: {tmp}/file: "),
        (["--listen", "192.0.2.7:9"], "cannot start: listen 192.0.2.7:9: "),  # TEST-NET: not this host's
    ],
)
def test_serve_refuses_bad_setup_with_one_line_exit_2(tmp_path, args, message):
    (tmp_path / "file").write_text("not a directory")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    message = message.replace("{tmp}", str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-P", "-m", "topoagent", "serve", "--state-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0", "--root", str(DGX_A100), *args],
        capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("topoagent serve: ") and message in last
    assert "Traceback" not in result.stderr


def test_short_token_is_refused(tmp_path):
    token = tmp_path / "token"
    token.write_text("short\n")
    result = subprocess.run(
        [sys.executable, "-P", "-m", "topoagent", "serve", "--token-file", str(token), "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 2
    assert "at least 16 characters" in result.stderr


def test_example_config_documents_every_key():
    """systemd/topoagent.toml claims to document every key: each one the parser accepts
    appears there, set or commented out, under its section."""
    import re
    import tomllib

    from conftest import REPO

    from topoagent.config import SCHEMA

    text = REPO / "systemd" / "topoagent.toml"
    uncommented = re.sub(r"^# ?(\w+ = )", r"\1", text.read_text(), flags=re.M)
    documented = tomllib.loads(uncommented)
    assert set(documented) == set(SCHEMA)
    for section, keys in SCHEMA.items():
        assert set(documented[section]) == set(keys), section
    # ... and the commented-out values are valid too.
    config_from_toml(uncommented)


def test_serve_takes_the_token_from_systemd_credentials(tmp_path):
    from service_helpers import start_agent

    creds = tmp_path / "creds"
    creds.mkdir()
    secret = "credential-token-0123456789"
    (creds / "token").write_text(secret + "\n")
    a = start_agent(tmp_path, token=False, env={"CREDENTIALS_DIRECTORY": str(creds)})
    try:
        body = {"gpus": 2, "reserve": {"owner": "j", "ttl_s": 60}}
        assert a.post("/place", body, token="wrong-token-wrong-token").status == 401
        assert a.post("/place", body, token=secret).status == 200
        assert f"token_file={creds / 'token'}" in a.log()
        assert "mutating_endpoints_off" not in a.log()
    finally:
        a.stop()
    # An explicit token_file wins over the credential.
    other = tmp_path / "other"
    other.mkdir()
    b = start_agent(other, env={"CREDENTIALS_DIRECTORY": str(creds)})
    try:
        assert b.post("/place", {"gpus": 1, "reserve": {"owner": "j", "ttl_s": 60}}, token=secret).status == 401
        assert b.post("/place", {"gpus": 1, "reserve": {"owner": "j", "ttl_s": 60}}, token=b.token).status == 200
    finally:
        b.stop()
