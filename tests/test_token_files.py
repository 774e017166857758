"""Who may read the bearer token: the README's command makes it the user's alone, and
every reader of a token file (the agent, the extender, cluster-topology) says so in one
warning line when others may read it, without refusing it (Kubernetes Secrets)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from service_helpers import DGX_A100, wait_ready

from topoagent.commands.token import readable_by_others

README = (REPO / "README.md").read_text()
EVENT = "event=token_file_readable_by_others"
TOKEN = "0123456789abcdef0123456789abcdef"


def try_it_block() -> list[str]:
    """The README's first command, one step a line: install, make a token, serve."""
    section = README[README.index("## Try it"):]
    block = section[section.index("```sh\n") + 6:]
    return block[: block.index("```")].splitlines()


def try_it_serve_line() -> str:
    return next(line for line in try_it_block() if line.startswith(".venv/bin/topoagent serve"))


def try_it_token_step() -> str:
    """The lines between the install and the serve: they make the token."""
    lines = try_it_block()
    start = next(i for i, line in enumerate(lines) if line.startswith("mkdir -p .state"))
    return "\n".join(lines[start: lines.index(try_it_serve_line())])


def child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "CREDENTIALS_DIRECTORY")}


def token_file(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(mode)
    return path


def warnings_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if EVENT in line]


def test_the_readme_command_makes_a_token_only_its_owner_reads(tmp_path: Path) -> None:
    """Run the README's token step as a user would (umask 022), over a token an older
    README left world-readable: the file ends 0600 with a token in it."""
    step = try_it_token_step()
    assert "install -m 600 /dev/null .state/token" in step
    (tmp_path / ".state").mkdir()
    token_file(tmp_path / ".state", 0o644)
    done = subprocess.run(["bash", "-e", "-c", f"umask 022\n{step.replace('.venv/bin/python', shlex.quote(sys.executable))}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    made = tmp_path / ".state" / "token"
    assert oct(made.stat().st_mode & 0o777) == oct(0o600)
    assert len(made.read_text().strip()) >= 32 and made.read_text().strip() != TOKEN


def test_the_readme_serve_command_prints_its_urls_and_no_token_warning(tmp_path: Path) -> None:
    """The README's serve, on a free port, with the token its command makes: the banner
    names every URL the README promises, and the log has no warning about the token."""
    line = try_it_serve_line()
    serve = shlex.split(line)
    assert serve[:2] == [".venv/bin/topoagent", "serve"]
    args = serve[2:]
    assert args[args.index("--listen") + 1] == "127.0.0.1:9477"
    args[args.index("--listen") + 1] = "127.0.0.1:0"
    (tmp_path / "fixtures").symlink_to(REPO / "fixtures")  # run where the README runs it: a checkout
    state = tmp_path / ".state"
    state.mkdir()
    token_file(state, 0o600)
    log = tmp_path / "agent.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "topoagent", "serve", *args], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=child_env())
    try:
        banner = [proc.stdout.readline() for _ in range(9)]
        first = re.match(r"topoagent serving fixtures/snapshots/dgx-a100 on (http://127\.0\.0\.1:\d+)\n", banner[0])
        assert first, banner
        base = first.group(1)
        for path in ("/", "/topology", "/metrics", "/openapi.json"):
            assert any(shown.split()[-1] == base + path for shown in banner[1:]), (path, banner)
        assert any("Ctrl-C" in shown for shown in banner), banner
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        proc.stdout.close()
    assert warnings_in(log.read_text()) == [], log.read_text()


def _serve(tmp_path: Path, token: Path):
    from service_helpers import Agent

    log = tmp_path / "agent.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(DGX_A100), "--listen", "127.0.0.1:0",
                                 "--state-dir", str(tmp_path / "state"), "--token-file", str(token)],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=child_env())
    match = re.search(r"on http://([\d.]+):(\d+)", proc.stdout.readline())
    assert match, log.read_text()
    agent = Agent(proc, match.group(1), int(match.group(2)), TOKEN, DGX_A100, tmp_path / "state", log)
    wait_ready(agent)
    return agent


@pytest.mark.parametrize(("mode", "who"), [(0o644, "anyone"), (0o604, "anyone"), (0o640, '"its group"'), (0o600, None), (0o400, None)])
def test_the_agent_serves_a_token_others_may_read_and_warns_once(tmp_path: Path, mode: int, who: str | None) -> None:
    token = token_file(tmp_path, mode)
    agent = _serve(tmp_path, token)
    try:
        body = {"gpus": 1, "reserve": {"owner": "j", "ttl_s": 60}}
        assert agent.post("/place", body, token=TOKEN).status == 200  # warned, not refused
    finally:
        assert agent.stop() == 0
    said = warnings_in(agent.log())
    if who is None:
        assert said == [], agent.log()
    else:
        assert len(said) == 1, agent.log()
        assert " WARNING " in said[0] and f"{EVENT} file={token} mode={mode:04o} readable_by={who} " in said[0], said[0]
        assert f'fix="chmod go-r {token}"' in said[0], said[0]
        assert TOKEN not in agent.log()  # the warning names the file, never the token


def test_a_token_others_may_write_is_refused_before_any_readable_warning(tmp_path: Path) -> None:
    token = token_file(tmp_path, 0o666)
    done = subprocess.run([sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(DGX_A100), "--listen", "127.0.0.1:0",
                           "--state-dir", str(tmp_path / "state"), "--token-file", str(token)],
                          capture_output=True, text=True, timeout=30, env=child_env())
    assert done.returncode == 2 and warnings_in(done.stderr) == [], done.stderr


def test_cluster_topology_warns_about_a_token_others_may_read(tmp_path: Path) -> None:
    saved = tmp_path / "node.json"  # a node under one leaf switch: a tree cluster-topology writes
    saved.write_text(json.dumps({"schema_version": 2, "hostname": "gpu001",
                                 "fabric": {"leaf": "0xaa", "rails": [{"leaf": "0xaa", "leaf_name": "leaf-a"}]}}))
    for mode, expected in ((0o644, 1), (0o600, 0)):
        token = token_file(tmp_path, mode)
        done = subprocess.run([sys.executable, "-P", "-m", "topoagent", "cluster-topology", "--topology-files", str(saved),
                               "--token-file", str(token)], capture_output=True, text=True, timeout=60, env=child_env())
        assert done.returncode == 0, done.stderr
        said = warnings_in(done.stderr)
        assert len(said) == expected, done.stderr
        if expected:
            assert said[0].startswith(f"{EVENT} file={token} mode=0644 readable_by=anyone"), said[0]


def test_the_extender_warns_at_start_up_about_a_token_others_may_read(tmp_path: Path) -> None:
    token = token_file(tmp_path, 0o644)
    log = tmp_path / "extender.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "topoagent", "extender", "--listen", "127.0.0.1:0",
                                 "--agent-url", "http://{address}:9", "--agent-token-file", str(token), "--kube-api", "http://127.0.0.1:9"],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=child_env())
    try:
        assert proc.stdout.readline(), log.read_text()  # it started: warned, not refused
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        proc.stdout.close()
    said = warnings_in(log.read_text())
    assert len(said) == 1 and f"file={token} mode=0644 readable_by=anyone" in said[0], log.read_text()


def test_group_read_on_a_file_root_owns_is_how_root_grants_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-root agent reading root's file through its group (a Secret under fsGroup,
    root:GROUP 0440, a systemd credential's ACL mask): not a leak.  Its other bit still is."""
    if os.geteuid() != 0:
        pytest.skip(reason="a root-owned token file needs root to make (CI runs as root)")
    group_only, everyone = token_file(tmp_path, 0o440), tmp_path / "everyone"
    everyone.write_text(TOKEN)
    everyone.chmod(0o444)
    assert readable_by_others(group_only.stat()) == "its group"  # root reading its own file: the group is extra
    monkeypatch.setattr(os, "geteuid", lambda: 65534)
    assert readable_by_others(group_only.stat()) is None
    assert readable_by_others(everyone.stat()) == "anyone"
    os.chown(group_only, 12345, 12345)  # a file another user owns: its group bit is that user's doing
    assert readable_by_others(group_only.stat()) == "its group"


def test_a_small_file_that_is_no_regular_file_is_refused_and_leaks_no_descriptor(tmp_path):
    """A FIFO a writer holds open (a read would return no bytes, not end of file), or a
    directory, in a token's or certificate's place: refused with what it is, no descriptor kept."""
    from topoagent.smallfile import read_small_file

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        before = len(os.listdir("/proc/self/fd"))
        for path, kind in ((fifo, "a FIFO"), (tmp_path, "a directory")):
            with pytest.raises(OSError, match=rf"not a regular file \({kind}\)"):
                read_small_file(str(path), 1024)
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        os.close(writer)
