"""Every example of README.md and docs/*.md runs as written (issue #27 item 6, #30 item 4).

Each ```sh block runs in a scratch directory of its own that sees the checkout's folders
(fixtures/, scripts/, ...) through links, with a ready `.venv`: install lines
(`python3 -m venv .venv`, `.venv/bin/pip install .`, `'.[probes]'`, PyTorch's CPU index) are
not run again; the test checks this environment already holds what each would install (the
same distributions, torch's CPU build) and drops them.  `.venv/bin/topoagent` runs the
checkout.  A real install of the wheel into a fresh venv is tests/test_packaging.py's.
A serve line runs in the background on a free port (the address the page wrote is swapped
for it in the block's later lines) from the moment /readyz says it is up until the block
ends, then must exit 0 on SIGTERM.  ```http blocks go, in page order, to one demo node: the
"Try it" block that serves fixtures/snapshots/dgx-a100, run once for the session.
The contract for writers (markers, languages) is in tests/examples.py.

The sh blocks run concurrently (a few at a time) before their tests report; `pytest -k`
runs only the blocks selected.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO
from examples import (
    INSTALL_PREFIX,
    Block,
    Outcome,
    checkout_state,
    collect,
    demo_block,
    demo_token,
    make_ready_venv,
    make_scratch,
    pages,
    parse_http,
    report,
    run_sh,
    send,
    shape_mismatch,
)
from examples import (
    commands as block_commands,
)

BLOCKS, PROBLEMS = collect(pages())
SH = [b for b in BLOCKS if b.language == "sh" and b.not_run is None]
HTTP = [b for b in BLOCKS if b.language == "http" and b.not_run is None]
WORKERS = max(2, min(4, os.cpu_count() or 1))


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_block_says_how_it_is_checked(page: Path) -> None:
    """A block needs a language (sh, http, or a sample's); a marker needs its block and, for
    `not run`, its reason; an sh or http block must read as one."""
    name = page.relative_to(REPO).as_posix()
    wrong = [str(p) for p in PROBLEMS if p.page == name]
    if wrong:
        pytest.fail("\n".join(wrong), pytrace=False)


@pytest.fixture(scope="module")
def ready_venv(tmp_path_factory) -> Path:
    return make_ready_venv(tmp_path_factory.mktemp("examples") / "venv")


@pytest.fixture(scope="module")
def checkout_before() -> str:
    return checkout_state()


@pytest.fixture(scope="module")
def sh_outcomes(request, tmp_path_factory, ready_venv, checkout_before) -> dict[str, Outcome]:
    """Every selected sh block, run a few at a time: commands mostly wait on children."""
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_sh_example" and hasattr(item, "callspec")]
    base = tmp_path_factory.mktemp("sh")

    def one(block: Block) -> Outcome:
        scratch = make_scratch(base / block.where.replace("/", "_").replace(":", "-"), ready_venv)
        return run_sh(block, scratch)

    started = time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        outcomes = {o.block.where: o for o in pool.map(one, selected)}
    print(f"\nexamples: {len(selected)} sh blocks in {time.monotonic() - started:.1f} s wall, {WORKERS} at a time", file=sys.stderr)
    return outcomes


@pytest.mark.parametrize("block", SH, ids=lambda b: b.where)
def test_sh_example(block: Block, sh_outcomes: dict[str, Outcome]) -> None:
    outcome = sh_outcomes[block.where]
    if outcome.failure is not None:
        pytest.fail(report(outcome), pytrace=False)


@pytest.fixture(scope="module")
def demo_node(tmp_path_factory, ready_venv):
    """The "Try it" serve, up for the http blocks; stopped (and its exit checked) after them."""
    block = demo_block(BLOCKS)
    if block is None:
        pytest.fail("no sh block serves fixtures/snapshots/dgx-a100 ('Try it'): the http examples have no demo node")
    scratch = make_scratch(tmp_path_factory.mktemp("demo") / "scratch", ready_venv)
    outcome = run_sh(block, scratch, keep_serving=True)
    if outcome.failure is not None or not outcome.served:
        pytest.fail("the demo node did not start:\n" + report(outcome))
    (served,) = outcome.served
    yield served.address, demo_token(scratch, block)
    status = served.stop()
    assert status == 0, served.log.read_text()[-2000:]


@pytest.mark.parametrize("block", HTTP, ids=lambda b: b.where)
def test_http_example(block: Block, demo_node) -> None:
    address, token = demo_node
    request = parse_http(block.text)
    status, body = send(address, request, token)
    want = block.expect
    if not (status == want if want is not None else 200 <= status < 300):
        pytest.fail(f"{block.where}: {request.method} {request.path} answered {status}, expected {want or '2xx'}\n"
                    + body.decode(errors="replace")[-2000:], pytrace=False)
    if block.answer is not None and (wrong := shape_mismatch(block.answer, body)) is not None:
        pytest.fail(f"{block.where}: {request.method} {request.path}: {wrong}\n" + body.decode(errors="replace")[-2000:], pytrace=False)


def test_the_demo_node_serves_the_recorded_dgx_a100(demo_node) -> None:
    """What the http blocks talk to: "Try it"'s node, ready, its token accepted."""
    address, token = demo_node
    assert send(address, parse_http("GET /readyz\n"))[0] == 200
    status, body = send(address, parse_http("GET /topology\n"))
    assert status == 200 and len(json.loads(body)["gpus"]) == 8
    assert token is not None
    assert send(address, parse_http("POST /refresh\nAuthorization: Bearer <token>\n"), token)[0] == 200


def test_the_examples_leave_the_checkout_as_it_was(sh_outcomes, checkout_before) -> None:
    assert checkout_state() == checkout_before, "an example wrote into the checkout (git status shows it)"


# --- the shipped pair of node recordings ----------------------------------------------------

CLUSTER = REPO / "fixtures" / "cluster"
CLUSTER_COMMAND = ".venv/bin/topoagent cluster-topology --topology-files fixtures/cluster/*.json"


def test_the_shipped_recordings_print_a_switch_tree_from_a_fresh_clone(tmp_path, ready_venv) -> None:
    """The command the docs give, as written, from a scratch directory like any example's."""
    block = Block("(tests)", 1, "sh", CLUSTER_COMMAND + "\n")
    outcome = run_sh(block, make_scratch(tmp_path / "scratch", ready_venv))
    if outcome.failure is not None:
        pytest.fail(report(outcome), pytrace=False)
    printed = outcome.steps[-1].output
    leaves = dict(re.findall(r"^SwitchName=(leaf-[0-9a-f]+) Nodes=(\S+)$", printed, re.M))
    # gpu001 and gpu004 are cabled to two leaves of the recorded fat tree (fixtures/SOURCES.md)
    assert leaves == {"leaf-ec0d9a0300ec8240": "gpu001", "leaf-ec0d9a0300ec8480": "gpu004"}, printed
    assert re.search(r"^SwitchName=fabric Switches=leaf-ec0d9a0300ec8240,leaf-ec0d9a0300ec8480$", printed, re.M), printed


def test_the_shipped_recordings_are_what_their_script_writes() -> None:
    done = subprocess.run([sys.executable, str(CLUSTER / "make_recordings.py"), "--check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in CLUSTER.glob("*.json")) == ["gpu001.json", "gpu004.json"]


# --- the install path (issue #36) -----------------------------------------------------------


def test_the_readme_installs_from_the_checkout_where_the_systemd_unit_runs_it():
    """`pip install topoagent` failed: the project is on no index.  The README's Install block
    builds the checkout's wheel and installs it into the prefix the unit's ExecStart runs from;
    test_sh_example runs that block (with the prefix in its scratch directory)."""
    (block,) = [b for b in SH if b.where.startswith("README.md") and f"{INSTALL_PREFIX}/bin/pip install" in b.text]
    lines = [command for _, command in block_commands(block)]
    assert f"python3 -m venv {INSTALL_PREFIX}" in lines
    assert any(re.fullmatch(rf"{INSTALL_PREFIX}/bin/pip wheel .* -w dist \.", line) for line in lines)
    (install,) = [line for line in lines if line.startswith(f"{INSTALL_PREFIX}/bin/pip install")]
    assert re.search(r"dist/topoagent-[\d.]+-py3-none-any\.whl$", install)
    assert not any(re.search(r"pip install (-q )?topoagent\b", line) for line in lines)  # nothing from an index
    unit = (REPO / "systemd" / "topoagent.service").read_text()
    (exec_start,) = re.findall(r"^ExecStart=(\S+)", unit, re.M)
    assert exec_start == f"{INSTALL_PREFIX}/bin/topoagent"
