"""The examples of README.md and docs/*.md, collected and run (tests/test_examples.py).

The contract with whoever writes the pages:

- ```sh blocks run: one command a line (a trailing `\\` joins the next line; `#` lines are
  comments). Commands run with bash in a scratch directory that sees the checkout's top-level
  folders (fixtures/, scripts/, ...) through links, and a ready `.venv` (see below). Each line
  is its own bash, but `cd` and `export` carry over to the next line of the block.
- ```http blocks are sent to the demo node ("Try it"'s serve block, started by the test even
  where it is marked not run): `METHOD /path`, header lines, a blank line, a JSON body. They
  go with the demo node's token, unless the block writes its own `Authorization` line (one
  reading `Bearer <token>` or `Bearer $(cat .state/token)` stands for the token too).
- `<!-- example: expect STATUS -->` right before a block: an http block answers STATUS, an sh
  block's last command exits STATUS (every other line 0). Without it: 2xx, and 0.
- `<!-- example: not run — REASON -->` right before a block: not run, and REASON must be said.
- ```text / json / yaml / promql / toml / ini / xml (SAMPLES) blocks are samples, never run;
  a ```json block right after an http block (blank lines between at most) is its answer's
  shape: when it reads as a JSON object, the answer must have each of its top-level keys.
- Any other block (no language, or one not listed) is a problem naming its file:line.

The ready `.venv`: install lines (`python3 -m venv .venv`, `.venv/bin/pip install ...`) are
not run; the test checks that the venv it provides already holds what each asks for (the
package's own dependencies for `.`, its extras for `.[x]`, torch's CPU build for a line that
names PyTorch's CPU index) and drops them.  `.venv/bin/topoagent` and `.venv/bin/python` are
this test environment's Python, running the checkout.

The install prefix `/opt/topoagent` (README "Install", the systemd unit's ExecStart) is
`opt/topoagent` in the scratch directory, and what a block does there runs for real, offline:
`pip wheel` builds with this environment's pip and setuptools (--no-build-isolation --no-index), and a
`pip install` of a built wheel into the prefix installs the wheel alone (--no-deps --no-index),
its dependencies borrowed from this environment by a .pth line, as tests/test_packaging.py does.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
import venv
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]

RUN = frozenset({"sh", "http"})
# Output and config samples: shown, never run (toml, ini, xml: the config, slurm.conf and NCCL file shapes).
SAMPLES = frozenset({"text", "json", "yaml", "promql", "toml", "ini", "xml"})
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"})
TOKEN_PLACEHOLDERS = ("Bearer <token>", "Bearer $(cat .state/token)")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
COMMAND_TIMEOUT_S = 120
READY_TIMEOUT_S = 60

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*example:(?P<body>.*?)-->\s*$")
_NOT_RUN = re.compile(r"^not run\s*(?:[—–:]|--?)?\s*(?P<reason>.*)$")
_EXPECT = re.compile(r"^expect\s+(?P<status>\d{1,3})$")


# --- collecting ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository, e.g. "README.md", "docs/service.md"
    line: int  # the opening fence's line, counting from 1
    language: str
    text: str  # the content, less the fence's indentation
    not_run: str | None = None  # the reason given
    expect: int | None = None
    answer: str | None = None  # an http block's answer as the page shows it: the json block right after it

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class Problem:
    page: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.message}"


def parse_page(page: str, text: str) -> tuple[list[Block], list[Problem]]:
    """Every fenced block of a markdown page with the marker before it, and what breaks the
    contract (a block without a known language, a marker without a reason or a block, ...)."""
    blocks: list[Block] = []
    problems: list[Problem] = []
    lines = text.splitlines()
    marker: tuple[int, str | None, int | None] | None = None  # (line, not-run reason, expect)
    after_block = -1  # the line index just past the last block's closing fence
    i = 0
    while i < len(lines):
        number = i + 1
        if (m := _MARKER.match(lines[i])) is not None:
            if marker is not None:
                problems.append(Problem(page, marker[0], "an example marker stands before no block"))
            marker = _read_marker(page, number, m.group("body").strip(), problems)
            i += 1
            continue
        fence = _FENCE.match(lines[i])
        if fence is None:
            if marker is not None and lines[i].strip():
                problems.append(Problem(page, marker[0], "an example marker stands before no block"))
                marker = None
            i += 1
            continue
        indent, mark = len(fence.group("indent")), fence.group("fence")
        language = fence.group("info").strip().split(" ", 1)[0].lower()
        follows_http = bool(blocks) and blocks[-1].language == "http" and not any(line.strip() for line in lines[after_block:i])
        body: list[str] = []
        i += 1
        closed = False
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if close and close.group("fence")[0] == mark[0] and len(close.group("fence")) >= len(mark) and not close.group("info").strip():
                closed = True
                break
            body.append(_dedent(lines[i], indent))
            i += 1
        i += 1
        after_block = i
        if not closed:
            problems.append(Problem(page, number, "a code block is never closed"))
        not_run, expect = (marker[1], marker[2]) if marker else (None, None)
        if not language:
            problems.append(Problem(page, number, "a code block needs a language: sh (run), http (sent to the demo node) "
                                                  f"or {'/'.join(sorted(SAMPLES))} (a sample, not run)"))
        elif language not in RUN | SAMPLES:
            problems.append(Problem(page, number, f"a code block in {language!r}: the examples test knows sh and http (run) and "
                                                  f"{'/'.join(sorted(SAMPLES))} (samples)"))
        elif language in SAMPLES and marker is not None:
            problems.append(Problem(page, marker[0], f"an example marker before a {language} block, which is never run"))
        elif language == "json" and follows_http:
            blocks[-1] = replace(blocks[-1], answer="\n".join(body) + "\n")
        else:
            block = Block(page, number, language, "\n".join(body) + ("\n" if body else ""), not_run, expect)
            if block.not_run is None and block.language in RUN:
                try:
                    commands(block) if block.language == "sh" else parse_http(block.text)
                except ValueError as error:
                    problems.append(Problem(page, number, str(error)))
            blocks.append(block)
        marker = None
    if marker is not None:
        problems.append(Problem(page, marker[0], "an example marker stands before no block"))
    return blocks, problems


def _dedent(line: str, indent: int) -> str:
    cut = 0
    while cut < indent and cut < len(line) and line[cut] in " \t":
        cut += 1
    return line[cut:]


def _read_marker(page: str, number: int, body: str, problems: list[Problem]) -> tuple[int, str | None, int | None]:
    if (m := _NOT_RUN.match(body)) is not None:
        reason = m.group("reason").strip()
        if not reason:
            problems.append(Problem(page, number, "`not run` needs its reason: <!-- example: not run — REASON -->"))
        return number, reason or "(no reason given)", None
    if (m := _EXPECT.match(body)) is not None:
        return number, None, int(m.group("status"))
    problems.append(Problem(page, number, f"unknown example marker {body!r}: `not run — REASON` or `expect STATUS`"))
    return number, None, None


def pages(repo: Path = REPO) -> list[Path]:
    """README.md, then docs/*.md in name order."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def collect(paths: Iterable[Path], repo: Path = REPO) -> tuple[list[Block], list[Problem]]:
    blocks: list[Block] = []
    problems: list[Problem] = []
    for path in paths:
        found, wrong = parse_page(path.relative_to(repo).as_posix(), path.read_text())
        blocks += found
        problems += wrong
    return blocks, problems


# --- reading a block ----------------------------------------------------------------------


def commands(block: Block) -> list[tuple[int, str]]:
    """(line, command) of an sh block: continuations joined, comments and blank lines left out."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for offset, raw in enumerate(block.text.splitlines()):
        line = raw.rstrip()
        if not pending:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = block.line + 1 + offset
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        pending.append(line)
        out.append((start, " ".join(part.strip() for part in pending)))
        pending = []
    if pending:
        raise ValueError("the block's last line ends in `\\`: nothing continues it")
    if not out:
        raise ValueError("an sh block with no command")
    return out


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes | None


def parse_http(text: str) -> HttpRequest:
    lines = text.splitlines()
    while lines and not lines[0].strip():
        lines.pop(0)
    if not lines:
        raise ValueError("an http block with no request line")
    parts = lines[0].split()
    if len(parts) != 2 or parts[0] not in HTTP_METHODS or not parts[1].startswith("/"):
        raise ValueError(f"an http block must start `METHOD /path` (methods {', '.join(sorted(HTTP_METHODS))}), not {lines[0]!r}")
    headers = []
    index = 1
    while index < len(lines) and lines[index].strip():
        name, colon, value = lines[index].partition(":")
        if not colon or not name.strip() or " " in name.strip():
            raise ValueError(f"http header line {lines[index]!r} is not `Name: value` (a blank line comes before the body)")
        headers.append((name.strip(), value.strip()))
        index += 1
    body_text = "\n".join(lines[index + 1:]).strip()
    body = None
    if body_text:
        try:
            json.loads(body_text)
        except json.JSONDecodeError as error:
            raise ValueError(f"the http block's body is not JSON: {error}") from None
        body = body_text.encode()
    return HttpRequest(parts[0], parts[1], tuple(headers), body)


# --- install lines ------------------------------------------------------------------------


def split_and(command: str) -> list[str]:
    """The steps of an `a && b && c` line; `&&` inside quotes stays."""
    steps, quote, current, i = [], "", [], 0
    while i < len(command):
        c = command[i]
        if quote:
            if c == quote:
                quote = ""
            elif c == "\\" and quote == '"' and i + 1 < len(command):
                current.append(c)
                i += 1
                c = command[i]
        elif c in "'\"":
            quote = c
        elif command.startswith("&&", i):
            steps.append("".join(current).strip())
            current, i = [], i + 2
            continue
        current.append(c)
        i += 1
    steps.append("".join(current).strip())
    return steps


_VENV = re.compile(r"^python3(\.\d+)? -m venv \.venv$")


# The README's install prefix, the one the systemd unit's ExecStart names.
INSTALL_PREFIX = "/opt/topoagent"
_PIP_WHEEL = re.compile(r"^\S*pip wheel ")
_PIP_INSTALL_WHEEL = re.compile(r"^(\S*/bin/pip) install (.*\.whl)$")


def offline(step: str, scratch: Path) -> str:
    """``step`` as the examples test runs it: the install prefix inside ``scratch``, and the
    wheel built and installed offline (see the module's docstring)."""
    import sysconfig

    prefix = str(scratch / INSTALL_PREFIX.lstrip("/"))
    step = step.replace(INSTALL_PREFIX, prefix)
    step = _PIP_WHEEL.sub(f"{sys.executable} -m pip wheel --no-build-isolation --no-index ", step)
    if (install := _PIP_INSTALL_WHEEL.match(step)) and install[1].startswith(prefix):
        borrow = (f"import pathlib, site; pathlib.Path(site.getsitepackages()[0], 'examples-borrowed.pth')"
                  f".write_text({sysconfig.get_paths()['purelib']!r} + chr(10))")
        # Without the suite's PYTHONPATH (the checkout): pip would take the checkout's own
        # topoagent.egg-info (a clone that ran `pip install .` has one) as the package already
        # installed, and install nothing.
        step = (f"env -u PYTHONPATH {install[1]} install --no-deps --no-index {install[2]} && "
                f"{prefix}/bin/python -c {shlex.quote(borrow)}")
    return step


def is_install(step: str) -> bool:
    return bool(_VENV.match(step)) or step.startswith(".venv/bin/pip install ")


def install_shortfall(step: str, environment: Environment | None = None) -> list[str]:
    """What the ready venv lacks of what the install step would put in `.venv` ([] = all there)."""
    environment = environment or Environment.current()
    if _VENV.match(step):
        return []
    words = shlex.split(step)[2:]  # after `.venv/bin/pip install`
    targets: list[str] = []
    index_url = None
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("-q", "--quiet", "-U", "--upgrade", "--disable-pip-version-check"):
            pass
        elif word == "--index-url":
            i += 1
            index_url = words[i] if i < len(words) else None
        elif word.startswith("-"):
            return [f"`{step}`: the examples test does not know pip's {word}"]
        else:
            targets.append(word)
        i += 1
    if not targets:
        return [f"`{step}`: installs nothing"]
    missing = []
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for target in targets:
        if target == "." or target.startswith(".["):
            extras = [e.strip() for e in target[2:-1].split(",")] if target.startswith(".[") else []
            unknown = [e for e in extras if e not in project["optional-dependencies"]]
            if unknown or (target.startswith(".[") and not target.endswith("]")):
                missing.append(f"`{target}`: pyproject.toml has no extra {', '.join(unknown) or target}")
                continue
            wanted = list(project["dependencies"]) + [r for e in extras for r in project["optional-dependencies"][e]]
            missing += [f"{requirement} (from `{target}`)" for requirement in wanted if not environment.satisfies(requirement)]
        else:
            requirement = Requirement(target)
            if requirement.name == "torch" and index_url == CPU_INDEX:
                probes = [Requirement(r) for r in project["optional-dependencies"]["probes"] if Requirement(r).name == "torch"]
                if probes and requirement.specifier != probes[0].specifier:
                    missing.append(f"`{target}` from the CPU index: the probes extra takes torch{probes[0].specifier}, and a torch "
                                   "outside that range makes `.[probes]` replace it with a CUDA build; ask for the same range")
                if not environment.cpu_torch():
                    missing.append("torch's CPU build (the ready venv's torch is not one)")
            elif requirement.name == "torch":
                missing.append(f"`{step}`: torch from PyPI is a CUDA build of several GB; the README's CPU line names {CPU_INDEX}")
            elif not environment.satisfies(target):
                missing.append(target)
    return missing


@dataclass(frozen=True)
class Environment:
    """The distributions the ready venv holds, by normalised name -> version."""

    versions: dict[str, str]

    @staticmethod
    def current() -> Environment:
        found = {}
        for dist in metadata.distributions():
            name = dist.metadata["Name"]
            if name:
                found[_normal(name)] = dist.version
        return Environment(found)

    def satisfies(self, requirement: str) -> bool:
        parsed = Requirement(requirement)
        version = self.versions.get(_normal(parsed.name))
        return version is not None and parsed.specifier.contains(version, prereleases=True)

    def cpu_torch(self) -> bool:
        """torch installed as a CPU build: a `+cpu` wheel, and none of the CUDA wheels a CUDA build pulls in."""
        version = self.versions.get("torch", "")
        return version.endswith("+cpu") and not any(name.startswith("nvidia-cu") for name in self.versions)


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --- running ------------------------------------------------------------------------------


def make_ready_venv(where: Path) -> Path:
    """A venv whose python is this test environment's, with the checkout and this environment's
    site-packages on its path, and a `topoagent` command like the one `pip install .` writes."""
    import sysconfig

    venv.create(where, with_pip=False, symlinks=True)
    (site,) = (where / "lib").glob("python3*/site-packages")
    (site / "examples-ready.pth").write_text(f"{REPO}\n{sysconfig.get_paths()['purelib']}\n")
    script = where / "bin" / "topoagent"
    script.write_text(f"#!{where / 'bin' / 'python'}\nimport sys\nfrom topoagent.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return where


def make_scratch(where: Path, ready_venv: Path) -> Path:
    """A directory where commands run: links to the checkout's top-level entries (none hidden)
    and to the ready venv as `.venv`; what commands write lands here, not in the checkout."""
    where.mkdir(parents=True, exist_ok=True)
    for entry in REPO.iterdir():
        if not entry.name.startswith("."):
            (where / entry.name).symlink_to(entry)
    (where / ".venv").symlink_to(ready_venv)
    (where / "home").mkdir()
    return where


@dataclass
class Step:
    line: int
    command: str
    status: int | None = None
    output: str = ""


@dataclass
class Served:
    """A serve command a block started, until the block ends (or the session, for the demo node)."""

    proc: subprocess.Popen
    address: str  # HOST:PORT it listens on
    documented: str  # the address the page wrote
    log: Path

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return -signal.SIGKILL


@dataclass
class Outcome:
    block: Block
    steps: list[Step] = field(default_factory=list)
    failure: str | None = None
    served: list[Served] = field(default_factory=list)
    seconds: float = 0.0


# An example runs as whoever runs the suite, root on CI: a line that would change the machine
# (system folders, services, packages, a cluster) or run the suite itself is refused, not
# run; its block needs `not run — REASON` or a rewrite that works in its scratch directory.
SYSTEM_COMMANDS = frozenset({"sudo", "su", "systemctl", "apt-get", "apt", "dpkg", "kubectl", "helm", "srun", "sbatch",
                             "salloc", "scontrol", "scancel", "slurmd", "slurmctld", "reboot", "shutdown", "modprobe", "pytest"})
# /opt/topoagent: the install prefix, which a block sees in its scratch directory (offline()).
ALLOWED_ROOTS = ("/dev/null", "/dev/stdin", "/dev/stdout", "/dev/stderr", "/tmp/", "/proc/", INSTALL_PREFIX)


def refusal(command: str) -> str | None:
    """Why the examples test will not run ``command`` on this machine (None: it may)."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError as error:
        return f"bash would not read it: {error}"
    for word in words:
        name = "scripts/test" if word.endswith("scripts/test") else word.rsplit("/", 1)[-1]
        word = re.sub(r"[a-z]+://\S*", "", word)  # a URL names no file here
        if name in SYSTEM_COMMANDS or name == "scripts/test":
            return f"`{name}` changes the machine or runs the suite; mark the block `not run — REASON`"
        for path in re.findall(r"(?:^|[=:,<>])(/[^\s:,;|&<>]*)", word):  # an argument, a value, a redirection
            if not path.startswith(ALLOWED_ROOTS) and path != "/dev/null":
                return (f"names {path}, outside the example's scratch directory; write a relative path "
                        "or mark the block `not run — REASON`")
    return None


_SERVE = re.compile(r"(^|[\s/])topoagent\s+serve(\s|$)")
_LISTEN = re.compile(r"--listen[= ](\S+)")
_URL = re.compile(r"on http://([\d.]+):(\d+)")


def run_sh(block: Block, scratch: Path, *, keep_serving: bool = False, timeout: float = COMMAND_TIMEOUT_S) -> Outcome:
    """Run the block's commands in order in ``scratch``; stop at the first that fails.  A
    serve command runs in the background from the moment it is ready (polled) until the
    block ends, when it gets SIGTERM and must exit 0; with ``keep_serving`` it is left
    running, for the caller to stop."""
    started = time.monotonic()
    outcome = Outcome(block)
    env = {**os.environ, "HOME": str(scratch / "home"), "TOPOAGENT_EXAMPLES": "1"}
    env.pop("CREDENTIALS_DIRECTORY", None)
    cwd = scratch
    listed = commands(block)
    try:
        for index, (line, command) in enumerate(listed):
            step = Step(line, command)
            outcome.steps.append(step)
            steps = split_and(command)
            shortfall = [gap for s in steps if is_install(s) for gap in install_shortfall(s)]
            if shortfall:
                step.status = 1
                outcome.failure = "the ready venv lacks what this install line asks for: " + "; ".join(shortfall)
                break
            steps = [s for s in steps if not is_install(s)]
            refused = next(filter(None, map(refusal, steps)), None)
            steps = [offline(s, scratch) for s in steps]
            if refused is not None:
                step.status = None
                outcome.failure = f"refused: {refused}"
                break
            for served in outcome.served:  # a later command talks to the address the page wrote
                steps = [s.replace(served.documented, served.address) for s in steps]
            if not steps:
                step.status = 0
                step.output = "(install line: the ready venv already holds it)"
                continue
            if _SERVE.search(steps[-1]):
                served_or_error = _start_serve(steps, cwd, env, scratch, len(outcome.served))
                if isinstance(served_or_error, str):
                    step.status, step.output = 1, served_or_error
                    outcome.failure = "serve did not become ready"
                    break
                if served_or_error.proc.poll() is not None:  # a serve that ends by itself (--help)
                    step.status = served_or_error.proc.returncode
                    step.output = served_or_error.log.read_text(errors="replace")
                else:
                    step.status = 0
                    outcome.served.append(served_or_error)
            else:
                if any(_SERVE.search(s) for s in steps):
                    step.status = 1
                    outcome.failure = "a serve command must be the last of its `&&` line"
                    break
                cwd, env = _run_step(step, " && ".join(steps), cwd, env, scratch, timeout)
            want = block.expect if (block.expect is not None and index == len(listed) - 1) else 0
            if step.status != want:
                outcome.failure = f"exit status {step.status}, expected {want}"
                break
    finally:
        if not keep_serving or outcome.failure:
            for served in outcome.served:
                status = served.stop()
                if status != 0 and outcome.failure is None:
                    outcome.failure = (f"`{served.documented}` serve exited {status} on SIGTERM (expected 0):\n"
                                       + served.log.read_text(errors="replace")[-2000:])
            if outcome.failure:
                outcome.served = []
    outcome.seconds = time.monotonic() - started
    return outcome


def _run_step(step: Step, command: str, cwd: Path, env: dict[str, str], scratch: Path, timeout: float) -> tuple[Path, dict[str, str]]:
    """One command in its own bash; its `cd` and `export` carry over to the block's next line."""
    state = scratch / ".example-state"
    script = f"{command}\n__example_status=$?\n{{ printf '%s\\0' \"$PWD\"; env -0; }} > {shlex.quote(str(state))}\nexit $__example_status\n"
    state.unlink(missing_ok=True)
    proc = subprocess.Popen(["bash", "-o", "pipefail", "-c", script], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        step.status = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        step.status = 124
        out += f"\n(killed after {timeout:.0f} s)".encode()
    step.output = out.decode(errors="replace")
    if state.is_file():
        fields = state.read_bytes().split(b"\0")
        cwd = Path(fields[0].decode())
        env = dict(item.decode(errors="replace").split("=", 1) for item in fields[1:] if b"=" in item)
    return cwd, env


def _start_serve(steps: list[str], cwd: Path, env: dict[str, str], scratch: Path, n: int) -> Served | str:
    last = steps[-1]
    listen = _LISTEN.search(last)
    if listen:
        documented = listen.group(1)
        last = last[:listen.start()] + "--listen 127.0.0.1:0" + last[listen.end():]
    else:
        documented = "127.0.0.1:9477"  # serve's default
        last += " --listen 127.0.0.1:0"
    # exec: SIGTERM reaches serve itself, whose exit status is the one checked
    script = " && ".join([*steps[:-1], "exec " + last])
    log = scratch / f"serve-{n}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "-o", "pipefail", "-c", script], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    address = None
    while time.monotonic() < deadline:
        if address is None and (m := _URL.search(log.read_text(errors="replace"))) is not None:
            address = f"{m.group(1)}:{m.group(2)}"
        if address is not None and _ready(address):
            return Served(proc, address, documented, log)
        if proc.poll() is not None:
            if proc.returncode == 0 and address is None:
                return Served(proc, "", documented, log)
            return f"exited {proc.returncode} before it was ready:\n{log.read_text(errors='replace')}"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return f"not ready within {READY_TIMEOUT_S} s:\n{log.read_text(errors='replace')}"


def _ready(address: str) -> bool:
    """A topology is loaded: /readyz 200, or 503 naming its snapshot (loaded, not ready for placement)."""
    try:
        status, body = send(address, HttpRequest("GET", "/readyz", (), None))
    except OSError:
        return False
    return status == 200 or (status == 503 and b"snapshot_version" in body)


def send(address: str, request: HttpRequest, token: str | None = None, timeout: float = 60) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    for name, value in request.headers:
        if name.lower() == "authorization":
            headers.pop("Authorization", None)
            if value in TOKEN_PLACEHOLDERS and token is not None:
                value = f"Bearer {token}"
        headers[name] = value
    if request.body is not None and not any(n.lower() == "content-type" for n in headers):
        headers["Content-Type"] = "application/json"
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request(request.method, request.path, body=request.body, headers=headers)
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def shape_mismatch(sample: str, answer: bytes) -> str | None:
    """Why ``answer`` does not have the shape of the page's ``sample`` (None: it has, or the
    sample is not a JSON object, e.g. shortened with `...`, so it shows no shape to hold)."""
    try:
        shown = json.loads(sample)
    except json.JSONDecodeError:
        return None
    if not isinstance(shown, dict):
        return None
    try:
        got = json.loads(answer)
    except json.JSONDecodeError:
        return "the answer is not JSON, the page shows a JSON object"
    if not isinstance(got, dict):
        return f"the answer is a JSON {type(got).__name__}, the page shows an object"
    missing = [key for key in shown if key not in got]
    return f"the answer lacks {', '.join(missing)}, which the page shows" if missing else None


def report(outcome: Outcome, tail: int = 3000) -> str:
    """What a failure says: where, the command, its exit status and the end of its output."""
    last = outcome.steps[-1] if outcome.steps else None
    lines = [f"{outcome.block.where}: {outcome.failure}"]
    if last is not None:
        lines += [f"  line {last.line}: {last.command}", f"  exit status: {last.status}", "  output (tail):",
                  _indent(last.output[-tail:] or "(none)")]
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())


def checkout_state() -> str:
    """What git sees changed or added in the checkout (ignored files aside): commands must leave it as it was."""
    done = subprocess.run(["git", "status", "--porcelain=v1", "--untracked-files=all"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    return done.stdout if done.returncode == 0 else f"git status failed: {done.stderr}"


def demo_block(blocks: Iterable[Block]) -> Block | None:
    """The block that serves the demo node: the first sh block whose serve replays the recorded
    DGX A100, one the examples run before one marked not run ("Try it" may say it serves until
    Ctrl-C: the demo node is that serve, started and stopped by the test)."""
    serving = []
    for block in blocks:
        if block.language != "sh":
            continue
        try:
            lines = commands(block)
        except ValueError:
            continue
        if any(_SERVE.search(c) and "fixtures/snapshots/dgx-a100" in c for _, c in lines):
            serving.append(block)
    serving.sort(key=lambda b: b.not_run is not None)  # stable: page order within each kind
    return serving[0] if serving else None


def demo_token(scratch: Path, block: Block) -> str | None:
    """The token file the demo block's serve line names, read from its scratch directory."""
    for _, command in commands(block):
        if _SERVE.search(command) and (m := re.search(r"--token-file[= ](\S+)", command)):
            path = Path(m.group(1))
            path = path if path.is_absolute() else scratch / path
            return path.read_text().strip() if path.is_file() else None
    return None


if __name__ == "__main__":  # list what the pages hold: python tests/examples.py
    found, wrong = collect(pages())
    for b in found:
        print(b.where, b.language, f"not run: {b.not_run}" if b.not_run else "" if b.expect is None else f"expect {b.expect}")
    for p in wrong:
        print(p, file=sys.stderr)
