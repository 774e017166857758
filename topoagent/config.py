"""The agent's configuration: a TOML file, then command-line flags on top.

Every key is checked once here, so the runtime can trust a `Config`; a bad file or flag
raises `ConfigError` whose message names the key (`http.listen`, `discovery.interval_s`).
"""

from __future__ import annotations

import ipaddress
import math
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from topoagent.errors import TopoagentError
from topoagent.placement.request import SERVICE_DEADLINE_MS
from topoagent.service.telemetry import THRESHOLD_KEYS
from topoagent.vocabulary import MetricsDetail

THRESHOLD_PREFIX = "threshold:"

# GET /capacity's searches share this much wall time: with the wait for one computation
# already under way (twice this plus a quarter second) it stays under the extender's
# default --agent-timeout of 2 s.
CAPACITY_BUDGET_MS = 500

# Loopback only by default: reads are open there.  9477 is this agent's fixed port so
# Prometheus' `instance` label stays stable across restarts (see docs/service.md, "Port").
DEFAULT_PORT = 9477
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"


class ConfigError(TopoagentError):
    """A configuration value is wrong; the message names the key."""


@dataclass(frozen=True, slots=True)
class Listen:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Config:
    listen: Listen = Listen("127.0.0.1", DEFAULT_PORT)
    root: str = "/"  # "/" is the live node; a directory or tarball replays a recorded one
    state_dir: str = "/var/lib/topoagent"
    token_file: str | None = None
    require_token_for_reads: bool = False
    max_body_bytes: int = 16 * 1024
    # Slow or idle clients: what they may hold, and for how long (see serve's listener).
    max_connections: int = 512  # beyond it the longest-idle connection is closed, else the new one
    header_timeout_s: float = 10.0  # from connecting to a whole request head; again for a body
    keepalive_timeout_s: float = 30.0  # an idle kept-alive connection is closed after this
    # Host names this agent answers to besides localhost, this machine's name and any IP
    # literal (a DNS-rebinding page names its own host); "*" turns the check off.
    allowed_hosts: tuple[str, ...] = ()
    # POST /place with reserve, DELETE /leases, POST /refresh, POST /probe: per client IP.
    rate_limit_per_s: float = 2.0
    rate_limit_burst: int = 60
    interval_s: float = 300.0  # re-discover this often even without udev events
    timeout_s: float = 60.0  # a discovery run longer than this is cut off
    udev: bool = True  # re-discover on PCI / InfiniBand / net hotplug (live root only)
    udev_debounce_s: float = 2.0
    lease_sweep_s: float = 5.0
    drain_timeout_s: float = 10.0
    activity_interval_s: float = 10.0  # re-read GPU utilization/processes (busy GPUs)
    # [probes]: link measurements in a child process (off unless asked for)
    probes_enabled: bool = False
    probe_backend: str = "cuda"  # "cpu" copies host memory instead (testing without a GPU)
    probe_duty_cycle: float = 0.01  # at most this share of each GPU's wall time
    probe_timeout_s: float = 600.0  # a worker running longer is killed
    probe_startup_delay_s: float = 30.0  # first probes this long after start-up
    probe_min_interval_s: float = 900.0
    probe_max_interval_s: float = 24 * 3600.0
    probe_busy_utilization_percent: float = 5.0
    probe_sizes_bytes: tuple[int, ...] | None = None  # None: the backend's defaults
    probe_repetitions: int | None = None
    # [telemetry]: link and GPU counters read on their own interval (topoagent/service/telemetry.py)
    telemetry_enabled: bool = True
    telemetry_interval_s: float = 10.0
    telemetry_timeout_s: float = 5.0  # one source's read longer than this fails alone
    telemetry_thresholds: tuple[tuple[str, float], ...] = ()  # THRESHOLDS overridden by key
    # [exports]: files the running agent keeps current (topoagent/service/exports.py); None = not written
    export_nfd_path: str | None = None
    export_nfd_prefix: str = "topoagent.io"
    export_nfd_expiry_s: float = 3600.0  # NFD drops the labels this long after a write
    export_nfd_topograph_labels: bool = False  # also write topograph's leaf/accelerator labels
    export_gres_path: str | None = None
    export_gres_node_name: str | None = None
    export_nccl_path: str | None = None
    # [metrics]: what /metrics serves beyond its default series budget (exporters/prometheus.py)
    metrics_pairwise: bool = False  # GPU-GPU and GPU-NIC link levels, expected bandwidth (n^2 series)
    metrics_per_link: bool = False  # one series per NVLink, not per GPU
    metrics_detail: frozenset[MetricsDetail] = frozenset()  # the series served beside the default page (MetricsDetail)
    metrics_dcgm_labels: bool = False  # dcgm-exporter's identity labels (UUID, modelName, Hostname...) on every GPU series
    # [placement]: a request without deadline_ms gets this one (ms)
    placement_deadline_ms: int = SERVICE_DEADLINE_MS
    # [placement]: the wall time GET /capacity's searches (every k) share (topoagent/service/capacity.py)
    placement_capacity_budget_ms: int = CAPACITY_BUDGET_MS
    # The fields the config file or a flag set; the others are the defaults above.  Not part
    # of the value (==): what a setting is, not who chose it.
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @property
    def live(self) -> bool:
        return self.root == "/"


# TOML layout: section -> {key: (Config field, checker)}.
def _shown(value: Any, limit: int = 80) -> str:
    """A value quoted in an error message: repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a non-empty string, got {_shown(value)}")
    return value


def _path(key: str, value: Any) -> str:
    """A file or directory name: a NUL would make every system call on it fail."""
    text = _str(key, value)
    if "\x00" in text:
        raise ConfigError(f"{key}: a path cannot contain a NUL character, got {_shown(text)}")
    if len(text) > 4095:
        raise ConfigError(f"{key}: a path of {len(text)} characters is longer than the system allows (4095)")
    return text


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {_shown(value)}")
    return value


# Every duration's floor and ceiling, in seconds, by its TOML key: a value outside them is
# refused at start-up and by a reload (which keeps the running config), as max_connections
# is.  A floor is the least that still works (a microsecond header timeout answered every
# request with an empty reply); a ceiling, the most that is not a typo.
WEEK_S = 7 * 24 * 3600.0
SECONDS_BOUNDS: dict[str, tuple[float, float]] = {
    "http.drain_timeout_s": (0.1, 600.0),
    "http.header_timeout_s": (0.5, 600.0),  # a slow client's head on a loaded node still arrives
    "http.keepalive_timeout_s": (0.5, 3600.0),
    "discovery.interval_s": (1.0, WEEK_S),
    "discovery.timeout_s": (0.1, 3600.0),
    "discovery.udev_debounce_s": (0.01, 600.0),
    "discovery.activity_interval_s": (0.1, 3600.0),
    "leases.sweep_s": (0.05, 3600.0),
    "probes.timeout_s": (0.01, 24 * 3600.0),
    "probes.startup_delay_s": (0.01, WEEK_S),
    "probes.min_interval_s": (1.0, WEEK_S),
    "probes.max_interval_s": (1.0, WEEK_S),
    "telemetry.interval_s": (0.1, 3600.0),
    "telemetry.timeout_s": (0.1, 600.0),
    "exports.nfd_expiry_s": (60.0, WEEK_S),  # NFD must not drop the labels between two writes
}


def _seconds(key: str, value: Any) -> float:
    floor, ceiling = SECONDS_BOUNDS[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not floor <= value <= ceiling:
        raise ConfigError(f"{key}: expected a number of seconds from {floor:g} to {ceiling:g}, got {_shown(value)}")
    return float(value)


def _backend(key: str, value: Any) -> str:
    if value not in ("cuda", "cpu"):
        raise ConfigError(f"{key}: expected \"cuda\" or \"cpu\", got {_shown(value)}")
    return value


def _fraction(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{key}: expected a fraction in (0, 1], got {_shown(value)}")
    return float(value)


def _percent(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
        raise ConfigError(f"{key}: expected a percentage from 0 to 100, got {_shown(value)}")
    return float(value)


def _sizes(key: str, value: Any) -> tuple[int, ...]:
    ok = isinstance(value, list) and value and all(
        isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1 << 34 for v in value
    )
    if not ok:
        raise ConfigError(f"{key}: expected a non-empty list of byte counts from 1 to 2^34, got {_shown(value)}")
    return tuple(value)


def _repetitions(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
        raise ConfigError(f"{key}: expected an integer from 1 to 1000, got {_shown(value)}")
    return value


def _deadline_ms(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 60_000:
        raise ConfigError(f"{key}: expected milliseconds from 1 to 60000, got {value!r}")
    return value


def _rate(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value >= 0:
        raise ConfigError(f"{key}: expected a number >= 0, got {_shown(value)}")
    return float(value)


def _connections(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 8 <= value <= 65536:
        raise ConfigError(f"{key}: expected a number of connections from 8 to 65536, got {_shown(value)}")
    return value


def _request_rate(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= 10000:
        raise ConfigError(f"{key}: expected requests per second, > 0 and at most 10000, got {_shown(value)}")
    return float(value)


def _burst(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100000:
        raise ConfigError(f"{key}: expected a number of requests from 1 to 100000, got {_shown(value)}")
    return value


# A DNS name as a Host header carries it (RFC 1123 labels), or "*" for any.
_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


def _hosts(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > 256:
        raise ConfigError(f"{key}: expected a list of up to 256 host names, got {_shown(value)}")
    names = []
    for item in value:
        if not isinstance(item, str) or not (item == "*" or _HOST_NAME.fullmatch(item)):
            raise ConfigError(f"{key}: expected host names such as \"node7.example.org\" (or \"*\" for any), got {_shown(item)}")
        names.append(item.lower().rstrip("."))
    return tuple(names)


def _details(key: str, value: Any) -> frozenset[MetricsDetail]:
    known = [d.value for d in MetricsDetail]
    if not isinstance(value, list) or not all(isinstance(v, str) and v in known for v in value):
        raise ConfigError(f"{key}: expected a list of {', '.join(known)}, got {_shown(value)}")
    return frozenset(MetricsDetail(v) for v in value)


def _body_limit(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 256 <= value <= 16 * 1024 * 1024:
        raise ConfigError(f"{key}: expected a byte count from 256 to 16777216, got {_shown(value)}")
    return value


def _absolute_path(key: str, value: Any) -> str:
    text = _str(key, value)
    if not Path(text).is_absolute():
        raise ConfigError(f"{key}: expected an absolute path, got {_shown(text)}")
    return text


def _label_prefix(key: str, value: Any) -> str:
    from topoagent.exporters.nfd import LabelError, check_label

    text = _str(key, value)
    try:
        check_label(f"{text}/gpu.count", "0")
    except LabelError:
        raise ConfigError(f"{key}: {_shown(text)} is not a valid label namespace (a DNS subdomain)") from None
    return text


def _node_name(key: str, value: Any) -> str:
    from topoagent.exporters.gres import GresError, check_node_name

    try:
        return check_node_name(_str(key, value))
    except GresError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def parse_listen(key: str, value: Any) -> Listen:
    """`HOST:PORT`, `[V6]:PORT` or `:PORT` (loopback)."""
    text = _str(key, value)
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ConfigError(f"{key}: expected HOST:PORT, got {_shown(text)}")
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]") and ":" in host):
            raise ConfigError(f"{key}: brackets hold an IPv6 address, as in [::1]:9477; got {_shown(text)}")
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"{key}: write an IPv6 address in brackets, as in [::1]:9477; got {_shown(text)}")
    host = host or "127.0.0.1"
    if not re.fullmatch(r"[0-9]{1,5}", port_text):  # int() would take "+80", " 80", "8_0"
        raise ConfigError(f"{key}: port {_shown(port_text)} is not a number")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ConfigError(f"{key}: port {port} is outside 0-65535")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(f"{key}: {_shown(host)} is not an IP address (or localhost)") from None
    return Listen(host, port)


SCHEMA: dict[str, dict[str, tuple[str, Any]]] = {
    "http": {
        "listen": ("listen", parse_listen),
        "token_file": ("token_file", _path),
        "require_token_for_reads": ("require_token_for_reads", _bool),
        "max_body_bytes": ("max_body_bytes", _body_limit),
        "drain_timeout_s": ("drain_timeout_s", _seconds),
        "max_connections": ("max_connections", _connections),
        "header_timeout_s": ("header_timeout_s", _seconds),
        "keepalive_timeout_s": ("keepalive_timeout_s", _seconds),
        "allowed_hosts": ("allowed_hosts", _hosts),
        "rate_limit_per_s": ("rate_limit_per_s", _request_rate),
        "rate_limit_burst": ("rate_limit_burst", _burst),
    },
    "discovery": {
        "root": ("root", _path),
        "interval_s": ("interval_s", _seconds),
        "timeout_s": ("timeout_s", _seconds),
        "udev": ("udev", _bool),
        "udev_debounce_s": ("udev_debounce_s", _seconds),
        "activity_interval_s": ("activity_interval_s", _seconds),
    },
    "leases": {
        "state_dir": ("state_dir", _path),
        "sweep_s": ("lease_sweep_s", _seconds),
    },
    "probes": {
        "enabled": ("probes_enabled", _bool),
        "backend": ("probe_backend", _backend),
        "duty_cycle": ("probe_duty_cycle", _fraction),
        "timeout_s": ("probe_timeout_s", _seconds),
        "startup_delay_s": ("probe_startup_delay_s", _seconds),
        "min_interval_s": ("probe_min_interval_s", _seconds),
        "max_interval_s": ("probe_max_interval_s", _seconds),
        "busy_utilization_percent": ("probe_busy_utilization_percent", _percent),
        "sizes_bytes": ("probe_sizes_bytes", _sizes),
        "repetitions": ("probe_repetitions", _repetitions),
    },
    "telemetry": {
        "enabled": ("telemetry_enabled", _bool),
        "interval_s": ("telemetry_interval_s", _seconds),
        "timeout_s": ("telemetry_timeout_s", _seconds),
        # One key per row of topoagent.service.telemetry.THRESHOLDS, gathered into telemetry_thresholds.
        **{key: (f"{THRESHOLD_PREFIX}{key}", _rate) for key in THRESHOLD_KEYS},
    },
    "exports": {
        "nfd_path": ("export_nfd_path", _absolute_path),
        "nfd_prefix": ("export_nfd_prefix", _label_prefix),
        "nfd_expiry_s": ("export_nfd_expiry_s", _seconds),
        "nfd_topograph_labels": ("export_nfd_topograph_labels", _bool),
        "gres_path": ("export_gres_path", _absolute_path),
        "gres_node_name": ("export_gres_node_name", _node_name),
        "nccl_path": ("export_nccl_path", _absolute_path),
    },
    "metrics": {
        "pairwise": ("metrics_pairwise", _bool),
        "per_link": ("metrics_per_link", _bool),
        "detail": ("metrics_detail", _details),
        "dcgm_labels": ("metrics_dcgm_labels", _bool),
    },
    "placement": {
        "deadline_ms": ("placement_deadline_ms", _deadline_ms),
        "capacity_budget_ms": ("placement_capacity_budget_ms", _deadline_ms),
    },
}


def config_from_toml(text: str, source: str = "config") -> Config:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise ConfigError(f"{source}: not valid TOML: {' '.join(str(exc).split())[:200]}") from None
    except RecursionError:  # arrays or inline tables nested thousands deep
        raise ConfigError(f"{source}: not valid TOML: nested too deeply") from None
    values: dict[str, Any] = {}
    for section, table in doc.items():
        if section not in SCHEMA:
            raise ConfigError(f"{section if section.isidentifier() else _shown(section, 60)}: unknown section (known: {', '.join(SCHEMA)})")
        if not isinstance(table, dict):
            raise ConfigError(f"{section}: expected a [{section}] table")
        for key, value in table.items():
            if key not in SCHEMA[section]:
                known = ", ".join(SCHEMA[section])
                raise ConfigError(f"{section}.{_shown(key, 60) if not key.isidentifier() else key}: unknown key (known: {known})")
            field_name, check = SCHEMA[section][key]
            values[field_name] = check(f"{section}.{key}", value)
    thresholds = {k.removeprefix(THRESHOLD_PREFIX): values.pop(k) for k in list(values) if k.startswith(THRESHOLD_PREFIX)}
    if thresholds:
        values["telemetry_thresholds"] = tuple(sorted(thresholds.items()))
    if values.get("probe_min_interval_s", 900.0) > values.get("probe_max_interval_s", 24 * 3600.0):
        raise ConfigError("probes.min_interval_s: must not exceed probes.max_interval_s")
    return Config(**values, given=frozenset(values))


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """Read the TOML file (if any), then apply flag overrides (None = not given)."""
    config = Config()
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config {path} is not UTF-8 text") from None
        config = config_from_toml(text, str(path))
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    if "listen" in flags:
        flags["listen"] = parse_listen("--listen", flags["listen"])
    if "probes" in flags:  # --probes off|cpu|cuda
        choice = flags.pop("probes")
        if choice not in ("off", "cpu", "cuda"):
            raise ConfigError(f"--probes: expected off, cpu or cuda, got {_shown(choice)}")
        flags["probes_enabled"] = choice != "off"
        if choice != "off":
            flags["probe_backend"] = choice
    known = {f.name for f in fields(Config)} - {"given"}
    unknown = set(flags) - known
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    return replace(config, **flags, given=config.given | set(flags))
