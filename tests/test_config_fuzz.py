"""The TOML config under fuzzing: any document is a `Config` or one `ConfigError` line that
names the key (exit 2 from `topoagent serve`), never a traceback; good values still load."""

from __future__ import annotations

import datetime
import math
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from service_helpers import DGX_A100

from topoagent.config import SCHEMA, SECONDS_BOUNDS, THRESHOLD_PREFIX, Config, ConfigError, Listen, config_from_toml, parse_listen
from topoagent.service.telemetry import THRESHOLD_KEYS
from topoagent.vocabulary import MetricsDetail

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- a small TOML writer (tomllib only reads) ------------------------------------------------

def toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= ord(ch) < 0x7F:
            out.append(ch)
        else:
            out.append(f"\\U{ord(ch):08X}")
    return '"' + "".join(out) + '"'


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def toml_document(doc: dict) -> str:
    lines = []
    for section, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{toml_string(section)}]")
            lines += [f"{toml_string(key)} = {toml_value(value)}" for key, value in table.items()]
        else:
            lines.insert(0, f"{toml_string(section)} = {toml_value(table)}")
    return "\n".join(lines) + "\n"


# -- strategies -------------------------------------------------------------------------------

TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=30)
SCALARS = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([0, 1, -1, 7, 255, 256, 65535, 65536, 7 * 24 * 3600, 1 << 34, (1 << 34) + 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e300, 0.5, 1.0, 100.0, 100.5]),
    TEXT,
    st.sampled_from(["", "/", "a\x00b", "127.0.0.1:9477", "[::1]:0", "1.2.3.4:8_0", ":+80", "[1.2.3.4]:80", "[::1:80", "::1:80",
                     "localhost:99999", "0.0.0.0:0", "cuda", "cpu", "*", "node7.example.org", "x" * 5000]),
    st.datetimes(), st.dates(), st.times(),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.from_regex(r"[a-z_]{1,6}", fullmatch=True), inner, max_size=3), max_leaves=8)
KNOWN_KEYS = [(section, key) for section, keys in SCHEMA.items() for key in keys]
IDENT = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)


@st.composite
def documents(draw) -> dict:
    doc: dict = {}
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.integers(0, 9)) < 8:
            section, key = draw(st.sampled_from(KNOWN_KEYS))
        else:
            section = draw(st.sampled_from([*SCHEMA, "cache"]) | IDENT)
            key = draw(IDENT)
        doc.setdefault(section, {})[key] = draw(VALUES)
    return doc


def assert_names_the_key(message: str, doc: dict) -> None:
    assert "\n" not in message and len(message) < 600, message
    names = [f"{section}.{key}:" for section, table in doc.items() if isinstance(table, dict) for key in table]
    names += [f"{section}:" for section in doc]
    names += ["probes.min_interval_s:", "config: not valid TOML"]
    assert any(message.startswith(name) for name in names), (message, doc)


@FUZZ
@given(documents())
def test_any_document_loads_or_is_one_line_naming_the_key(doc):
    text = toml_document(doc)
    try:
        config_from_toml(text)
    except ConfigError as exc:
        assert_names_the_key(str(exc), doc)


@FUZZ
@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_any_text_loads_or_is_one_config_error(text):
    try:
        config_from_toml(text)
    except ConfigError as exc:
        assert "\n" not in str(exc)


@pytest.mark.parametrize(
    "text, named",
    [
        ("[http]\nmax_body_bytes = " + "9" * 5000 + "\n", "config: not valid TOML"),  # past int()'s 4300 digits
        ("a = " + "[" * 5000 + "]" * 5000 + "\n", "config: not valid TOML"),  # nested past the recursion limit
        ('[leases]\nstate_dir = "a\\u0000b"\n', "leases.state_dir: a path cannot contain a NUL"),
        ('[http]\ntoken_file = "a\\u0000b"\n', "http.token_file: a path cannot contain a NUL"),
        ('[discovery]\nroot = "a\\u0000b"\n', "discovery.root: a path cannot contain a NUL"),
        ('[http]\nlisten = "1.2.3.4:8_0"\n', "http.listen: port '8_0' is not a number"),
        ('[http]\nlisten = ":+80"\n', "http.listen: port '+80' is not a number"),
        ('[http]\nlisten = "[::1:80"\n', "http.listen: brackets hold an IPv6 address"),
        ('[http]\nlisten = "[1.2.3.4]:80"\n', "http.listen: brackets hold an IPv6 address"),
        ('[http]\nlisten = "::1:80"\n', "http.listen: write an IPv6 address in brackets"),
        ("[http]\nmax_connections = 4\n", "http.max_connections"),
        ("[http]\nheader_timeout_s = 0\n", "http.header_timeout_s"),
        ("[http]\nheader_timeout_s = 0.000001\n", "http.header_timeout_s: expected a number of seconds from 0.5 to 600"),
        ('[http]\nallowed_hosts = ["evil example"]\n', "http.allowed_hosts"),
        ('[http]\nallowed_hosts = "node7"\n', "http.allowed_hosts"),
        ("[http]\nrate_limit_per_s = nan\n", "http.rate_limit_per_s"),
        ("[http]\nrate_limit_burst = 0\n", "http.rate_limit_burst"),
        ('["a\\nb"]\nc = 1\n', "'a\\nb': unknown section"),
        ('[metrics]\ndetail = ["xids"]\n', "metrics.detail: expected a list of xid, throttle, errors, packets, pcie_link, settings, video, capacity, got ['xids']"),
        ('[metrics]\ndetail = "xid"\n', "metrics.detail: expected a list of"),
    ],
)
def test_values_that_gave_tracebacks_or_passed_are_refused(text, named):
    with pytest.raises(ConfigError) as caught:
        config_from_toml(text)
    assert str(caught.value).startswith(named) or named in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value)


# -- good values still load ------------------------------------------------------------------

def seconds(key: str) -> st.SearchStrategy:
    """Any duration within the key's bounds (topoagent.config.SECONDS_BOUNDS)."""
    floor, ceiling = SECONDS_BOUNDS[key]
    return st.floats(min_value=floor, max_value=ceiling) | st.integers(math.ceil(floor), int(ceiling))


HOSTNAME = st.from_regex(r"[a-z][a-z0-9-]{0,10}[a-z0-9](\.[a-z][a-z0-9]{0,8}){0,3}", fullmatch=True)
GOOD: dict[tuple[str, str], st.SearchStrategy] = {
    ("http", "listen"): st.builds(lambda ip, port: f"{ip}:{port}", st.ip_addresses(v=4).map(str), st.integers(0, 65535))
    | st.builds(lambda ip, port: f"[{ip}]:{port}", st.ip_addresses(v=6).map(str), st.integers(0, 65535))
    | st.integers(0, 65535).map(lambda port: f"localhost:{port}"),
    ("http", "token_file"): st.from_regex(r"/[a-z0-9_./-]{1,40}", fullmatch=True),
    ("http", "require_token_for_reads"): st.booleans(),
    ("http", "max_body_bytes"): st.integers(256, 16 * 1024 * 1024),
    ("http", "drain_timeout_s"): seconds("http.drain_timeout_s"),
    ("http", "max_connections"): st.integers(8, 65536),
    ("http", "header_timeout_s"): seconds("http.header_timeout_s"),
    ("http", "keepalive_timeout_s"): seconds("http.keepalive_timeout_s"),
    ("http", "allowed_hosts"): st.lists(HOSTNAME, max_size=5),
    ("http", "rate_limit_per_s"): st.floats(min_value=0.001, max_value=10000) | st.integers(1, 10000),
    ("http", "rate_limit_burst"): st.integers(1, 100000),
    ("discovery", "root"): st.from_regex(r"/[a-z0-9_./-]{0,40}", fullmatch=True),
    ("discovery", "interval_s"): seconds("discovery.interval_s"),
    ("discovery", "timeout_s"): seconds("discovery.timeout_s"),
    ("discovery", "udev"): st.booleans(),
    ("discovery", "udev_debounce_s"): seconds("discovery.udev_debounce_s"),
    ("discovery", "activity_interval_s"): seconds("discovery.activity_interval_s"),
    ("leases", "state_dir"): st.from_regex(r"/[a-z0-9_./-]{1,40}", fullmatch=True),
    ("leases", "sweep_s"): seconds("leases.sweep_s"),
    ("probes", "enabled"): st.booleans(),
    ("probes", "backend"): st.sampled_from(["cuda", "cpu"]),
    ("probes", "duty_cycle"): st.floats(min_value=1e-6, max_value=1.0),
    ("probes", "timeout_s"): seconds("probes.timeout_s"),
    ("probes", "startup_delay_s"): seconds("probes.startup_delay_s"),
    ("probes", "min_interval_s"): st.floats(min_value=1, max_value=900),
    ("probes", "max_interval_s"): st.floats(min_value=900, max_value=7 * 24 * 3600),
    ("probes", "busy_utilization_percent"): st.floats(min_value=0, max_value=100),
    ("probes", "sizes_bytes"): st.lists(st.integers(1, 1 << 34), min_size=1, max_size=5),
    ("probes", "repetitions"): st.integers(1, 1000),
    ("exports", "nfd_path"): st.from_regex(r"/[a-z0-9_./-]{1,40}", fullmatch=True),
    ("exports", "nfd_prefix"): st.sampled_from(["topoagent.io", "topoagent.feature.node.kubernetes.io", "example.org"]),
    ("exports", "nfd_expiry_s"): seconds("exports.nfd_expiry_s"),
    ("exports", "nfd_topograph_labels"): st.booleans(),
    ("exports", "gres_path"): st.from_regex(r"/[a-z0-9_./-]{1,40}", fullmatch=True),
    ("exports", "gres_node_name"): st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True),
    ("exports", "nccl_path"): st.from_regex(r"/[a-z0-9_./-]{1,40}", fullmatch=True),
    ("placement", "deadline_ms"): st.integers(1, 60000),
    ("placement", "capacity_budget_ms"): st.integers(1, 60000),
    ("metrics", "pairwise"): st.booleans(),
    ("metrics", "per_link"): st.booleans(),
    ("metrics", "dcgm_labels"): st.booleans(),
    ("metrics", "detail"): st.lists(st.sampled_from([d.value for d in MetricsDetail]), max_size=5),
    ("telemetry", "enabled"): st.booleans(),
    ("telemetry", "interval_s"): seconds("telemetry.interval_s"),
    ("telemetry", "timeout_s"): seconds("telemetry.timeout_s"),
    **{("telemetry", key): st.floats(min_value=0, max_value=1e6) | st.integers(0, 10**6) for key in THRESHOLD_KEYS},
}


def test_every_key_has_a_good_value_strategy():
    assert set(GOOD) == set(KNOWN_KEYS)


def expected(section: str, key: str, value):
    if (section, key) == ("http", "listen"):
        return parse_listen("http.listen", value)
    if (section, key) == ("metrics", "detail"):
        return frozenset(value)
    if (section, key) == ("http", "allowed_hosts"):
        return tuple(v.lower() for v in value)
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, float) or key.endswith("_s") or key in ("duty_cycle", "busy_utilization_percent", "rate_limit_per_s"):
        return float(value)
    return value


@FUZZ
@given(st.lists(st.sampled_from(KNOWN_KEYS), min_size=1, max_size=8, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({k: GOOD[k] for k in keys})))
def test_good_values_load_as_given(values):
    doc: dict = {}
    for (section, key), value in values.items():
        doc.setdefault(section, {})[key] = value
    config = config_from_toml(toml_document(doc))
    thresholds = dict(config.telemetry_thresholds)
    for (section, key), value in values.items():
        field = SCHEMA[section][key][0]
        if field.startswith(THRESHOLD_PREFIX):  # gathered into one table
            assert thresholds[key] == float(value), (section, key)
            continue
        assert getattr(config, field) == expected(section, key, value), (section, key)
    assert isinstance(config.listen, Listen)


def test_the_defaults_are_good_values():
    config = config_from_toml("")
    assert config == Config()


# -- the same through `topoagent serve`: exit 2, one line, no traceback ----------------------

def serve_with(tmp_path, text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "t.toml"
    path.write_text(text)
    return subprocess.run(
        [sys.executable, "-P", "-m", "topoagent", "serve", "--config", str(path), "--root", str(DGX_A100), "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=30,
    )


@pytest.mark.parametrize(
    "text, named",
    [
        ('[leases]\nstate_dir = "a\\u0000b"\n', "leases.state_dir"),
        ('[http]\ntoken_file = "a\\u0000b"\n', "http.token_file"),
        ("[http]\nmax_body_bytes = " + "9" * 5000 + "\n", "not valid TOML"),
        ("a = " + "[" * 5000 + "]" * 5000 + "\n", "not valid TOML"),
        ('[http]\nlisten = "1.2.3.4:8_0"\n', "http.listen"),
        ("[http]\nrequire_token_for_reads = true\n", "http.require_token_for_reads"),
    ],
)
def test_serve_refuses_each_with_one_line_exit_2(tmp_path, text, named):
    result = serve_with(tmp_path, text)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("topoagent serve: ") and named in lines[0], result.stderr[-2000:]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.sampled_from(KNOWN_KEYS), VALUES)
def test_serve_fuzzed_bad_values_exit_2_with_one_line(tmp_path, key, value):
    section, name = key
    text = f"[{section}]\n{name} = {toml_value(value)}\n"
    try:
        config_from_toml(text)
    except ConfigError:
        pass
    else:
        assume(False)  # a good value: serve would start and run
    result = serve_with(tmp_path, text)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines[0].startswith(f"topoagent serve: {section}.{name}:") or "not valid TOML" in lines[0], lines[0]
