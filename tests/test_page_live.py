"""The agent's `/` in real headless Chromium, driven over the DevTools protocol: legible at
1366 px on every fixture, live (a lease shows up without a reload), hover follows links.

"Screenshots compared in the suite": Pillow is not installed in the test environment, so
the screenshots (kept under test-artifacts/page-*.png for a person to look at) are not
compared pixel by pixel.  Each page is compared structurally instead, in the browser that
rendered it: every GPU and NIC name present and inside the 1366 px window at full size (no
shrinking), no two pieces of text overlapping, no finding badge over a name, and the text
the picture shows equal to a golden list committed beside the recording, in
fixtures/snapshots/<node>/expected/page-text.json (a changed label, a lost device or a stray
finding fails; font hinting across machines does not).
"""

from __future__ import annotations

import asyncio
import json
import os
import xml.etree.ElementTree as ET
from collections.abc import Iterator

import pytest
from browser import Browser, SharedBrowser
from conftest import FIXTURES, REPO
from service_helpers import start_agent, wait_counters_read

from topoagent.commands.discover import discover_root
from topoagent.exporters.svg import render_page, render_svg

SNAPSHOTS = FIXTURES / "snapshots"
ARTIFACTS = REPO / "test-artifacts"
ALL = sorted(p.name for p in SNAPSHOTS.iterdir())
SVG_NS = "{http://www.w3.org/2000/svg}"

# Every text box of the picture as laid out by Chromium, in CSS px of the window.
LAYOUT = """(() => {
  const svg = document.querySelector('svg.topoagent-topology');
  const shown = t => [...t.childNodes].filter(n => n.nodeType === 3).map(n => n.data).join('').trim();
  const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  return {
    scale: svg.getBoundingClientRect().width / svg.width.baseVal.value,
    texts: [...svg.querySelectorAll('text')].filter(t => shown(t))
             .map(t => ({text: shown(t), box: box(t),
                         name: t.getAttribute('data-name-of'), badge: !!t.closest('.finding-badge')})),
    badges: [...svg.querySelectorAll('.finding-badge')].map(g => ({of: g.dataset.findingFor,
                                                                  box: box(g.querySelector('circle'))})),
    devices: [...svg.querySelectorAll('[data-device]')].map(r => r.dataset.device),
  };
})()"""


def _overlap(a: list[float], b: list[float], slack: float = 0.5) -> bool:
    return a[0] < b[2] - slack and b[0] < a[2] - slack and a[1] < b[3] - slack and b[1] < a[3] - slack


def check_layout(layout: dict, devices: list[str], width: int = 1366) -> None:
    assert layout["scale"] > 0.99, f"the picture is shrunk to {layout['scale']:.2f} of its size"
    assert sorted(layout["devices"]) == sorted(devices)
    names = {t["name"]: t for t in layout["texts"] if t["name"]}
    assert sorted(names) == sorted(devices), "every GPU and NIC shows its name"
    for t in names.values():
        assert t["box"][0] >= 0 and t["box"][2] <= width, f"{t['text']} is outside the window: {t['box']}"
    for badge in layout["badges"]:
        assert not _overlap(badge["box"], names[badge["of"]]["box"], 0), f"the badge covers {badge['of']}'s name"
    texts = layout["texts"]
    clashes = [(a["text"], b["text"]) for i, a in enumerate(texts) for b in texts[i + 1:] if _overlap(a["box"], b["box"])]
    assert not clashes, f"text over text: {clashes[:5]}"


def golden_texts(name: str, texts: list[str]) -> None:
    path = SNAPSHOTS / name / "expected" / "page-text.json"
    if os.environ.get("TOPOAGENT_WRITE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(texts, indent=0, ensure_ascii=False) + "\n")
    assert texts == json.loads(path.read_text()), f"the picture's text differs from {path} (re-record with TOPOAGENT_WRITE_GOLDEN=1 if meant)"


@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedBrowser]:
    shared = SharedBrowser(tmp_path_factory.mktemp("chromium") / "profile")
    yield shared
    shared.close()


@pytest.mark.parametrize("name", ALL)
def test_served_page_is_legible_at_1366_px_on_every_fixture(name, tmp_path, chromium):
    """`topoagent serve --root <fixture>`, `/` in Chromium at 1366x900, screenshot kept."""
    topology = discover_root(str(SNAPSHOTS / name))
    devices = [g.name for g in topology.gpus] + [n.name for n in topology.nics]
    agent = start_agent(tmp_path, root=SNAPSHOTS / name)

    async def look() -> dict:
        browser = chromium.browser
        await browser.goto(f"{agent.url}/")
        ARTIFACTS.mkdir(exist_ok=True)
        await browser.screenshot(ARTIFACTS / f"page-{name}-1366.png")
        return await browser.eval(LAYOUT)

    try:
        wait_counters_read(agent)  # the recorded counters' findings are part of the picture
        layout = chromium.run(look())
    finally:
        assert agent.stop() == 0
    check_layout(layout, devices)
    golden_texts(name, [t["text"] for t in layout["texts"]])


def test_a_lease_shows_on_the_open_page_without_a_reload(tmp_path):
    """Reads need the token here; Chromium sends it on every request, as a proxy in front of
    the agent would (a browser has no way to add a bearer token on its own).  The page polls
    `/` with If-None-Match: 304 while nothing changes; a lease changes the ETag and the
    page swaps its picture, and drops the mark when the lease is released."""
    agent = start_agent(tmp_path, root=SNAPSHOTS / "dgx-a100", config="[http]\nrequire_token_for_reads = true\n")

    async def watch() -> None:
        async with Browser(tmp_path / "profile", 1366, 900) as browser:
            await browser.send("Network.enable")
            await browser.send("Network.setExtraHTTPHeaders", headers={"Authorization": f"Bearer {agent.token}"})
            await browser.goto(f"{agent.url}/")
            before = await browser.eval("document.body.dataset.etag")
            assert before == agent.get("/", token=agent.token).headers["etag"]
            assert agent.get("/", token=agent.token, headers={"If-None-Match": before}).status == 304
            assert await browser.eval("document.querySelectorAll('[data-state=leased]').length") == 0
            await browser.eval("window.notReloaded = true")
            granted = await asyncio.to_thread(
                agent.post, "/place", {"gpus": 2, "reserve": {"owner": "job-7", "ttl_s": 600}}, token=agent.token)
            assert granted.status == 200, granted.body
            lease = granted.json()["lease"]
            await browser.wait_for("document.querySelectorAll('[data-state=leased]').length === 2", timeout=20)
            leased = await browser.eval("[...document.querySelectorAll('[data-state=leased]')].map(e => e.dataset.device)")
            assert sorted(leased) == sorted(f"GPU{i}" for i in lease["gpus"])
            assert await browser.eval("window.notReloaded === true && document.body.dataset.etag") not in (before, False)
            assert "leased 2" in await browser.eval("document.querySelector('svg').textContent")
            await browser.screenshot(ARTIFACTS / "page-dgx-a100-leased.png")
            gone = await asyncio.to_thread(agent.request, "DELETE", f"/leases/{lease['id']}", token=agent.token)
            assert gone.status == 200
            await browser.wait_for("document.querySelectorAll('[data-state=leased]').length === 0", timeout=20)
            assert await browser.eval("window.notReloaded === true")
            assert await browser.eval("document.body.dataset.etag") == before  # same state, same page

    try:
        ARTIFACTS.mkdir(exist_ok=True)
        asyncio.run(watch())
    finally:
        assert agent.stop() == 0


def test_hover_on_a_gpu_highlights_its_hybrid_cube_mesh_links(tmp_path, chromium):
    """DGX-1: GPU0 links to GPU1, GPU2, GPU3 and GPU4; the mouse over GPU0 turns those red
    and dims the other twelve links."""
    page = tmp_path / "dgx1.html"
    page.write_text(render_page(discover_root(str(SNAPSHOTS / "dgx1-v100"))))

    async def hover() -> tuple[dict, dict]:
        browser = chromium.browser
        await browser.goto(page.as_uri())
        look = """Object.fromEntries([...document.querySelectorAll('path.direct-link')].map(p =>
                   [p.dataset.pair, [getComputedStyle(p).stroke, getComputedStyle(p).opacity]]))"""
        still = await browser.eval(look)
        x, y = await browser.eval("(() => { const r = document.querySelector('[data-device=GPU0]')"
                                  ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        await browser.hover(x, y)
        await browser.wait_for("document.querySelector('[data-hover=GPU0]').matches(':hover')")
        moved = await browser.eval(look)
        await browser.screenshot(ARTIFACTS / "page-dgx1-v100-hover-GPU0.png")
        return still, moved

    ARTIFACTS.mkdir(exist_ok=True)
    still, moved = chromium.run(hover())
    mine = {p for p in moved if "GPU0" in p.split("-")}
    assert mine == {"GPU0-GPU1", "GPU0-GPU2", "GPU0-GPU3", "GPU0-GPU4"}
    assert {still[p][0] for p in still} == {"rgb(47, 125, 28)"}  # all NVLink green at rest
    assert {moved[p][0] for p in mine} == {"rgb(209, 36, 47)"}  # GPU0's turn red
    assert {float(moved[p][1]) for p in moved if p not in mine} == {0.12}  # the rest dim


def test_finding_badges_sit_beside_names_in_the_svg():
    """Geometry of the SVG itself (no browser): on the degraded node each badge's circle
    lies right of its device's name, whose width is bounded by 0.7 em a character."""
    root = ET.fromstring(render_svg(discover_root(str(SNAPSHOTS / "degraded"))))
    names = {e.get("data-name-of"): e for e in root.iter(f"{SVG_NS}text") if e.get("data-name-of")}
    badges = [e for e in root.iter() if e.get("data-finding-for")]
    assert {b.get("data-finding-for") for b in badges} == {"GPU3", "GPU5", "NIC6"}
    for badge in badges:
        circle = badge.find(f"{SVG_NS}circle")
        cx, cy, r = (float(circle.get(k)) for k in ("cx", "cy", "r"))
        text = names[badge.get("data-finding-for")]
        size = float(text.get("font-size"))
        x0, baseline = float(text.get("x")), float(text.get("y"))
        x1 = x0 + 0.7 * size * len(text.text)
        assert cx - r >= x1 or cy + r <= baseline - size or cy - r >= baseline + 0.3 * size, badge.get("data-finding-for")


def test_page_shows_probe_findings_and_measured_fabric_bandwidth():
    """An NVSwitch node: findings from every source are listed and badged, and a fresh
    measurement labels each GPU's drop into the fabric (there are no pair edges there)."""
    import time

    from topoagent.node.matrix import Measurement
    from topoagent.node.model import Finding
    from topoagent.vocabulary import FindingKind, Severity

    topology = discover_root(str(SNAPSHOTS / "hgx-h100"))
    matrix = topology.distance_matrix()
    now = time.time()
    matrix = matrix.with_measurements({(0, 1): Measurement(gbps=180.0, taken_at=now),
                                       (0, 2): Measurement(gbps=200.0, taken_at=now)})
    probe = Finding(kind=FindingKind.DEGRADED_LINK, severity=Severity.WARNING, subject="GPU0/GPU1", message="GPU0 to GPU1: 180 GB/s, expected 360",
                    source="probe")
    svg = render_svg(topology, matrix, findings=(*topology.findings, probe))
    root = ET.fromstring(svg)
    assert "GPU0" in {e.get("data-finding-for") for e in root.iter() if e.get("data-finding-for")}
    assert any("180 GB/s" in (e.text or "") for e in root.iter() if e.get("class") == "finding")
    labels = {e.text for e in root.iter(f"{SVG_NS}text") if "link-GPU0" in (e.get("class") or "")}
    assert labels == {"NV18 · 190 GB/s"}
