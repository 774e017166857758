"""What the agent serves: one immutable snapshot of the node, swapped whole.

Readers (HTTP handlers, the Prometheus collector) take `agent.snapshot` once and read
only that value, so they never see half of one discovery and half of the next.  The JSON
body and its ETag are computed once per snapshot, not per request.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from topoagent.matrix import DistanceMatrix

if TYPE_CHECKING:
    from topoagent.model import NodeTopology
    from topoagent.probes.figures import ProbeFigure


@dataclass(frozen=True, slots=True)
class CollectorStatus:
    """node_exporter's pattern: every source says whether it worked and how long it took."""

    name: str
    success: bool
    duration_s: float
    last_success_at: float | None  # Unix time of this collector's last good run
    error: str | None = None
    status: str = "ok"  # "ok", "no_data" (source absent: quiet, still a success) or "error"


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str  # "level-disagreement", "pcie-degraded", ...
    detail: str
    severity: str = "warning"  # "info", "warning" or "error"


@dataclass(frozen=True, slots=True)
class PcieLink:
    device: str  # PCI address
    role: str  # "gpu", "nic", "bridge"
    current_speed_gts: float | None
    max_speed_gts: float | None
    current_width: int | None
    max_width: int | None


@dataclass(frozen=True, slots=True)
class NvLink:
    gpu: int
    link: int
    active: bool


@dataclass(frozen=True, slots=True)
class IbPort:
    device: str  # "mlx5_0"
    port: int
    state: str  # "ACTIVE", "DOWN", ...
    rate_gbps: float | None


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What one discovery run produced, in the shape the exporters read, with the
    probes' measurements overlaid when there are any (``matrix.measured``,
    ``probe_figures``, probe findings among ``findings``)."""

    topology: dict[str, Any]  # the NodeTopology JSON
    matrix: DistanceMatrix
    matrix_text: str  # nvidia-smi-style text for ?format=matrix
    collectors: tuple[CollectorStatus, ...] = ()
    findings: tuple[Finding, ...] = ()
    pcie_links: tuple[PcieLink, ...] = ()
    nvlinks: tuple[NvLink, ...] = ()
    ib_ports: tuple[IbPort, ...] = ()
    node: NodeTopology | None = None  # discovery's own value (the picture at / draws it)
    probe_figures: tuple[ProbeFigure, ...] = ()  # newest figure per measurement


@dataclass(frozen=True)
class Snapshot:
    version: int  # increases with every swap
    facts: NodeFacts
    built_at: float  # Unix time the facts were collected
    stale: bool = False  # the last discovery failed; these facts are older
    error: str | None = None  # why the last discovery failed
    failed_at: float | None = None
    # Collector results of the latest run when it failed (the facts are from an older one).
    latest_collectors: tuple[CollectorStatus, ...] | None = None
    # Cached per snapshot (computed on first use, never per request).
    _cache: tuple[bytes, str] | None = field(default=None, repr=False, compare=False)
    _page: tuple[bytes, str] | None = field(default=None, repr=False, compare=False)

    def marked_stale(self, version: int, error: str, failed_at: float, collectors: tuple[CollectorStatus, ...]) -> Snapshot:
        return replace(self, version=version, stale=True, error=error, failed_at=failed_at, latest_collectors=collectors, _cache=None, _page=None)

    def with_facts(self, version: int, facts: NodeFacts) -> Snapshot:
        """The same discovery state with new facts (a probe result overlaid)."""
        return replace(self, version=version, facts=facts, _cache=None, _page=None)

    @property
    def collectors(self) -> tuple[CollectorStatus, ...]:
        """How each source fared in the latest run (which may be newer than the facts)."""
        return self.latest_collectors if self.latest_collectors is not None else self.facts.collectors

    def document(self) -> dict[str, Any]:
        doc = dict(self.facts.topology)
        doc["agent"] = {
            "snapshot_version": self.version,
            "built_at": self.built_at,
            "stale": self.stale,
            "error": self.error,
            "failed_at": self.failed_at,
            "collectors": [
                {
                    "name": c.name,
                    "success": c.success,
                    "status": c.status,
                    "duration_s": round(c.duration_s, 6),
                    "last_success_at": c.last_success_at,
                    "error": c.error,
                }
                for c in self.collectors
            ],
            "findings": [{"kind": f.kind, "severity": f.severity, "detail": f.detail} for f in self.facts.findings],
            "probe_figures": [f.to_json() for f in self.facts.probe_figures],
        }
        return doc

    def _cached(self) -> tuple[bytes, str]:
        if self._cache is None:
            body = json.dumps(self.document(), indent=1).encode()
            etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
            # frozen: the cache is filled once, through object.__setattr__
            object.__setattr__(self, "_cache", (body, etag))
        return self._cache  # type: ignore[return-value]

    def page(self) -> tuple[bytes, str]:
        """The HTML picture of the node and its ETag, rendered once per snapshot."""
        if self._page is None:
            from topoagent.exporters.svg import render_page

            if self.facts.node is None:
                raise LookupError("this snapshot has no discovered topology to draw")
            body = render_page(self.facts.node, self.facts.matrix).encode()
            etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
            object.__setattr__(self, "_page", (body, etag))
        return self._page  # type: ignore[return-value]

    @property
    def body(self) -> bytes:
        return self._cached()[0]

    @property
    def etag(self) -> str:
        return self._cached()[1]
