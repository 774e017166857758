"""What the agent serves: one immutable snapshot of the node, swapped whole.

The snapshot *is* discovery's typed ``NodeTopology`` plus the agent's own state (the
matrix with the probes' measurements overlaid, their figures and findings, how each
collector fared, staleness); there is no second set of types for serving.  Readers (HTTP
handlers, the Prometheus collector) take ``agent.snapshot`` once and read only that value,
so they never see half of one discovery and half of the next.  The JSON body, its ETag and
the nvidia-smi-style text are computed once per snapshot, not per request.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from topoagent.matrix import DistanceMatrix
from topoagent.model import CollectorStatus, Finding, NodeTopology
from topoagent.probes.figures import ProbeFigure
from topoagent.telemetry import Telemetry


@dataclass(frozen=True)
class Snapshot:
    version: int  # increases with every swap
    node: NodeTopology  # discovery's value
    matrix: DistanceMatrix  # the node's matrix, measurements overlaid (placement reads it)
    built_at: float  # Unix time the node's facts were collected
    # How each source fared in the latest run, which may be newer than ``node`` (stale).
    collectors: tuple[CollectorStatus, ...]
    last_success_at: Mapping[str, float | None]  # collector name -> Unix time
    probe_figures: tuple[ProbeFigure, ...] = ()  # newest figure per measurement
    probe_findings: tuple[Finding, ...] = ()
    # GPU sets of the probe targets whose newest figures were taken under load (not judged).
    probes_under_load: frozenset[frozenset[int]] = frozenset()
    stale: bool = False  # the last discovery failed; these facts are older
    error: str | None = None  # why the last discovery failed
    failed_at: float | None = None
    # The counters' last read (telemetry loop), swapped in every [telemetry] interval_s.
    telemetry: Telemetry | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def marked_stale(self, version: int, error: str, failed_at: float, collectors: tuple[CollectorStatus, ...]) -> Snapshot:
        return replace(self, version=version, stale=True, error=error, failed_at=failed_at, collectors=collectors, _cache={})

    def with_probes(
        self, version: int, matrix: DistanceMatrix, figures: tuple[ProbeFigure, ...], findings: tuple[Finding, ...],
        under_load: frozenset[frozenset[int]] | None = None,
    ) -> Snapshot:
        """The same discovery state with new measurements overlaid."""
        loaded = self.probes_under_load if under_load is None else under_load
        return replace(
            self, version=version, matrix=matrix, probe_figures=figures, probe_findings=findings, probes_under_load=loaded, _cache={},
        ).with_health()

    def taken_under_load(self, figure: ProbeFigure) -> bool:
        """Whether this figure was taken under load (so it was not judged)."""
        from topoagent.probes.overlay import target_gpus

        return target_gpus(figure) in self.probes_under_load

    def with_telemetry(self, version: int, telemetry: Telemetry) -> Snapshot:
        """The same discovery state with the counters' latest read."""
        return replace(self, version=version, telemetry=telemetry, _cache={}).with_health()

    def with_health(self) -> Snapshot:
        """The matrix marks unhealthy every GPU a critical finding names -- discovery's,
        the probes' and the counters' -- so placement keeps off it (unless included).
        Unchanged health keeps the matrix, and with it placement's tables."""
        unhealthy = self.node.unhealthy_gpus(self.probe_findings + (self.telemetry.findings if self.telemetry else ()))
        if all(g.unhealthy == unhealthy.get(g.name) for g in self.matrix.gpus):
            return self
        gpus = tuple(replace(g, unhealthy=unhealthy.get(g.name)) for g in self.matrix.gpus)
        return replace(self, matrix=replace(self.matrix, gpus=gpus), _cache={})

    @property
    def findings(self) -> tuple[Finding, ...]:
        telemetry = self.telemetry.findings if self.telemetry else ()
        return self.node.findings + self.probe_findings + telemetry

    def cached(self, key: str, make: Callable[[], Any]) -> Any:
        """What a door renders from this snapshot once (the JSON, the text matrix, the
        picture at /): computed on first use, dropped with the snapshot."""
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = make()
        return got

    def _json(self) -> tuple[bytes, str]:
        from topoagent.agent_schema import topology_document

        body = json.dumps(topology_document(self), indent=1).encode()
        return body, etag_of(body)

    @property
    def body(self) -> bytes:
        return self.cached("json", self._json)[0]

    @property
    def etag(self) -> str:
        return self.cached("json", self._json)[1]

    @property
    def matrix_text(self) -> str:
        """The derived matrix printed the way `nvidia-smi topo -m` does (?format=matrix)."""
        from topoagent.collectors.nvidia_smi import render_topo_matrix

        return self.cached("matrix", lambda: render_topo_matrix(self.node.topo_matrix()))


def etag_of(body: bytes) -> str:
    return '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
