"""Agent side of probing: run the worker as a child process and read what it measured.

Torch never enters the agent process: the worker (``topoagent.probes.worker``) is started
with ``asyncio.create_subprocess_exec``, fed its plan on stdin, and read line by line.
A round that overruns its timeout is killed; a worker that crashes, runs out of memory
or hits a CUDA error ends the round with a typed ``ProbeFailure`` (results it sent
before failing are kept), and ``ProbeRunner`` then backs off geometrically before it
starts another worker, so a broken GPU is not hammered every few seconds.

For the service: ``ProbeRunner.latest_figures()`` gives the newest figure per
measurement and direction, ``ProbeRunner.latest_round()`` the last round with its
failure (if any) and duration — what ``/metrics`` and ``POST /probe`` need.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from topoagent.child import module_command
from topoagent.probes.figures import (
    FailureKind,
    FigureKey,
    MalformedRecord,
    ProbeFigure,
    ProbeSkip,
    RecordType,
    parse_failure,
    parse_figure,
    parse_skip,
)
from topoagent.probes.plan import validate_plan

WORKER_MODULE = "topoagent.probes.worker"
STDERR_TAIL_BYTES = 4096
WORKER_EXIT = {
    1: FailureKind.CRASH,
    2: FailureKind.PLAN_ERROR,
    3: FailureKind.OOM,
    4: FailureKind.CUDA_ERROR,
    5: FailureKind.UNAVAILABLE,
}


@dataclass(frozen=True, slots=True)
class ProbeFailure:
    """Why a round ended early."""

    kind: FailureKind
    message: str
    exit_code: int | None = None


@dataclass(frozen=True, slots=True)
class ProbeRound:
    """One run of the worker: what it measured, and how it ended."""

    backend: str
    started_at: float  # Unix time
    duration_s: float
    results: tuple[ProbeFigure, ...]
    skipped: tuple[ProbeSkip, ...] = ()
    worker: Mapping[str, Any] | None = None  # the worker's hello line
    failure: ProbeFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def figures(self) -> list[ProbeFigure]:
        """One figure per measurement and direction: bandwidth at the largest size.

        Small sizes are kept in ``results`` (they show fixed costs); the largest size is
        the plateau the link delivers and the figure the matrix and findings use.
        """
        best: dict[FigureKey, ProbeFigure] = {}
        for figure in self.results:
            held = best.get(figure.key)
            if held is None or (figure.size_bytes or 0) >= (held.size_bytes or 0):
                best[figure.key] = figure
        return list(best.values())


# Said wherever probes cannot run for want of torch: the agent's install lacks the extra.
TORCH_INSTALL_HINT = "install the probes extra: pip install '.[probes]' (from a checkout) or 'topoagent[probes]'"


def torch_missing() -> str | None:
    """Why the worker could not import torch, found without importing it here (the agent
    process never does); None when it is installed or this cannot tell (the worker then
    says).  The worker runs on this interpreter, so its search path answers; a finder
    only an import hook knows (an editable install) is asked too."""
    import importlib.machinery
    import importlib.util

    if importlib.machinery.PathFinder.find_spec("torch") is not None:
        return None
    try:
        if importlib.util.find_spec("torch") is not None:
            return None
    except (ImportError, ValueError):
        return None
    return f"torch is not installed in {sys.executable}: {TORCH_INSTALL_HINT}"


def worker_command() -> list[str]:
    """``python -P -m topoagent.probes.worker`` with the agent's own topoagent (a checkout too)."""
    return module_command(WORKER_MODULE)


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA indices = nvidia-smi/NVML indices
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


async def _tail(stream: asyncio.StreamReader) -> bytes:
    kept = b""
    while chunk := await stream.read(65536):
        kept = (kept + chunk)[-STDERR_TAIL_BYTES:]
    return kept


async def run_probe_round(
    plan: Mapping[str, Any],
    *,
    timeout_s: float,
    on_record: Callable[[ProbeFigure | ProbeSkip], None] | None = None,
    command: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    clock: Callable[[], float] = time.time,
    since: float | None = None,
) -> ProbeRound:
    """Run one worker over ``plan``; never raises for what the worker does.

    ``timeout_s`` counts from ``since`` (a ``time.monotonic()`` reading) when given, so a
    caller can make it cover its own preparation too; by default from this call.

    ``on_record`` sees every result and skipped line as it arrives (progress bars).
    A result or skipped line that does not parse ends the round as a crash naming what
    was wrong (the lines before it are kept).
    ``command`` replaces the worker command line (tests stand in a hung or crashing
    worker there, the hardware edge we cannot produce on a CPU).
    """
    validate_plan(plan)
    started_at = clock()
    t0 = time.monotonic()
    remaining_s = timeout_s - (t0 - since) if since is not None else timeout_s
    results: list[ProbeFigure] = []
    skipped: list[ProbeSkip] = []
    hello: dict[str, Any] | None = None
    reported: ProbeFailure | None = None
    malformed: str | None = None  # what was wrong with the first line that did not parse
    finished = False

    def end(failure: ProbeFailure | None) -> ProbeRound:
        return ProbeRound(
            backend=str(plan["backend"]),
            started_at=started_at,
            duration_s=time.monotonic() - t0,
            results=tuple(results),
            skipped=tuple(skipped),
            worker=hello,
            failure=failure,
        )

    if remaining_s <= 0:  # the caller's preparation used up the whole budget
        return end(ProbeFailure(FailureKind.TIMEOUT, f"the round ran past {timeout_s:g} s before the worker started"))
    try:
        proc = await asyncio.create_subprocess_exec(
            *(command or worker_command()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env) if env is not None else worker_env(),
            start_new_session=True,  # a signal to the agent's group does not reach it
            limit=1 << 20,
        )
    except OSError as exc:
        return end(ProbeFailure(FailureKind.UNAVAILABLE, f"cannot start the probe worker: {exc}"))

    assert proc.stdin and proc.stdout and proc.stderr
    stdin, stdout = proc.stdin, proc.stdout
    stderr_task = asyncio.create_task(_tail(proc.stderr))

    async def converse() -> None:
        nonlocal hello, reported, malformed, finished
        try:
            stdin.write(json.dumps(plan).encode())
            await stdin.drain()
            stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died at once; its exit status tells why
        async for raw in stdout:
            try:
                record = json.loads(raw)
            except ValueError:
                continue  # a library printing to stdout; not ours
            if not isinstance(record, dict):
                continue
            try:
                match record.get("type"):
                    case RecordType.HELLO:
                        hello = record
                    case RecordType.RESULT:
                        figure = parse_figure(record | {"received_at": clock()})
                        results.append(figure)
                        if on_record:
                            on_record(figure)
                    case RecordType.SKIPPED:
                        skip = parse_skip(record)
                        skipped.append(skip)
                        if on_record:
                            on_record(skip)
                    case RecordType.FAILURE:
                        said = parse_failure(record)
                        reported = ProbeFailure(said.failure, said.message)
                    case RecordType.DONE:
                        finished = True
            except MalformedRecord as exc:
                if malformed is None:
                    malformed = f"the worker sent a malformed {record.get('type')} line: {exc}"
        await proc.wait()

    timed_out = False
    try:
        await asyncio.wait_for(converse(), remaining_s)
    except TimeoutError:  # TimeoutError itself from 3.11 on
        timed_out = True
    finally:
        if proc.returncode is None:  # timed out, or the agent is being cancelled
            proc.kill()
            await proc.wait()
    err_tail = (await stderr_task).decode(errors="replace").strip()
    rc = proc.returncode

    if timed_out:
        return end(ProbeFailure(FailureKind.TIMEOUT, f"worker ran past {timeout_s:g} s and was killed", rc))
    if reported is not None:
        return end(replace(reported, exit_code=rc))
    if malformed is not None:
        return end(ProbeFailure(FailureKind.CRASH, malformed, rc))
    if rc is not None and rc < 0:
        name = _signal_name(-rc)
        if -rc == signal.SIGKILL:
            return end(ProbeFailure(FailureKind.OOM, "worker killed by SIGKILL, most likely by the kernel's OOM killer", rc))
        return end(ProbeFailure(FailureKind.CRASH, f"worker killed by {name}" + _last_line(err_tail), rc))
    if rc != 0:
        kind = WORKER_EXIT.get(rc or 1, FailureKind.CRASH)
        return end(ProbeFailure(kind, f"worker exited with status {rc}" + _last_line(err_tail), rc))
    if not finished:
        return end(ProbeFailure(FailureKind.CRASH, "worker exited before finishing its plan" + _last_line(err_tail), rc))
    return end(None)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return f": {lines[-1].strip()[:300]}" if lines else ""


@dataclass
class ProbeRunner:
    """Runs rounds one at a time, keeps the newest figures, backs off after failures.

    After the n-th failure in a row the next round waits ``backoff_base_s * 2**(n-1)``
    seconds (capped at ``backoff_max_s``) unless forced; a good round resets it.
    """

    timeout_s: float = 600.0
    backoff_base_s: float = 60.0
    backoff_max_s: float = 3600.0
    clock: Callable[[], float] = time.time
    command: Sequence[str] | None = None
    consecutive_failures: int = 0
    retry_at: float = 0.0
    _latest: ProbeRound | None = None
    _figures: dict[FigureKey, ProbeFigure] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def backoff_s(self) -> float:
        if self.consecutive_failures == 0:
            return 0.0
        return min(self.backoff_base_s * 2 ** (self.consecutive_failures - 1), self.backoff_max_s)

    async def run(
        self,
        plan: Mapping[str, Any],
        *,
        force: bool = False,
        on_record: Callable[[ProbeFigure | ProbeSkip], None] | None = None,
    ) -> ProbeRound:
        async with self._lock:  # one worker at a time: probes must not disturb each other
            now = self.clock()
            if not force and now < self.retry_at:
                return ProbeRound(
                    backend=str(plan["backend"]),
                    started_at=now,
                    duration_s=0.0,
                    results=(),
                    failure=ProbeFailure(
                        FailureKind.BACKOFF,
                        f"{self.consecutive_failures} failed round(s) in a row; "
                        f"next try in {self.retry_at - now:.0f} s",
                    ),
                )
            probe_round = await run_probe_round(
                plan, timeout_s=self.timeout_s, on_record=on_record, command=self.command, clock=self.clock
            )
            for figure in probe_round.figures():
                self._figures[figure.key] = figure
            self._latest = probe_round
            if probe_round.ok:
                self.consecutive_failures = 0
                self.retry_at = 0.0
            else:
                self.consecutive_failures += 1
                self.retry_at = self.clock() + self.backoff_s()
            return probe_round

    def latest_round(self) -> ProbeRound | None:
        return self._latest

    def latest_figures(self) -> list[ProbeFigure]:
        """Newest figure per measurement and direction, across all rounds so far."""
        return list(self._figures.values())
