"""The suite's NVML: a stub ``libnvidia-ml.so.1`` under the real nvidia-ml-py.

``tests/nvml_stub/nvml_stub.c`` is compiled here (Debian's gcc, NVIDIA's ``nvml.h`` from the
``nvidia-nvml-dev`` wheel) into a library the real pynvml loads with
``CDLL("libnvidia-ml.so.1")`` and calls exactly as it calls the driver's: ctypes scalars,
``byref`` structs laid out by nvml.h, pointer handles.  A call the binding makes wrongly fails
here as it fails on a GPU.  It answers from a *node file* this module writes from our own
recording shapes (``nvml.json``, one ``nvml_counters`` sample of ``telemetry.json``).

Use in a test::

    def test_x(nvml_stub):                          # tests/conftest.py's fixture
        nvml_stub.serve_recording(FIXTURES / "snapshots/dgx-a100")
        ... pynvml / the agent in this process ...  # the library is preloaded, env set
        subprocess.run([...])                       # children inherit the fixture's env too
        subprocess.run([...], env={**os.environ, **node.env()})   # a StubNode made by hand

    nvml_stub.serve(nvml, counters, errors={"nvmlDeviceGetPowerUsage.0": 15})  # GPU_IS_LOST
    nvml_stub.add_xid(gpu=0, xid=79)                # one Xid event, delivered once

The node file (``key value`` a line; ``#`` comments; the C side refuses an unknown key, a
duplicate, a GPU index >= ``gpu_count``, a link >= 36, a number that does not parse: init then
fails with NVML_ERROR_UNKNOWN and a line on stderr).  A key absent means the call answers
NVML_ERROR_NOT_SUPPORTED.  N = GPU index, L = NVLink, numbers are NVML's enums:

    driver_version, nvml_version (text), cuda_driver_version, gpu_count
    gpu.N.uuid, gpu.N.name, gpu.N.pci.bus_id (text), gpu.N.pci.device_id, gpu.N.pci.subsystem_id
    gpu.N.memory.{total,free,used,reserved}      v2's fields; v1's ``used`` = used + reserved
    gpu.N.numa_node, gpu.N.cpu_affinity.W        W: 64-bit word, lowest CPUs first
    gpu.N.nvlink.L.{state,version,remote_type}, gpu.N.nvlink.L.remote_bus_id (text)
    gpu.N.nvlink.L.error.C                       nvmlNvLinkErrorCounter_t C
    gpu.N.p2p.PEER.CAPS                          nvmlGpuP2PStatus_t for nvmlGpuP2PCapsIndex_t CAPS
    gpu.N.ecc.TYPE.COUNTER                       nvmlMemoryErrorType_t, nvmlEccCounterType_t
    gpu.N.power_mw, gpu.N.power_limit_mw, gpu.N.energy_mj, gpu.N.clocks_event_reasons
    gpu.N.utilization.{gpu,memory,encoder,decoder}, gpu.N.temperature.SENSOR, gpu.N.clock.TYPE
    gpu.N.process_count, gpu.N.process.I.{pid,used_memory}
    gpu.N.fabric.{state,status,clique_id,health_mask,health_summary}, gpu.N.fabric.cluster_uuid
    gpu.N.field.ID.SCOPE                         nvmlDeviceGetFieldValues (unsigned long long)
    gpu.N.remapped_rows.{correctable,uncorrectable,pending,failure}, gpu.N.retired_pages_pending
    error.FUNCTION[.N]                           that C function answers this nvmlReturn_t

What the stub cannot express (tests of these need another stand-in, or none):
- a call that hangs or is slow (a driver stuck in the kernel); a crash inside the library;
- a real driver's timing, sampling periods (encoder/decoder answer 1 s), field timestamps;
- values that change between two calls without the test rewriting the file (the file is re-read
  only when it changed, at nvmlDeviceGetCount and nvmlDeviceGetHandleByIndex);
- events other than Xid (registering another type answers NOT_SUPPORTED); MIG instances;
- events lost before a set existed: each event set reads the events file from its start, so a
  test may add an Xid before the agent registers (NVML would drop it);
- P2P caps other than those recorded (nvml.json records the read caps only);
- a field value of another type than unsigned long long; negative numbers;
- a driver without a symbol: ``error.<function> 13`` makes the call raise pynvml's
  NVMLError_FunctionNotFound, but the symbol is still there for ``hasattr(pynvml.nvmlLib, ...)``.

What it shows as a driver would (tests/test_nvml_stub.py):
- a struct passed by value where the binding wants ``byref``: ctypes hands C a pointer to
  libffi's own scratch memory.  A versioned struct is refused (NVMLError_ArgumentVersionMismatch);
  an unversioned one (nvmlDeviceGetGpuFabricInfo's) is written into that memory, never into the
  caller's struct, and the process may die of it (SIGSEGV here);
- the binding's own defects: before nvidia-ml-py 13.615.71 (pyproject's bound since) its fabric
  structs were not nvml.h's (12.550.52's clusterUuid was 80 bytes: state, status and clique read
  from the wrong place; the v1 struct stayed wrong up to 13.610.43), and pynvml's
  NVML_P2P_CAPS_INDEX_READ is the tuple ``(0,)``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import MappingProxyType
from typing import Any

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SOURCE = TESTS / "nvml_stub" / "nvml_stub.c"
SONAME = "libnvidia-ml.so.1"
NODE_ENV = "TOPOAGENT_NVML_STUB_NODE"
EVENTS_ENV = "TOPOAGENT_NVML_STUB_EVENTS"
CACHE = Path(tempfile.gettempdir()) / f"topoagent-nvml-stub-{os.getuid()}"

# nvml.h's numbers for what our recordings hold (tests/test_nvml_stub.py checks them against it).
NVML_FI_DEV_MEMORY_TEMP = 82
NVML_FI_DEV_PCIE_REPLAY_COUNTER = 94
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138  # KiB, scopeId = link
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197
NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
NVML_VOLATILE_ECC = 0
NVML_P2P_CAPS_INDEX_READ = 0
NVML_ERROR_GPU_IS_LOST = 15
NVLINK_ERRORS = {"replay": 0, "recovery": 1, "crc_flit": 2, "crc_data": 3}  # nvmlNvLinkErrorCounter_t
REMOTE_TYPES = {"gpu": 0, "cpu": 1, "switch": 2}  # nvmlIntNvLinkDeviceType_t
P2P_STATUS = {"OK": 0, "CHIPSET_NOT_SUPPORTED": 1, "GPU_NOT_SUPPORTED": 2, "IOH_TOPOLOGY_NOT_SUPPORTED": 3,
              "DISABLED_BY_REGKEY": 4, "NOT_SUPPORTED": 5, "UNKNOWN": 6}  # nvmlGpuP2PStatus_t
FABRIC_STATES = {"not_supported": 0, "not_started": 1, "in_progress": 2, "completed": 3}  # nvmlGpuFabricState_t
# The C functions the stub exports (tests/test_nvml_stub.py checks the library's symbol table):
# what nvidia-ml-py 12.550.52 .. 13.615.71 call for the wrappers the agent uses.
FUNCTIONS = (
    "nvmlInitWithFlags", "nvmlInit_v2", "nvmlShutdown", "nvmlErrorString",
    "nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetNumaNodeId", "nvmlDeviceGetCpuAffinity",
    "nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkVersion", "nvmlDeviceGetNvLinkRemotePciInfo_v2",
    "nvmlDeviceGetNvLinkRemoteDeviceType", "nvmlDeviceGetNvLinkErrorCounter", "nvmlDeviceGetP2PStatus",
    "nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetTemperature", "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetEncoderUtilization",
    "nvmlDeviceGetDecoderUtilization", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetFieldValues", "nvmlEventSetCreate", "nvmlDeviceRegisterEvents", "nvmlEventSetFree",
    "nvmlEventSetWait_v2",
)
NO_ERRORS: Mapping[str, int] = MappingProxyType({})
_MAX_TEXT = 127  # the C side's value length
_MAX_LINKS = 36


class StubBuildError(RuntimeError):
    """The stub library cannot be built here (no gcc, no nvml.h, a compile error)."""


# --- building and loading ---------------------------------------------------------------


def nvml_header() -> Path:
    """NVIDIA's nvml.h from the nvidia-nvml-dev wheel, wherever its CUDA major put it."""
    try:
        import nvidia  # the namespace package the nvidia-* wheels share
    except ImportError:
        raise StubBuildError("no 'nvidia' package: pip install nvidia-nvml-dev (requirements/test.txt)") from None
    found = sorted(h for root in nvidia.__path__ for h in Path(root).glob("*/include/nvml.h"))
    if not found:
        raise StubBuildError(f"no */include/nvml.h under {list(nvidia.__path__)}: pip install nvidia-nvml-dev")
    return found[-1]


@functools.cache
def stub_library() -> Path:
    """The built stub, ``<cache>/<hash>/libnvidia-ml.so.1``: built once per source and header."""
    header = nvml_header()
    digest = hashlib.sha256(SOURCE.read_bytes() + header.read_bytes()).hexdigest()[:16]
    library = CACHE / digest / SONAME
    if library.is_file():
        return library
    gcc = shutil.which("gcc") or "/usr/bin/gcc"
    if not Path(gcc).is_file():
        raise StubBuildError("no gcc: the NVML stub is C (apt-get install gcc)")
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_name(f".{SONAME}.{os.getpid()}")  # parallel workers each build, one wins
    command = [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-Wl,-soname,{SONAME}",
               f"-I{header.parent}", "-o", str(partial), str(SOURCE)]
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    if built.returncode != 0:
        partial.unlink(missing_ok=True)
        raise StubBuildError(f"{' '.join(command)} failed:\n{built.stderr}")
    os.replace(partial, library)
    return library


@functools.cache
def preload() -> ctypes.CDLL:
    """Loads the stub into this process by its soname (RTLD_GLOBAL), once: glibc's dlopen then
    hands pynvml's ``CDLL("libnvidia-ml.so.1")`` this same library, whatever LD_LIBRARY_PATH is."""
    library = ctypes.CDLL(str(stub_library()), mode=ctypes.RTLD_GLOBAL)
    by_soname = ctypes.CDLL(SONAME)
    if by_soname._handle != library._handle:
        raise StubBuildError(f"dlopen({SONAME!r}) does not give the preloaded stub: another one is loaded")
    return library


def shutdown_all() -> int:
    """Shuts NVML down as often as it was initialised (through pynvml, so its own count follows);
    returns how many references were still open."""
    import pynvml

    for left in range(10_000):
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError_Uninitialized:
            return left
    raise RuntimeError("NVML still initialised after 10,000 shutdowns")


# --- the node file -----------------------------------------------------------------------


def _whole(value: Any, what: str) -> int | None:
    """A recorded number as the unsigned integer NVML answers; None stays None (no answer)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        value = round(value)
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}: {value!r} is not a whole number >= 0")
    return value


def _text(value: Any, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > _MAX_TEXT or not all(" " <= c <= "~" for c in value):
        raise ValueError(f"{what}: {value!r} is not 1-{_MAX_TEXT} characters of printable ASCII (what NVML answers)")
    return value


def _cpu_words(cpulist: str, what: str) -> dict[int, int]:
    from topoagent.node.cpulist import parse_cpulist

    words: dict[int, int] = {}
    for cpu in parse_cpulist(cpulist):
        words[cpu // 64] = words.get(cpu // 64, 0) | 1 << cpu % 64
    if any(w >= 64 for w in words):
        raise ValueError(f"{what}: CPUs beyond 4095")
    return words


def _gpu_keys(raw: Mapping[str, Any], n: int, keys: dict[str, Any]) -> None:
    """One nvml.json GPU -> node-file keys."""
    g = f"gpu.{n}"
    keys[f"{g}.uuid"] = _text(raw.get("uuid"), f"{g}.uuid")
    keys[f"{g}.name"] = _text(raw.get("name"), f"{g}.name")
    keys[f"{g}.pci.bus_id"] = _text(raw.get("pci_bus_id"), f"{g}.pci_bus_id")
    keys[f"{g}.memory.total"] = _whole(raw.get("memory_total_bytes"), f"{g}.memory_total_bytes")
    numa = raw.get("numa_node")
    keys[f"{g}.numa_node"] = numa if isinstance(numa, int) and not isinstance(numa, bool) and numa >= 0 else None
    if raw.get("cpu_affinity") is not None:
        for word, bits in _cpu_words(str(raw["cpu_affinity"]), f"{g}.cpu_affinity").items():
            keys[f"{g}.cpu_affinity.{word}"] = bits
    for link in raw.get("nvlinks") or []:
        number = link["link"]
        if not isinstance(number, int) or not 0 <= number < _MAX_LINKS:
            raise ValueError(f"{g}: NVLink {number!r} is not 0-{_MAX_LINKS - 1}")
        at = f"{g}.nvlink.{number}"
        keys[f"{at}.state"] = 1 if link.get("active") else 0
        keys[f"{at}.version"] = _whole(link.get("version"), f"{at}.version")
        keys[f"{at}.remote_bus_id"] = _text(link.get("remote_pci_bus_id"), f"{at}.remote_pci_bus_id")
        remote = link.get("remote_type")
        if remote is not None and remote not in REMOTE_TYPES:
            raise ValueError(f"{at}.remote_type: {remote!r} is not one of {', '.join(REMOTE_TYPES)}")
        keys[f"{at}.remote_type"] = REMOTE_TYPES.get(remote) if remote is not None else None
    for peer, status in (raw.get("p2p") or {}).items():
        code = P2P_STATUS.get(status, int(status) if str(status).isdigit() else None)
        if code is None:
            raise ValueError(f"{g}.p2p.{peer}: {status!r} is not an nvmlGpuP2PStatus_t")
        keys[f"{g}.p2p.{int(peer)}.{NVML_P2P_CAPS_INDEX_READ}"] = code
    _fabric_keys(raw.get("fabric"), n, keys)
    health = raw.get("health") or {}
    _health_keys(health, n, keys)
    processes = health.get("processes")
    if isinstance(processes, list):
        keys[f"{g}.process_count"] = len(processes)
        for i, pid in enumerate(processes):
            keys[f"{g}.process.{i}.pid"] = _whole(pid, f"{g}.processes[{i}]") or 0


def _fabric_keys(fabric: Mapping[str, Any] | None, n: int, keys: dict[str, Any]) -> None:
    """nvml.json's fabric: None (no answer) writes nothing, so both calls say NOT_SUPPORTED."""
    if fabric is None:
        return
    g = f"gpu.{n}.fabric"
    state = fabric.get("state")
    unknown = str(fabric.get("unknown") or "")
    if state == "unknown":
        said = re.fullmatch(r"(state|error) (\d+)", unknown)
        if not said:
            raise ValueError(f"{g}: state unknown with {unknown!r}: expected 'state N' or 'error N'")
        if said[1] == "error":  # NVML refused the call with this code
            keys[f"error.nvmlDeviceGetGpuFabricInfo.{n}"] = keys[f"error.nvmlDeviceGetGpuFabricInfoV.{n}"] = int(said[2])
            return
        keys[f"{g}.state"] = int(said[2])
    elif state is not None:
        if state not in FABRIC_STATES:
            raise ValueError(f"{g}.state: {state!r} is not one of {', '.join(FABRIC_STATES)}")
        keys[f"{g}.state"] = FABRIC_STATES[state]
    else:
        return
    uuid = fabric.get("cluster_uuid")
    if uuid is not None:
        digits = str(uuid).replace("-", "")
        if not re.fullmatch(r"[0-9a-fA-F]{32}", digits):
            raise ValueError(f"{g}.cluster_uuid: {uuid!r} is not 16 bytes of hex")
        keys[f"{g}.cluster_uuid"] = digits.lower()
    keys[f"{g}.clique_id"] = _whole(fabric.get("clique_id"), f"{g}.clique_id")
    keys[f"{g}.status"] = _whole(fabric.get("status"), f"{g}.status")


# Keys shared by nvml.json's health and a counter sample: recorded name -> node-file key.
_SHARED = {
    "temperature_c": f"temperature.{NVML_TEMPERATURE_GPU}",
    "memory_used_bytes": "memory.used",
    "memory_free_bytes": "memory.free",
    "memory_reserved_bytes": "memory.reserved",
    "ecc_corrected_total": f"ecc.{NVML_MEMORY_ERROR_TYPE_CORRECTED}.{NVML_VOLATILE_ECC}",
    "ecc_uncorrected_total": f"ecc.{NVML_MEMORY_ERROR_TYPE_UNCORRECTED}.{NVML_VOLATILE_ECC}",
    "utilization_gpu_percent": "utilization.gpu",
    "utilization_memory_percent": "utilization.memory",
}
_COUNTERS = {
    **_SHARED,
    "memory_temperature_c": f"field.{NVML_FI_DEV_MEMORY_TEMP}.0",
    "energy_mj_total": "energy_mj",
    "encoder_utilization_percent": "utilization.encoder",
    "decoder_utilization_percent": "utilization.decoder",
    "sm_clock_mhz": f"clock.{NVML_CLOCK_SM}",
    "memory_clock_mhz": f"clock.{NVML_CLOCK_MEM}",
    "retired_pages_pending": "retired_pages_pending",
    "throttle_reasons": "clocks_event_reasons",
    "pcie_replays_total": f"field.{NVML_FI_DEV_PCIE_REPLAY_COUNTER}.0",
    "pcie_tx_bytes_total": f"field.{NVML_FI_DEV_PCIE_COUNT_TX_BYTES}.0",
    "pcie_rx_bytes_total": f"field.{NVML_FI_DEV_PCIE_COUNT_RX_BYTES}.0",
}


def _milliwatts(watts: Any, what: str) -> int | None:
    return None if watts is None else _whole(float(watts) * 1000, what)


def _health_keys(health: Mapping[str, Any], n: int, keys: dict[str, Any]) -> None:
    g = f"gpu.{n}"
    for name, key in _SHARED.items():
        keys[f"{g}.{key}"] = _whole(health.get(name), f"{g}.health.{name}")
    keys[f"{g}.power_mw"] = _milliwatts(health.get("power_w"), f"{g}.health.power_w")


def _counter_keys(raw: Mapping[str, Any], keys: dict[str, Any]) -> None:
    """One GPU of an nvml_counters sample -> keys; a value given here replaces nvml.json's."""
    n = raw["index"]
    g = f"gpu.{n}"
    counters = raw.get("counters") or {}

    def put(key: str, value: Any) -> None:
        if value is not None:
            keys[key] = value

    for name, key in _COUNTERS.items():
        put(f"{g}.{key}", _whole(counters.get(name), f"{g}.counters.{name}"))
    put(f"{g}.power_mw", _milliwatts(counters.get("power_w"), f"{g}.counters.power_w"))
    put(f"{g}.power_limit_mw", _milliwatts(counters.get("power_limit_w"), f"{g}.counters.power_limit_w"))
    for state, value in (counters.get("remapped_rows") or {}).items():
        put(f"{g}.remapped_rows.{state}", _whole(value, f"{g}.counters.remapped_rows.{state}"))
    for link in raw.get("nvlinks") or []:
        number = link["link"]
        if not isinstance(number, int) or not 0 <= number < _MAX_LINKS:
            raise ValueError(f"{g}: NVLink {number!r} is not 0-{_MAX_LINKS - 1}")
        for field, name in ((NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, "tx_bytes_total"),
                            (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, "rx_bytes_total")):
            value = _whole(link.get(name), f"{g}.nvlinks[{number}].{name}")
            put(f"{g}.field.{field}.{number}", None if value is None else value // 1024)  # NVML counts KiB
        for name, value in (link.get("errors") or {}).items():
            if name not in NVLINK_ERRORS:
                raise ValueError(f"{g}.nvlinks[{number}].errors: {name!r} is not one of {', '.join(NVLINK_ERRORS)}")
            put(f"{g}.nvlink.{number}.error.{NVLINK_ERRORS[name]}", _whole(value, f"{g}.nvlinks[{number}].errors.{name}"))


def node_lines(nvml: Mapping[str, Any], counters: Mapping[str, Any] | None = None, *,
               errors: Mapping[str, int] = NO_ERRORS) -> list[str]:
    """The node file's lines for a recording's nvml.json and one nvml_counters sample."""
    keys: dict[str, Any] = {
        "driver_version": _text(nvml.get("driver_version"), "driver_version"),
        "nvml_version": _text(nvml.get("nvml_version"), "nvml_version"),
        "cuda_driver_version": nvml.get("cuda_driver_version"),
    }
    if not isinstance(keys["cuda_driver_version"], int | None) or isinstance(keys["cuda_driver_version"], bool):
        raise ValueError(f"cuda_driver_version: {keys['cuda_driver_version']!r} is not an integer")
    gpus = nvml.get("gpus") or []
    indices = [g["index"] for g in gpus]
    count = max(indices, default=-1) + 1
    if count > 64 or len(set(indices)) != len(indices) or any(i < 0 for i in indices):
        raise ValueError(f"GPU indices {indices}: expected distinct 0-63")
    keys["gpu_count"] = count
    for lost in sorted(set(range(count)) - set(indices)):
        # NVML numbers GPUs 0..n-1: one the recording lacks had no handle.
        keys[f"error.nvmlDeviceGetHandleByIndex_v2.{lost}"] = NVML_ERROR_GPU_IS_LOST
    for raw in gpus:
        _gpu_keys(raw, raw["index"], keys)
    for raw in (counters or {}).get("gpus") or []:
        if raw.get("index") not in indices:
            raise ValueError(f"counters for GPU {raw.get('index')!r}, which nvml.json does not have")
        _counter_keys(raw, keys)
    for call, code in errors.items():
        function = call.split(".")[0]
        if function not in FUNCTIONS or not re.fullmatch(r"\w+(\.\d+)?", call):
            raise ValueError(f"errors: {call!r} is not '<C function the stub exports>[.<gpu index>]'")
        keys[f"error.{call}"] = int(code)
    return [f"{key} {value}" for key, value in keys.items() if value is not None]


def write_node(path: Path, nvml: Mapping[str, Any], counters: Mapping[str, Any] | None = None, *,
               errors: Mapping[str, int] = NO_ERRORS) -> None:
    """Writes the node file at ``path`` in one step (a new inode: the stub sees the change)."""
    text = "".join(line + "\n" for line in node_lines(nvml, counters, errors=errors))
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def recording(snapshot_dir: Path, sample: int = 0) -> tuple[dict, dict | None]:
    """A recording's nvml.json and its telemetry.json's nvml_counters at ``sample`` (None
    where it has none, or where that read failed)."""
    nvml = json.loads((snapshot_dir / "nvml.json").read_text())
    telemetry = snapshot_dir / "telemetry.json"
    counters = None
    if telemetry.is_file():
        samples = json.loads(telemetry.read_text()).get("samples") or []
        found = samples[sample].get("sources", {}).get("nvml_counters") if -len(samples) <= sample < len(samples) else None
        counters = found if isinstance(found, dict) else None
    return nvml, counters


class StubNode:
    """One node served by the stub: its node file and Xid events file in ``directory``."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "nvml-node.txt"
        self.events_path = directory / "nvml-events.txt"
        self.events_path.touch()

    def serve(self, nvml: Mapping[str, Any], counters: Mapping[str, Any] | None = None,
              errors: Mapping[str, int] = NO_ERRORS) -> None:
        """Serves ``nvml`` (nvml.json's dict) and ``counters`` (one nvml_counters sample);
        ``errors``: {"<C function>" or "<C function>.<gpu index>": nvmlReturn_t}."""
        write_node(self.path, nvml, counters, errors=errors)

    def serve_recording(self, snapshot_dir: Path, sample: int = 0, errors: Mapping[str, int] = NO_ERRORS) -> None:
        """Serves a recording (``fixtures/snapshots/<name>``): its nvml.json, and its
        telemetry.json's nvml_counters at ``sample`` where it has one."""
        nvml, counters = recording(snapshot_dir, sample)
        self.serve(nvml, counters, errors)

    def add_xid(self, gpu: int, xid: int) -> None:
        """One Xid event on GPU ``gpu``: each event set that registered it gets it once."""
        with self.events_path.open("a") as events:
            events.write(f"{int(gpu)} {int(xid)}\n")  # one write: the stub never sees half a line

    def env(self) -> dict[str, str]:
        """What a child process needs to load the stub and read this node (merge into os.environ)."""
        search = [str(stub_library().parent), *filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":"))]
        return {"LD_LIBRARY_PATH": ":".join(dict.fromkeys(search)), NODE_ENV: str(self.path),
                EVENTS_ENV: str(self.events_path)}


# --- nvml.h's struct layouts, for the contract test ------------------------------------------

# The structs the agent hands the binding: pynvml's ctypes class -> nvml.h's type and fields.
STRUCTS = {
    "c_nvmlMemory_t": ("nvmlMemory_t", ("total", "free", "used")),
    "c_nvmlMemory_v2_t": ("nvmlMemory_v2_t", ("version", "total", "reserved", "free", "used")),
    "nvmlPciInfo_t": ("nvmlPciInfo_t", ("busIdLegacy", "domain", "bus", "device", "pciDeviceId", "pciSubSystemId", "busId")),
    "c_nvmlUtilization_t": ("nvmlUtilization_t", ("gpu", "memory")),
    "c_nvmlProcessInfo_v3_t": ("nvmlProcessInfo_t", ("pid", "usedGpuMemory", "gpuInstanceId", "computeInstanceId")),
    "c_nvmlFieldValue_t": ("nvmlFieldValue_t", ("fieldId", "scopeId", "timestamp", "latencyUsec", "valueType", "nvmlReturn", "value")),
    "c_nvmlEventData_t": ("nvmlEventData_t", ("device", "eventType", "eventData", "gpuInstanceId", "computeInstanceId")),
    "c_nvmlGpuFabricInfo_t": ("nvmlGpuFabricInfo_t", ("clusterUuid", "status", "cliqueId", "state")),
    "c_nvmlGpuFabricInfoV_t": ("nvmlGpuFabricInfo_v2_t", ("version", "clusterUuid", "status", "cliqueId", "state", "healthMask")),
}


@functools.cache
def nvml_h_layouts() -> dict[str, list]:
    """{pynvml class name: [sizeof, {field: offsetof}]} as nvml.h lays the C types out."""
    header = nvml_header()
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <nvml.h>", "int main(void) {", 'printf("{");']
    for i, (name, (c_type, fields)) in enumerate(STRUCTS.items()):
        offsets = ", ".join(f'\\"{f}\\": %zu' for f in fields)
        values = ", ".join(f"offsetof({c_type}, {f})" for f in fields)
        lines.append(f'printf("{"," if i else ""}\\"{name}\\": [%zu, {{{offsets}}}]", sizeof({c_type}), {values});')
    lines += ['printf("}\\n");', "return 0; }"]
    with tempfile.TemporaryDirectory() as work:
        source, program = Path(work) / "layouts.c", Path(work) / "layouts"
        source.write_text("\n".join(lines) + "\n")
        gcc = shutil.which("gcc") or "/usr/bin/gcc"
        subprocess.run([gcc, "-Wall", "-Werror", "-Wno-deprecated-declarations", f"-I{header.parent}", "-o", str(program),
                        str(source)], check=True, capture_output=True)
        return json.loads(subprocess.run([str(program)], check=True, capture_output=True, text=True).stdout)


def binding_layouts(pynvml: Any) -> dict[str, list]:
    """The same, as a pynvml module's ctypes classes lay them out (None where it lacks one)."""
    layouts: dict[str, list] = {}
    for name, (_, fields) in STRUCTS.items():
        cls = getattr(pynvml, name, None)
        if cls is not None:
            declared = {f[0] for f in cls._fields_}
            layouts[name] = [ctypes.sizeof(cls), {f: getattr(cls, f).offset for f in fields if f in declared}]
    return layouts


# --- the binding versions the project admits ---------------------------------------------


@dataclass(frozen=True)
class Binding:
    """One admitted nvidia-ml-py: ``pythonpath`` holds just its pynvml.py."""

    version: str
    pythonpath: Path

    def env(self) -> dict[str, str]:
        """PYTHONPATH with this binding first (merge into os.environ for a child process)."""
        rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return {"PYTHONPATH": os.pathsep.join([str(self.pythonpath), *rest])}


def admitted_versions() -> tuple[str, str]:
    """(oldest, newest): pyproject's ``nvidia-ml-py>=`` bound and the installed one."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    bounds = [m[1] for d in project["dependencies"] if (m := re.fullmatch(r"nvidia-ml-py\s*>=\s*([\w.]+)", d.strip()))]
    if len(bounds) != 1:
        raise RuntimeError("pyproject.toml: expected one 'nvidia-ml-py>=X' dependency")
    return bounds[0], metadata.version("nvidia-ml-py")


@functools.cache
def binding(version: str) -> Binding:
    """A directory holding only nvidia-ml-py ``version``'s pynvml.py: the installed one copied,
    any other downloaded from PyPI once (pip download) and cached."""
    where = CACHE / "bindings" / version
    module = where / "pynvml.py"
    if not module.is_file():
        where.mkdir(parents=True, exist_ok=True)
        partial = where / f".pynvml.py.{os.getpid()}"
        if version == metadata.version("nvidia-ml-py"):
            import pynvml

            shutil.copyfile(str(pynvml.__file__), partial)
        else:
            with tempfile.TemporaryDirectory() as download:
                fetched = subprocess.run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                     f"nvidia-ml-py=={version}", "-d", download], capture_output=True, text=True, check=False)
                wheels = list(Path(download).glob("*.whl"))
                if fetched.returncode != 0 or len(wheels) != 1:
                    raise RuntimeError(f"cannot download nvidia-ml-py=={version}: {fetched.stderr.strip()}")
                with zipfile.ZipFile(wheels[0]) as wheel:
                    partial.write_bytes(wheel.read("pynvml.py"))
        os.replace(partial, module)
    return Binding(version, where)


def binding_versions() -> Iterator[Binding]:
    """Each admitted nvidia-ml-py, oldest first (the contract test runs against both)."""
    for version in dict.fromkeys(admitted_versions()):
        yield binding(version)


def check_pynvml_loads_stub() -> None:
    """Fails unless pynvml in this process has loaded, or will load, the preloaded stub."""
    import pynvml

    library = getattr(pynvml, "nvmlLib", None)
    if library is not None and library._handle != preload()._handle:
        raise StubBuildError("pynvml already loaded another libnvidia-ml.so.1 in this process")
