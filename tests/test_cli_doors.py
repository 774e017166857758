"""What a newcomer meets at the doors: request flags beside --batch, duplicates, mistyped
flags, exit statuses, a node without GPUs, unknown query parameters, help with examples."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import FIXTURES
from service_helpers import start_agent

RUN = [sys.executable, "-P", "-m", "topoagent"]
DGX_A100 = str(FIXTURES / "snapshots" / "dgx-a100")


def topoagent(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([*RUN, *args], input=stdin, capture_output=True, text=True, timeout=120)


# --- place --batch and the request flags ---------------------------------------------------

@pytest.mark.parametrize("flags, named", [
    (["--busy", "0,1"], '--busy (give each line its "busy")'),
    (["--gpus", "2"], '--gpus (give each line its "gpus")'),
    (["--pattern", "alltoall", "--single-numa"], '--pattern, --single-numa (give each line its "pattern", "single_numa")'),
    (["--message-bytes", "1024"], "--message-bytes"),
    (["--deadline-ms", "5"], "--deadline-ms"),
    (["--min-level", "NV", "--include", "1", "--exclude", "2", "--nics", "1", "--affinity", "best", "--fallback"],
     "--min-level, --include, --exclude, --nics, --affinity, --fallback"),
    (["--busy", ""], "--busy"),  # given, even if empty: not silently dropped
])
def test_batch_refuses_request_flags_instead_of_ignoring_them(flags, named):
    done = topoagent("place", "--root", DGX_A100, "--batch", *flags, stdin='{"gpus": 2}\n')
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"topoagent place: --batch takes requests from stdin; drop {named}"), done.stderr
    assert done.stderr.count("\n") == 1


def test_batch_lines_carry_busy_and_the_node_flags_apply():
    done = topoagent("place", "--root", DGX_A100, "--batch", stdin='{"gpus": 2, "busy": [0, 1]}\n')
    assert done.returncode == 0, done.stderr
    assert not {g["index"] for g in json.loads(done.stdout)["gpus"]} & {0, 1}


def test_busy_duplicates_are_refused_in_the_batch_lines_words():
    flag = topoagent("place", "--root", DGX_A100, "--gpus", "4", "--busy", "0,0")
    assert flag.returncode == 2 and flag.stdout == ""
    assert flag.stderr == "topoagent place: --busy: GPU 0 is listed twice\n"
    line = topoagent("place", "--root", DGX_A100, "--batch", stdin='{"gpus": 4, "busy": [0, 0]}\n')
    error = json.loads(line.stdout)["error"]
    assert (error["field"], error["message"]) == ("busy[1]", "GPU 0 is listed twice")
    # The rest of --busy is judged as a line's "busy" is, too.
    assert topoagent("place", "--root", DGX_A100, "--gpus", "4", "--busy", "9").stderr.startswith(
        "topoagent place: --busy: GPU 9 is not on this node (GPUs: 0, 1,")
    assert topoagent("place", "--root", DGX_A100, "--gpus", "4", "--busy", "x").stderr == (
        'topoagent place: --busy: expected an integer, got "x"\n')


@pytest.mark.parametrize("lines, status", [
    (['{"gpus": 2}', '{"gpus": 4}'], 0),
    (['{"gpus": 2}', '{"gpus": 2, "busy": [0, 1, 2, 3, 4, 5, 6]}'], 1),
    (['{"gpus": 2}', '{"gpus": 9}', '{"gpus": 2, "busy": [0, 1, 2, 3, 4, 5, 6]}'], 3),
    (['{"gpus": 2}', '{"gpus": 9}', "not json"], 2),
    (['{"gpus": 2, "colour": "red"}', '{"gpus": 2}'], 2),
    ([], 0),
], ids=["all-placed", "a-no-fit-now", "a-never-fits", "a-bad-line", "bad-first", "empty"])
def test_batch_exit_status_is_the_worst_lines(lines, status):
    done = topoagent("place", "--root", DGX_A100, "--batch", stdin="".join(line + "\n" for line in lines))
    assert done.returncode == status, done.stderr
    assert len(done.stdout.splitlines()) == len(lines)  # every line answered all the same


# --- a node without GPUs -------------------------------------------------------------------

def test_place_on_a_node_without_gpus_says_so_at_every_door(tmp_path):
    node = tmp_path / "no-gpus"
    (node / "sys").mkdir(parents=True)  # a recorded node where sysfs shows nothing
    said = "1 GPUs requested; no GPUs found on this node"
    # Nothing is busy: it never fits this node (exit 3, 422), not "busy now" (issue 27).
    flag = topoagent("place", "--root", str(node), "--gpus", "1")
    assert flag.returncode == 3
    assert flag.stdout.startswith(f"never fits this node (--gpus): {said}\n")
    assert flag.stderr == f"topoagent place: never fits this node: {said}\n"
    line = topoagent("place", "--root", str(node), "--batch", stdin='{"gpus": 1}\n')
    assert line.returncode == 3 and json.loads(line.stdout)["reason"] == said
    (tmp_path / "agent").mkdir()
    agent = start_agent(tmp_path / "agent", root=node)
    try:
        reply = agent.post("/place", {"gpus": 1})
    finally:
        agent.stop()
    assert reply.status == 422 and reply.json()["nofit"]["reason"] == said


# --- HTTP: unknown query parameters --------------------------------------------------------

@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    served = start_agent(tmp_path_factory.mktemp("doors-http"), root=FIXTURES / "snapshots" / "dgx-a100")
    yield served
    served.stop()


def get_paths_with_query_parameters(agent) -> dict[str, list[str]]:
    doc = agent.get("/openapi.json").json()
    found = {}
    for path, item in doc["paths"].items():
        names = [p["name"] for p in item.get("get", {}).get("parameters", []) if p["in"] == "query"]
        if names:
            found[path] = names
    return found


def test_a_mistyped_query_parameter_is_refused_by_name(agent):
    reply = agent.get("/topology?fromat=matrix")
    assert reply.status == 400
    assert reply.json() == {"error": "bad_request", "detail": "fromat: unknown query parameter (known: format)"}
    twice = agent.get("/topology?format=json&format=matrix")
    assert twice.status == 400 and twice.json()["detail"] == "format: given twice"
    assert agent.get("/topology?format=matrix").status == 200
    assert agent.get("/topology").status == 200


def test_every_get_endpoint_with_query_parameters_refuses_unknown_ones(agent):
    """The OpenAPI document's list of parameters is the one the endpoint keeps to."""
    found = get_paths_with_query_parameters(agent)
    assert "/topology" in found
    for path, names in found.items():
        reply = agent.get(f"{path}?colour=red")
        assert reply.status == 400, path
        assert reply.json()["detail"] == f"colour: unknown query parameter (known: {', '.join(names)})"


# --- mistyped flags, bare topoagent ---------------------------------------------------------

def test_a_mistyped_flag_gets_the_subcommands_usage_and_the_closest_flag():
    done = topoagent("place", "--gpus", "4", "--patern", "alltoall")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("usage: topoagent place ")
    assert done.stderr.splitlines()[-1] == (
        "topoagent place: error: unrecognized arguments: --patern alltoall; did you mean --pattern?")
    nested = topoagent("export", "nfd", "--prefx=x")
    assert nested.returncode == 2 and nested.stderr.startswith("usage: topoagent export nfd ")
    assert nested.stderr.splitlines()[-1].endswith("unrecognized arguments: --prefx=x; did you mean --prefix?")
    two = topoagent("place", "--gpus", "4", "--patern", "alltoall", "--bsy", "1")
    assert two.stderr.splitlines()[-1].endswith("did you mean --pattern (for --patern), --busy (for --bsy)?")
    nothing_close = topoagent("place", "--gpus", "4", "--zzzzzz")
    assert nothing_close.stderr.splitlines()[-1] == "topoagent place: error: unrecognized arguments: --zzzzzz"


# What a command needs before argparse looks at unknown arguments (it reports those last).
NEEDS = {"matrix": ["--from-nvidia-smi", "x"], "snapshot": ["out"], "install-files": ["dir"], "cluster-topology": ["--agents", "x"], "export": ["nfd"],
         "completion": ["bash"], "slurm": ["epilog"]}


def test_every_subcommand_reports_its_own_unknown_flags():
    from topoagent.cli import COMMANDS

    for name in COMMANDS:
        done = topoagent(name, *NEEDS.get(name, []), "--log-levle=debug")
        usage = "usage: topoagent " + ("export nfd" if name == "export" else name) + " "
        assert done.returncode == 2 and done.stderr.startswith(usage), (name, done.stderr)
        assert done.stderr.splitlines()[-1].endswith("did you mean --log-level?"), (name, done.stderr)
        assert "Traceback" not in done.stderr


def test_bare_topoagent_lists_the_commands_and_exits_2():
    from topoagent.cli import COMMANDS

    for argv in ([], ["--log-level", "debug"]):
        done = topoagent(*argv)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.startswith("usage: topoagent ")
        assert all(name in done.stderr for name in COMMANDS)


# --- help that helps ------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["place", "discover", "serve"])
def test_help_and_man_page_show_examples(command):
    shown = topoagent(command, "--help").stdout
    examples = shown.split("\nexamples:\n", 1)[1]
    assert f"  topoagent {command} " in examples
    page = topoagent("man").stdout.replace("\\-", "-")
    section = page.split(f".SS {command}\n", 1)[1].split(".SS ", 1)[0]
    assert ".nf\nexamples:\n" in section and f"  topoagent {command} " in section


def test_place_help_states_the_defaults_and_the_batch_rules():
    shown = " ".join(topoagent("place", "--help").stdout.split())  # unwrapped
    for said in ("--busy LIST GPUs in use by others, e.g. 0,3 (default: none)", "(default 0)",
                 "PIX, ...; default: none)", "deadline_ms defaults to 20 ms",
                 "Request flags (--gpus, --busy, --pattern, ...) are refused with --batch",
                 "POST /place takes no busy", "the exit status is the worst line's"):
        assert said in shown, said


def test_the_batch_deadline_the_help_states_is_the_one_used():
    done = topoagent("place", "--root", DGX_A100, "--batch", stdin='{"gpus": 2, "detail": ["explain"]}\n')
    from topoagent.placement.request import SERVICE_DEADLINE_MS

    assert json.loads(done.stdout)["request"]["deadline_ms"] == SERVICE_DEADLINE_MS == 20


@pytest.mark.parametrize(("command", "page"), [("place", "commands.md"), ("cluster-topology", "cluster-fabric.md")])
def test_the_docs_synopsis_lists_every_flag_help_has(command, page):
    from conftest import REPO

    from topoagent.cli import build_parser

    text = (REPO / "docs" / page).read_text()
    start = text.index(f"\n`topoagent {command} ") + 1  # the synopsis opens a line of its own
    synopsis = text[start: text.index("`", start + 1)]
    parser = build_parser(command)._subparsers._group_actions[0].choices[command]
    flags = {f for a in parser._actions for f in a.option_strings if f.startswith("--")} - {"--help", "--log-level"}
    assert {f for f in flags if f not in synopsis} == set()
