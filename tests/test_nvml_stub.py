"""The suite's NVML stub (tests/nvml_stub.py, tests/nvml_stub/nvml_stub.c) through the real
nvidia-ml-py: recorded nodes come back through pynvml's own wrappers, errors per call come
back as pynvml's own exception classes, wrong calls fail loudly, and the oldest admitted
binding (run in a child process) reads the same node as the installed one."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import re
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any

import nvml_stub as stub
import pytest
from conftest import FIXTURES, SHARED, TESTS

DGX_A100 = FIXTURES / "snapshots" / "dgx-a100"
H200_TARBALL = SHARED / "real-nodes" / "h200-vm" / "snapshot-nvml-read-right.tar.gz"
# The pynvml wrappers the agent calls (collectors/nvml.py); each must reach only C symbols the
# stub exports, in every admitted binding.
AGENT_WRAPPERS = (
    "nvmlInit", "nvmlShutdown", "nvmlSystemGetDriverVersion", "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetNVMLVersion", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkRemotePciInfo",
    "nvmlDeviceGetNvLinkRemoteDeviceType", "nvmlDeviceGetNvLinkVersion", "nvmlDeviceGetP2PStatus",
    "nvmlDeviceGetCpuAffinity", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetNumaNodeId",
    "nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetUUID", "nvmlDeviceGetName",
    "nvmlDeviceGetTemperature", "nvmlDeviceGetFieldValues", "nvmlDeviceGetNvLinkErrorCounter",
    "nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetDecoderUtilization", "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetClockInfo", "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlEventSetCreate", "nvmlDeviceRegisterEvents", "nvmlEventSetWait_v2", "nvmlEventSetFree", "nvmlErrorString",
)


def h200(tmp_path: Path) -> Path:
    """The real H200's recording (its NVML read right), unpacked."""
    if not H200_TARBALL.is_file():
        pytest.fail(f"{H200_TARBALL} missing: the tests need ../shared beside the repo")
    with tarfile.open(H200_TARBALL) as tar:
        tar.extractall(tmp_path / "h200", filter="data")
    (snapshot,) = (p.parent for p in (tmp_path / "h200").glob("*/nvml.json"))
    return snapshot


# --- checks shared by this process and the child running the oldest binding -------------


def _address(pci: Any) -> str:
    """pynvml's busId ("00000000:07:00.0") as nvml.json writes it ("0000:07:00.0")."""
    bus_id = pci.busId.decode() if isinstance(pci.busId, bytes) else pci.busId
    domain, rest = bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _answer(call: Any, *args: Any, nv: Any) -> Any:
    """The call's answer, or the NVMLError class it raised."""
    try:
        return call(*args)
    except nv.NVMLError as exc:
        return type(exc)


def check_recording(nv: Any, nvml: dict, counters: dict | None) -> None:
    """Every value the recording holds comes back through pynvml's wrappers; every value it
    lacks is NVMLError_NotSupported.  Where counters and nvml.json's health both give a value,
    the counters' is served."""
    not_supported = nv.NVMLError_NotSupported
    assert _text(nv.nvmlSystemGetDriverVersion()) == nvml["driver_version"]
    assert _text(nv.nvmlSystemGetNVMLVersion()) == nvml["nvml_version"]
    assert nv.nvmlSystemGetCudaDriverVersion() == nvml["cuda_driver_version"]
    assert nv.nvmlDeviceGetCount() == len(nvml["gpus"])
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(len(nvml["gpus"]))]
    sampled = {g["index"]: g for g in (counters or {}).get("gpus", [])}
    for gpu in nvml["gpus"]:
        h = handles[gpu["index"]]
        sample = sampled.get(gpu["index"], {})
        c = sample.get("counters", {})

        def value(name: str) -> Any:
            return c[name] if c.get(name) is not None else gpu["health"].get(name)

        def expect(name: str, got: Any, scale: float = 1) -> None:
            want = value(name)
            assert got == (not_supported if want is None else round(want * scale)), name

        assert _text(nv.nvmlDeviceGetUUID(h)) == gpu["uuid"]
        assert _text(nv.nvmlDeviceGetName(h)) == gpu["name"]
        assert _address(nv.nvmlDeviceGetPciInfo(h)) == gpu["pci_bus_id"]
        v2 = nv.nvmlDeviceGetMemoryInfo(h, nv.nvmlMemory_v2)
        assert (v2.total, v2.used, v2.free, v2.reserved) == (
            gpu["memory_total_bytes"], value("memory_used_bytes"), value("memory_free_bytes"), value("memory_reserved_bytes"))
        v1 = nv.nvmlDeviceGetMemoryInfo(h)  # v1's used counts the reserved memory too
        assert (v1.total, v1.used, v1.free) == (v2.total, v2.used + v2.reserved, v2.free)
        numa = _answer(nv.nvmlDeviceGetNumaNodeId, h, nv=nv)
        assert numa == (gpu["numa_node"] if gpu["numa_node"] is not None else not_supported)
        words = nv.nvmlDeviceGetCpuAffinity(h, 64)
        cpus = [w * 64 + b for w in range(64) for b in range(64) if words[w] >> b & 1]
        from topoagent.node.cpulist import parse_cpulist

        assert cpus == sorted(parse_cpulist(gpu["cpu_affinity"]))
        recorded_links = {link["link"]: link for link in gpu["nvlinks"]}
        for link in range(18):
            state = _answer(nv.nvmlDeviceGetNvLinkState, h, link, nv=nv)
            if link not in recorded_links:
                assert state is not_supported
                continue
            want = recorded_links[link]
            assert state == int(want["active"])
            assert nv.nvmlDeviceGetNvLinkVersion(h, link) == want["version"]
            assert _address(nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link)) == want["remote_pci_bus_id"]
            assert nv.nvmlDeviceGetNvLinkRemoteDeviceType(h, link) == stub.REMOTE_TYPES[want["remote_type"]]
        for peer, status in gpu["p2p"].items():  # pynvml's NVML_P2P_CAPS_INDEX_READ is a tuple (a stray comma)
            assert nv.nvmlDeviceGetP2PStatus(h, handles[int(peer)], stub.NVML_P2P_CAPS_INDEX_READ) == stub.P2P_STATUS[status]
        expect("temperature_c", _answer(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU, nv=nv))
        expect("power_w", _answer(nv.nvmlDeviceGetPowerUsage, h, nv=nv), scale=1000)
        expect("ecc_corrected_total", _answer(nv.nvmlDeviceGetTotalEccErrors, h, 0, 0, nv=nv))
        expect("ecc_uncorrected_total", _answer(nv.nvmlDeviceGetTotalEccErrors, h, 1, 0, nv=nv))
        util = nv.nvmlDeviceGetUtilizationRates(h)
        assert (util.gpu, util.memory) == (value("utilization_gpu_percent"), value("utilization_memory_percent"))
        assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)] == gpu["health"]["processes"]
        if not c:
            continue
        expect("power_limit_w", _answer(nv.nvmlDeviceGetEnforcedPowerLimit, h, nv=nv), scale=1000)
        expect("energy_mj_total", _answer(nv.nvmlDeviceGetTotalEnergyConsumption, h, nv=nv))
        expect("sm_clock_mhz", _answer(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM, nv=nv))
        expect("memory_clock_mhz", _answer(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM, nv=nv))
        expect("throttle_reasons", _answer(nv.nvmlDeviceGetCurrentClocksEventReasons, h, nv=nv))
        expect("throttle_reasons", _answer(nv.nvmlDeviceGetCurrentClocksThrottleReasons, h, nv=nv))
        expect("encoder_utilization_percent", nv.nvmlDeviceGetEncoderUtilization(h)[0])
        expect("decoder_utilization_percent", nv.nvmlDeviceGetDecoderUtilization(h)[0])
        pending = _answer(nv.nvmlDeviceGetRetiredPagesPendingStatus, h, nv=nv)
        assert pending == (not_supported if c["retired_pages_pending"] is None else int(c["retired_pages_pending"]))
        rows = c["remapped_rows"]
        assert nv.nvmlDeviceGetRemappedRows(h) == (rows["correctable"], rows["uncorrectable"], rows["pending"], rows["failure"])
        fields = [stub.NVML_FI_DEV_MEMORY_TEMP, stub.NVML_FI_DEV_PCIE_REPLAY_COUNTER,
                  stub.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, stub.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 999]
        answers = [(v.fieldId, v.nvmlReturn, v.value.ullVal) for v in nv.nvmlDeviceGetFieldValues(h, fields)]
        for (field, ret, got), name in zip(answers, ["memory_temperature_c", "pcie_replays_total",
                                                      "pcie_tx_bytes_total", "pcie_rx_bytes_total", None]):
            want = c.get(name) if name else None
            assert (ret, got if ret == 0 else None) == ((0, want) if want is not None else (3, None)), field
        for link in sample.get("nvlinks", []):
            tx, rx = nv.nvmlDeviceGetFieldValues(h, [(stub.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, link["link"]),
                                                     (stub.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, link["link"])])
            assert (tx.scopeId, tx.value.ullVal * 1024, rx.value.ullVal * 1024) == (
                link["link"], link["tx_bytes_total"], link["rx_bytes_total"])
            for name, code in stub.NVLINK_ERRORS.items():
                assert nv.nvmlDeviceGetNvLinkErrorCounter(h, link["link"], code) == link["errors"][name]


def check_fabric(nv: Any, gpu: int, fabric: dict) -> None:
    """nvml.json's fabric comes back through both the versioned call (byref, as nvml.h asks) and v1."""
    h = nv.nvmlDeviceGetHandleByIndex(gpu)
    uuid = (fabric.get("cluster_uuid") or "0" * 32).replace("-", "")
    want = (bytes.fromhex(uuid), fabric["status"] or 0, fabric["clique_id"] or 0,
            stub.FABRIC_STATES[fabric["state"]])
    info = nv.c_nvmlGpuFabricInfoV_t()
    assert nv.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info)) == nv.NVML_SUCCESS
    assert (bytes(info.clusterUuid), info.status, info.cliqueId, info.state) == want
    old = nv.c_nvmlGpuFabricInfo_t()
    nv.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(old))
    assert (bytes(old.clusterUuid), old.status, old.cliqueId, old.state) == want


def check_events(nv: Any, add_xid: Any) -> None:
    """Xids of registered GPUs come back once each, then NVMLError_Timeout."""
    events = nv.nvmlEventSetCreate()
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
    for h in handles:
        nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, events)
    add_xid(1, 79)
    add_xid(2, 13)  # a GPU this set did not register: not delivered
    add_xid(0, 48)
    got = []
    for _ in range(2):
        event = nv.nvmlEventSetWait_v2(events, 0)
        got.append((ctypes.cast(event.device, ctypes.c_void_p).value, event.eventType, event.eventData))
    assert got == [(ctypes.cast(handles[1], ctypes.c_void_p).value, 8, 79), (ctypes.cast(handles[0], ctypes.c_void_p).value, 8, 48)]
    with pytest.raises(nv.NVMLError_Timeout):
        nv.nvmlEventSetWait_v2(events, 0)
    nv.nvmlEventSetFree(events)


def _child_main(check: str, snapshot: str, events_path: str) -> None:
    """In a child process with an admitted binding first on PYTHONPATH: ``check`` "recording"
    (values and Xid events) or "fabric" (every GPU's fabric) of the node served from ``snapshot``."""
    import pynvml

    nvml, counters = stub.recording(Path(snapshot))
    pynvml.nvmlInit()
    if check == "fabric":
        for gpu in nvml["gpus"]:
            if gpu.get("fabric"):
                check_fabric(pynvml, gpu["index"], gpu["fabric"])
    else:
        check_recording(pynvml, nvml, counters)

        def add_xid(gpu: int, xid: int) -> None:
            with open(events_path, "a") as f:
                f.write(f"{gpu} {xid}\n")

        if len(nvml["gpus"]) > 2:
            check_events(pynvml, add_xid)
    pynvml.nvmlShutdown()
    print("checked", Path(pynvml.__file__).parent)


def _run_child(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = [{str(TESTS)!r}]\n{code}"],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120, check=False)


# --- the library and its contract with the binding --------------------------------------


def test_the_stub_exports_every_symbol_both_bindings_call_for_the_agents_wrappers(nvml_binding: stub.Binding) -> None:
    exported = set(subprocess.run(["nm", "-D", "--defined-only", str(stub.stub_library())], capture_output=True,
                                  text=True, check=True).stdout.split()[2::3])
    assert exported == set(stub.FUNCTIONS)
    source = (nvml_binding.pythonpath / "pynvml.py").read_text()

    def symbols(wrapper: str, depth: int = 0) -> set[str]:
        body = re.search(rf"^def {wrapper}\(.*?(?=^def |\Z)", source, re.S | re.M)
        assert body, f"nvidia-ml-py {nvml_binding.version} has no {wrapper}"
        names = set(re.findall(r'_nvmlGetFunctionPointer\("(\w+)"\)', body[0]))
        for delegate in set(re.findall(r"^\s*(?:return\s+)?(nvml\w+)\(", body[0], re.M)) - {wrapper}:
            names |= symbols(delegate, depth + 1) if depth < 2 else set()
        return names

    for wrapper in AGENT_WRAPPERS:
        called = symbols(wrapper)
        assert called, wrapper
        assert called <= exported, f"{wrapper} calls {called - exported}"


def test_the_stubs_constants_are_nvml_hs() -> None:
    header = stub.nvml_header().read_text()
    for name in ("NVML_FI_DEV_MEMORY_TEMP", "NVML_FI_DEV_PCIE_REPLAY_COUNTER", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX",
                 "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES",
                 "NVML_TEMPERATURE_GPU", "NVML_CLOCK_SM", "NVML_CLOCK_MEM", "NVML_MEMORY_ERROR_TYPE_CORRECTED",
                 "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC", "NVML_P2P_CAPS_INDEX_READ", "NVML_ERROR_GPU_IS_LOST"):
        found = re.search(rf"\b{name}\s*=?\s*(\d+)", header)
        assert found and int(found[1]) == getattr(stub, name), name


def test_pynvml_in_this_process_loads_the_preloaded_stub(nvml_stub: stub.StubNode) -> None:
    import pynvml

    nvml_stub.serve_recording(DGX_A100)
    pynvml.nvmlInit()
    preloaded = stub.preload()
    assert pynvml.nvmlLib._handle == preloaded._handle
    assert ctypes.cast(pynvml.nvmlLib.nvmlInitWithFlags, ctypes.c_void_p).value == \
        ctypes.cast(preloaded.nvmlInitWithFlags, ctypes.c_void_p).value


# --- recorded nodes through the installed binding ---------------------------------------


def test_the_dgx_a100_recording_comes_back_through_pynvml(nvml_stub: stub.StubNode) -> None:
    import pynvml

    nvml_stub.serve_recording(DGX_A100)
    pynvml.nvmlInit()
    check_recording(pynvml, *stub.recording(DGX_A100))


def test_the_real_h200_comes_back_through_pynvml(nvml_stub: stub.StubNode, tmp_path: Path) -> None:
    import pynvml

    snapshot = h200(tmp_path)
    nvml, counters = stub.recording(snapshot)
    assert counters is not None and counters["gpus"][0]["counters"]["power_w"] == 130.649
    nvml_stub.serve_recording(snapshot)
    pynvml.nvmlInit()
    check_recording(pynvml, nvml, counters)
    check_fabric(pynvml, 0, nvml["gpus"][0]["fabric"])  # state 0 "not supported", status 0, as the GPU answered
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetPowerUsage(h) == 130649  # the counters' milliwatts, not health's 130.4 W
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetNvLinkState(h, 0)  # no NVLink on that GPU


@pytest.mark.parametrize("fabric", [
    {"cluster_uuid": "6f1e2a3b-4c5d-6e7f-8091-a2b3c4d5e6f7", "clique_id": 7, "state": "completed", "status": 0},
    {"cluster_uuid": None, "clique_id": None, "state": "not_started", "status": None},
    {"cluster_uuid": None, "clique_id": 0, "state": "in_progress", "status": 0},
], ids=lambda f: f["state"])
def test_every_fabric_state_comes_back_through_both_calls(nvml_stub: stub.StubNode, fabric: dict) -> None:
    import pynvml

    nvml, counters = stub.recording(DGX_A100)
    nvml["gpus"][3]["fabric"] = fabric
    nvml_stub.serve(nvml, counters)
    pynvml.nvmlInit()
    check_fabric(pynvml, 3, fabric)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # the recording has no fabric for the others
        pynvml.nvmlDeviceGetGpuFabricInfoV(pynvml.nvmlDeviceGetHandleByIndex(0), ctypes.byref(pynvml.c_nvmlGpuFabricInfoV_t()))


def test_a_fabric_recorded_unknown_is_served_as_recorded(nvml_stub: stub.StubNode) -> None:
    import pynvml

    nvml, _ = stub.recording(DGX_A100)
    nvml["gpus"][0]["fabric"] = {"cluster_uuid": None, "clique_id": None, "state": "unknown", "status": None, "unknown": "state 7"}
    nvml["gpus"][1]["fabric"] = {"cluster_uuid": None, "clique_id": None, "state": "unknown", "status": None, "unknown": "error 4"}
    nvml_stub.serve(nvml)
    pynvml.nvmlInit()
    info = pynvml.c_nvmlGpuFabricInfoV_t()
    pynvml.nvmlDeviceGetGpuFabricInfoV(pynvml.nvmlDeviceGetHandleByIndex(0), ctypes.byref(info))
    assert info.state == 7
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlDeviceGetGpuFabricInfoV(pynvml.nvmlDeviceGetHandleByIndex(1), ctypes.byref(info))


def test_the_process_list_follows_nvmls_two_call_protocol(nvml_stub: stub.StubNode) -> None:
    import pynvml

    nvml, _ = stub.recording(DGX_A100)
    nvml["gpus"][2]["health"]["processes"] = [4242, 4343, 4444]
    nvml_stub.serve(nvml)
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(2)
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)] == [4242, 4343, 4444]
    count = ctypes.c_uint(0)  # asked with no buffer: the count needed, and INSUFFICIENT_SIZE
    assert pynvml.nvmlLib.nvmlDeviceGetComputeRunningProcesses_v3(h, ctypes.byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 3


def test_a_missing_gpu_index_has_no_handle(nvml_stub: stub.StubNode) -> None:
    import pynvml

    nvml, _ = stub.recording(DGX_A100)
    del nvml["gpus"][5]
    nvml_stub.serve(nvml)
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 8
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetHandleByIndex(5)
    assert _text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(6))) == nvml["gpus"][5]["uuid"]


# --- errors per call ----------------------------------------------------------------------


@pytest.mark.parametrize(("planted", "error"), [
    ({"nvmlDeviceGetPowerUsage.1": 15}, "NVMLError_GpuIsLost"),
    ({"nvmlDeviceGetPowerUsage": 3}, "NVMLError_NotSupported"),
    ({"nvmlDeviceGetPowerUsage.1": 10}, "NVMLError_Timeout"),
    ({"nvmlDeviceGetPowerUsage.1": 13}, "NVMLError_FunctionNotFound"),
])
def test_an_error_planted_on_a_call_comes_back_as_pynvmls_own_class(nvml_stub: stub.StubNode, planted: dict, error: str) -> None:
    import pynvml

    nvml_stub.serve_recording(DGX_A100, errors=planted)
    pynvml.nvmlInit()
    with pytest.raises(getattr(pynvml, error)) as raised:
        pynvml.nvmlDeviceGetPowerUsage(pynvml.nvmlDeviceGetHandleByIndex(1))
    assert str(raised.value)  # NVMLError.__str__ asks nvmlErrorString for codes it does not name
    gpu0 = _answer(pynvml.nvmlDeviceGetPowerUsage, pynvml.nvmlDeviceGetHandleByIndex(0), nv=pynvml)
    assert gpu0 == (64000 if "." in next(iter(planted)) else getattr(pynvml, error))  # the others answer unless all are planted
    assert pynvml.nvmlDeviceGetTemperature(pynvml.nvmlDeviceGetHandleByIndex(1), 0) == 31  # other calls answer


def test_errors_on_init_count_processes_and_events(nvml_stub: stub.StubNode) -> None:
    import pynvml

    nvml_stub.serve_recording(DGX_A100, errors={"nvmlInitWithFlags": 9})
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    nvml_stub.serve_recording(DGX_A100, errors={"nvmlDeviceGetComputeRunningProcesses_v3.2": 15,
                                                "nvmlEventSetWait_v2": 999})
    pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(2))
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlEventSetWait_v2(pynvml.nvmlEventSetCreate(), 0)
    nvml_stub.serve_recording(DGX_A100, errors={"nvmlDeviceGetCount_v2": 15})
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetCount()  # the changed file is read at this very call


def test_a_value_the_node_does_not_give_is_not_supported(nvml_stub: stub.StubNode) -> None:
    import pynvml

    nvml_stub.serve({"driver_version": "550.54.15", "gpus": [{"index": 0, "uuid": "GPU-1"}]})
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    for call, args in [(pynvml.nvmlSystemGetCudaDriverVersion, ()), (pynvml.nvmlDeviceGetName, (h,)),
                       (pynvml.nvmlDeviceGetPciInfo, (h,)), (pynvml.nvmlDeviceGetMemoryInfo, (h,)),
                       (pynvml.nvmlDeviceGetCpuAffinity, (h, 64)), (pynvml.nvmlDeviceGetPowerUsage, (h,)),
                       (pynvml.nvmlDeviceGetRemappedRows, (h,)), (pynvml.nvmlDeviceGetComputeRunningProcesses, (h,))]:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(*args)


def test_write_node_refuses_what_the_stub_could_not_serve(tmp_path: Path) -> None:
    nvml, _ = stub.recording(DGX_A100)
    for bad, errors in [
        ({**nvml, "gpus": [{**nvml["gpus"][0], "nvlinks": [{"link": 40, "active": True}]}]}, {}),
        ({**nvml, "gpus": [{**nvml["gpus"][0], "p2p": {"1": "MAYBE"}}]}, {}),
        ({**nvml, "gpus": [{**nvml["gpus"][0], "name": "two\nlines"}]}, {}),
        (nvml, {"nvmlDeviceGetPowerUsage_v9": 15}),
        (nvml, {"nvmlDeviceGetPowerUsage.x": 15}),
    ]:
        with pytest.raises(ValueError):
            stub.write_node(tmp_path / "node", bad, errors=errors)


# --- wrong calls fail as on a GPU ---------------------------------------------------------


def test_a_call_with_a_wrong_handle_or_no_output_fails_with_invalid_argument(nvml_stub: stub.StubNode) -> None:
    import pynvml

    nvml_stub.serve_recording(DGX_A100)
    pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetUUID(0)  # an index where a handle belongs
    stranger = ctypes.c_int(0)  # a pointer the library never gave out
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetPowerUsage(ctypes.cast(ctypes.byref(stranger), pynvml.c_nvmlDevice_t))
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlLib.nvmlDeviceGetPowerUsage(h, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlDeviceGetMemoryInfo(h, version=1)  # a struct version nvml.h does not define
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(8)


def test_a_struct_passed_by_value_is_not_filled(nvml_stub: stub.StubNode) -> None:
    """ctypes passes a Structure argument by value: C gets a pointer to libffi's scratch memory,
    as the driver would.  The versioned struct is refused; the unversioned one is written into
    that memory, never into the caller's struct.  (A child process: it may crash.)"""
    nvml, _ = stub.recording(DGX_A100)
    nvml["gpus"][0]["fabric"] = {"cluster_uuid": "6f1e2a3b4c5d6e7f8091a2b3c4d5e6f7", "clique_id": 7, "state": "completed", "status": 0}
    nvml_stub.serve(nvml)
    child = _run_child(
        "import pynvml\n"
        "pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
        "info = pynvml.c_nvmlGpuFabricInfoV_t()\n"
        "try: pynvml.nvmlDeviceGetGpuFabricInfoV(h, info); print('V answered')\n"
        "except pynvml.NVMLError as e: print('V', type(e).__name__)\n"
        "old = pynvml.c_nvmlGpuFabricInfo_t()\n"
        "try: pynvml.nvmlDeviceGetGpuFabricInfo(h, old); print('v1 answered', old.state, old.cliqueId)\n"
        "except pynvml.NVMLError as e: print('v1', type(e).__name__)\n", nvml_stub.env())
    # The versioned struct: refused, loudly.  The unversioned one: the stub writes through
    # libffi's pointer; the process dies (SIGSEGV here) or the caller's struct stays unfilled.
    assert child.stdout.splitlines()[0] == "V NVMLError_ArgumentVersionMismatch", child.stdout + child.stderr
    assert child.returncode != 0 or child.stdout.splitlines()[1] != "v1 answered 3 7"


def test_calls_before_init_or_after_the_last_shutdown_are_uninitialized(nvml_stub: stub.StubNode) -> None:
    import pynvml

    nvml_stub.serve_recording(DGX_A100)
    pynvml.nvmlInit()
    pynvml.nvmlInit()  # reference counted, as NVML is
    pynvml.nvmlShutdown()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    pynvml.nvmlShutdown()
    for call, args in [(pynvml.nvmlDeviceGetCount, ()), (pynvml.nvmlDeviceGetUUID, (h,)), (pynvml.nvmlShutdown, ())]:
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            call(*args)
    assert stub.shutdown_all() == 0


# --- the node file: re-read, malformed, missing ---------------------------------------------


def test_a_changed_node_file_is_read_at_the_next_count_or_handle(nvml_stub: stub.StubNode) -> None:
    import pynvml

    nvml, counters = stub.recording(DGX_A100)
    nvml_stub.serve(nvml, counters)
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(4)
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(h) == counters["gpus"][4]["counters"]["energy_mj_total"]
    counters["gpus"][4]["counters"]["energy_mj_total"] += 5000
    nvml_stub.serve(nvml, counters)
    h = pynvml.nvmlDeviceGetHandleByIndex(4)
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(h) == counters["gpus"][4]["counters"]["energy_mj_total"]


@pytest.mark.parametrize("text", [
    "gpu_count 1\ngpu.0.power_watts 5\n",  # an unknown key
    "gpu_count 1\ngpu.1.power_mw 5\n",  # a GPU beyond gpu_count
    "gpu_count 65\n",  # more GPUs than NVML's 64
    "gpu_count 1\ngpu.0.nvlink.36.state 1\n",  # a link beyond nvml.h's 36
    "gpu_count 1\ngpu.0.power_mw lots\n",  # not a number
    "gpu_count 1\ngpu.0.power_mw -5\n",  # not unsigned
    "gpu_count 1\ngpu.0.power_mw 5\ngpu.0.power_mw 6\n",  # twice
    "gpu_count 1\ngpu.0.name " + "x" * 600 + "\n",  # a line too long
    "gpu_count\n",  # no value
    "\x00\xff\xfe binary\n",
    "gpu.0.uuid GPU-1\n" * 20000,  # too large
], ids=["unknown-key", "gpu-beyond-count", "too-many-gpus", "link-36", "not-a-number", "negative", "twice",
        "long-line", "no-value", "binary", "too-large"])
def test_a_malformed_node_file_fails_init_with_unknown_and_a_line_on_stderr(
        nvml_stub: stub.StubNode, text: str, capfd: pytest.CaptureFixture[str]) -> None:
    import pynvml

    nvml_stub.path.write_bytes(text.encode("latin-1"))
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlInit()
    assert "nvml stub: " in capfd.readouterr().err


def test_no_node_file_is_a_node_without_the_driver(nvml_stub: stub.StubNode, monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()  # the fixture's node file is not written yet
    monkeypatch.delenv(stub.NODE_ENV)
    nvml_stub.serve_recording(DGX_A100)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()


# --- events, threads, child processes -------------------------------------------------------


def test_xid_events_come_back_once_for_registered_gpus_then_timeout(nvml_stub: stub.StubNode) -> None:
    import pynvml

    nvml_stub.serve_recording(DGX_A100)
    pynvml.nvmlInit()
    check_events(pynvml, nvml_stub.add_xid)
    events = pynvml.nvmlEventSetCreate()  # a second set reads the file from its start
    pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(2), pynvml.nvmlEventTypeXidCriticalError, events)
    with nvml_stub.events_path.open("a") as f:
        f.write("two 79\n2 9")  # a malformed line is skipped; a line without its end waits for it
    assert pynvml.nvmlEventSetWait_v2(events, 0).eventData == 13
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(events, 1)
    with nvml_stub.events_path.open("a") as f:
        f.write("4\n")
    assert pynvml.nvmlEventSetWait_v2(events, 0).eventData == 94
    with pytest.raises(pynvml.NVMLError_NotSupported):  # only Xid events
        pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlEventTypeSingleBitEccError, events)
    pynvml.nvmlEventSetFree(events)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlEventSetWait_v2(events, 0)


def test_threads_reading_while_the_file_changes_see_whole_answers(nvml_stub: stub.StubNode) -> None:
    import pynvml

    nvml, counters = stub.recording(DGX_A100)
    nvml_stub.serve(nvml, counters)
    pynvml.nvmlInit()
    seen: set[int] = set()
    failures: list[BaseException] = []

    def read() -> None:
        try:
            for _ in range(200):
                h = pynvml.nvmlDeviceGetHandleByIndex(1)
                seen.add(pynvml.nvmlDeviceGetPowerUsage(h))
                assert _text(pynvml.nvmlDeviceGetUUID(h)) == nvml["gpus"][1]["uuid"]
        except BaseException as exc:
            failures.append(exc)

    readers = [threading.Thread(target=read) for _ in range(4)]
    for t in readers:
        t.start()
    for watts in range(100, 120):
        counters["gpus"][1]["counters"]["power_w"] = watts
        nvml_stub.serve(nvml, counters)
    for t in readers:
        t.join()
    assert not failures
    recorded = round(nvml["gpus"][1]["health"]["power_w"] * 1000), round(stub.recording(DGX_A100)[1]["gpus"][1]["counters"]["power_w"] * 1000)
    assert seen <= {*recorded, *(w * 1000 for w in range(100, 120))}


def test_a_child_process_given_env_loads_the_stub(nvml_stub: stub.StubNode, monkeypatch: pytest.MonkeyPatch) -> None:
    nvml_stub.serve_recording(DGX_A100)
    for key in nvml_stub.env():  # the child must need nothing but env()
        monkeypatch.delenv(key)
    child = _run_child("import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())", nvml_stub.env())
    assert (child.returncode, child.stdout) == (0, "8\n"), child.stderr
    if ctypes.util.find_library("nvidia-ml") is None:  # a machine with no driver of its own: env() is what loads it
        without = _run_child("import pynvml\ntry: pynvml.nvmlInit()\nexcept pynvml.NVMLError as e: print(type(e).__name__)", {})
        assert without.stdout == "NVMLError_LibraryNotFound\n", without.stderr


@pytest.mark.parametrize("snapshot", ["dgx-a100", "h200"])
def test_each_admitted_binding_reads_the_recording_in_a_child(
        nvml_stub: stub.StubNode, nvml_binding: stub.Binding, snapshot: str, tmp_path: Path) -> None:
    where = DGX_A100 if snapshot == "dgx-a100" else h200(tmp_path)
    nvml_stub.serve_recording(where)
    child = _run_child(f"import test_nvml_stub as t; t._child_main('recording', {str(where)!r}, {str(nvml_stub.events_path)!r})",
                       {**nvml_stub.env(), **nvml_binding.env()})
    assert child.returncode == 0, child.stdout + child.stderr
    assert child.stdout.strip() == f"checked {nvml_binding.pythonpath}"




@functools.cache
def _binding_layouts(binding: stub.Binding) -> dict[str, list]:
    child = _run_child("import json, pynvml, nvml_stub; print(json.dumps(nvml_stub.binding_layouts(pynvml)))", binding.env())
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout)


@pytest.mark.parametrize("struct", list(stub.STRUCTS))
def test_each_admitted_binding_lays_out_the_agents_structs_as_nvml_h(
        nvml_binding: stub.Binding, struct: str) -> None:
    assert _binding_layouts(nvml_binding).get(struct) == stub.nvml_h_layouts()[struct]


def test_each_admitted_binding_reads_every_fabric_state_in_a_child(
        nvml_stub: stub.StubNode, nvml_binding: stub.Binding, tmp_path: Path) -> None:
    nvml, counters = stub.recording(DGX_A100)
    for gpu, fabric in enumerate([
            {"cluster_uuid": "6f1e2a3b-4c5d-6e7f-8091-a2b3c4d5e6f7", "clique_id": 7, "state": "completed", "status": 0},
            {"cluster_uuid": None, "clique_id": None, "state": "not_started", "status": None},
            {"cluster_uuid": None, "clique_id": 0, "state": "in_progress", "status": 0},
            {"cluster_uuid": None, "clique_id": 0, "state": "not_supported", "status": 0}]):
        nvml["gpus"][gpu]["fabric"] = fabric
    (tmp_path / "fabrics").mkdir()
    (tmp_path / "fabrics" / "nvml.json").write_text(json.dumps(nvml))
    nvml_stub.serve(nvml, counters)
    child = _run_child(f"import test_nvml_stub as t; t._child_main('fabric', {str(tmp_path / 'fabrics')!r}, '')",
                       {**nvml_stub.env(), **nvml_binding.env()})
    assert child.returncode == 0, child.stdout + child.stderr


def test_the_bindings_are_pyprojects_bound_and_the_installed_one() -> None:
    import pynvml

    oldest, newest = stub.admitted_versions()
    bindings = list(stub.binding_versions())
    assert [b.version for b in bindings] == list(dict.fromkeys([oldest, newest]))
    assert (bindings[-1].pythonpath / "pynvml.py").read_bytes() == Path(pynvml.__file__).read_bytes()
    assert all((b.pythonpath / "pynvml.py").is_file() for b in bindings)
