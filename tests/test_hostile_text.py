"""Text from the machine is made safe once, where it enters (issue #37, item 4).

A GPU name in a recording (as NVML could answer it) holding a lone surrogate, a NUL and a
right-to-left override: the served agent still answers /metrics (promtool-clean) and its
page, and every export keeps its own grammar.  One hostile string costs one value, not a
page.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
from service_helpers import make_root, promtool_complaints, start_agent

from topoagent.exporters.nfd import check_label

HOSTILE = "A100\udcff\x00\u202eBG08-XMS"  # a lone surrogate, a NUL, RIGHT-TO-LEFT OVERRIDE
# What no document may hold (a document's own tabs and line ends aside).
UNSAFE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


@pytest.fixture(scope="module")
def hostile_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_root(tmp_path_factory.mktemp("hostile-text"))
    nvml = json.loads((root / "nvml.json").read_text())
    nvml["gpus"][0]["name"] = "NVIDIA " + HOSTILE
    nvml["driver_version"] = "535.\x00\u202e129"
    text = json.dumps(nvml)  # ensure_ascii: the surrogate travels as the escape "\udcff", as JSON allows
    assert "\\udcff" in text
    (root / "nvml.json").write_text(text)
    return root


def export(root: Path, what: str) -> str:
    done = subprocess.run([sys.executable, "-P", "-m", "topoagent", "export", what, "--root", str(root)],
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    assert b"Traceback" not in done.stderr
    return done.stdout.decode("utf-8")  # strict: a lone surrogate would not have been written as UTF-8


def test_machine_text_replaces_what_cannot_be_safe_once() -> None:
    from topoagent.text import machine_text

    assert machine_text(HOSTILE) == "A100\ufffd\ufffd\ufffdBG08-XMS"
    assert machine_text("line one\nline\ttwo\n") == "line one\nline\ttwo\n"  # a file's lines and tabs stay
    assert machine_text("NVIDIA H100 80GB HBM3") == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("raw", [
    '{"name": "A100\\udcff\\u0000\\u202eBG08"}',  # escapes: a surrogate, a NUL, an override
    '{"name": "A100\udcff\u202eBG08"}',  # the same, raw in the text
    '{"name": "A100\udcffBG08"}',  # a raw surrogate alone (in UTF-8 bytes too: ED B3 BF)
    '{"name": "A100\\u001b[4mBG08", "ok": "\u0394"}',  # a terminal escape (JSON has no raw ESC)
    '{"A100\u202e": ["x", {"k": "\\f"}]}',  # in a key; a form feed by escape, deep inside
    '{"name": "A100\x7f\x85BG08"}',  # DEL and a C1 control, raw: JSON lets them stand unescaped
])
def test_machine_json_leaves_no_unsafe_string_in_what_it_parses(raw: str) -> None:
    from topoagent.text import machine_data, machine_json

    # As a str and as bytes; UTF-8 bytes carry a raw lone surrogate too (json.loads takes them).
    texts: list[str | bytes] = [raw, raw.encode("utf-8", "surrogatepass")] + ([] if "\udcff" in raw else [raw.encode("utf-16")])
    for text in texts:
        parsed = machine_json(text)
        assert parsed == machine_data(json.loads(text))
        assert not any(UNSAFE.search(s) or "\x1b" in s for s in _strings(parsed))
    assert machine_json(b'{"name": "NVIDIA A100-SXM4-40GB", "n": [1, 2.5, null]}') == {
        "name": "NVIDIA A100-SXM4-40GB", "n": [1, 2.5, None]}


def _strings(value: object) -> list[str]:
    """Every string in parsed JSON, keys too."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(k) + _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def test_a_served_agent_answers_every_page_with_one_hostile_gpu_name(tmp_path: Path, hostile_root: Path) -> None:
    agent = start_agent(tmp_path, root=hostile_root)
    try:
        metrics = agent.get("/metrics")
        assert metrics.status == 200, metrics.body[-500:]
        assert promtool_complaints(metrics.body) == []
        page = metrics.body.decode("utf-8")
        assert not UNSAFE.search(page)
        assert 'model="NVIDIA A100\ufffd\ufffd\ufffdBG08-XMS"' in page  # one value spoiled, the GPU still shown
        index = agent.get("/")
        assert index.status == 200, index.body[-500:]
        html = index.body.decode("utf-8")
        assert not UNSAFE.search(html) and "A100\ufffd" in html
        topology = agent.get("/topology")
        assert topology.status == 200
        assert not UNSAFE.search(topology.body.decode("utf-8"))
        assert "Traceback" not in agent.log()
    finally:
        agent.stop()


def test_every_export_keeps_its_own_grammar(hostile_root: Path) -> None:
    gres = export(hostile_root, "gres")
    types = re.findall(r"Type=(\S*)", gres)
    assert types and all(re.fullmatch(r"[a-z0-9_.-]+", t) for t in types), gres
    assert not UNSAFE.search(gres)
    labels = [line.partition("=") for line in export(hostile_root, "nfd").splitlines() if not line.startswith("#")]
    assert any(name.endswith("gpu.count") for name, _, _ in labels)
    for name, _, value in labels:
        check_label(name, value)
    xml = export(hostile_root, "nccl-xml")
    assert not UNSAFE.search(xml)
    ElementTree.fromstring(xml)  # well-formed: no control character, even escaped
    for what in ("svg", "html"):
        assert not UNSAFE.search(export(hostile_root, what))


def test_sysfs_files_link_targets_directory_names_and_recorded_outputs_enter_safe(tmp_path: Path) -> None:
    from topoagent.node.host import Host

    root = make_root(tmp_path)
    hostile = b"mlx5\x00\xe2\x80\xae\xed\xb3\xbf_0\n"  # a NUL, U+202E, a surrogate encoded in UTF-8
    (root / "sys" / "class" / "hostile").mkdir(parents=True)
    (root / "sys" / "class" / "hostile" / "board_id").write_bytes(hostile)
    (root / "sys" / "class" / "hostile" / "driver").symlink_to("../../bus/pci/drivers/nv\u202eidia")
    (root / "sys" / "class" / "hostile" / "\u202eevil").mkdir()
    (root / "commands" / "lspci_-vvv.out").write_bytes(hostile)
    with Host(root) as host:
        assert host.read_text("/sys/class/hostile/board_id") == "mlx5\ufffd\ufffd\ufffd\ufffd\ufffd_0\n"
        assert host.readlink("/sys/class/hostile/driver").endswith("nv\ufffdidia")
        assert host.listdir("/sys/class/hostile") == ["board_id", "driver"]
        replayed = asyncio.run(host.run(["lspci", "-vvv"]))
        assert replayed.stdout == "mlx5\ufffd\ufffd\ufffd\ufffd\ufffd_0\n"
