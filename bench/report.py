"""Run the benchmarks and write their figures into the docs, between markers.

    python bench/report.py [--quick] [--only NAME ...] [--page FILE ...]
    python bench/report.py --check [--page FILE ...]

Every figure in the docs comes from here, never typed by hand.  A block is

    <!-- figures:NAME -->
    (what NAME's generator prints: markdown)

    _Measured ... machine, load, date, git revision._
    <!-- /figures:NAME -->

and it may stand in any page: README.md or docs/*.md (most are in docs/benchmarks.md).
Only the lines between a block's markers are rewritten; the rest of the page is kept
byte for byte.  ``GENERATORS`` maps each NAME to the command that prints it; a NAME
stands in one page only.  A generator that fails (or is not there yet) is skipped with a
line saying why, and its block keeps what it had.  ``--check`` runs nothing: it verifies
that every block names a known generator, that the markers are balanced and that no
block is in two pages (exit 1 otherwise).  ``--quick`` asks each generator for fewer
samples, so that a full regeneration takes minutes on a 2-core machine; the block says
which mode wrote it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Generator:
    argv: tuple[str, ...]  # after the interpreter, run from the checkout's root
    quick: tuple[str, ...] = ()  # added with --quick


GENERATORS: dict[str, Generator] = {
    "discovery": Generator(("-m", "bench.discovery", "--markdown"), ("--runs", "7")),
    # CPU time beside lstopo on hwloc's recordings, and idle RSS beside node_exporter (#38).
    # The command at 835f05c (before #38's import cuts of this round) measured in the same rounds.
    "discovery-lstopo": Generator(("-m", "bench.discovery", "--recordings", "--rev", "835f05c", "--markdown"), ("--runs", "5")),
    "footprint": Generator(("-m", "bench.footprint", "--markdown"), ("--rounds", "2", "--idle-seconds", "3")),
    "placement": Generator(("-m", "bench.placement", "--only", "latency", "--markdown"), ("--quick",)),
    "simulation": Generator(("-m", "bench.placement", "--only", "simulate", "--markdown"), ("--quick",)),
    "service": Generator(("bench/service.py", "--markdown"), ("--seconds", "5", "--idle-seconds", "10")),
    "deadline": Generator(("-m", "bench.placement", "--only", "deadline", "--markdown"), ("--quick",)),
    "loaded": Generator(("-m", "bench.placement", "--only", "loaded", "--markdown"), ("--quick",)),
    # Medians over five streams: which policy makes fewer pods wait changes from one stream to the next.
    "cluster": Generator(("-m", "bench.cluster", "--markdown", "--seeds", "1,2,3,4,5"), ("--quick",)),
    "meshfloor": Generator(("-m", "bench.mesh_floor", "--markdown"), ("--requests", "6")),
    # The irregular-mesh deadline study against the search before #38 (37da41e), interleaved.
    "meshversus": Generator(("-m", "bench.placement_versus", "--rev", "37da41e", "--mesh", "--samples", "100", "--rounds", "4"),
                            ("--rounds", "2")),
    "meshversus-cpu": Generator(
        ("-m", "bench.placement_versus", "--rev", "37da41e", "--mesh", "--sizes", "32,64,128", "--samples", "100", "--rounds", "4",
         "--cpu-only"),
        ("--rounds", "2"),
    ),
    "meshversus-loaded": Generator(
        ("-m", "bench.placement_versus", "--rev", "37da41e", "--mesh", "--samples", "100", "--rounds", "4", "--spinners", "2"),
        ("--rounds", "2"),
    ),
    "series": Generator(("-m", "bench.series", "--markdown")),
    # Issue #39's stream with and without holds, the pattern as given and sustained (medians of nine seeds).
    "holds": Generator(("-m", "bench.cluster_replay", "--starve", "--markdown", "--seeds", "0-8"), ("--seeds", "0-2")),
    "holds-sustained": Generator(("-m", "bench.cluster_replay", "--starve", "--markdown", "--seeds", "0-8", "--rounds", "30"),
                                 ("--seeds", "0-2")),
    # The pattern as given on real agents and the real extender, without holds and with guards.
    "holds-cluster": Generator(("-m", "bench.cluster", "--starve", "--markdown", "--seeds", "0-8"), ("--seeds", "0-2")),
    # Sustained, a hold taking the node with the most GPUs free instead of the soonest to free up.
    "holds-choice": Generator(("-m", "bench.cluster_replay", "--starve", "--markdown", "--seeds", "0-8", "--rounds", "30",
                               "--holds", "guard+30,guard+10,30", "--hold-choice", "most-free"), ("--seeds", "0-2")),
    # Both, with a kube-scheduler that waits out each backoff (SchedulerPopFromBackoffQ off).
    "holds-nopop": Generator(("-m", "bench.cluster_replay", "--starve", "--markdown", "--seeds", "0-8", "--no-pop-from-backoff",
                              "--holds", "off,guard,guard+30"), ("--seeds", "0-2")),
    "holds-nopop-sustained": Generator(("-m", "bench.cluster_replay", "--starve", "--markdown", "--seeds", "0-8", "--rounds", "30",
                                        "--no-pop-from-backoff", "--holds", "off,guard,guard+30"), ("--seeds", "0-2")),
    "holds-waits": Generator(("-m", "bench.cluster_replay", "--starve", "--markdown", "--waits", "overload", "--seeds", "0",
                              "--holds", "off,guard")),
}

OPEN = re.compile(r"^<!-- figures:([a-z][a-z0-9-]*) -->$")
CLOSE = re.compile(r"^<!-- /figures:([a-z][a-z0-9-]*) -->$")
ANY = re.compile(r"<!--\s*/?\s*figures\b")  # anything that looks like one of ours


class MarkerError(ValueError):
    """A page's figure markers are not balanced, or one is malformed."""


@dataclass(frozen=True)
class Block:
    name: str
    start: int  # index of the line after the opening marker
    end: int  # index of the closing marker's line


def blocks(text: str) -> list[Block]:
    """Every figures block, in order; MarkerError on anything unbalanced or malformed."""
    out: list[Block] = []
    open_name, open_line = None, 0
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines()):
        opened, closed = OPEN.match(line), CLOSE.match(line)
        where = f"line {number + 1}"
        if opened:
            if open_name is not None:
                raise MarkerError(f"{where}: figures:{opened.group(1)} opens inside figures:{open_name} (opened on line {open_line + 1})")
            if opened.group(1) in seen:
                raise MarkerError(f"{where}: a second figures:{opened.group(1)} block")
            open_name, open_line = opened.group(1), number
        elif closed:
            if open_name is None:
                raise MarkerError(f"{where}: /figures:{closed.group(1)} closes a block that was never opened")
            if closed.group(1) != open_name:
                raise MarkerError(f"{where}: /figures:{closed.group(1)} closes figures:{open_name} (opened on line {open_line + 1})")
            out.append(Block(open_name, open_line + 1, number))
            seen.add(open_name)
            open_name = None
        elif ANY.search(line):
            raise MarkerError(f"{where}: a figures marker must be a line of its own, exactly "
                              f"'<!-- figures:NAME -->' or '<!-- /figures:NAME -->': {line.strip()!r}")
    if open_name is not None:
        raise MarkerError(f"line {open_line + 1}: figures:{open_name} is never closed")
    return out


def rewrite(text: str, name: str, content: str) -> str:
    """``text`` with block ``name``'s lines replaced by ``content``; nothing else changes."""
    block = next((b for b in blocks(text) if b.name == name), None)
    if block is None:
        raise MarkerError(f"no figures:{name} block")
    lines = text.splitlines(keepends=True)
    body = content if content.endswith("\n") else content + "\n"
    return "".join(lines[: block.start]) + body + "".join(lines[block.end:])


def pages() -> list[Path]:
    """Where figures blocks may stand: the README and every page under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def check(text: str) -> list[str]:
    """What is wrong with one page's markers (empty: nothing)."""
    try:
        found = blocks(text)
    except MarkerError as exc:
        return [str(exc)]
    return [f"figures:{b.name} has no generator in bench/report.py (known: {', '.join(GENERATORS)})"
            for b in found if b.name not in GENERATORS]


def check_pages(texts: dict[Path, str]) -> list[str]:
    """What is wrong with the pages' markers, each page's and across them (empty: nothing)."""
    problems = [f"{path}: {problem}" for path, text in texts.items() for problem in check(text)]
    if problems:
        return problems
    where: dict[str, Path] = {}
    for path, text in texts.items():
        for block in blocks(text):
            if block.name in where:
                problems.append(f"{path}: figures:{block.name} is also in {where[block.name]}: a block stands in one page")
            where.setdefault(block.name, path)
    return problems


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def revision() -> str:
    rev = _git("rev-parse", "--short=10", "HEAD") or "unknown revision"
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)README.md", ":(exclude)docs/*.md")
    return rev + (" with uncommitted changes" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def machine(name: str, quick: bool, load_before: str) -> str:
    """The line naming where, when and on what the block's figures were measured."""
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    mode = " --quick" if quick else ""
    return (f"_Written by `python bench/report.py{mode} --only {name}` on {cpu_model()}, "
            f"{os.cpu_count()} cores, load average (1/5/15 min) {load_before} before and {load()} after, "
            f"{when}, git {revision()}, Python {sys.version.split()[0]}._")


def generate(name: str, quick: bool, timeout_s: float) -> str:
    """The block's new content; RuntimeError saying why when the generator fails."""
    gen = GENERATORS[name]
    argv = [sys.executable, *gen.argv, *(gen.quick if quick else ())]
    # Children run this checkout, with bytecode cached as an installed agent has it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PYTHONPATH": str(REPO)}
    before = load()
    try:
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(argv[1:])}` ran past {timeout_s:.0f} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"`{' '.join(argv[1:])}` exited {done.returncode}: {last}")
    if not done.stdout.strip():
        raise RuntimeError(f"`{' '.join(argv[1:])}` printed nothing")
    return done.stdout.strip() + "\n\n" + machine(name, quick, before) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="extend", nargs="+", choices=sorted(GENERATORS), metavar="NAME",
                        help=f"regenerate only these blocks (one or more, or repeated): {', '.join(GENERATORS)}")
    parser.add_argument("--quick", action="store_true", help="fewer samples: minutes instead of tens of minutes")
    parser.add_argument("--check", action="store_true", help="verify the markers; run nothing")
    parser.add_argument("--page", "--readme", dest="pages", action="append", type=Path, metavar="FILE",
                        help="a page holding figures blocks (repeatable; default: README.md and docs/*.md)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one generator may run")
    args = parser.parse_args(argv)
    texts = {path: path.read_text() for path in args.pages or pages()}
    problems = check_pages(texts)
    if problems:
        for problem in problems:
            print(f"report: {problem}", file=sys.stderr)
        return 1
    if args.check:
        return 0
    page_of = {block.name: path for path, text in texts.items() for block in blocks(text)}
    wanted = args.only or list(page_of)
    failed = False
    for name in wanted:
        if name not in page_of:
            print(f"report: skipped {name}: no page has a figures:{name} block", file=sys.stderr)
            failed = failed or bool(args.only)
            continue
        print(f"report: running {name} ...", file=sys.stderr, flush=True)
        try:
            content = generate(name, args.quick, args.timeout)
        except RuntimeError as exc:
            print(f"report: skipped {name}: {exc}", file=sys.stderr)
            failed = failed or bool(args.only)
            continue
        page = page_of[name]
        page.write_text(rewrite(page.read_text(), name, content))  # re-read: keep edits made meanwhile
        print(f"report: wrote figures:{name} in {page}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
