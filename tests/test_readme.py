"""The docs' promises that can drift from the code: the metric list, runnable examples,
figures written by bench/report.py.  The README links the pages under docs/."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO

from bench import report  # the checkout's root is on sys.path (conftest)

README = (REPO / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in sorted((REPO / "docs").glob("*.md"))}
EVERY_PAGE = {"README.md": README, **DOCS}


def exported_metric_names() -> set[str]:
    """Every family exporters/prometheus.py yields, as Prometheus exposes its name."""
    source = (REPO / "exporters" / "prometheus.py").read_text()
    families = re.findall(r'(Gauge|Counter|Info)MetricFamily\(\s*f"\{NS\}_([a-z_]+)"', source)
    assert len(families) == source.count("MetricFamily(")  # the pattern missed none
    suffix = {"Gauge": "", "Counter": "_total", "Info": "_info"}
    from topoagent.collectors.registry import FAMILIES  # the counter sources' own declarations

    return {name + suffix[kind] for kind, name in families} | {family.name for family in FAMILIES}


def test_the_telemetry_page_lists_exactly_the_exported_metrics():
    page = DOCS["telemetry.md"]
    paragraph = page[page.index("Metrics (all `topoagent_`):"):]
    paragraph = paragraph[: paragraph.index("\n\n")]
    listed = set(re.findall(r"`([a-z][a-z_]*)`", paragraph)) - {"topoagent_"}
    exported = exported_metric_names()
    assert listed - exported == set(), "docs/telemetry.md lists metrics the exporter does not have"
    assert exported - listed == set(), "docs/telemetry.md omits exported metrics"


@pytest.mark.parametrize("page", sorted(EVERY_PAGE))
def test_examples_create_the_directories_they_write_into(page: str):
    text = EVERY_PAGE[page]
    for match in re.finditer(r"^topoagent export \S+ -o (/\S+)$", text, re.M):
        directory = match.group(1).rsplit("/", 1)[0]
        before = text[: match.start()].rstrip().splitlines()[-1]
        assert before == f"mkdir -p {directory}", (page, match.group(0))


def test_the_readme_links_every_page_of_the_docs():
    linked = set(re.findall(r"\]\(docs/([a-z-]+\.md)(?:#[^)]*)?\)", README))
    assert linked == set(DOCS)


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # a '#' in a code block is no heading
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", text, re.M)}


def test_links_between_pages_name_pages_and_headings_that_exist():
    for page, text in EVERY_PAGE.items():
        for target, anchor in re.findall(r"\]\((?:docs/)?([a-z-]+\.md)(?:#([^)]*))?\)", text):
            assert target in EVERY_PAGE, (page, target)
            assert not anchor or anchor in anchors(EVERY_PAGE[target]), (page, target, anchor)
        for anchor in re.findall(r"\]\(#([^)]*)\)", text):
            assert anchor in anchors(text), (page, anchor)


def test_the_cpu_probes_example_needs_no_root_and_its_own_port():
    line = next(line for line in DOCS["service.md"].splitlines() if "--probes cpu" in line and "serve --root" in line)
    assert "--state-dir .state-probes" in line
    port = re.search(r"--listen 127\.0\.0\.1:(\d+)", line)
    assert port and port.group(1) != "9477"


# --- figures written by bench/report.py, never typed ------------------------------------


def test_every_figures_block_has_a_generator_and_the_markers_balance():
    assert report.check_pages({path: path.read_text() for path in report.pages()}) == []
    names = {b.name for text in EVERY_PAGE.values() for b in report.blocks(text)}
    assert names == set(report.GENERATORS)  # every generator has its block, in some page
    assert {"discovery", "placement", "simulation", "service"} <= {b.name for b in report.blocks(DOCS["benchmarks.md"])}


def test_the_benchmarks_page_has_no_figure_outside_a_generated_block():
    page = DOCS["benchmarks.md"]
    lines = page.splitlines(keepends=True)
    for block in reversed(report.blocks(page)):  # drop what report.py writes
        del lines[block.start : block.end]
    typed = re.findall(r"\d[\d.,]*\s?(?:ms|µs|us|s|req/s|×|MiB|GiB|MB|GB/s|%)(?![\w/])", "".join(lines))
    assert typed == [], "figures typed by hand in docs/benchmarks.md"


OUTSIDE = "# Title\r\n\ntext with trailing spaces   \n<!-- figures:service -->\nold 1 ms\n<!-- /figures:service -->\nafter\n\tend"


def test_report_rewrites_only_the_block_and_keeps_the_rest_byte_for_byte():
    new = report.rewrite(OUTSIDE, "service", "| new | 2 ms |\n")
    head, tail = OUTSIDE.split("old 1 ms\n")
    assert new == head + "| new | 2 ms |\n" + tail
    assert report.rewrite(new, "service", "old 1 ms") == OUTSIDE  # and back


@pytest.mark.parametrize(("text", "says"), [
    ("<!-- figures:service -->\nx\n", "figures:service is never closed"),
    ("x\n<!-- /figures:service -->\n", "closes a block that was never opened"),
    ("<!-- figures:service -->\n<!-- /figures:placement -->\n", "closes figures:service"),
    ("<!-- figures:a -->\n<!-- figures:b -->\n", "opens inside figures:a"),
    ("see <!-- figures:service --> here\n", "must be a line of its own"),
    ("<!-- figures:service -->\n<!-- /figures:service -->\n<!-- figures:service -->\n<!-- /figures:service -->\n",
     "a second figures:service block"),
])
def test_report_refuses_unbalanced_markers_naming_the_line(text: str, says: str):
    with pytest.raises(report.MarkerError, match=re.escape(says)):
        report.rewrite(text, "service", "new\n")


def test_report_check_refuses_a_block_in_two_pages_naming_both(tmp_path):
    one, two = tmp_path / "one.md", tmp_path / "two.md"
    for page in (one, two):
        page.write_text("<!-- figures:service -->\n1 ms\n<!-- /figures:service -->\n")
    done = subprocess.run([sys.executable, str(REPO / "bench" / "report.py"), "--check", "--page", str(one), "--page", str(two)],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert f"{two}: figures:service is also in {one}" in done.stderr


def test_report_writes_each_block_into_the_page_that_holds_it(tmp_path, monkeypatch):
    one, two = tmp_path / "one.md", tmp_path / "two.md"
    one.write_text("a\n<!-- figures:service -->\nold\n<!-- /figures:service -->\nb\n")
    two.write_text("c\n<!-- figures:series -->\nold\n<!-- /figures:series -->\nd\n")
    monkeypatch.setattr(report, "generate", lambda name, quick, timeout_s: f"new {name}\n")
    assert report.main(["--only", "series", "--page", str(one), "--page", str(two)]) == 0
    assert one.read_text() == "a\n<!-- figures:service -->\nold\n<!-- /figures:service -->\nb\n"
    assert two.read_text() == "c\n<!-- figures:series -->\nnew series\n<!-- /figures:series -->\nd\n"


def test_report_check_names_an_unknown_block_and_changes_nothing(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("<!-- figures:nobody -->\n1 ms\n<!-- /figures:nobody -->\n")
    done = subprocess.run([sys.executable, str(REPO / "bench" / "report.py"), "--check", "--readme", str(readme)],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert "figures:nobody has no generator" in done.stderr
    assert readme.read_text() == "<!-- figures:nobody -->\n1 ms\n<!-- /figures:nobody -->\n"
