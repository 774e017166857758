"""The node picture, loaded in real headless Chromium: one shape per GPU and NIC, a screenshot kept."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from browser import Browser, SharedBrowser
from conftest import FIXTURES, REPO

from topoagent.commands.discover import discover_root
from topoagent.exporters.svg import render_page, render_svg

SNAPSHOTS = FIXTURES / "snapshots"
ARTIFACTS = REPO / "test-artifacts"
ALL = sorted(p.name for p in SNAPSHOTS.iterdir())
SVG_NS = "{http://www.w3.org/2000/svg}"


def chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.fail("chromium not found: install the Debian package 'chromium' (scripts/test does)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-extensions", "--disable-dev-shm-usage", f"--user-data-dir={profile}"]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=90)


@pytest.mark.parametrize("name", ALL)
def test_svg_is_well_formed_with_one_shape_per_device(name):
    topology = discover_root(str(SNAPSHOTS / name))
    root = ET.fromstring(render_svg(topology))
    shapes = [e.get("data-device") for e in root.iter() if e.get("data-device")]
    assert sorted(shapes) == sorted([g.name for g in topology.gpus] + [n.name for n in topology.nics])
    assert not any(e.tag in (f"{SVG_NS}script", f"{SVG_NS}image") for e in root.iter())
    assert "href" not in render_svg(topology)  # nothing fetched from anywhere


def test_nvswitch_fabric_is_one_bus_not_n_squared_edges():
    root = ET.fromstring(render_svg(discover_root(str(SNAPSHOTS / "dgx2"))))
    assert len([e for e in root.iter() if e.get("class") == "nvswitch-fabric"]) == 1
    assert len([e for e in root.iter() if "fabric-link" in (e.get("class") or "")]) == 16
    assert not [e for e in root.iter() if "direct-link" in (e.get("class") or "")]


def test_direct_nvlinks_are_edges_weighted_by_link_count():
    root = ET.fromstring(render_svg(discover_root(str(SNAPSHOTS / "dgx1-v100"))))
    edges = {e.get("data-pair"): float(e.get("stroke-width")) for e in root.iter()
             if "direct-link" in (e.get("class") or "")}
    assert len(edges) == 16  # the hybrid cube mesh: each GPU links to 4 others
    assert edges["GPU0-GPU3"] > edges["GPU0-GPU1"]  # NV2 drawn wider than NV1


def test_findings_are_marked_on_their_devices():
    root = ET.fromstring(render_svg(discover_root(str(SNAPSHOTS / "degraded"))))
    marked = {e.get("data-finding-for") for e in root.iter() if e.get("data-finding-for")}
    assert {"GPU3", "GPU5", "NIC6"} <= marked
    assert len([e for e in root.iter() if e.get("class") == "finding"]) == 3  # one per fault


@pytest.fixture(scope="module")
def window(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedBrowser]:
    """One Chromium for the module's pages (a launch each, twice a page, cost 40 s a run)."""
    shared = SharedBrowser(tmp_path_factory.mktemp("chromium") / "profile")
    yield shared
    shared.close()


async def load_dom(browser: Browser, url: str) -> str:
    """The page's DOM once loaded, serialised as `chromium --dump-dom` prints it."""
    await browser.send("Emulation.setDeviceMetricsOverride", width=1366, height=900, deviceScaleFactor=1, mobile=False)
    await browser.goto(url)
    return await browser.eval("document.documentElement.outerHTML")


async def screenshot(browser: Browser, url: str, path: Path, width: int, height: int) -> bytes:
    """The page loaded afresh in a window of this size, as `chromium --screenshot` takes it."""
    await browser.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
    await browser.goto(url)
    return await browser.screenshot(path)


@pytest.mark.parametrize("name", ALL)
def test_page_loads_in_headless_chromium_and_is_kept_as_a_screenshot(name, tmp_path, window):
    topology = discover_root(str(SNAPSHOTS / name))
    page = tmp_path / f"{name}.html"
    page.write_text(render_page(topology))
    dom = window.run(load_dom(window.browser, page.as_uri()))
    found = re.findall(r'<rect class="device (gpu|nic)" data-device="([A-Z]+\d+)"', dom)
    assert sorted(d for _, d in found) == sorted([g.name for g in topology.gpus] + [n.name for n in topology.nics])
    width, height = map(int, re.search(r'<svg[^>]*width="(\d+)" height="(\d+)"', dom).groups())
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / f"{name}.png"
    shot.unlink(missing_ok=True)
    window.run(screenshot(window.browser, page.as_uri(), shot, width + 40, height + 90))
    assert shot.stat().st_size > 10_000
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_running_service_serves_the_picture_at_root(tmp_path):
    """`topoagent serve --root fixtures/snapshots/dgx-a100`, then `/` in real Chromium."""
    from service_helpers import start_agent

    topology = discover_root(str(SNAPSHOTS / "dgx-a100"))
    agent = start_agent(tmp_path)
    try:
        page = agent.get("/")
        assert page.status == 200 and page.headers["content-type"].startswith("text/html")
        dom = chromium(["--dump-dom", f"{agent.url}/"], tmp_path / "profile")
        assert dom.returncode == 0, dom.stderr[-2000:]
        found = re.findall(r'<rect class="device (gpu|nic)" data-device="([A-Z]+\d+)"', dom.stdout)
        assert sorted(d for _, d in found) == sorted([g.name for g in topology.gpus] + [n.name for n in topology.nics])
    finally:
        assert agent.stop() == 0


class Links(HTMLParser):
    """Every address a page points at (href, src, action), as a browser reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found += [value for name, value in attrs if name in ("href", "src", "action", "xlink:href") and value is not None]


def links_in(page: str) -> list[str]:
    parser = Links()
    parser.feed(page)
    return parser.found


def test_an_exported_page_points_nowhere_a_file_cannot_reach(tmp_path):
    """`topoagent export html -o node.html` opened from disk: `/topology` there would be the
    file system's root, so the page carries no link (and no script) at all."""
    out = tmp_path / "node.html"
    done = subprocess.run([sys.executable, "-P", "-m", "topoagent", "export", "html", "--root", str(SNAPSHOTS / "dgx-a100"), "-o", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert links_in(page) == [] and "<script" not in page
    assert 'class="device gpu"' in page  # still the whole picture


def test_the_served_page_links_the_agents_json_and_metrics_and_each_answers(tmp_path):
    from service_helpers import start_agent

    agent = start_agent(tmp_path)
    try:
        links = links_in(agent.get("/").body.decode())
        assert sorted(links) == ["/metrics", "/topology"]
        assert all(agent.get(link).status == 200 for link in links)
    finally:
        assert agent.stop() == 0
