"""Each link's long memory: its first healthy figure and a slow moving reference.

The schedule's baseline follows the link (a drift becomes the new baseline), so a link
that loses a few per cent per round -- a marginal cable, a retimer going bad -- never
steps outside the tolerance and never raises anything.  This book keeps, per probe
target (``pair:0-1``, ``gpu:3``):

- ``first``: the first figure of a good round not taken under load, kept until the
  link's facts change (``forget``);
- ``reference``: a moving average of those figures, each round moving it
  ``REFERENCE_WEIGHT`` of the way, so one outlier barely moves it and a sustained change
  shows within a few rounds.

``decayed(tolerance)`` lists the links whose reference has lost more than the tolerance
against their first figure: a cumulative loss, whatever each step did.

It also keeps, per lease, the figures its GPUs' links had when the lease was granted,
so what a job leaves behind can be compared with what it was given.

Persisted in ``<state_dir>/probe-baselines.json`` (written atomically, after every
change) so a restart does not forget; a file that cannot be read is moved aside to
``probe-baselines.json.corrupt`` and the book starts empty.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from topoagent.smallfile import read_small_file
from topoagent.statefile import write_json_atomically

MAX_BOOK_BYTES = 16 << 20  # a figure per link of the largest node, and the leases' figures, many times over

STATE_FILE = "probe-baselines.json"
SCHEMA = 1
REFERENCE_WEIGHT = 0.25


@dataclass(frozen=True, slots=True)
class LinkHistory:
    first: float  # GB/s, the first healthy figure
    reference: float  # GB/s, the slow moving average of healthy figures
    rounds: int  # healthy figures seen
    first_at: float  # Unix time of the first
    updated_at: float  # Unix time of the latest

    @property
    def loss(self) -> float:
        """Fraction of the first figure the reference has lost (negative: it gained)."""
        return 1.0 - self.reference / self.first


class BaselineBook:
    def __init__(self, state_dir: Path | str | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(state_dir) / STATE_FILE if state_dir is not None else None
        self.clock = clock
        self.links: dict[str, LinkHistory] = {}
        self.leases: dict[str, dict[str, float]] = {}  # lease id -> target key -> figure at grant
        self.load_error: str | None = None  # why the file on disk was not read
        self._load()

    # --- the file ---------------------------------------------------------------------
    def _load(self) -> None:
        if self.path is None:
            return
        try:
            raw, _ = read_small_file(self.path, MAX_BOOK_BYTES, follow_links=False)
        except FileNotFoundError:
            return
        except OSError as exc:  # a FIFO, a link, a directory in its place: said, never waited on
            self.load_error = f"{type(exc).__name__}: {exc}"
            return
        try:
            if len(raw) > MAX_BOOK_BYTES:
                raise ValueError(f"larger than {MAX_BOOK_BYTES} bytes")
            doc = json.loads(raw)
            if doc.get("schema") != SCHEMA:
                raise ValueError(f"schema {doc.get('schema')!r}, this agent reads {SCHEMA}")
            links = {str(k): LinkHistory(**v) for k, v in doc.get("links", {}).items()}
            for history in links.values():
                if not (math.isfinite(history.first) and history.first > 0 and math.isfinite(history.reference)):
                    raise ValueError(f"a figure that is not a positive number: {history}")
            leases = {str(k): {str(t): float(f) for t, f in v.items()} for k, v in doc.get("leases", {}).items()}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(OSError):
                os.replace(self.path, self.path.with_name(self.path.name + ".corrupt"))
            return
        self.links, self.leases = links, leases

    def save(self) -> None:
        if self.path is None:
            return
        write_json_atomically(
            self.path,
            {"schema": SCHEMA, "links": {k: asdict(v) for k, v in self.links.items()}, "leases": self.leases},
        )

    # --- links ------------------------------------------------------------------------
    def observe(self, key: str, figure: float) -> LinkHistory:
        """A healthy figure for this link: the first one, or one more for the reference."""
        now = self.clock()
        held = self.links.get(key)
        if held is None:
            history = LinkHistory(first=figure, reference=figure, rounds=1, first_at=now, updated_at=now)
        else:
            reference = held.reference + REFERENCE_WEIGHT * (figure - held.reference)
            history = LinkHistory(held.first, reference, held.rounds + 1, held.first_at, now)
        self.links[key] = history
        self.save()
        return history

    def forget(self, keys: Iterable[str]) -> None:
        """The link's facts changed: its old figures say nothing about the new one."""
        gone = [k for k in keys if k in self.links]
        for key in gone:
            del self.links[key]
        if gone:
            self.save()

    def decayed(self, tolerance: float) -> list[tuple[str, LinkHistory]]:
        return sorted((k, h) for k, h in self.links.items() if h.rounds > 1 and h.loss > tolerance)

    # --- leases -----------------------------------------------------------------------
    def record_lease(self, lease_id: str, figures: Mapping[str, float]) -> None:
        self.leases[lease_id] = dict(figures)
        self.save()

    def end_lease(self, lease_id: str) -> dict[str, float]:
        """The figures recorded when the lease was granted (forgotten now)."""
        figures = self.leases.pop(lease_id, None)
        if figures is None:
            return {}
        self.save()
        return figures
