"""Host replays stay inside their root; a snapshot of this machine replays to the same output."""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import SHARED

from topoagent.cli import main
from topoagent.node.host import CommandNotFound, CommandResult, FileTooLarge, Host, HostError


def test_symlinks_resolve_inside_the_root(tmp_path: Path) -> None:
    (tmp_path / "sys/class/net").mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/hostname").write_text("replayed\n")
    os.symlink("../../../../../../../etc", tmp_path / "sys/class/net/up")
    os.symlink("/etc", tmp_path / "sys/class/net/absolute")
    host = Host(tmp_path)
    assert host.realpath("/sys/class/net/up") == "/etc"
    # Both reach the recording's etc/, never this machine's.
    assert host.read_text("/sys/class/net/up/hostname") == "replayed\n"
    assert host.read_text("/sys/class/net/absolute/hostname") == "replayed\n"
    assert host.read_optional("/sys/class/net/up/passwd") is None


def test_tarball_members_escaping_the_root_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as archive:
        info = tarfile.TarInfo("../escape")
        data = b"x"
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    with pytest.raises(HostError, match="unsafe member"):
        Host(bad)
    assert not (tmp_path / "escape").exists()


def test_hwloc_tarball_is_a_root() -> None:
    with Host(SHARED / "hwloc/linux/32intel64-2p8co2t+8ve.tar.bz2") as host:
        assert host.realpath("/sys/bus/pci/devices/0000:1a:00.0") == (
            "/sys/devices/pci0000:17/0000:17:00.0/0000:18:00.0/0000:19:04.0/0000:1a:00.0")


def test_replayed_commands(tmp_path: Path) -> None:
    (tmp_path / "commands").mkdir()
    (tmp_path / "commands/nvidia-smi_topo_-m.out").write_text("out")
    (tmp_path / "commands/nvidia-smi_topo_-m.rc").write_text("3")
    host = Host(tmp_path)
    result = asyncio.run(host.run(["nvidia-smi", "topo", "-m"]))
    assert (result.stdout, result.returncode) == ("out", 3)
    with pytest.raises(CommandNotFound):
        asyncio.run(host.run(["ibstat"]))


def test_live_commands_run_without_a_shell_and_time_out() -> None:
    host = Host("/")
    result = asyncio.run(host.run([sys.executable, "-c", "print('a;b')"]))
    assert result.stdout == "a;b\n"
    with pytest.raises(CommandNotFound):
        asyncio.run(host.run(["no-such-command-topoagent"]))
    from topoagent.node.host import CommandTimeout

    with pytest.raises(CommandTimeout):
        asyncio.run(host.run([sys.executable, "-c", "import time; time.sleep(5)"], timeout=0.2))


def test_live_commands_without_an_event_loop() -> None:
    """One-shot commands drive collectors with no event loop: the blocking path runs the
    command, and tells a tool that is not installed from a PATH look-up (no fork)."""

    def run(argv: list[str]) -> CommandResult:
        coroutine = Host("/").run(argv)
        try:
            coroutine.send(None)
        except StopIteration as done:
            return done.value
        raise AssertionError("Host.run waited on an event loop")

    assert run([sys.executable, "-c", "print('a;b')"]).stdout == "a;b\n"
    with pytest.raises(CommandNotFound):
        run(["no-such-command-topoagent"])


def _discover_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["discover", "--json", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    for status in out["collectors"].values():
        status.pop("seconds")
    return out


@pytest.mark.parametrize("form", ["dir", "tar.gz"])
def test_snapshot_of_this_machine_replays_to_the_same_discovery(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], form: str
) -> None:
    out = tmp_path / ("node" if form == "dir" else "node.tar.gz")
    assert main(["snapshot", str(out)]) == 0
    capsys.readouterr()
    live = _discover_json(capsys)
    replayed = _discover_json(capsys, "--root", str(out))
    assert replayed == live
    assert live["pci_devices"], "this machine has PCI devices to compare"
    # The kernel's name, read from /proc (a sysctl file refuses one read of megabytes).
    assert live["hostname"] == socket.gethostname()


def test_each_recording_is_discovered_under_the_name_its_snapshot_keeps() -> None:
    from topoagent.commands.discover import discover_root

    for path in sorted((Path(__file__).resolve().parents[1] / "fixtures" / "snapshots").iterdir()):
        recorded = json.loads((path / "snapshot.json").read_text())["hostname"]
        assert recorded and discover_root(str(path)).hostname == recorded, path.name


@pytest.mark.parametrize("name, kept", [
    ("gpu-017.rack3", "gpu-017.rack3"), ("  gpu01\n", "gpu01"), ("bad name", None), ("", None),
    ("x" * 254, None), ("evil\u0007", None), (42, None),
])
def test_a_recorded_hostname_is_kept_only_when_it_is_a_name(tmp_path: Path, name: object, kept: str | None) -> None:
    (tmp_path / "sys").mkdir()
    (tmp_path / "snapshot.json").write_text(json.dumps({"schema": 1, "hostname": name}))
    assert Host(tmp_path).hostname() == kept


def test_a_node_file_is_read_whole_in_pieces_up_to_its_limit(tmp_path: Path) -> None:
    (tmp_path / "sys").mkdir()
    (tmp_path / "big").write_bytes(b"x" * (300 << 10))
    host = Host(tmp_path)
    assert host.read_bytes("/big") == b"x" * (300 << 10)
    assert host.read_bytes("/big", limit=300 << 10) == b"x" * (300 << 10)  # exactly its limit
    with pytest.raises(FileTooLarge):
        host.read_bytes("/big", limit=(300 << 10) - 1)
    (tmp_path / "empty").write_bytes(b"")
    assert host.read_bytes("/empty") == b""


def test_snapshot_holds_only_what_discovery_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["snapshot", str(tmp_path / "node")]) == 0
    files = [p for p in (tmp_path / "node").rglob("*") if p.is_file() and not p.is_symlink()]
    assert not any("/config" in str(p) or p.name == "resource" for p in files)
    assert json.loads((tmp_path / "node/snapshot.json").read_text())["schema"] == 1


def test_bad_root_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["discover", "--root", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file" in err


RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots" / "vm-1gpu"


def test_a_directory_without_sys_is_not_a_recorded_node(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Any directory used to 'discover' as a node with no GPUs and exit 0."""
    (tmp_path / "notes.txt").write_text("not a node\n")
    assert main(["discover", "--root", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"topoagent discover: not a recorded node: no sys/ under {tmp_path}\n"


@pytest.mark.parametrize("name", ["node.tar.gz", "node.tgz"])
def test_snapshot_refuses_an_existing_archive_unless_forced(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    out = tmp_path / name
    out.write_bytes(b"precious")
    assert main(["snapshot", "--root", str(RECORDED), str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"topoagent snapshot: {out}: exists; use --force to replace it\n"  # the path once
    assert out.read_bytes() == b"precious"
    assert main(["snapshot", "--root", str(RECORDED), "--force", str(out)]) == 0
    with tarfile.open(out) as archive:
        assert any(m.name.endswith("/snapshot.json") for m in archive.getmembers())
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no partial file left


def test_snapshot_refuses_an_existing_directory_and_forces_only_over_a_snapshot(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "node"
    assert main(["snapshot", "--root", str(RECORDED), str(out)]) == 0
    assert main(["snapshot", "--root", str(RECORDED), str(out)]) == 2
    assert capsys.readouterr().err.endswith(f"snapshot: {out}: exists and is not empty; use --force to replace an earlier snapshot\n")
    (out / "stale-file").write_text("from an earlier run")
    assert main(["snapshot", "--root", str(RECORDED), "--force", str(out)]) == 0
    assert not (out / "stale-file").exists() and (out / "snapshot.json").is_file()
    other = tmp_path / "home"
    other.mkdir()
    (other / "thesis.tex").write_text("keep me")
    assert main(["snapshot", "--root", str(RECORDED), "--force", str(other)]) == 2
    assert "holds no snapshot.json" in capsys.readouterr().err
    assert (other / "thesis.tex").read_text() == "keep me"


@pytest.mark.parametrize("name", ["node.zip", "node.tar.xz", "node.tar"])
def test_snapshot_names_the_archive_forms_it_writes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    assert main(["snapshot", "--root", str(RECORDED), str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert "unsupported archive type" in err and "OUT.tar.gz or OUT.tgz" in err and err.count("\n") == 1
    assert not (tmp_path / name).exists()


def test_nvml_module_is_import_safe_without_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    from topoagent.collectors import nvml

    with pytest.raises(nvml.NoData):
        nvml.read_live()
    result = asyncio.run(nvml.collect(Host("/")))
    assert result.status == "no_data"
