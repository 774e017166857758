"""The README's promises that can drift from the code: the metric list, runnable examples."""

from __future__ import annotations

import re

from conftest import REPO

README = (REPO / "README.md").read_text()


def exported_metric_names() -> set[str]:
    """Every family exporters/prometheus.py yields, as Prometheus exposes its name."""
    source = (REPO / "exporters" / "prometheus.py").read_text()
    families = re.findall(r'(Gauge|Counter|Info)MetricFamily\(\s*f"\{NS\}_([a-z_]+)"', source)
    assert len(families) == source.count("MetricFamily(")  # the pattern missed none
    suffix = {"Gauge": "", "Counter": "_total", "Info": "_info"}
    from topoagent.exporters.prometheus import TELEMETRY_METRICS  # families built from one table

    return {name + suffix[kind] for kind, name in families} | set(TELEMETRY_METRICS)


def test_readme_lists_exactly_the_exported_metrics():
    paragraph = README[README.index("Metrics (all `topoagent_`):"):]
    paragraph = paragraph[: paragraph.index("\n\n")]
    listed = set(re.findall(r"`([a-z][a-z_]*)`", paragraph)) - {"topoagent_"}
    exported = exported_metric_names()
    assert listed - exported == set(), "README lists metrics the exporter does not have"
    assert exported - listed == set(), "README omits exported metrics"


def test_examples_create_the_directories_they_write_into():
    for match in re.finditer(r"^topoagent export \S+ -o (/\S+)$", README, re.M):
        directory = match.group(1).rsplit("/", 1)[0]
        before = README[: match.start()].rstrip().splitlines()[-1]
        assert before == f"mkdir -p {directory}", match.group(0)


def test_the_cpu_probes_example_needs_no_root_and_its_own_port():
    line = next(line for line in README.splitlines() if "--probes cpu" in line and "serve --root" in line)
    assert "--state-dir .state-probes" in line
    port = re.search(r"--listen 127\.0\.0\.1:(\d+)", line)
    assert port and port.group(1) != "9477"
