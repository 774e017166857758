"""`topoagent install-files DIR`: write the deployment files the wheel carries.

The systemd unit, the example config, the Grafana dashboard and its alert rules travel inside the package
(topoagent/data, the repository's systemd/ folder), so installing the wheel (README, "Install") is all a
node needs; this writes them out where the operator wants them.  The alert rules name the
agent's scrape targets by the operator's selector (--alert-selector).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from topoagent.errors import UsageError

RULES = "topoagent-alerts.yml"
# The agent's scrape targets as the shipped rules name them: a static or file scrape job named
# topoagent (docs/telemetry.md), and the DaemonSet's pods (deploy/kubernetes/node.yaml, label
# app.kubernetes.io/name) as the usual kubernetes-pods job labels them from their
# prometheus.io/* annotations (it copies pod labels, sanitised to app_kubernetes_io_name).
DEFAULT_ALERT_SELECTORS = ('job="topoagent"', 'app_kubernetes_io_name="topoagent"')
_MATCHER = r'\s*[A-Za-z_][A-Za-z0-9_]*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\\n]|\\.)*"\s*'
MATCHERS = re.compile(rf"{_MATCHER}(?:,{_MATCHER})*")


def agent_targets(selectors: Sequence[str]) -> str:
    """The PromQL the rules read the agent's `up` series by: one selector each, ORed."""
    return " or ".join(f"up{{{s.strip()}}}" for s in selectors)


def render_rules(text: str, selectors: Sequence[str]) -> str:
    """The shipped rules with ``selectors`` (PromQL label matchers, ``job="x", env="y"``) in
    place of the default ones."""
    for selector in selectors:
        if not MATCHERS.fullmatch(selector):
            raise UsageError(f"--alert-selector {selector!r}: expected PromQL label matchers, such as "
                             "'job=\"topoagent\"' or 'job=~\"topoagent|gpu-nodes\", env=\"prod\"'")
    default = agent_targets(DEFAULT_ALERT_SELECTORS)
    if text.count(default) != 2:  # TopoagentDown and TopoagentAbsent: the shipped file and this code disagree
        raise RuntimeError(f"{RULES}: expected {default!r} twice (the shipped rules changed; topoagent's bug)")
    said = " ".join(f"--alert-selector '{s}'" for s in selectors)
    return f"# Written by topoagent install-files {said}\n" + text.replace(default, agent_targets(selectors))


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "install-files",
        help="write the systemd unit, config, Grafana dashboard and alert rules into a directory",
        description="Write the deployment files shipped with topoagent (systemd unit, example "
                    "config, Grafana dashboard, Prometheus alert rules) into DIR and name each one written. Existing files "
                    "are left alone unless --force.",
    )
    parser.add_argument("directory", metavar="DIR", help="where to write them (created if missing)")
    parser.add_argument("--force", action="store_true", help="overwrite files that already exist")
    parser.add_argument("--alert-selector", action="append", metavar="MATCHERS",
                        help="PromQL label matchers of the agent's scrape targets, which the agent-down alert rules read "
                             "`up` by (repeat it: each is ORed); default: "
                             + " and ".join(f"'{s}'" for s in DEFAULT_ALERT_SELECTORS)
                             + " (a scrape job named topoagent, and the shipped DaemonSet's pods under kubernetes-pods)")
    parser.set_defaults(run=run)


def shipped_files() -> list[Traversable]:
    data = files("topoagent") / "data"
    return sorted((f for f in data.iterdir() if f.is_file() and not f.name.startswith(".")), key=lambda f: f.name)


def run(args: argparse.Namespace) -> int:
    target = Path(args.directory)
    shipped = shipped_files()
    if not shipped:
        raise UsageError("this installation carries no deployment files (topoagent/data is empty)")
    contents = {f.name: f.read_bytes() for f in shipped}
    if args.alert_selector and RULES in contents:
        contents[RULES] = render_rules(contents[RULES].decode(), args.alert_selector).encode()
    existing = [target / name for name in contents if (target / name).exists()]
    if existing and not args.force:
        # Nothing written: half a set of files is worse than none.
        raise UsageError(f"{', '.join(map(str, existing))}: already there; --force overwrites")
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name, content in contents.items():
            (target / name).write_bytes(content)
            print(target / name)
    except OSError as exc:
        raise UsageError(f"{exc.filename or target}: {exc.strerror}") from None
    return 0
