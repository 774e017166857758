"""A picture of the node: NUMA nodes, PCIe switches, GPUs and NICs, NVLink, findings.

Drawn on the server as plain SVG (no script, no external asset), so the same text works as
a file (`topoagent export svg`), inline in the agent's page (`render_page`) and in a report.

Layout, left to right by NUMA node:

    ┌ NUMA 3 · CPUs 48-63 ───────────────┐
    │ ┌ PCIe switch 0000:01:00.0 ──────┐ │
    │ │ [NIC0] [NIC1]                  │ │   NICs on top,
    │ │ [GPU0] [GPU1]                  │ │   GPUs at the bottom of their switch,
    │ └────────────────────────────────┘ │
    └──────────┼──────┼──────────────────┘
    ═══════════╧══════╧═══ NVSwitch fabric  so NVLink leaves every GPU straight down:
                                            a bus for a switch fabric (16 GPUs stay
                                            readable), arcs for direct links.

Each GPU and NIC rectangle carries ``data-device="GPU3"`` / ``"NIC1"`` for tests and for
anyone styling the page.  Line widths follow the link count, or the measured bandwidth when
the distance matrix holds a fresh measurement.
"""

from __future__ import annotations

import html
import re
import time
from dataclasses import dataclass, field

from topoagent.node.matrix import DistanceMatrix
from topoagent.node.model import Finding, GpuTopo, NicTopo, NodeTopology
from topoagent.text import machine_text

GPU_W, GPU_H = 92, 64
NIC_W, NIC_H = 92, 50
GAP = 10
SW_PAD, SW_TITLE = 10, 20
NUMA_PAD, NUMA_TITLE = 12, 26
EMPTY_NUMA_W = 130
MARGIN = 20
MAX_WIDTH = 1320  # 1366 px screen less the page's padding and a scrollbar
LANE = 64  # room under a row for its NVLink drops and the fabric bus

COLORS = {
    "gpu": "#76b900", "gpu_text": "#10240a", "nic": "#3b82c4", "nic_down": "#9aa5b1",
    "numa": "#f4f6f8", "numa_stroke": "#5b6b7b", "switch": "#ffffff", "switch_stroke": "#8a99a8",
    "nvlink": "#2f7d1c", "fabric": "#1f5f12", "critical": "#d1242f", "warning": "#e08a00",
    "info": "#6e7781", "text": "#1f2328", "muted": "#57606a",
    "leased": "#8250df", "busy": "#bf8700",
}
SEVERITY_RANK = {"critical": 3, "warning": 2, "info": 1}


@dataclass
class _Box:
    x: float
    y: float
    w: float
    h: float


@dataclass
class _Switch:
    key: str | None  # bus id of the switch (or root port); None: on the host bridge
    label: str
    gpus: list[GpuTopo] = field(default_factory=list)
    nics: list[NicTopo] = field(default_factory=list)

    @property
    def width(self) -> float:
        n = max(len(self.gpus), len(self.nics), 1)
        return 2 * SW_PAD + n * GPU_W + (n - 1) * GAP

    @property
    def height(self) -> float:
        rows = (GPU_H if self.gpus else 0) + (NIC_H if self.nics else 0)
        rows += GAP if self.gpus and self.nics else 0
        return SW_TITLE + rows + SW_PAD


def _esc(text: object) -> str:
    """Text for the page: escaped, and safe even if it did not come through the Host."""
    return html.escape(machine_text(str(text)), quote=True)


def _short_model(model: str | None) -> str:
    if not model:
        return "GPU"
    text = model.removeprefix("NVIDIA ").removeprefix("Tesla ")
    return text if len(text) <= 13 else text[:12] + "…"


def _switch_of(topology: NodeTopology, address: str | None) -> tuple[str | None, str]:
    dev = topology.pci.get(address) if topology.pci and address else None
    if dev is None or not dev.bridges:
        return None, "host bridge"
    if len(dev.bridges) >= 2:
        return dev.bridges[1], f"PCIe switch {dev.bridges[1].removeprefix('0000:')}"
    return dev.bridges[0], f"root port {dev.bridges[0].removeprefix('0000:')}"


def _device_findings(topology: NodeTopology, findings: tuple[Finding, ...]) -> dict[str, list[Finding]]:
    """Findings per GPU/NIC name, matched by name, RDMA device or a PCI address on its path."""
    names: dict[str, str] = {}
    for g in topology.gpus:
        names[g.name] = g.name
        if g.pci_address:
            names[g.pci_address] = g.name
    for n in topology.nics:
        names[n.name] = n.name
        if n.device:
            names[n.device] = n.name
        if n.pci_address:
            names[n.pci_address] = n.name
    by_device: dict[str, list[Finding]] = {}
    for finding in findings:
        tokens = set(re.split(r"[\s/,()]+", f"{finding.subject} {finding.message}"))
        hits = {names[t] for t in tokens if t in names}
        for name in hits:
            by_device.setdefault(name, []).append(finding)
    return by_device


def _fabric(topology: NodeTopology) -> dict[str, int]:
    """GPU name -> active NVLinks into an NVSwitch fabric."""
    links: dict[str, int] = {}
    for g in topology.gpus:
        count = sum(1 for l in g.nvlinks if l.active and l.remote_type == "switch")
        if count:
            links[g.name] = count
    return links


def _measured(matrix: DistanceMatrix | None) -> dict[frozenset[str], float]:
    if matrix is None:
        return {}
    now = time.time()
    out = {}
    for (i, j), m in matrix.measured.items():
        if now - m.taken_at <= matrix.measurement_max_age_s:
            out[frozenset((matrix.gpus[i].name, matrix.gpus[j].name))] = m.gbps
    return out


def _fabric_gbps(fabric: dict[str, int], measured: dict[frozenset[str], float]) -> dict[str, float]:
    """GPU name -> mean fresh measured GB/s to the other fabric GPUs (a bus has no pair
    edges to label, so each GPU's drop carries its own figure)."""
    out: dict[str, float] = {}
    for name in fabric:
        figures = [g for pair, g in measured.items() if name in pair and len(pair) == 2]
        if figures:
            out[name] = sum(figures) / len(figures)
    return out


def render_svg(topology: NodeTopology, matrix: DistanceMatrix | None = None, *,
               findings: tuple[Finding, ...] | None = None, leased: frozenset[int] = frozenset(),
               busy: frozenset[int] = frozenset(), max_width: float = MAX_WIDTH, show_state: bool = False) -> str:
    """The picture.  ``findings``: every source's (default: discovery's); ``leased`` and
    ``busy``: GPU indices the agent has leased out / sees running processes (the page);
    rows of NUMA nodes wrap at ``max_width`` so a 16-GPU node stays legible at 1366 px."""
    findings = topology.findings if findings is None else findings
    findings_of = _device_findings(topology, findings)
    fabric = _fabric(topology)
    measured = _measured(matrix)
    fabric_gbps = _fabric_gbps(fabric, measured)

    # --- group devices: NUMA node -> switch -> GPUs / NICs
    numa_ids = [n.id for n in topology.numa.nodes] if topology.numa else []
    groups: dict[int | None, dict[str | None, _Switch]] = {i: {} for i in numa_ids}
    devices: list[GpuTopo | NicTopo] = [*topology.gpus, *topology.nics]
    for dev in devices:
        node = dev.numa_node if dev.numa_node is not None and dev.numa_node in groups else None
        if dev.numa_node is None and len(numa_ids) == 1:
            node = numa_ids[0]
        key, label = _switch_of(topology, dev.pci_address)
        switch = groups.setdefault(node, {}).setdefault(key, _Switch(key, label))
        if isinstance(dev, GpuTopo):
            switch.gpus.append(dev)
        else:
            switch.nics.append(dev)

    # --- place NUMA boxes in rows, wrapping at max_width; under each row a lane for NVLink
    def numa_width(switches: dict[str | None, _Switch]) -> float:
        if not switches:
            return EMPTY_NUMA_W
        return sum(s.width for s in switches.values()) + GAP * (len(switches) - 1) + 2 * NUMA_PAD

    rows: list[list[tuple[int | None, dict[str | None, _Switch]]]] = [[]]
    x: float = MARGIN
    for node, switches in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        w = numa_width(switches)
        if rows[-1] and x + w > max_width - MARGIN:
            rows.append([])
            x = MARGIN
        rows[-1].append((node, switches))
        x += w + GAP * 2
    numa_boxes: list[tuple[int | None, _Box, list[tuple[_Switch, _Box]]]] = []
    parts: list[str] = []
    gpu_anchor: dict[str, tuple[float, float]] = {}  # bottom centre of each GPU
    row_of: dict[str, int] = {}
    row_bottoms: list[float] = []
    width: float = 640
    top: float = MARGIN + 34
    for r, row in enumerate(rows):
        x = MARGIN
        inner = [max(s.height for s in sw.values()) for _, sw in row if sw]
        inner_h: float = max(inner, default=40)
        for node, switches in row:
            if not switches:
                box = _Box(x, top, EMPTY_NUMA_W, NUMA_TITLE + 40)
                numa_boxes.append((node, box, []))
                x += box.w + GAP * 2
                continue
            placed = []
            sx: float = x + NUMA_PAD
            for s in sorted(switches.values(), key=lambda s: (not s.gpus, s.key or "")):
                placed.append((s, _Box(sx, top + NUMA_TITLE, s.width, inner_h)))
                for gi, gpu in enumerate(s.gpus):
                    row_of[gpu.name] = r
                    gx = sx + SW_PAD + gi * (GPU_W + GAP)
                    gpu_anchor[gpu.name] = (gx + GPU_W / 2, top + NUMA_TITLE + inner_h - SW_PAD)
                sx += s.width + GAP
            box = _Box(x, top, sx - GAP + NUMA_PAD - x, NUMA_TITLE + inner_h + NUMA_PAD)
            numa_boxes.append((node, box, placed))
            x += box.w + GAP * 2
        width = max(width, x - GAP * 2 + MARGIN)
        bottom = top + NUMA_TITLE + inner_h + NUMA_PAD
        row_bottoms.append(bottom)
        in_fabric = any(row_of.get(n) == r for n in fabric)
        top = bottom + (LANE + 24 if in_fabric else 24)

    def device_rect(name: str, kind: str, bx: float, by: float, w: float, h: float,
                    fill: str, lines: list[str], tooltip: str, state: str | None = None) -> None:
        found = findings_of.get(name, [])
        worst = max((f.severity for f in found), key=lambda s: SEVERITY_RANK.get(s, 0), default=None)
        stroke = COLORS[worst] if worst else "#33404d"
        sw = 3 if worst in ("critical", "warning") else 1
        tip = tooltip + (f"\n{state}" if state else "") + "".join(f"\n{f.severity}: {f.message}" for f in found)
        hover = f' data-hover="{_esc(name)}"' if kind == "gpu" else ""
        parts.append(f'<g class="dev"{hover}>')
        data_state = f' data-state="{state}"' if state else ""
        parts.append(
            f'<rect class="device {kind}" data-device="{_esc(name)}"{data_state} x="{bx:.1f}" y="{by:.1f}" '
            f'width="{w}" height="{h}" rx="5" fill="{fill}" stroke="{stroke}" stroke-width="{sw}">'
            f"<title>{_esc(tip)}</title></rect>"
        )
        color = COLORS["gpu_text"] if kind == "gpu" else "#ffffff"
        for k, line in enumerate(lines):
            if k == 0:  # the name, left; the finding badge keeps to the right of it
                parts.append(f'<text class="device-name" data-name-of="{_esc(name)}" x="{bx + 7:.1f}" '
                             f'y="{by + 16:.1f}" font-size="13" font-weight="bold" fill="{color}">{_esc(line)}</text>')
            else:
                parts.append(f'<text x="{bx + w / 2:.1f}" y="{by + 16 + k * 13:.1f}" font-size="10" '
                             f'text-anchor="middle" fill="{color}">{_esc(line)}</text>')
        if state:
            parts.append(f'<text class="state-tag" x="{bx + w / 2:.1f}" y="{by + h - 5:.1f}" font-size="9" '
                         f'font-weight="bold" text-anchor="middle" fill="{COLORS[state]}">{state.upper()}</text>')
        if worst in ("critical", "warning"):
            cx, cy = bx + w - 11, by + 11
            parts.append(f'<g class="finding-badge" data-finding-for="{_esc(name)}">'
                         f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="7" fill="{COLORS[worst]}" stroke="#fff"/>'
                         f'<text x="{cx:.1f}" y="{cy + 4:.1f}" font-size="11" font-weight="bold" '
                         f'text-anchor="middle" fill="#fff">!</text></g>')
        parts.append("</g>")

    for node, box, placed in numa_boxes:
        cpus = ""
        if topology.numa and node is not None:
            n = topology.numa.node(node)
            cpus = f" · CPUs {n.cpulist}" if n and n.cpus else " · no CPUs"
        title = f"NUMA {node}{cpus}" if node is not None else "NUMA unknown"
        parts.append(f'<g class="numa" data-numa="{_esc(node if node is not None else "unknown")}">')
        parts.append(f'<rect x="{box.x}" y="{box.y}" width="{box.w:.1f}" height="{box.h:.1f}" rx="8" '
                     f'fill="{COLORS["numa"]}" stroke="{COLORS["numa_stroke"]}" stroke-width="1.5"/>')
        # A box of NICs alone (a node without GPUs) is narrow: its full title would run into
        # the next box's (12 px bold, about 7 px a character).
        fits = any(sw.gpus for sw, _ in placed) or 7 * len(title) <= box.w + GAP * 2 - 8
        text = title if (placed and fits) or len(title) < 22 else f"NUMA {node}"
        parts.append(f'<text x="{box.x + 8}" y="{box.y + 17}" font-size="12" font-weight="bold" '
                     f'fill="{COLORS["text"]}">{_esc(text)}</text>')
        if not placed:
            parts.append(f'<text x="{box.x + 8}" y="{box.y + 36}" font-size="10" fill="{COLORS["muted"]}">'
                         f'{_esc(cpus.removeprefix(" · ") or "no devices")}</text>')
            parts.append(f'<text x="{box.x + 8}" y="{box.y + 50}" font-size="10" fill="{COLORS["muted"]}">'
                         f"no GPUs or NICs</text>")
        parts.append("</g>")
        for switch, sbox in placed:
            parts.append(f'<rect class="switch" data-switch="{_esc(switch.key or "host")}" x="{sbox.x:.1f}" '
                         f'y="{sbox.y:.1f}" width="{sbox.w:.1f}" height="{sbox.h:.1f}" rx="6" '
                         f'fill="{COLORS["switch"]}" stroke="{COLORS["switch_stroke"]}" stroke-dasharray="4 3"/>')
            parts.append(f'<text x="{sbox.x + 6:.1f}" y="{sbox.y + 14:.1f}" font-size="10" '
                         f'fill="{COLORS["muted"]}">{_esc(switch.label)}</text>')
            row_y = sbox.y + SW_TITLE
            if switch.nics:
                for k, nic in enumerate(switch.nics):
                    nx = sbox.x + SW_PAD + k * (NIC_W + GAP)
                    rate = f"{nic.rate_gbps:g} Gb/s" if nic.rate_gbps else ("down" if nic.ports else "")
                    layer = "RoCE" if nic.ports and all(p.roce for p in nic.ports) else "IB"
                    fill = COLORS["nic"] if nic.active is not False else COLORS["nic_down"]
                    device_rect(nic.name, "nic", nx, row_y, NIC_W, NIC_H, fill,
                                [nic.name, nic.device or "", f"{rate} {layer}".strip()],
                                f"{nic.name} {nic.device or ''} {nic.pci_address or ''}")
                row_y += NIC_H + GAP
            for k, gpu in enumerate(switch.gpus):
                gx = sbox.x + SW_PAD + k * (GPU_W + GAP)
                gy = sbox.y + sbox.h - SW_PAD - GPU_H
                link = ""
                if gpu.link and gpu.link.max_gen:
                    link = f"PCIe{gpu.link.max_gen} x{gpu.link.current_width or '?'}"
                state = "leased" if gpu.index in leased else "busy" if gpu.index in busy else None
                fill = {"leased": "#d8c8f7", "busy": "#f3dc8f"}.get(state or "", COLORS["gpu"])
                device_rect(gpu.name, "gpu", gx, gy, GPU_W, GPU_H, fill,
                            [gpu.name, _short_model(gpu.model), link],
                            f"{gpu.name} {gpu.model or ''} {gpu.pci_address or ''}", state)

    y = row_bottoms[-1] + 24

    # --- NVLink: a bus for a switch fabric (a segment under each row), arcs for direct links
    if fabric:
        segments: list[tuple[float, float, float]] = []  # x0, x1, bar y
        drops: list[str] = []
        for r, bottom in enumerate(row_bottoms):
            names = [n for n in fabric if row_of.get(n) == r and n in gpu_anchor]
            if not names:
                continue
            bar_y = bottom + 24 + 22
            usual = max(fabric.values())
            for name in names:
                links = fabric[name]
                gx, gy = gpu_anchor[name]
                degraded = links < usual
                color = COLORS["warning"] if degraded else COLORS["fabric"]
                dash = ' stroke-dasharray="6 4"' if degraded else ""
                gbps = fabric_gbps.get(name)
                weight, label = _nvlink_look(links, gbps)
                klass = f"link-{_esc(name)}"
                drops.append(f'<line class="nvlink fabric-link {klass}" data-gpu="{_esc(name)}" x1="{gx:.1f}" '
                             f'y1="{gy:.1f}" x2="{gx:.1f}" y2="{bar_y:.1f}" stroke="{color}" '
                             f'stroke-width="{_width(weight):.1f}"{dash}><title>{_esc(name)}: {links} NVLinks into '
                             f'the fabric{"" if gbps is None else f", {gbps:.0f} GB/s measured (mean)"}</title></line>')
                drops.append(f'<text class="link-label {klass}" x="{gx + 8:.1f}" y="{bar_y - 6:.1f}" font-size="9" '
                             f'fill="{color}">{_esc(label)}</text>')
            xs = [gpu_anchor[n][0] for n in names]
            segments.append((min(xs) - 30, max(xs) + 30, bar_y))
        nvswitches = len(topology.pci.of_kind("nvswitch")) if topology.pci else 0
        label = f"NVSwitch fabric · {nvswitches} NVSwitch{'es' if nvswitches != 1 else ''}" if nvswitches \
            else "NVSwitch fabric"
        parts.extend(drops)
        parts.append('<g class="nvswitch-fabric">')
        if len(segments) > 1:  # one fabric: the row segments joined down the left margin
            x_join = MARGIN / 2
            parts.append(f'<rect class="fabric-join" x="{x_join - 3:.1f}" y="{segments[0][2]:.1f}" width="6" '
                         f'height="{segments[-1][2] - segments[0][2] + 22:.1f}" fill="{COLORS["fabric"]}"/>')
            segments = [(x_join - 3, x1, by) for _, x1, by in segments]
        for k, (x0, x1, bar_y) in enumerate(segments):
            parts.append(f'<rect class="fabric-segment" x="{x0:.1f}" y="{bar_y:.1f}" width="{x1 - x0:.1f}" '
                         f'height="22" rx="4" fill="{COLORS["fabric"]}"/>')
            text = f"{label} · GPUs {len(fabric)}" if k == 0 else f"{label} (continued)"
            parts.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{bar_y + 15:.1f}" font-size="12" font-weight="bold" '
                         f'text-anchor="middle" fill="#fff">{_esc(text)}</text>')
        parts.append("</g>")
        y = segments[-1][2] + 22 + 20
    direct = []
    for i, ga in enumerate(topology.gpus):
        for gb in topology.gpus[i + 1:]:
            level = topology.level(ga.name, gb.name)
            if level is None or not level.is_nvlink or (ga.name in fabric and gb.name in fabric):
                continue
            if ga.name in gpu_anchor and gb.name in gpu_anchor:
                direct.append((ga.name, gb.name, level.nvlinks))
    if direct:
        deepest = y
        for a, b, links in direct:
            (ax, ay), (bx, by) = gpu_anchor[a], gpu_anchor[b]
            depth = 26 + 0.22 * abs(bx - ax)
            base = max(ay, by)
            cy = base + depth + (y - base)
            gbps = measured.get(frozenset((a, b)))
            weight, label = _nvlink_look(links, gbps)
            stroke = _width(weight)
            klass = f"link-{_esc(a)} link-{_esc(b)}"
            parts.append(f'<path class="nvlink direct-link {klass}" data-pair="{_esc(a)}-{_esc(b)}" '
                         f'd="M{ax:.1f},{ay:.1f} C{ax:.1f},{cy:.1f} {bx:.1f},{cy:.1f} {bx:.1f},{by:.1f}" '
                         f'fill="none" stroke="{COLORS["nvlink"]}" stroke-opacity="0.75" '
                         f'stroke-width="{stroke:.1f}"><title>{_esc(a)} ↔ {_esc(b)}: {_esc(label)}</title></path>')
            mid_y = 0.25 * base + 0.75 * cy
            parts.append(f'<text class="link-label {klass}" x="{(ax + bx) / 2:.1f}" y="{mid_y + 3:.1f}" '
                         f'font-size="10" text-anchor="middle" '
                         f'fill="{COLORS["nvlink"]}" stroke="#fff" stroke-width="3" paint-order="stroke">'
                         f"{_esc(label)}</text>")
            deepest = max(deepest, mid_y + 14)
        y = deepest + 10
    if not fabric and not direct:
        # Said only where it was seen: no GPUs, or links no witness classified, are not "no NVLink".
        if not topology.gpus:
            said = "No GPUs."
        elif topology.gpus_with_unknown_links():
            said = "NVLink unknown: no witness saw the links between GPUs."
        else:
            said = "No NVLink: GPUs talk over PCIe."
        parts.append(f'<text x="{MARGIN}" y="{y + 10:.1f}" font-size="11" fill="{COLORS["muted"]}">'
                     f"{said}</text>")
        y += 24

    # --- legend and findings
    y += 8
    legend_y = y
    parts.append(f'<g class="legend" transform="translate({MARGIN},{legend_y:.1f})">')
    parts.append('<text x="0" y="12" font-size="12" font-weight="bold">Legend</text>')
    items = [
        (f'<rect x="0" y="20" width="26" height="16" rx="3" fill="{COLORS["gpu"]}" stroke="#33404d"/>', "GPU"),
        (f'<rect x="0" y="20" width="26" height="16" rx="3" fill="{COLORS["nic"]}" stroke="#33404d"/>', "NIC (RDMA)"),
        (f'<rect x="0" y="20" width="26" height="16" rx="3" fill="#fff" stroke="{COLORS["switch_stroke"]}" '
         f'stroke-dasharray="4 3"/>', "PCIe switch"),
        (f'<rect x="0" y="20" width="26" height="16" rx="3" fill="{COLORS["numa"]}" '
         f'stroke="{COLORS["numa_stroke"]}"/>', "NUMA node"),
        (f'<line x1="0" y1="28" x2="26" y2="28" stroke="{COLORS["nvlink"]}" stroke-width="{_width(2):.1f}"/>',
         "NVLink (width = links or GB/s)"),
        (f'<rect x="0" y="21" width="26" height="14" rx="3" fill="{COLORS["fabric"]}"/>', "NVSwitch fabric"),
        (f'<circle cx="13" cy="28" r="8" fill="{COLORS["warning"]}"/>', "finding"),
    ]
    if show_state:
        items += [
            ('<rect x="0" y="20" width="26" height="16" rx="3" fill="#d8c8f7" stroke="#33404d"/>', "leased"),
            ('<rect x="0" y="20" width="26" height="16" rx="3" fill="#f3dc8f" stroke="#33404d"/>',
             "busy (processes)"),
        ]
    lx = 0
    for shape, text in items:
        parts.append(f'<g transform="translate({lx},0)">{shape}'
                     f'<text x="32" y="32" font-size="11">{_esc(text)}</text></g>')
        lx += 40 + 7 * len(text)
    parts.append("</g>")
    y = legend_y + 50
    width = max(width, min(max_width, MARGIN * 2 + lx))  # the legend never clipped
    if findings:
        cap = int((max_width - 2 * MARGIN) / 6.6)  # 11 px text, about 6.6 px a character
        parts.append(f'<g class="findings" transform="translate({MARGIN},{y:.1f})">')
        parts.append(f'<text x="0" y="12" font-size="12" font-weight="bold">Findings ({len(findings)})</text>')
        for k, f in enumerate(findings):
            line = f"{f.severity}: {f.subject}: {f.message}"
            short = line if len(line) <= cap else line[:cap - 1] + "…"
            parts.append(f'<text class="finding" data-severity="{_esc(f.severity)}" x="0" y="{30 + k * 15}" '
                         f'font-size="11" fill="{COLORS.get(f.severity, COLORS["text"])}">'
                         f"{_esc(short)}<title>{_esc(line)} ({_esc(f.source)})</title></text>")
        parts.append("</g>")
        y += 30 + 15 * len(findings)
        width = max(width, min(max_width, MARGIN * 2 + 6.6 * max(len(f"{f.severity}: {f.subject}: {f.message}")
                                                                 for f in findings)))
    height = y + MARGIN
    links_seen = {n for n in fabric if n in gpu_anchor} | {n for a, b, _ in direct for n in (a, b)}
    held = [g.name for g in topology.gpus if g.index in leased]
    running = [g.name for g in topology.gpus if g.index in busy and g.index not in leased]
    state_note = (f" · leased {len(held)}" if held else "") + (f" · busy {len(running)}" if running else "")
    header = (f'<text x="{MARGIN}" y="{MARGIN + 12}" font-size="16" font-weight="bold" fill="{COLORS["text"]}">'
              f"{_esc(topology.hostname or 'node')} · {len(topology.gpus)} GPU"
              f"{'s' if len(topology.gpus) != 1 else ''} · {len(topology.nics)} NIC"
              f"{'s' if len(topology.nics) != 1 else ''}{state_note}</text>")
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="topoagent-topology" width="{width:.0f}" '
        f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
        f'font-family="DejaVu Sans, Helvetica, Arial, sans-serif">'
        f'<rect width="100%" height="100%" fill="#ffffff"/>'
        + _hover_style([g.name for g in topology.gpus if g.name in links_seen]) + header + "".join(parts) + "</svg>\n"
    )


def _hover_style(gpus: list[str]) -> str:
    """Hovering a GPU highlights its NVLinks and dims the rest (CSS only: works in the
    file and the page alike).  Each link drawing carries ``link-GPUn`` for both ends."""
    if not gpus:
        return ""
    rules = ["text{pointer-events:none}.dev{cursor:default}"]
    for name in gpus:
        on = f'svg:has([data-hover="{name}"]:hover)'
        rules.append(f"{on} .nvlink:not(.link-{name}),{on} .link-label:not(.link-{name}){{opacity:.12}}"
                     f"{on} .nvlink.link-{name}{{stroke:{COLORS['critical']};stroke-opacity:1}}"
                     f"{on} .link-label.link-{name}{{fill:{COLORS['critical']};font-weight:bold}}")
    return "<style>" + "".join(rules) + "</style>"


def _nvlink_look(links: int, gbps: float | None) -> tuple[float, str]:
    """A link's drawn weight and label: by its link count, or by the GB/s measured on it
    (25 GB/s, one NVLink's worth, weighs as one link)."""
    if gbps is None:
        return float(links), f"NV{links}"
    return gbps / 25.0, f"NV{links} · {gbps:.0f} GB/s"


def _width(weight: float) -> float:
    """Stroke width for a link weight (NVLink count, or GB/s ÷ 25): readable from 1 to 18."""
    return max(1.5, min(12.0, 1.2 + weight * 0.8))


# The page's live refresh: poll / with If-None-Match; on 200 swap the picture in place.
# The agent stamps the page's own ETag into <body data-etag> so the first poll is a 304.
_LIVE = (
    "<script>(()=>{let tag=document.body.dataset.etag;const note=document.getElementById('live');"
    "const poll=async()=>{try{const r=await fetch(location.pathname,{headers:{'If-None-Match':tag},"
    "cache:'no-store',credentials:'same-origin'});"
    "if(r.status===200){const d=new DOMParser().parseFromString(await r.text(),'text/html');"
    "document.querySelector('svg.topoagent-topology').replaceWith(d.querySelector('svg.topoagent-topology'));"
    "tag=r.headers.get('ETag')||'';document.body.dataset.etag=tag;note.textContent='live: updated '+"
    "new Date().toLocaleTimeString()}else if(r.status!==304){note.textContent='live refresh stopped: HTTP '+"
    "r.status+' (reload with the token to resume)';return}}catch(e){note.textContent='live: agent unreachable, retrying'}"
    "setTimeout(poll,POLL_MS)};setTimeout(poll,POLL_MS)})()</script>"
)
ETAG_SLOT = 'data-etag=""'


def render_page(topology: NodeTopology, matrix: DistanceMatrix | None = None, *,
                findings: tuple[Finding, ...] | None = None, leased: frozenset[int] = frozenset(),
                busy: frozenset[int] = frozenset(), live_ms: int | None = None) -> str:
    """A standalone HTML page (inline SVG, inline CSS; nothing fetched from elsewhere).

    With ``live_ms`` (the agent's ``/``) the page shows the agent's state (leases, busy
    GPUs, every source's findings) and carries a few lines of script that poll ``/`` every
    ``live_ms`` with If-None-Match and swap the picture when it changed; the caller fills
    ``data-etag=""`` (``ETAG_SLOT``) with the page's ETag, and links the agent's /topology
    and /metrics.  Without it (`export html`, a file opened from disk): no script and no
    links, which would point at the file system's root instead of an agent."""
    title = f"topoagent · {topology.hostname or 'node'}"
    live = live_ms is not None
    script = _LIVE.replace("POLL_MS", str(live_ms)) if live else ""
    footer = ('<p style="font-size:12px;color:#57606a"><span id="live">live: polling every '
              f'{(live_ms or 0) / 1000:g} s</span> · JSON: <a href="/topology">/topology</a> · '
              'metrics: <a href="/metrics">/metrics</a></p>') if live else ""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{_esc(title)}</title>"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        "<style>body{margin:0;padding:12px;font-family:DejaVu Sans,Helvetica,Arial,sans-serif;"
        "color:#1f2328;background:#fff}h1{font-size:18px;margin:0 0 8px}"
        ".error{color:#d1242f}.warning{color:#e08a00}.info{color:#6e7781}"
        "svg{max-width:100%;height:auto}ul{font-size:13px}</style></head>"
        f"{f'<body {ETAG_SLOT}>' if live else '<body>'}"
        f"<h1>{_esc(title)}</h1>"
        f"{render_svg(topology, matrix, findings=findings, leased=leased, busy=busy, show_state=live or bool(leased or busy))}"
        f"{footer}{script}</body></html>\n"
    )


__all__ = ["render_page", "render_svg"]
