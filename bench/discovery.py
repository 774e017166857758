"""Discovery time: in-process, as a whole command, and against hwloc's lstopo, side by side.

    python -m bench.discovery [--runs N] [--root SNAPSHOT] [--markdown]    (from a checkout's root)
    python -m bench.discovery --recordings [--rev REV] [--runs N] [--markdown]

Prints medians.  The in-process figure runs on --root (default: fixtures/snapshots/dgx-a100)
and on the live machine; the command comparison alternates `topoagent discover --json`,
`lstopo-no-graphics --of xml` and a floor (FLOOR: the interpreter importing the standard
modules the design needs, nothing of ours) on the live machine so all three see the same
load.  Child processes run this checkout's topoagent (PYTHONPATH), not whichever copy is
installed.

--recordings compares CPU time (user + system, from getrusage(RUSAGE_CHILDREN) around each
whole command), not wall time, since the machine is shared: `topoagent discover --json
--root DIR` against `lstopo-no-graphics --whole-io --of xml -` with HWLOC_FSROOT=DIR, on
hwloc's own test recordings (../shared/hwloc/linux beside the checkout, and the one shipped
in tests/data/hwloc, so a clean clone has one), alternated round by round, with the
interpreter's own start beside them: `python -c pass` (what a console script pays before its
first line) and `python -I -S -c pass` (no site packages: the least any Python process
costs).  Beside each, in-process discovery of the same recording (a fresh Host each run, the
imports warm): what a running agent's rediscovery costs beyond any start-up.  With --rev REV
the rounds also run that revision's `topoagent discover --json --root` (``git archive REV``
unpacked into a temporary directory, its own bytecode cached first), so the block shows the
command before and after a change, measured in the same rounds.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from topoagent.node.discovery import discover_sync
from topoagent.node.host import Host

REPO = Path(__file__).resolve().parents[1]

# The interpreter with no site packages and no environment: the least any Python process costs.
BARE = ("-I", "-S")
# An installed agent runs from compiled bytecode; a shell with PYTHONDONTWRITEBYTECODE
# would make every run compile every module again and time the compiler instead.
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PYTHONPATH": str(REPO)}


@dataclass(frozen=True)
class Run:
    seconds: float
    max_rss_kib: int


# A child forked from this Python process starts with its memory counted in its peak
# (Linux keeps the pre-exec peak), so wait4 alone would give every command this process's
# RSS as a floor.  GNU time (Debian package 'time') forks the command from a small
# process and reports its own peak; without it the figure is an upper bound.  GNU time
# adds its own start (about 1 ms: 8 % of lstopo's 16 ms), so the time is taken from a run
# without it and the peak from a second run under it.
GNU_TIME = "/usr/bin/time" if Path("/usr/bin/time").is_file() else None
MEMORY_NOTE = "" if GNU_TIME else " (upper bound: /usr/bin/time missing, so it includes the benchmark's own memory)"


def _run(argv: list[str]) -> tuple[float, int]:
    """Wall seconds and wait4's peak RSS (KiB) of one run of ``argv``."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=CHILD_ENV)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)}: exit status {os.waitstatus_to_exitcode(status)}")
    return seconds, usage.ru_maxrss


def command(argv: list[str], memory: bool = False) -> Run:
    """Wall time of one run of ``argv``; with ``memory``, its peak resident memory from a
    second run under GNU time (else wait4's upper bound, see above)."""
    seconds, max_rss_kib = _run(argv)
    if memory and GNU_TIME:
        with tempfile.NamedTemporaryFile("r") as peak:
            _run([GNU_TIME, "-f", "%M", "-o", peak.name, *argv])
            max_rss_kib = int(peak.read().split()[-1])
    return Run(seconds, max_rss_kib)


def in_process(root: str | Path, runs: int) -> float:
    times = []
    with Host(root) as host:
        for _ in range(runs):
            start = time.perf_counter()
            discover_sync(host)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_ms(runs: list[Run]) -> float:
    return statistics.median(r.seconds for r in runs) * 1e3


def median_mib(runs: list[Run]) -> float:
    return statistics.median(r.max_rss_kib for r in runs) / 1024


TOPOAGENT = [sys.executable, "-m", "topoagent", "discover", "--json"]
LSTOPO_ARGS = ["--whole-io", "--of", "xml", "-"]
# What any `topoagent` command pays before a line of ours runs: the interpreter and the
# standard modules the design commits to (argparse for the CLI, dataclasses for facts,
# json, pathlib, typing).  Our time above this is what our own code can still win back.
FLOOR_MODULES = ("argparse", "dataclasses", "json", "pathlib", "typing")
FLOOR = [sys.executable, "-c", f"import {', '.join(FLOOR_MODULES)}"]


def measure(runs: int, root: str | Path) -> dict[str, float | str]:
    """Every figure the docs quote about discovery, by name."""
    figures: dict[str, float | str] = {
        "in_process_replay_ms": in_process(root, runs) * 1e3,
        "in_process_live_ms": in_process("/", runs) * 1e3,
    }
    replay = TOPOAGENT + ["--root", str(root)]
    figures["command_first_ms"] = command(replay).seconds * 1e3  # also writes the bytecode caches
    figures["command_replay_ms"] = median_ms([command(replay) for _ in range(runs)])
    figures["interpreter_ms"] = median_ms([command([sys.executable, "-c", "pass"]) for _ in range(runs)])
    lstopo = shutil.which("lstopo-no-graphics")
    if lstopo is None:
        figures["lstopo"] = "lstopo-no-graphics not installed: no side-by-side comparison"
        return figures
    ours: list[Run] = []
    theirs: list[Run] = []
    floor: list[Run] = []
    for _ in range(runs):  # alternate so all three see the same machine state
        ours.append(command(TOPOAGENT, memory=True))
        theirs.append(command([lstopo, *LSTOPO_ARGS], memory=True))
        floor.append(command(FLOOR))
    figures |= {
        "live_ms": median_ms(ours), "lstopo_ms": median_ms(theirs),
        "live_mib": median_mib(ours), "lstopo_mib": median_mib(theirs),
        "floor_ms": median_ms(floor),
    }
    # Ratios and differences pair by pair (each round ran back to back), then their median.
    figures["time_ratio"] = statistics.median(a.seconds / b.seconds for a, b in zip(ours, theirs))
    figures["memory_ratio"] = statistics.median(a.max_rss_kib / b.max_rss_kib for a, b in zip(ours, theirs))
    figures["floor_ratio"] = statistics.median(a.seconds / b.seconds for a, b in zip(floor, theirs))
    figures["above_floor_ms"] = statistics.median(a.seconds - b.seconds for a, b in zip(ours, floor)) * 1e3
    return figures


def markdown(figures: dict[str, float | str], runs: int, root: str | Path) -> list[str]:
    """The docs' block: the same figures as a table."""
    f = figures
    out = [
        f"Medians of {runs} runs; child processes run this checkout with its bytecode cached, as an"
        " installed agent does.",
        "",
        "| what | wall (median) | peak memory |",
        "|---|---:|---:|",
        f"| discovery in-process, recorded `{Path(root).name}` | {f['in_process_replay_ms']:.1f} ms | |",
        f"| discovery in-process, this machine (`/`) | {f['in_process_live_ms']:.1f} ms | |",
        f"| `python -c pass` (interpreter start alone) | {f['interpreter_ms']:.0f} ms | |",
        f"| `topoagent discover --json --root {Path(root).name}` | {f['command_replay_ms']:.0f} ms | |",
    ]
    if "lstopo" in f:
        out += ["", str(f["lstopo"])]
        return out
    out += [
        f"| `topoagent discover --json`, this machine | {f['live_ms']:.0f} ms | {f['live_mib']:.0f} MiB |",
        f"| `lstopo-no-graphics {' '.join(LSTOPO_ARGS)}`, this machine | {f['lstopo_ms']:.0f} ms | {f['lstopo_mib']:.0f} MiB |",
        f"| ratio, pair by pair (alternated runs) | {f['time_ratio']:.1f}× | {f['memory_ratio']:.1f}× |",
        f"| Python + the standard modules the design needs (`{', '.join(FLOOR_MODULES)}`), imported alone"
        f" | {f['floor_ms']:.0f} ms | |",
        f"| its ratio to lstopo, pair by pair: the floor under any ratio of ours | {f['floor_ratio']:.1f}× | |",
        f"| `topoagent discover --json` above that floor, pair by pair | {f['above_floor_ms']:.0f} ms | |",
    ]
    if MEMORY_NOTE:
        out += ["", "Peak memory" + MEMORY_NOTE + "."]
    return out


def lines(figures: dict[str, float | str], runs: int, root: str | Path) -> list[str]:
    f = figures
    out = [
        f"in-process discover, {Path(root).name}: {f['in_process_replay_ms']:.1f} ms; live /: "
        f"{f['in_process_live_ms']:.1f} ms (median of {runs})",
        f"whole command `topoagent discover --json --root {Path(root).name}`: {f['command_replay_ms']:.0f} ms"
        f" (first run {f['command_first_ms']:.0f} ms; interpreter start alone {f['interpreter_ms']:.0f} ms)",
    ]
    if "lstopo" in f:
        out.append(str(f["lstopo"]))
    else:
        out.append(
            f"live: `topoagent discover --json` {f['live_ms']:.0f} ms, {f['live_mib']:.0f} MiB | "
            f"`lstopo-no-graphics --of xml` {f['lstopo_ms']:.0f} ms, {f['lstopo_mib']:.0f} MiB | "
            f"ratio {f['time_ratio']:.1f}× time, {f['memory_ratio']:.1f}× memory (medians of {runs}, alternated)"
        )
        out.append(
            f"floor: Python importing {', '.join(FLOOR_MODULES)} {f['floor_ms']:.0f} ms, "
            f"ratio {f['floor_ratio']:.1f}× to lstopo; topoagent above it {f['above_floor_ms']:.0f} ms "
            f"(medians of {runs}, alternated with the two above)"
        )
    return out


# hwloc's recordings: beside the checkout (the test suite's oracle), and the one shipped here.
HWLOC_RECORDINGS = (REPO.parent / "shared" / "hwloc" / "linux", REPO / "tests" / "data" / "hwloc")


def cpu_seconds(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> float:
    """User + system CPU seconds of one run of ``argv`` (getrusage of the reaped child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit status {done.returncode}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def in_process_cpu(root: str | Path, runs: int) -> tuple[float, float]:
    """Median and least CPU seconds (user + system) of one in-process discovery, a fresh
    Host each.  The least too: a second of another process's load on this core's sibling
    inflates every run it overlaps, never deflates one."""
    discover_sync(Host(root))  # imports and caches warm, as in a running agent
    times = []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_SELF)
        with Host(root) as host:
            discover_sync(host)
        after = resource.getrusage(resource.RUSAGE_SELF)
        times.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    return statistics.median(times), min(times)


def extract(rev: str, into: Path) -> str:
    """``git archive REV`` unpacked into ``into``; the commit's short name."""
    named = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", "--short", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if named.returncode:
        raise SystemExit(f"--rev {rev}: not a commit in {REPO}")
    archive = subprocess.Popen(["git", "-C", str(REPO), "archive", rev], stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, capture_output=True, text=True)
    assert archive.stdout is not None
    archive.stdout.close()
    if archive.wait() or untar.returncode:
        raise SystemExit(f"--rev {rev}: extracting it failed: {untar.stderr.strip()}")
    return named.stdout.strip()


def recordings(runs: int, rev: str | None = None) -> tuple[list[dict[str, float | str]], str | None]:
    """Per hwloc recording: median CPU ms of ours (and of revision ``rev``'s command),
    lstopo's, the interpreter's and in-process discovery's, and the medians of the per-round
    ratios to lstopo; and ``rev``'s short commit name."""
    lstopo = shutil.which("lstopo-no-graphics")
    if lstopo is None:
        raise SystemExit("lstopo-no-graphics not installed (Debian: apt-get install hwloc-nox): no peer to measure beside")
    tarballs = sorted(t for d in HWLOC_RECORDINGS for t in d.glob("*.tar.bz2"))
    rows: list[dict[str, float | str]] = []
    commit = None
    with tempfile.TemporaryDirectory(prefix="bench-discovery-") as tmp:
        if rev is not None:
            before_tree = Path(tmp) / "before"
            before_tree.mkdir()
            commit = extract(rev, before_tree)
            # cwd too: `python -m` puts the working directory first on sys.path.
            before_env = CHILD_ENV | {"PYTHONPATH": str(before_tree)}
        for tarball in tarballs:
            name = tarball.name.removesuffix(".tar.bz2")
            with Host(tarball) as host:  # unpacked once, by the same code --root uses
                root = str(host.root)
                shutil.copytree(root, Path(tmp) / name, symlinks=True)
            root = str(Path(tmp) / name)
            ours_argv = [*TOPOAGENT, "--root", root]
            theirs_env = dict(os.environ, HWLOC_FSROOT=root, HWLOC_COMPONENTS="linux,stop", LC_ALL="C")
            cpu_seconds(ours_argv, CHILD_ENV)  # bytecode caches written before the first timed run
            if rev is not None:
                cpu_seconds(ours_argv, before_env, cwd=before_tree)
            ours, theirs, floor, bare, before = [], [], [], [], []
            for _ in range(runs):  # alternated, so all of them see the same machine
                ours.append(cpu_seconds(ours_argv, CHILD_ENV))
                theirs.append(cpu_seconds([lstopo, *LSTOPO_ARGS], theirs_env))
                floor.append(cpu_seconds([sys.executable, "-c", "pass"], CHILD_ENV))
                bare.append(cpu_seconds([sys.executable, *BARE, "-c", "pass"], CHILD_ENV))
                if rev is not None:
                    before.append(cpu_seconds(ours_argv, before_env, cwd=before_tree))
            in_median, _ = in_process_cpu(root, max(runs, 15))
            row: dict[str, float | str] = {
                "name": name, "shipped": "yes" if tarball.parent == HWLOC_RECORDINGS[1] else "",
                "ours_ms": statistics.median(ours) * 1e3, "lstopo_ms": statistics.median(theirs) * 1e3,
                "floor_ms": statistics.median(floor) * 1e3,
                "ratio": statistics.median(a / b for a, b in zip(ours, theirs)),
                "floor_ratio": statistics.median(a / b for a, b in zip(floor, theirs)),
                "bare_ms": statistics.median(bare) * 1e3,
                "bare_ratio": statistics.median(a / b for a, b in zip(bare, theirs)),
                "in_process_ms": in_median * 1e3, "in_process_ratio": in_median / statistics.median(theirs),
            }
            if before:
                row |= {"before_ms": statistics.median(before) * 1e3,
                        "before_ratio": statistics.median(a / b for a, b in zip(before, theirs))}
            rows.append(row)
    return rows, commit


def recordings_markdown(rows: list[dict[str, float | str]], runs: int, in_process_ms: tuple[float, float], in_runs: int,
                        commit: str | None = None) -> list[str]:
    before = f" before ({commit})" if commit else ""
    out = [
        f"CPU time (user + system, getrusage of each whole command), not wall time: the machine is shared."
        f" Medians of {runs} alternated rounds; ratios are medians of each round's ratio."
        " Peer: Debian's hwloc `lstopo-no-graphics --whole-io --of xml -` on the same unpacked recording"
        " (HWLOC_FSROOT). `python -c pass` is the interpreter's own start under the same environment,"
        " what a console script pays before its first line; `python -I -S -c pass` starts it without"
        " site packages: no Python process costs less."
        + (f" The command{before} is the same command at git {commit}, run in the same rounds." if commit else "")
        + f" In-process: discovery of the same recording in a running interpreter (a fresh Host each run,"
        f" imports warm; median of {max(runs, 15)}), what an agent's rediscovery costs.",
        "",
        "| hwloc recording | lstopo | `topoagent discover --json --root` | ratio |"
        + (f" the command{before} | ratio |" if commit else "")
        + " `python -c pass` | ratio | `python -I -S -c pass` | ratio | in-process discovery | ratio |",
        "|---|---:|---:|---:|" + ("---:|---:|" if commit else "") + "---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        shipped = " (shipped in tests/data/hwloc)" if r["shipped"] else ""
        was = f" {r['before_ms']:.0f} ms | {r['before_ratio']:.1f}× |" if commit else ""
        out.append(f"| {r['name']}{shipped} | {r['lstopo_ms']:.1f} ms | {r['ours_ms']:.0f} ms | {r['ratio']:.1f}× |{was}"
                   f" {r['floor_ms']:.0f} ms | {r['floor_ratio']:.1f}× | {r['bare_ms']:.1f} ms | {r['bare_ratio']:.1f}× |"
                   f" {r['in_process_ms']:.1f} ms | {r['in_process_ratio']:.1f}× |")
    out += ["", f"In-process discovery of the recorded `dgx-a100` (a fresh Host each run, imports warm): "
            f"{in_process_ms[0]:.1f} ms CPU, median of {in_runs} runs; least {in_process_ms[1]:.1f} ms."]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--root", default=str(REPO / "fixtures/snapshots/dgx-a100"))
    parser.add_argument("--recordings", action="store_true", help="CPU time against lstopo on hwloc's recordings")
    parser.add_argument("--rev", metavar="REV", help="with --recordings: also run this revision's command in the same rounds")
    parser.add_argument("--markdown", action="store_true", help="print its block in the docs (bench/report.py)")
    args = parser.parse_args()
    if args.rev and not args.recordings:
        parser.error("--rev compares the command on hwloc's recordings: give --recordings too")
    if args.recordings:
        rows, commit = recordings(args.runs, args.rev)
        in_runs = max(args.runs, 15)
        median_s, least_s = in_process_cpu(REPO / "fixtures/snapshots/dgx-a100", in_runs)
        in_process_ms = (median_s * 1e3, least_s * 1e3)
        if args.markdown:
            print("\n".join(recordings_markdown(rows, args.runs, in_process_ms, in_runs, commit)))
        else:
            for r in rows:
                was = f"; at {commit} {r['before_ms']:.0f} ms ({r['before_ratio']:.1f}x)" if commit else ""
                print(f"{r['name']}: topoagent {r['ours_ms']:.0f} ms, lstopo {r['lstopo_ms']:.1f} ms CPU, ratio {r['ratio']:.1f}x{was};"
                      f" python -c pass {r['floor_ms']:.0f} ms ({r['floor_ratio']:.1f}x);"
                      f" python -I -S -c pass {r['bare_ms']:.1f} ms ({r['bare_ratio']:.1f}x);"
                      f" in-process {r['in_process_ms']:.1f} ms ({r['in_process_ratio']:.1f}x)")
            print(f"in-process discovery of dgx-a100: {in_process_ms[0]:.1f} ms CPU (median of {in_runs}; least {in_process_ms[1]:.1f})")
        return 0
    for line in (markdown if args.markdown else lines)(measure(args.runs, args.root), args.runs, args.root):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
