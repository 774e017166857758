"""The examples test's own machinery (tests/examples.py) on sample pages of its own
(tests/data/examples/): what it collects, what it calls a problem, how it runs a block and
what a failure says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO
from examples import (
    CPU_INDEX,
    Block,
    Environment,
    collect,
    commands,
    demo_block,
    install_shortfall,
    is_install,
    make_ready_venv,
    make_scratch,
    offline,
    parse_http,
    parse_page,
    refusal,
    report,
    run_sh,
    send,
    shape_mismatch,
    split_and,
)

SAMPLES = REPO / "tests" / "data" / "examples"


def test_a_good_page_gives_its_blocks_with_their_markers_and_no_problem() -> None:
    blocks, problems = collect([SAMPLES / "good.md"])
    assert problems == []
    assert [(b.line, b.language, b.not_run, b.expect) for b in blocks] == [
        (3, "sh", None, None),
        (12, "sh", None, None),
        (17, "sh", None, 3),
        (23, "sh", "needs a GPU node: it measures the real links", None),
        (27, "http", None, None),
        (39, "http", None, 401),
        (44, "text", None, None),
        (48, "json", None, None),
    ]
    assert blocks[0].where == "tests/data/examples/good.md:3"
    # comments dropped, a continuation joined and numbered from its first line
    assert commands(blocks[0]) == [(5, ".venv/bin/topoagent --version"),
                                   (6, ".venv/bin/topoagent matrix --from-nvidia-smi fixtures/nvidia-smi/hgx-h20-8gpu-8nic.txt")]
    assert blocks[1].text == 'mkdir -p out && echo "a && b" > out/x\n'  # the list item's indent taken off
    request = parse_http(blocks[4].text)
    assert (request.method, request.path, request.headers, request.body) == (
        "POST", "/place", (("Content-Type", "application/json"),), b'{"gpus": 2, "pattern": "allreduce"}')
    assert parse_http(blocks[5].text).body is None and parse_http(blocks[5].text).headers[0][0] == "Authorization"
    # the json block right after the POST is its answer's shape; one after prose is only a sample
    assert blocks[4].answer == '{"gpus": [0, 1], "pattern": "allreduce", "proven_optimal": true}\n'
    assert blocks[5].answer is None


@pytest.mark.parametrize(("sample", "answer", "says"), [
    ('{"gpus": [0], "fit": true}', b'{"gpus": [3], "fit": true, "more": 1}', None),
    ('{"gpus": [0], "shiny": 1}', b'{"gpus": [3]}', "the answer lacks shiny, which the page shows"),
    ('{"gpus": [0, ...]}', b"{}", None),  # shortened: no shape to hold it to
    ('[1, 2]', b"{}", None),
    ('{"a": 1}', b"not json", "the answer is not JSON, the page shows a JSON object"),
    ('{"a": 1}', b"[1]", "the answer is a JSON list, the page shows an object"),
])
def test_an_answer_is_held_to_the_shape_of_the_sample_after_its_request(sample: str, answer: bytes, says: str | None) -> None:
    assert shape_mismatch(sample, answer) == says


def test_a_bad_page_names_every_problem_by_its_line() -> None:
    _, problems = collect([SAMPLES / "bad.md"])
    said = [(p.line, p.message) for p in problems]
    expected = [
        (3, "a code block needs a language"),
        (7, "a code block in 'bash'"),
        (11, "`not run` needs its reason"),
        (16, "an example marker stands before no block"),
        (19, "unknown example marker 'skip this one'"),
        (24, "an example marker before a json block, which is never run"),
        (29, "an http block must start `METHOD /path`"),
        (33, "http header line 'not a header' is not `Name: value`"),
        (40, "the http block's body is not JSON"),
        (46, "the block's last line ends in `\\`"),
        (51, "a code block is never closed"),
    ]
    assert len(said) == len(expected), said
    for (line, message), (want_line, want) in zip(said, expected):
        assert line == want_line and message.startswith(want), (line, message)
    assert str(problems[0]).startswith("tests/data/examples/bad.md:3: ")


@pytest.mark.parametrize(("page", "line", "says"), [
    ("<!-- example: not run —   -->\n```sh\ntrue\n```\n", 1, "`not run` needs its reason"),
    ("<!-- example: not run — fine -->\n<!-- example: expect 1 -->\n```sh\ntrue\n```\n", 1, "an example marker stands before no block"),
    ("```sh\n```\n", 1, "an sh block with no command"),
    ("```http\n\n```\n", 1, "an http block with no request line"),
    ("text\n<!-- example: expect 2 -->\n", 2, "an example marker stands before no block"),
])
def test_markers_and_blocks_that_cannot_be_read(page: str, line: int, says: str) -> None:
    _, problems = parse_page("p.md", page)
    assert [(p.line, p.message[: len(says)]) for p in problems] == [(line, says)]


def test_not_run_takes_a_dash_or_a_colon_before_its_reason() -> None:
    for dash in ("—", "-", "--", ":", "–"):
        (block,), problems = parse_page("p.md", f"<!-- example: not run {dash} no GPU here -->\n```sh\ntrue\n```\n")
        assert problems == [] and block.not_run == "no GPU here", dash


SERVE_A100 = ".venv/bin/topoagent serve --root fixtures/snapshots/dgx-a100 --state-dir .state"


def test_the_demo_node_is_the_try_it_serve_even_where_it_is_marked_not_run() -> None:
    marked = f"<!-- example: not run — serves until Ctrl-C -->\n```sh\n{SERVE_A100}\n```\n"
    other = "```sh\n.venv/bin/topoagent serve --root fixtures/snapshots/hgx-h100\n```\n"
    runnable = f"```sh\n{SERVE_A100} --listen 127.0.0.1:9478\n```\n"
    blocks, _ = parse_page("p.md", marked + other)
    assert demo_block(blocks) == blocks[0]
    blocks, _ = parse_page("p.md", marked + other + runnable)
    assert demo_block(blocks) == blocks[2]  # one the examples run comes first
    assert demo_block(parse_page("p.md", other)[0]) is None


def test_and_lists_split_outside_quotes_only() -> None:
    assert split_and("a && b 'c && d' && e \"f && g\"") == ["a", "b 'c && d'", "e \"f && g\""]
    assert split_and("one") == ["one"]


# --- install lines and the ready venv ------------------------------------------------------

HAS = {"aiohttp": "3.13.0", "prometheus-client": "0.21.0", "nvidia-ml-py": "13.615.71", "pyudev": "0.24"}


def test_install_lines_are_checked_against_what_the_venv_holds() -> None:
    cpu = Environment({**HAS, "torch": "2.13.0+cpu"})
    assert is_install("python3 -m venv .venv") and is_install(".venv/bin/pip install -q .")
    assert not is_install("pip install .")  # only the README's own venv is provided
    assert install_shortfall("python3 -m venv .venv", cpu) == []
    assert install_shortfall(".venv/bin/pip install -q .", cpu) == []
    assert install_shortfall(".venv/bin/pip install '.[probes]'", cpu) == []
    assert install_shortfall(f".venv/bin/pip install 'torch>=2.1,<3' --index-url {CPU_INDEX}", cpu) == []
    # what the venv lacks is named
    assert install_shortfall(".venv/bin/pip install '.[probes]'", Environment(HAS)) == ["torch>=2.1,<3 (from `.[probes]`)"]
    assert install_shortfall(".venv/bin/pip install .", Environment({**HAS, "aiohttp": "3.8.0"})) == ["aiohttp>=3.9 (from `.`)"]
    assert "no extra nosuch" in install_shortfall(".venv/bin/pip install '.[nosuch]'", cpu)[0]


def test_the_cpu_torch_line_must_ask_for_the_probes_range_and_get_a_cpu_build() -> None:
    cpu = Environment({**HAS, "torch": "2.13.0+cpu"})
    (unpinned,) = install_shortfall(f".venv/bin/pip install torch --index-url {CPU_INDEX}", cpu)
    assert "the probes extra takes torch<3,>=2.1" in unpinned
    cuda = Environment({**HAS, "torch": "2.13.0", "nvidia-cublas-cu12": "12.8"})
    assert install_shortfall(f".venv/bin/pip install 'torch>=2.1,<3' --index-url {CPU_INDEX}", cuda) == [
        "torch's CPU build (the ready venv's torch is not one)"]
    (from_pypi,) = install_shortfall(".venv/bin/pip install 'torch>=2.1,<3'", cpu)
    assert "CUDA build" in from_pypi
    assert "does not know pip's --pre" in install_shortfall(".venv/bin/pip install --pre .", cpu)[0]


def test_this_environment_is_a_ready_venv_for_every_documented_install() -> None:
    """The premise of dropping install lines: what they would install is here, torch's CPU build too."""
    assert install_shortfall(".venv/bin/pip install -q '.[probes]'") == []
    assert install_shortfall(f".venv/bin/pip install 'torch>=2.1,<3' --index-url {CPU_INDEX}") == []


@pytest.mark.parametrize(("command", "says"), [
    ("mkdir -p /etc/nccl", "names /etc/nccl"),
    (".venv/bin/topoagent export gres -o /etc/slurm/gres.conf", "names /etc/slurm/gres.conf"),
    ("X=/var/lib/topoagent true", "names /var/lib/topoagent"),
    ("systemctl restart slurmd", "`systemctl` changes the machine"),
    ("sudo true", "`sudo`"),
    ("echo x >/etc/motd", "names /etc/motd"),
    ("true 2>/dev/null >>/var/log/x", "names /var/log/x"),
    ("cat /", "names /,"),
    ("bash scripts/test", "`scripts/test` changes the machine or runs the suite"),
    ("echo 'unclosed", "bash would not read it"),
])
def test_lines_that_would_change_the_machine_are_refused(command: str, says: str) -> None:
    assert says in (refusal(command) or "")


@pytest.mark.parametrize("command", [
    "install -m 600 /dev/null .state/token",
    "curl -s http://127.0.0.1:9477/topology > /tmp/x.json",
    ".venv/bin/topoagent discover --root fixtures/snapshots/dgx-a100 2>/dev/null",
    "cat /proc/cpuinfo | head -1",
])
def test_lines_that_stay_in_their_scratch_directory_run(command: str) -> None:
    assert refusal(command) is None


# --- running blocks ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ready_venv(tmp_path_factory) -> Path:
    return make_ready_venv(tmp_path_factory.mktemp("framework") / "venv")


def sh(text: str, expect: int | None = None) -> Block:
    return Block("p.md", 10, "sh", text, None, expect)


def test_a_block_runs_in_its_scratch_directory_carrying_cd_and_export(tmp_path, ready_venv) -> None:
    scratch = make_scratch(tmp_path / "s", ready_venv)
    block = sh("mkdir -p work\ncd work\nexport GREETING=hello\necho \"$GREETING\" > said && pwd\n"
               ".venv/bin/topoagent --version\n")
    outcome = run_sh(block, scratch)
    assert outcome.failure == "exit status 127, expected 0"  # .venv is relative: after cd it is not there
    outcome = run_sh(sh(block.text.replace(".venv/bin/topoagent --version", "../.venv/bin/topoagent --version")), scratch)
    assert outcome.failure is None, report(outcome)
    assert (scratch / "work" / "said").read_text() == "hello\n"
    assert outcome.steps[-1].output.startswith("topoagent ")
    assert not (REPO / "work").exists()


def test_expect_is_the_last_lines_status_and_every_other_line_must_succeed(tmp_path, ready_venv) -> None:
    scratch = make_scratch(tmp_path / "s", ready_venv)
    place = ".venv/bin/topoagent place --gpus 9 --root fixtures/snapshots/dgx-a100"
    assert run_sh(sh(f"true\n{place}\n", expect=3), scratch).failure is None  # never fits: exit 3
    assert run_sh(sh(f"{place}\ntrue\n", expect=3), scratch).failure == "exit status 3, expected 0"
    assert run_sh(sh(f"true\n{place}\n"), scratch).failure == "exit status 3, expected 0"


def test_a_failure_says_where_the_command_its_status_and_the_end_of_its_output(tmp_path, ready_venv) -> None:
    scratch = make_scratch(tmp_path / "s", ready_venv)
    noisy = "for i in $(seq 1 500); do echo line-$i; done; echo the-last-words >&2; exit 4"
    outcome = run_sh(sh(f"true\n{noisy}\n"), scratch)
    said = report(outcome)
    assert said.startswith("p.md:10: exit status 4, expected 0\n")
    assert f"  line 12: {noisy}\n" in said and "  exit status: 4\n" in said
    assert said.rstrip().endswith("the-last-words") and "line-500" in said and "line-1\n" not in said


def test_a_command_past_its_timeout_is_killed_and_reported(tmp_path, ready_venv) -> None:
    outcome = run_sh(sh("sleep 30 & wait\n"), make_scratch(tmp_path / "s", ready_venv), timeout=0.5)
    assert outcome.failure == "exit status 124, expected 0" and "(killed after 0 s)" in outcome.steps[-1].output


def test_install_lines_are_dropped_and_a_refused_line_never_runs(tmp_path, ready_venv) -> None:
    scratch = make_scratch(tmp_path / "s", ready_venv)
    outcome = run_sh(sh("python3 -m venv .venv && .venv/bin/pip install -q . && .venv/bin/python -c 'print(41 + 1)'\n"), scratch)
    assert outcome.failure is None and outcome.steps[0].output == "42\n"
    refused = run_sh(sh("touch first\nmkdir -p /etc/topoagent-example-test\n"), scratch)
    assert refused.failure is not None and refused.failure.startswith("refused: names /etc/topoagent-example-test")
    assert not Path("/etc/topoagent-example-test").exists() and (scratch / "first").exists()


def test_a_serve_line_runs_until_the_block_ends_and_later_lines_reach_it(tmp_path, ready_venv) -> None:
    """The documented port is swapped for the free one it got; SIGTERM at the end, exit 0."""
    scratch = make_scratch(tmp_path / "s", ready_venv)
    block = sh("mkdir -p .state && install -m 600 /dev/null .state/token && echo secret-token-0123456789 > .state/token"
               " && .venv/bin/topoagent serve --root fixtures/snapshots/dgx-a100 --listen 127.0.0.1:9477 --state-dir .state"
               " --token-file .state/token\n"
               "curl -sf http://127.0.0.1:9477/readyz\n"
               "curl -sf -X POST -H \"Authorization: Bearer $(cat .state/token)\" http://127.0.0.1:9477/refresh\n")
    outcome = run_sh(block, scratch, keep_serving=True)
    assert outcome.failure is None, report(outcome)
    (served,) = outcome.served
    assert served.documented == "127.0.0.1:9477" and served.address != "127.0.0.1:9477"
    assert re.fullmatch(r"127\.0\.0\.1:\d+", served.address)
    assert [step.status for step in outcome.steps] == [0, 0, 0]  # curl -f: both answered 2xx
    try:
        # http blocks go to it with its token where they ask for it
        good, _ = collect([SAMPLES / "good.md"])
        status, body = send(served.address, parse_http(good[4].text), "secret-token-0123456789")
        assert status == 200 and shape_mismatch(good[4].answer or "", body) is None
        token = "secret-token-0123456789"
        refresh = parse_http("POST /refresh\n")
        assert send(served.address, refresh, token)[0] == 200  # the token goes with every request
        assert send(served.address, refresh)[0] == 401  # (the agent does want it)
        assert send(served.address, parse_http("POST /refresh\nAuthorization: Bearer <token>\n"), token)[0] == 200
        # a block's own Authorization line replaces it: a page may show a refusal
        assert send(served.address, parse_http(good[5].text), token)[0] == good[5].expect == 401
    finally:
        assert served.stop() == 0
    stopped = run_sh(sh(block.text.splitlines()[0] + "\n"), make_scratch(tmp_path / "t", ready_venv))
    # without keep_serving it is stopped with its block, and its exit 0 is checked
    assert stopped.failure is None and [s.proc.returncode for s in stopped.served] == [0]


def test_a_serve_that_cannot_start_fails_with_its_output(tmp_path, ready_venv) -> None:
    outcome = run_sh(sh(".venv/bin/topoagent serve --root no/such/node --listen 127.0.0.1:9477 --state-dir .state\n"),
                     make_scratch(tmp_path / "s", ready_venv))
    assert outcome.failure == "serve did not become ready"
    assert outcome.steps[0].output.startswith("exited 2 before it was ready")


def test_the_install_prefix_is_the_scratch_directorys_and_the_wheel_builds_and_installs_offline(tmp_path):
    prefix = f"{tmp_path}/opt/topoagent"
    assert refusal("/opt/topoagent/bin/topoagent --version") is None  # the README's prefix may be named
    assert offline("/opt/topoagent/bin/topoagent --version", tmp_path) == f"{prefix}/bin/topoagent --version"
    built = offline("/opt/topoagent/bin/pip wheel --no-deps -q -w dist .", tmp_path)
    assert built.endswith(" -m pip wheel --no-build-isolation --no-index --no-deps -q -w dist .")
    installed = offline("/opt/topoagent/bin/pip install -q dist/topoagent-0.1.0-py3-none-any.whl", tmp_path)
    assert installed.startswith(f"env -u PYTHONPATH {prefix}/bin/pip install --no-deps --no-index -q dist/topoagent-0.1.0-py3-none-any.whl && {prefix}/bin/python -c ")
    assert offline(".venv/bin/topoagent --version", tmp_path) == ".venv/bin/topoagent --version"  # nothing else changes
