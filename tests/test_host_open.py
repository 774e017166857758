"""A replayed node is read the same way with openat2 (one call per file) and without it
(one openat per path component, on kernels before 5.6): same answers, same confinement."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from topoagent.node import openat2
from topoagent.node.host import Host, NotAFile


@pytest.fixture(params=["openat2", "walk"])
def way(request, monkeypatch, tmp_path):
    """Host reads through openat2, or walks the path as a kernel without it makes it."""
    if request.param == "walk":
        monkeypatch.setattr(openat2, "_call", False)
    else:
        fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
        try:
            if not openat2.available(fd):
                pytest.skip(reason=f"this kernel ({os.uname().release}) refuses openat2: the walk is all it has")
        finally:
            os.close(fd)
    return request.param


def recording(tmp_path: Path) -> Path:
    root = tmp_path / "node"
    (root / "sys/devices/pci0000:00/0000:00:01.0").mkdir(parents=True)
    (root / "sys/devices/pci0000:00/0000:00:01.0/vendor").write_text("0x10de\n")
    (root / "sys/bus/pci/devices").mkdir(parents=True)
    os.symlink("../../../devices/pci0000:00/0000:00:01.0", root / "sys/bus/pci/devices/0000:00:01.0")
    os.symlink("/sys/devices/pci0000:00", root / "sys/bus/pci/devices/absolute")
    os.symlink("../../../../../../../../etc", root / "sys/bus/pci/devices/climbing")
    (root / "etc").mkdir()
    (root / "etc/hostname").write_text("replayed\n")
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret/vendor").write_text("SECRET\n")
    return root


def test_reads_follow_links_inside_the_root(tmp_path, way):
    with Host(recording(tmp_path)) as host:
        assert host.read_text("/sys/bus/pci/devices/0000:00:01.0/vendor") == "0x10de\n"
        assert host.read_text("/sys/bus/pci/devices/absolute/0000:00:01.0/vendor") == "0x10de\n"
        assert host.read_text("/sys/bus/pci/devices/climbing/hostname") == "replayed\n"
        assert host.listdir("/sys/bus/pci/devices") == ["0000:00:01.0", "absolute", "climbing"]
        assert host.is_dir("/sys/bus/pci/devices/0000:00:01.0")
        assert host.exists("/sys/bus/pci/devices/0000:00:01.0/vendor")
        assert not host.exists("/sys/bus/pci/devices/0000:00:01.0/device")
        assert host.islink("/sys/bus/pci/devices/0000:00:01.0")
        assert host.readlink("/sys/bus/pci/devices/absolute") == "/sys/devices/pci0000:00"
        with pytest.raises(FileNotFoundError) as missing:
            host.read_text("/sys/bus/pci/devices/0000:00:01.0/device")
        assert missing.value.filename == "/sys/bus/pci/devices/0000:00:01.0/device"  # the node's path


def test_a_link_at_the_end_of_the_path_is_followed_inside_the_root(tmp_path, way):
    """openat2 is tried on the last component as it is, refusing a link there: the link is
    then resolved by hand, inside the root, as one on the way is."""
    root = recording(tmp_path)
    device = root / "sys/devices/pci0000:00/0000:00:01.0"
    os.symlink("vendor", device / "alias")
    os.symlink("/etc/hostname", device / "absolute")
    os.symlink("../../../../secret/vendor", device / "climbing")  # the root's /secret: none
    with Host(root) as host:
        for _ in range(2):  # the second time from the cache
            assert host.read_text("/sys/bus/pci/devices/0000:00:01.0/alias") == "0x10de\n"
            assert host.read_text("/sys/devices/pci0000:00/0000:00:01.0/absolute") == "replayed\n"
            assert host.read_optional("/sys/devices/pci0000:00/0000:00:01.0/climbing") is None
            assert host.exists("/sys/devices/pci0000:00/0000:00:01.0/alias")
            assert host.islink("/sys/devices/pci0000:00/0000:00:01.0/alias")
            assert host.listdir("/sys/bus/pci/devices/0000:00:01.0/..") == ["0000:00:01.0"]


def test_a_link_planted_after_the_first_read_stays_inside_the_root(tmp_path, way):
    root = recording(tmp_path)
    with Host(root) as host:
        assert host.read_text("/sys/devices/pci0000:00/0000:00:01.0/vendor") == "0x10de\n"
        device = root / "sys/devices/pci0000:00/0000:00:01.0"
        (device / "vendor").unlink()
        device.rmdir()
        for planted in (str(tmp_path / "secret"), "../../../../secret"):  # absolute, and climbing out
            if device.is_symlink():
                device.unlink()
            os.symlink(planted, device)
            assert host.read_optional("/sys/devices/pci0000:00/0000:00:01.0/vendor") is None
            assert host.listdir("/sys/devices/pci0000:00/0000:00:01.0") == []


def test_a_fifo_in_a_file_s_place_is_refused_not_waited_on(tmp_path, way):
    root = recording(tmp_path)
    os.mkfifo(root / "sys/devices/pci0000:00/0000:00:01.0/device")
    with Host(root) as host, pytest.raises(NotAFile):
        host.read_bytes("/sys/bus/pci/devices/0000:00:01.0/device")


def test_a_closed_host_holds_no_descriptor(tmp_path, way):
    before = len(os.listdir("/proc/self/fd"))
    host = Host(recording(tmp_path))
    host.read_text("/etc/hostname")
    host.close()
    assert len(os.listdir("/proc/self/fd")) == before
