"""`topoagent export nccl-xml` against NCCL's own dumps of the machines our fixtures model."""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import CORPUS, FIXTURES

from topoagent.collectors.gpudirect import PEER_MEMORY_FILES
from topoagent.collectors.pci import PciDevice
from topoagent.commands.discover import discover_root
from topoagent.exporters.nccl_xml import cpumap, render_nccl_xml, xml_parent_chain

SNAPSHOTS = FIXTURES / "snapshots"
DUMPS = CORPUS / "nccl-topo-xml"
BUSID = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
# EPYC 7742 (DGX A100) and Xeon 8480C (DGX H100) as /proc/cpuinfo prints them.
CPUINFO = {
    "dgx-a100": "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 49\n"
                "model name\t: AMD EPYC 7742 64-Core Processor\n\n",
    "hgx-h100": "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
                "model name\t: Intel(R) Xeon(R) Platinum 8480C\n\n",
}


def parse_partial(path: Path) -> ET.Element:
    """Read a dump, closing the elements a pasted excerpt left open."""
    text = re.sub(r"<!--.*?-->", "", path.read_text(), flags=re.S)
    lines = text.rstrip().splitlines()
    while lines and not lines[-1].rstrip().endswith(">"):
        lines.pop()
    text = "\n".join(lines)
    stack: list[str] = []
    for match in re.finditer(r"<(/?)(\w+)[^>]*?(/?)>", text):
        closing, name, selfclosing = match.groups()
        if selfclosing:
            continue
        if closing:
            stack.pop()
        else:
            stack.append(name)
    # An opened <nic> with no <net> yet is dropped rather than kept empty.
    text += "".join(f"</{name}>" for name in reversed(stack))
    return ET.fromstring(text)


def structure(root: ET.Element) -> dict[str, set[str]]:
    """Element -> attribute names, and parent/child pairs under the key 'nesting'."""
    found: dict[str, set[str]] = {"nesting": set()}
    for parent in root.iter():
        found.setdefault(parent.tag, set()).update(parent.attrib)
        for child in parent:
            found["nesting"].add(f"{parent.tag}>{child.tag}")
    return found


def export(name: str, tmp_path: Path, peer_memory_file: str | None = None) -> ET.Element:
    """The fixture's NCCL file; ``peer_memory_file``: a GPUDirect module's file added to it."""
    root = SNAPSHOTS / name
    if name in CPUINFO or peer_memory_file:
        copy = tmp_path / name
        shutil.copytree(root, copy, symlinks=True)
        if name in CPUINFO:  # the CPU facts a live node has in /proc/cpuinfo
            (copy / "proc").mkdir(exist_ok=True)
            (copy / "proc" / "cpuinfo").write_text(CPUINFO[name])
        if peer_memory_file:
            marker = copy / peer_memory_file.lstrip("/")
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text("1.0-0\n")
        root = copy
    return ET.fromstring(render_nccl_xml(discover_root(str(root))))


@pytest.fixture(scope="module")
def h200_dump() -> ET.Element:
    return parse_partial(DUMPS / "nccl-tests-256-H200-baremetal-dump-PARTIAL.xml.txt")


def test_hgx_h100_has_the_elements_attributes_and_nesting_of_nccls_h200_dump(tmp_path, h200_dump):
    ours = structure(export("hgx-h100", tmp_path, "/sys/module/nvidia_peermem/version"))
    theirs = structure(h200_dump)
    assert set(ours) == set(theirs)
    assert ours["nesting"] == theirs["nesting"]
    # NCCL keeps these from a file instead of asking, and we cannot know them as NCCL means
    # them: host_hash (its hash of the host name), a GPU's gdr (a CUDA attribute), a net's
    # guid (verbs' sys_image_guid) and maxconn (a verbs query).  Left out, NCCL detects them.
    left_to_nccl = {"cpu": {"host_hash"}, "gpu": {"gdr"}, "net": {"maxconn", "guid"}}
    for tag, attrs in theirs.items():
        if tag != "nesting":
            assert ours[tag] == attrs - left_to_nccl.get(tag, set()), tag


def test_hgx_h100_switch_blocks_match_the_dump_line_for_line(tmp_path, h200_dump):
    """The fixture is modeled on this machine: the switches the paste shows come out the same."""
    ours = {p.get("busid"): p for p in export("hgx-h100", tmp_path).iter("pci")}
    for theirs in h200_dump.iter("pci"):
        mine = ours[theirs.get("busid")]
        attrs = ["vendor", "subsystem_vendor", "link_speed", "link_width"]
        if theirs.get("class") == "0x060400":
            # Endpoints differ on purpose: the fixture's GPUs are H100s (the dump's H200s) and
            # its ConnectX-7s run InfiniBand (class 0x0207, the dump's Ethernet 0x0200).
            attrs += ["class", "device", "subsystem_device"]
        for attr in attrs:
            assert mine.get(attr) == theirs.get(attr), (theirs.get("busid"), attr)
        # Same children (NCCL's own order within a switch varies with discovery order); the
        # paste stops inside the last switch, so that one shows fewer.
        assert {c.get("busid") for c in theirs.findall("pci")} <= {c.get("busid") for c in mine.findall("pci")}
        gpu, their_gpu = mine.find("gpu"), theirs.find("gpu")
        if their_gpu is not None:
            assert dict(gpu.attrib) == {k: their_gpu.get(k) for k in ("dev", "sm", "rank")}
            assert sorted((l.get("target"), l.get("count"), l.get("tclass")) for l in gpu.findall("nvlink")) == \
                sorted((l.get("target"), l.get("count"), l.get("tclass")) for l in their_gpu.findall("nvlink"))


def test_dgx_a100_matches_the_a100_files_and_links_through_six_nvswitches(tmp_path):
    ours = export("dgx-a100", tmp_path)
    aws = parse_partial(DUMPS / "aws-p4d-24xlarge-A100-static-topo.xml.txt")
    # The A100 static files: same cpu attributes, pci attributes on every pci element.
    assert set(ours.find("cpu").attrib) == set(aws.find("cpu").attrib)
    assert {"family": ours.find("cpu").get("familyid"), "model": ours.find("cpu").get("modelid")} == \
        {"family": "23", "model": "49"}  # EPYC Rome, as the Azure NDv4 file says
    for pci in ours.iter("pci"):
        assert set(aws.find(".//pci").attrib) <= set(pci.attrib)
        assert BUSID.match(pci.get("busid"))
    gpus = ours.findall(".//gpu")
    assert sorted(g.get("dev") for g in gpus) == [str(i) for i in range(8)]  # in NUMA order
    assert {g.get("sm") for g in gpus} == {"80"}
    for gpu in gpus:
        links = gpu.findall("nvlink")
        assert len(links) == 6 and {l.get("count") for l in links} == {"2"}  # 12 links, 2 per switch
        assert {l.get("tclass") for l in links} == {"0x068000"}
    nets = sorted(ours.findall(".//net"), key=lambda n: int(n.get("dev")))
    assert [n.get("name") for n in nets] == [f"mlx5_{i}" for i in range(10)]
    assert [n.get("dev") for n in nets] == [str(i) for i in range(10)]
    assert {n.get("speed") for n in nets} == {"200000"}


@pytest.mark.parametrize("name", ["dgx-a100", "hgx-h100"])
def test_without_a_peer_memory_module_no_gdr_is_written_so_nccl_detects_it(name, tmp_path):
    """NCCL keeps a file's gdr; with no module seen we do not know (DMA-BUF may still work)."""
    root = export(name, tmp_path)
    assert root.findall(".//net") and root.findall(".//gpu")
    assert [e.tag for e in root.iter() if "gdr" in e.attrib] == []
    assert [n.get("name") for n in root.iter("net") if "guid" in n.attrib] == []


@pytest.mark.parametrize("module_file", [path for path, _ in PEER_MEMORY_FILES])
def test_a_peer_memory_module_nccl_tests_for_turns_gdr_on_for_the_nets_only(module_file, tmp_path):
    root = export("dgx-a100", tmp_path, module_file)
    assert {n.get("gdr") for n in root.iter("net")} == {"1"}
    assert len(root.findall(".//net")) == 10
    assert [g.get("dev") for g in root.iter("gpu") if "gdr" in g.attrib] == []  # CUDA's to say


@pytest.mark.parametrize("name", sorted(p.name for p in SNAPSHOTS.iterdir()))
def test_every_fixture_exports_well_formed_xml_that_places_every_gpu(name, tmp_path):
    topology = discover_root(str(SNAPSHOTS / name))
    root = ET.fromstring(render_nccl_xml(topology))
    assert root.tag == "system" and root.get("version") == "1"
    assert {c.tag for c in root} == {"cpu"}
    busids = {p.get("busid") for p in root.iter("pci")}
    assert all(BUSID.match(b) for b in busids)
    for gpu in topology.gpus:
        pci = root.find(f".//pci[@busid='{gpu.pci_address}']")
        assert pci is not None and pci.find("gpu").get("dev") == str(gpu.index)
        cpu = next(c for c in root if pci in list(c.iter("pci")))
        assert cpu.get("numaid") == str(gpu.numa_node if gpu.numa_node is not None else -1)
    for parent in root.iter():  # NCCL keeps PCI children sorted by bus id
        children = [c.get("busid") for c in parent.findall("pci")]
        assert children == sorted(children)
    active = [n for n in topology.nics if n.active]
    assert len(root.findall(".//net")) == sum(sum(p.active for p in n.ports) for n in active)


def test_degraded_node_leaves_out_the_down_nic_and_the_down_nvlink(tmp_path):
    root = ET.fromstring(render_nccl_xml(discover_root(str(SNAPSHOTS / "degraded"))))
    assert "mlx5_6" not in {n.get("name") for n in root.iter("net")}
    gpu5 = root.find(".//gpu[@dev='5']")
    assert sum(int(l.get("count")) for l in gpu5.findall("nvlink")) == 17
    gpu0 = root.find(".//gpu[@dev='0']")
    assert sum(int(l.get("count")) for l in gpu0.findall("nvlink")) == 18


def test_nesting_climbs_two_path_components_like_ncclS_sysfs_walk():
    def dev(bridges):
        return PciDevice("0000:07:00.0", None, None, None, None, None, None, None, None, None, None,
                         bridges[-1] if bridges else None, tuple(bridges), "pci0000:00", "gpu")

    # root port, switch up, switch down, 2nd switch up, 2nd switch down -> keep 01:00.0, 05:00.0
    assert xml_parent_chain(dev(["0000:00:01.1", "0000:01:00.0", "0000:02:00.0", "0000:05:00.0",
                                 "0000:06:00.0"])) == ["0000:01:00.0", "0000:05:00.0"]
    assert xml_parent_chain(dev(["0000:00:01.1"])) == []  # under a root port: straight under <cpu>
    assert xml_parent_chain(dev([])) == []


def test_cpumap_writes_sysfs_words_high_first():
    assert cpumap(frozenset(range(24)) | frozenset(range(96, 120)), 192) == \
        "00000000,00000000,00ffffff,00000000,00000000,00ffffff"
