"""Shell completion, the man page, --log-level and the export exit rule, as a user meets them."""

from __future__ import annotations

import argparse
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES
from service_helpers import start_agent

from topoagent.cli import COMMANDS, build_parser
from topoagent.commands.export import FORMATS

RUN = [sys.executable, "-P", "-m", "topoagent"]
SNAPSHOTS = FIXTURES / "snapshots"


def topoagent(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*RUN, *args], capture_output=True, text=True, timeout=120, **kw)


def every_command_and_flag() -> list[tuple[tuple[str, ...], list[str]]]:
    """(subcommand path, its option strings) for the whole parser, walked here on its own."""
    found = []

    def visit(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        flags = [f for a in parser._actions for f in a.option_strings]
        found.append((path, flags))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    visit(sub, (*path, name))

    visit(build_parser(), ())
    return found


def test_the_walk_sees_every_registered_command():
    paths = {path for path, _ in every_command_and_flag()}
    assert {(name,) for name in COMMANDS} <= paths
    assert {("export", name) for name in FORMATS} <= paths
    assert {"completion", "man", "install-files"} <= set(COMMANDS)


@pytest.mark.parametrize("output", [("completion", "bash"), ("completion", "zsh"), ("man",)], ids=" ".join)
def test_every_subcommand_and_flag_appears(output):
    text = topoagent(*output).stdout
    if output == ("man",):
        text = text.replace("\\-", "-")  # roff's real dashes
    for path, flags in every_command_and_flag():
        for name in path:
            assert name in text, (output, name)
        for flag in flags:
            assert flag in text, (output, path, flag)


@functools.cache
def script(shell: str) -> str:
    return topoagent("completion", shell).stdout


def bash_complete(*words: str) -> list[str]:
    script_text = script("bash")
    words_text = " ".join(f"'{w}'" for w in words)
    probe = f'{script_text}\nCOMP_WORDS=({words_text}); COMP_CWORD={len(words) - 1}; _topoagent; printf "%s\\n" "${{COMPREPLY[@]}}"'
    done = subprocess.run(["bash", "--norc", "-c", probe], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def zsh_complete(*words: str) -> list[str]:
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.fail("zsh not found: install the Debian package 'zsh' (scripts/test does)")
    script_text = script("zsh")
    # compadd and _files stand in for the completion system: they print what would be offered.
    words_text = " ".join(f"'{w}'" for w in words)
    probe = ("compadd() { shift; print -rl -- \"$@\"; }; _files() { print FILES; }; compdef() { :; }\n"
             f"{script_text}\nwords=({words_text}); CURRENT={len(words)}; _topoagent")
    done = subprocess.run([zsh, "-f", "-c", probe], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.parametrize("complete", [bash_complete, zsh_complete], ids=["bash", "zsh"])
def test_completion_offers_commands_formats_flags_and_choices(complete):
    assert complete("topoagent", "") == list(COMMANDS)
    assert complete("topoagent", "export", "") == list(FORMATS)
    assert "--prefix" in complete("topoagent", "export", "nfd", "--")
    assert "--prefix" not in complete("topoagent", "export", "gres", "--")
    assert complete("topoagent", "serve", "--probes", "") == ["off", "cpu", "cuda"]
    assert complete("topoagent", "--log-level", "") == ["debug", "info", "warning", "error"]
    assert complete("topoagent", "completion", "") == ["bash", "zsh"]


def test_the_man_page_is_clean_roff_that_man_renders():
    page = topoagent("man").stdout
    assert page.startswith(".TH TOPOAGENT 1 ")
    lint = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z"], input=page, capture_output=True, text=True, timeout=30)
    assert lint.returncode == 0 and lint.stderr == "", lint.stderr
    shown = subprocess.run(["groff", "-man", "-Tascii", "-P-c", "-P-b", "-P-u"], input=page, capture_output=True, text=True, timeout=30).stdout
    assert "EXIT STATUS" in shown and "export nccl-xml" in shown and "--log-level" in shown


def test_log_level_is_accepted_before_and_after_the_command():
    args = build_parser().parse_args(["--log-level", "debug", "export", "nfd"])
    assert args.log_level == "debug"
    args = build_parser().parse_args(["export", "nfd", "--log-level", "error"])
    assert args.log_level == "error"
    assert build_parser().parse_args(["export", "nfd"]).log_level is None
    assert topoagent("--log-level", "loud", "discover").returncode == 2


def test_serve_logs_info_events_by_default_and_not_at_warning(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    default = start_agent(tmp_path / "a")
    quiet = start_agent(tmp_path / "b", extra=["--log-level", "warning"])
    for agent in (default, quiet):
        assert agent.stop() == 0
    assert "event=leases_loaded" in default.log()
    assert "event=leases_loaded" not in quiet.log()


def test_every_export_of_a_node_without_gpus_exits_1_with_one_message(tmp_path):
    node = tmp_path / "no-gpus"
    (node / "sys").mkdir(parents=True)  # a recorded node where sysfs shows nothing
    kept = tmp_path / "kept.txt"
    kept.write_text("the last good export\n")
    said = set()
    for name in FORMATS:
        done = topoagent("export", name, "--root", str(node), "-o", str(kept))
        assert done.returncode == 1 and done.stdout == "", (name, done.stderr)
        assert done.stderr == f"topoagent export {name}: no GPUs found on this node; nothing written\n"
        said.add(done.stderr.split(": ", 1)[1])
    assert said == {"no GPUs found on this node; nothing written\n"}
    assert kept.read_text() == "the last good export\n"


def test_install_files_writes_the_shipped_files_and_refuses_to_overwrite(tmp_path):
    target = tmp_path / "etc"
    done = topoagent("install-files", str(target))
    assert done.returncode == 0, done.stderr
    written = sorted(Path(line).name for line in done.stdout.splitlines())
    assert written == ["grafana-dashboard.json", "topoagent-alerts.yml", "topoagent.service", "topoagent.toml"]
    repo = Path(__file__).resolve().parents[1]
    for name in written:
        assert (target / name).read_bytes() == (repo / "systemd" / name).read_bytes()
    (target / "topoagent.toml").write_text("# mine\n")
    again = topoagent("install-files", str(target))
    assert again.returncode == 2 and "already there" in again.stderr and "--force" in again.stderr
    assert (target / "topoagent.toml").read_text() == "# mine\n"
    forced = topoagent("install-files", str(target), "--force")
    assert forced.returncode == 0 and (target / "topoagent.toml").read_bytes() == (repo / "systemd/topoagent.toml").read_bytes()


@pytest.mark.parametrize("argv, flag", [
    (["extender", "--agent-token-file"], "--agent-token-file"),
    (["device-plugin", "--agent-token-file"], "--agent-token-file"),
    (["cluster-topology", "--agents", "http://127.0.0.1:1", "--token-file"], "--token-file"),
])
def test_a_client_token_file_that_holds_no_usable_token_is_refused_at_start(tmp_path, argv, flag):
    """Empty (the requests would go out without a token and fail on every node), a FIFO
    (read_text() waited for a writer forever), a line break inside (no HTTP header carries it)."""
    import os

    empty = tmp_path / "empty"
    empty.write_text("\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    broken = tmp_path / "broken"
    broken.write_text("first-half-of-it\nsecond-half-of-it\n")
    for path, says in ((empty, "holds no token"), (fifo, "not a regular file (a FIFO)"), (broken, "line break")):
        done = topoagent(*argv, str(path))
        assert done.returncode == 2 and flag in done.stderr and says in done.stderr, (argv, path, done.stderr)


@pytest.mark.parametrize("args", [
    ("place", "--gpus", "9", "--root", str(SNAPSHOTS / "dgx-a100")),  # no fit: its own status is 1
    ("place", "--gpus", "2", "--root", str(SNAPSHOTS / "dgx-a100")),  # placed: its own status is 0
    ("matrix", "--from-nvidia-smi", str(FIXTURES / "nvidia-smi" / "hgx-h20-8gpu-8nic.txt")),
])
def test_a_reader_that_leaves_early_never_turns_the_exit_into_success(args: tuple[str, ...]) -> None:
    """`topoagent place … | head`: the reader closes before the answer is whole, so the
    command cannot say whether it placed; it exits 141 as a shell's SIGPIPE'd writer does,
    quietly, and never 0 (which called a request that did not fit a success)."""
    child = subprocess.Popen([*RUN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()  # the reader is gone before the command writes its first byte
    err = child.stderr.read()
    assert child.wait(timeout=120) == 141
    assert b"Traceback" not in err
