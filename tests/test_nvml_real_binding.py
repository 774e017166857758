"""The agent's NVML door through the real nvidia-ml-py, over the suite's C-ABI stand-in
(tests/nvml_stub): discovery's NVML pass, the counter reader, Xid events and every fabric
state, from recorded nodes (the real H200's among them), with errors per call.  And the
contract: every call the agent makes exists, with its arguments, in each nvidia-ml-py the
project admits, and reads the same answers there."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO
from nvml_stub import StubNode, recording

from topoagent.cli import main
from topoagent.collectors import nvml
from topoagent.collectors.base import CollectorResult, NoData
from topoagent.collectors.nvml import COUNTERS, LiveCounterReader, parse_counters, parse_nvml, read_live, read_live_activity
from topoagent.node.findings import collector_findings, fabric_findings, placement_blockers, witness_findings
from topoagent.node.host import Host
from topoagent.service.telemetry import Context, History
from topoagent.service.telemetry import read_live as read_source
from topoagent.vocabulary import Status

SNAPSHOTS = FIXTURES / "snapshots"
# Recordings whose nvml.json the stub can serve: NVSwitch nodes (A100, H100), a fabric not
# started, the real H200.
RECORDED = ["dgx-a100", "hgx-h100", "fabric-not-started", "h200-vm"]
# nvmlReturn_t (nvml.h)
NOT_SUPPORTED, TIMEOUT, FUNCTION_NOT_FOUND, GPU_IS_LOST = 3, 10, 13, 15


def without_health(info: nvml.NvmlInfo) -> list:
    return [g.__class__(**{**{f: getattr(g, f) for f in g.__slots__}, "health": ()}) for g in info.gpus]


@pytest.mark.parametrize("name", RECORDED)
def test_discoverys_nvml_pass_reads_back_what_the_node_answered(nvml_stub: StubNode, name: str):
    recorded, _ = recording(SNAPSHOTS / name)
    nvml_stub.serve(recorded)
    live = read_live()
    assert live is not None
    for gpu in recorded["gpus"]:  # NVML fills the whole struct: a generated recording leaves fields out
        if gpu.get("fabric"):
            gpu["fabric"] = {"clique_id": 0, "status": 0, **{k: v for k, v in gpu["fabric"].items() if v is not None}}
    assert parse_nvml(live) == parse_nvml(recorded)


@pytest.mark.parametrize("name", ["dgx-a100", "h200-vm"])
def test_the_counter_reader_reads_back_every_recorded_counter(nvml_stub: StubNode, name: str):
    recorded, counters = recording(SNAPSHOTS / name)
    assert counters is not None
    nvml_stub.serve(recorded, counters)
    reader = LiveCounterReader()
    try:
        read = reader.read()
    finally:
        reader.close()
    assert sorted(parse_counters(read)) == sorted(parse_counters(counters))
    assert len({family for family, _, _ in parse_counters(read)}) >= 19


def test_what_each_gpu_runs_is_read_through_the_binding(nvml_stub: StubNode):
    recorded, _ = recording(SNAPSHOTS / "h200-vm")
    recorded["gpus"][0]["health"].update(utilization_gpu_percent=99, processes=[4242, 4343])
    nvml_stub.serve(recorded)
    assert read_live_activity() == {"gpus": [{"index": 0, "health": {"utilization_gpu_percent": 99, "processes": [4242, 4343]}}]}


def test_no_library_is_no_nvml_not_a_failure(monkeypatch):
    monkeypatch.setattr(nvml, "nvml_library_present", lambda: False)
    assert read_live_activity() is None
    for read in (read_live, LiveCounterReader().read):
        with pytest.raises(NoData, match=f"^{nvml.NO_NVML}$"):
            read()


def test_a_driver_that_is_not_loaded_is_no_nvml_and_discovery_says_why(nvml_stub: StubNode):
    """Discovery's NVML source said only "not available" where the counter source named
    nvmlInit's error: both say what NVML said now."""
    recorded, _ = recording(SNAPSHOTS / "h200-vm")
    nvml_stub.serve(recorded, errors={"nvmlInitWithFlags": 9, "nvmlInit_v2": 9})  # NVML_ERROR_DRIVER_NOT_LOADED
    for read in (read_live, LiveCounterReader().read):
        with pytest.raises(NoData, match=r"nvmlInit: .*Driver Not Loaded"):
            read()
    result = _collect(Host("/"))
    assert result.status == Status.NO_DATA and not result.bug
    assert re.search(r"nvmlInit: .*Driver Not Loaded", result.message or ""), result.message


def test_a_snapshot_keeps_why_nvml_was_absent_and_its_replay_says_it(nvml_stub: StubNode, tmp_path, capsys):
    recorded, _ = recording(SNAPSHOTS / "h200-vm")
    nvml_stub.serve(recorded, errors={"nvmlInitWithFlags": 9, "nvmlInit_v2": 9})
    out = tmp_path / "node"
    assert main(["snapshot", str(out)]) == 0
    capsys.readouterr()
    said = {}
    for args in ((), ("--root", str(out))):
        assert main(["discover", "--json", *args]) == 0
        said[args] = json.loads(capsys.readouterr().out)["collectors"]["nvml"]
    live, replayed = said.values()
    assert live["status"] == replayed["status"] == "no_data"
    assert "nvmlInit: " in live["message"] and "Driver Not Loaded" in live["message"]
    assert replayed["message"] == live["message"]


def test_a_long_reason_nvml_is_absent_is_kept_as_its_replay_reads_it_back(tmp_path, monkeypatch):
    """A snapshot must never write a no_data its own replay refuses: the reason is cut to
    what the replay reads, and live and replay say the same words."""

    def absent() -> dict:
        raise NoData(f"{nvml.NO_NVML} (nvmlInit: {'a long driver message ' * 40})")

    monkeypatch.setattr(nvml, "read_live", absent)
    host = Host("/", record=True)
    live = _collect(host)
    assert host.recording is not None and host.recording.nvml is not None
    (tmp_path / "nvml.json").write_text(json.dumps(host.recording.nvml))
    replayed = _collect(Host(str(tmp_path)))
    assert live.status == replayed.status == Status.NO_DATA
    assert replayed.message == live.message and (live.message or "").startswith(f"{nvml.NO_NVML} (nvmlInit: a long")


@pytest.mark.parametrize("no_data", [None, 7, "", "x" * 501])
def test_a_recording_whose_nvml_no_data_is_no_reason_is_refused_by_name(tmp_path, no_data):
    (tmp_path / "nvml.json").write_text(json.dumps({"no_data": no_data}))
    result = _collect(Host(str(tmp_path)))
    assert result.status == Status.ERROR and "nvml.json: 'no_data' must be text" in (result.message or "")


# --- Xid events ----------------------------------------------------------------------


def series(raw: dict) -> dict[str, float]:
    return {metric + "".join(f'{{{k}="{v}"}}' for k, v in labels if k != "gpu"): value for metric, labels, value in parse_counters(raw)}


def test_xid_events_are_counted_per_gpu_once_each_and_the_last_is_dcgms_field(nvml_stub: StubNode):
    recorded, counters = recording(SNAPSHOTS / "dgx-a100")
    nvml_stub.serve(recorded, counters)
    reader = LiveCounterReader()
    try:
        before = series(reader.read())
        assert before['gpu_xid_events_total{class="actionable"}'] == 0 and "gpu_xid_last" not in before
        nvml_stub.add_xid(gpu=3, xid=13)
        nvml_stub.add_xid(gpu=3, xid=79)
        read = reader.read()
        again = reader.read()  # each event counted once
    finally:
        reader.close()
    gpu3 = next(g for g in read["gpus"] if g["index"] == 3)
    assert gpu3["counters"]["xid_errors"] == {"13": 1, "79": 1} and gpu3["counters"]["xid_last"] == 79
    assert all(g["counters"]["xid_errors"] == {} for g in read["gpus"] if g["index"] != 3)
    assert again == read


# --- errors per call -----------------------------------------------------------------


def test_a_call_the_gpu_refuses_is_that_value_absent_and_the_rest_read(nvml_stub: StubNode):
    recorded, counters = recording(SNAPSHOTS / "h200-vm")
    nvml_stub.serve(recorded, counters, errors={"nvmlDeviceGetPowerUsage": GPU_IS_LOST, "nvmlDeviceGetTemperature": TIMEOUT,
                                                "nvmlDeviceGetCurrentClocksEventReasons": FUNCTION_NOT_FOUND})
    reader = LiveCounterReader()
    try:
        ours = series(reader.read())
    finally:
        reader.close()
    for absent in ("gpu_power_watts", "gpu_temperature_celsius", "gpu_clock_throttle_reasons"):
        assert absent not in ours
    assert ours["gpu_memory_reserved_bytes"] == 644_939_776 and ours["gpu_sm_clock_hertz"] == 1980e6


def test_a_driver_without_memory_info_v2_still_gives_used_and_free_but_no_reserved(nvml_stub: StubNode):
    recorded, counters = recording(SNAPSHOTS / "h200-vm")
    nvml_stub.serve(recorded, counters, errors={"nvmlDeviceGetMemoryInfo_v2": FUNCTION_NOT_FOUND})
    reader = LiveCounterReader()
    try:
        ours = series(reader.read())
    finally:
        reader.close()
    assert ours["gpu_memory_used_bytes"] == 0 + 644_939_776  # v1's used holds the driver's reserve
    assert ours["gpu_memory_free_bytes"] == 150_109_880_320 and "gpu_memory_reserved_bytes" not in ours


# --- the fabric state ----------------------------------------------------------------

CLUSTER = "7a3f9c2e-4b1d-4e8a-9c6f-2d5e8b1a0c34"


@pytest.mark.parametrize(("fabric", "errors", "read"), [
    ({"state": "completed", "status": 0, "clique_id": 32766, "cluster_uuid": CLUSTER}, {},
     {"cluster_uuid": CLUSTER, "clique_id": 32766, "state": "completed", "status": 0}),
    ({"state": "not_started", "status": 0, "clique_id": 0}, {},
     {"cluster_uuid": None, "clique_id": 0, "state": "not_started", "status": 0}),
    ({"state": "in_progress", "status": 0, "clique_id": 0}, {},
     {"cluster_uuid": None, "clique_id": 0, "state": "in_progress", "status": 0}),
    ({"state": "not_supported", "status": 0, "clique_id": 0}, {},  # the real H200's answer
     {"cluster_uuid": None, "clique_id": 0, "state": "not_supported", "status": 0}),
    # A state number nvml.h does not name (a newer driver's): nobody can read it.
    ({"state": "unknown", "unknown": "state 7", "status": 0, "clique_id": 0}, {},
     {"cluster_uuid": None, "clique_id": 0, "state": "unknown", "status": 0, "unknown": "state 7"}),
    # A driver before R550 has no V call: the first form answers.
    ({"state": "in_progress", "status": 0, "clique_id": 0}, {"nvmlDeviceGetGpuFabricInfoV": FUNCTION_NOT_FOUND},
     {"cluster_uuid": None, "clique_id": 0, "state": "in_progress", "status": 0}),
    # No answer: an A100, a PCIe GPU, a driver before R535.
    (None, {}, None),
    ({"state": "completed"}, {"nvmlDeviceGetGpuFabricInfoV": NOT_SUPPORTED}, None),
    ({"state": "completed"}, {"nvmlDeviceGetGpuFabricInfoV": FUNCTION_NOT_FOUND, "nvmlDeviceGetGpuFabricInfo": FUNCTION_NOT_FOUND}, None),
    # Any other NVML error: a state nobody can read, with NVML's code.
    ({"state": "completed"}, {"nvmlDeviceGetGpuFabricInfoV": GPU_IS_LOST},
     {"cluster_uuid": None, "clique_id": None, "state": "unknown", "status": None, "unknown": "error 15"}),
])
def test_every_fabric_state_reads_through_the_binding_as_recorded(nvml_stub: StubNode, fabric, errors, read):
    recorded, _ = recording(SNAPSHOTS / "hgx-h100")
    for gpu in recorded["gpus"]:
        gpu.pop("fabric", None)
    if fabric is not None:
        recorded["gpus"][0]["fabric"] = fabric
    nvml_stub.serve(recorded, errors={f"{call}.0": code for call, code in errors.items()})
    live = read_live()
    assert live is not None and live["gpus"][0]["fabric"] == read


def test_an_nvswitch_node_whose_fabric_is_not_started_is_not_ready_with_the_fabric_managers_remedy(nvml_stub: StubNode):
    recorded, _ = recording(SNAPSHOTS / "fabric-not-started")
    nvml_stub.serve(recorded)
    live = read_live()
    assert live is not None
    (finding,) = fabric_findings(parse_nvml(live), nvswitches=4)
    assert placement_blockers([finding]) == (finding,)
    assert "not_started" in finding.message and "systemctl status nvidia-fabricmanager" in finding.message


# --- our own faults are ours ---------------------------------------------------------


def test_a_wrong_nvml_call_is_a_collector_error_naming_the_call_not_a_hardware_finding(nvml_stub: StubNode, monkeypatch):
    """The H200's bug planted again: the fabric asked without the struct the binding fills."""
    recorded, _ = recording(SNAPSHOTS / "h200-vm")
    nvml_stub.serve(recorded)

    def as_landed(session: nvml.NvmlSession, handle: object) -> object:
        return session.ask("nvmlDeviceGetGpuFabricInfo", handle)  # one argument short: a TypeError

    monkeypatch.setattr(nvml, "_fabric_info", as_landed)
    result = _collect(Host("/"))
    assert result.bug and not result.ok
    assert "TypeError" in (result.message or "") and "in pynvml.nvmlDeviceGetGpuFabricInfo" in (result.message or "")
    (finding,) = collector_findings([result])
    assert finding.kind == "collector-error" and finding.subject == "nvml"
    assert placement_blockers([finding]) == ()
    # ... and no witness reads it as a GPU stack that is missing (nvidia-smi silent too).
    silent = CollectorResult("nvidia_smi", Status.ERROR, None, "nvidia-smi: exit code 9")
    assert witness_findings(None, {"nvml": result, "nvidia_smi": silent}, 1, 0, None) == []
    # ... nor as a node with no GPU, where the PCI reader crashed too and saw none.
    pci = CollectorResult("pci", Status.ERROR, None, "collector crashed (KeyError)", bug=True)
    assert witness_findings(None, {"pci": pci, "nvml": result, "nvidia_smi": silent}, 0, 0, None) == []


def _collect(host: Host) -> CollectorResult:
    from topoagent.node.discovery import finish

    return finish(nvml.collect(host))


def test_a_counter_reader_fault_is_a_failed_source_saying_it_is_ours(nvml_stub: StubNode, monkeypatch, caplog):
    """The H200's other bug planted again: handles used as dict keys."""
    recorded, counters = recording(SNAPSHOTS / "h200-vm")
    nvml_stub.serve(recorded, counters)
    monkeypatch.setattr(nvml, "handle_address", lambda handle: handle)  # ctypes pointers are not hashable
    reader = LiveCounterReader()
    try:
        sample = read_source(COUNTERS, Context(Host("/"), None, reader))  # type: ignore[arg-type]
    finally:
        reader.close()
    assert sample.raw is None and not sample.absent
    assert sample.error is not None and sample.error.startswith("collector crashed (TypeError: unhashable type")
    assert "this is a topoagent bug" in sample.error
    assert "event=collector_crashed collector=nvml_counters error=TypeError" in caplog.text
    history = History()
    history.add(sample, COUNTERS.parse)
    status = history.statuses["nvml_counters"]
    assert status.status == Status.ERROR and status.bug  # topoagent_collector_crashed{collector="nvml_counters"} 1


# --- the contract with each admitted nvidia-ml-py ------------------------------------


def calls_the_agent_makes() -> list[tuple[str, int]]:
    """Every ``ask("nvml…", args…)`` in collectors/nvml.py: the binding's function and how many
    arguments the agent passes it."""
    calls = set()
    for node in ast.walk(ast.parse((REPO / "collectors" / "nvml.py").read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)
                and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) in ("ask", "ask_with_code")
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            calls.add((node.args[0].value, len(node.args) - 1))
    return sorted(calls)


SIGNATURES = """
import inspect, json, sys, pynvml
calls = json.loads(sys.argv[1])
out = {}
for name, count in calls:
    fn = getattr(pynvml, name, None)
    if fn is None:
        out[name] = "missing"
        continue
    try:
        inspect.signature(fn).bind(*range(count))
        out[name] = "ok"
    except TypeError as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""


def test_every_call_the_agent_makes_is_in_each_admitted_binding_with_its_arguments(nvml_binding):
    calls = calls_the_agent_makes()
    assert len(calls) >= 35 and ("nvmlDeviceGetGpuFabricInfoV", 2) in calls
    child = subprocess.run([sys.executable, "-c", SIGNATURES, json.dumps(calls)], capture_output=True, text=True,
                           env={**os.environ, **nvml_binding.env()}, timeout=60)
    assert child.returncode == 0, child.stderr
    assert {name: said for name, said in json.loads(child.stdout).items() if said != "ok"} == {}


READ_BOTH = """
import json, sys
from topoagent.collectors.nvml import LiveCounterReader, read_live
import pynvml
reader = LiveCounterReader()
print(json.dumps({"binding": pynvml.__file__, "nvml": read_live(), "counters": reader.read()}))
reader.close()
"""


@pytest.mark.parametrize("name", ["dgx-a100", "h200-vm"])
def test_each_admitted_binding_reads_the_recorded_node_as_recorded(nvml_stub: StubNode, nvml_binding, name: str):
    recorded, counters = recording(SNAPSHOTS / name)
    nvml_stub.serve(recorded, counters)
    child = subprocess.run([sys.executable, "-c", READ_BOTH], capture_output=True, text=True,
                           env={**os.environ, **nvml_binding.env()}, timeout=120)
    assert child.returncode == 0, child.stderr
    read = json.loads(child.stdout)
    assert Path(read["binding"]).parent == Path(nvml_binding.pythonpath)
    assert without_health(parse_nvml(read["nvml"])) == without_health(parse_nvml(recorded))
    assert sorted(map(tuple, parse_counters(read["counters"]))) == sorted(parse_counters(counters))


def test_no_nvml_call_escapes_the_contract():
    """The contract reads the calls from ``ask("name", ...)``: a binding function named any
    other way (``pynvml.nvmlX(...)``) would escape it.  Only the session's init and shutdown do."""
    named = {node.func.attr for node in ast.walk(ast.parse((REPO / "collectors" / "nvml.py").read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and re.match(r"nvml[A-Z]", node.func.attr)}
    assert named == {"nvmlInit", "nvmlShutdown"}


def test_a_bug_met_at_every_read_logs_its_traceback_once(caplog):
    """A counter source crashing at each read says so each time, but its traceback reaches the
    error log once; the repeats go to debug."""
    import logging

    from topoagent.collectors.base import report_bug

    caplog.set_level(logging.DEBUG)
    lines = {report_bug("a_source_of_this_test", TypeError("unhashable type: 'LP_struct_c_nvmlDevice_t'")) for _ in range(3)}
    assert len(lines) == 1 and next(iter(lines)).startswith("collector crashed (TypeError: unhashable type")
    levels = [r.levelno for r in caplog.records if "collector=a_source_of_this_test" in r.getMessage()]
    assert levels == [logging.ERROR, logging.DEBUG, logging.DEBUG]
