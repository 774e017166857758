"""NVML: GPUs, their NVLinks, P2P status and health — the only module that imports pynvml.

``read_live()`` asks the NVML library and answers in the ``nvml.json`` schema of
docs/snapshot-format.md; a replayed node serves the same dict from its recording, so
the rest of the agent sees one shape whichever way it came.  pynvml is imported only
inside ``read_live`` so importing this module never needs the library; every NVML call
is guarded because any one of them can be unsupported on a given GPU or driver.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from topoagent.collectors.base import CollectorResult, NoData, SourceError, off_loop, run_collector
from topoagent.collectors.counters import COUNTER, GAUGE, Context, CounterSource, Family, Series, Threshold, label_is
from topoagent.collectors.pci import PciParseError, normalize_address
from topoagent.node.cpulist import CpuListError, format_cpulist, parse_cpulist
from topoagent.node.host import Host
from topoagent.vocabulary import FindingKind, MetricsDetail, Severity

# Same words live and replayed, so a snapshot replays to the same output.
NO_NVML = "NVML not available on this node"
_MAX_NVLINKS = 18  # NVML_NVLINK_MAX_LINKS grew to 36 in newer headers; no GPU uses more than 18
_REMOTE_TYPES = {0: "gpu", 1: "cpu", 2: "switch"}  # NVML_NVLINK_DEVICE_TYPE_* (1 = IBM NPU)
_P2P_STATUS = {0: "OK", 1: "CHIPSET_NOT_SUPPORTED", 2: "GPU_NOT_SUPPORTED",
               3: "IOH_TOPOLOGY_NOT_SUPPORTED", 4: "DISABLED_BY_REGKEY", 5: "NOT_SUPPORTED",
               6: "UNKNOWN"}


@dataclass(frozen=True, slots=True)
class NvLink:
    """One NVLink of a GPU as NVML reports it, with what is at its other end."""

    link: int
    active: bool
    version: int | None
    remote_pci_address: str | None
    remote_type: str | None  # "gpu", "switch", "cpu" or None


# nvmlGpuFabricState_t (nvml.h), as nvml.json writes it.  A state nobody can read (a number
# nvml.h does not name, a newer driver's; an NVML error other than "no such answer") is
# written "unknown", with what NVML said: never taken as completed.
FABRIC_NOT_SUPPORTED, FABRIC_COMPLETED, FABRIC_UNKNOWN = "not_supported", "completed", "unknown"
_FABRIC_STATES = {0: FABRIC_NOT_SUPPORTED, 1: "not_started", 2: "in_progress", 3: FABRIC_COMPLETED}
_RECORDED_FABRIC_STATES = (*_FABRIC_STATES.values(), FABRIC_UNKNOWN)
# nvmlReturn_t: NOT_SUPPORTED (3), FUNCTION_NOT_FOUND (13, a driver before R550): no fabric answer.
_NO_FABRIC_ANSWER = frozenset({3, 13})


@dataclass(frozen=True, slots=True)
class GpuFabric:
    """nvmlDeviceGetGpuFabricInfo(V): the GPU's place in a multi-node NVLink fabric (GB200 NVL72)."""

    cluster_uuid: str | None  # the NVLink domain's cluster, "6f1e...-..."; None when all zero
    clique_id: int | None  # the partition (clique) within the cluster
    state: str | None  # "completed", "in_progress", "not_started", "not_supported", "unknown"
    status: int | None  # nvmlReturn_t of the registration: 0 = success
    unknown: str | None = None  # with state "unknown": what NVML said ("state 7", "error 4")

    @property
    def registered(self) -> bool:
        return self.state == FABRIC_COMPLETED and self.status == 0 and self.cluster_uuid is not None


@dataclass(frozen=True, slots=True)
class NvmlGpu:
    """One GPU as NVML (or its recording) reports it."""

    index: int
    uuid: str | None
    name: str | None
    pci_address: str | None
    memory_total_bytes: int | None
    numa_node: int | None
    cpu_affinity: str | None
    nvlinks: tuple[NvLink, ...]
    p2p: tuple[tuple[int, str], ...]  # (peer index, status)
    health: tuple[tuple[str, Any], ...]  # ("temperature_c", 33), ...
    fabric: GpuFabric | None = None  # absent in recordings made before it was asked

    def health_value(self, key: str) -> Any:
        return dict(self.health).get(key)

    @property
    def utilization_percent(self) -> float | None:
        return _percent(self.health_value("utilization_gpu_percent"))

    @property
    def processes(self) -> tuple[int, ...]:
        return _pids(self.health_value("processes"))


def _percent(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _pids(value: Any) -> tuple[int, ...]:
    # A process NVML could not name (pid None) still occupies the GPU: count it as 0.
    if not isinstance(value, list):
        return ()
    return tuple(p if isinstance(p, int) and not isinstance(p, bool) else 0 for p in value)


@dataclass(frozen=True, slots=True)
class NvmlInfo:
    """NVML's answer: driver versions and every GPU."""

    driver_version: str | None
    cuda_driver_version: int | None
    nvml_version: str | None
    gpus: tuple[NvmlGpu, ...]


# --- pure parser of the recorded / live answers --------------------------------------


def _field(raw: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``raw[key]`` when absent, null or of ``kind`` (never a bool for int); else SourceError.

    A recording is input: a field of the wrong type would surface later as a TypeError
    far from the file that holds it.
    """
    value = raw.get(key)
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise SourceError(f"{where}: {key!r} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")


def parse_nvml(data: dict, what: str = "nvml.json") -> NvmlInfo:
    """The nvml.json dict -> NvmlInfo; raises SourceError naming the bad field."""
    if not isinstance(data, dict):
        raise SourceError(f"{what}: expected a JSON object")
    raw_gpus = data.get("gpus", [])
    if not isinstance(raw_gpus, list):
        raise SourceError(f"{what}: 'gpus' must be a list")
    gpus = []
    for position, raw in enumerate(raw_gpus):
        where = f"{what}: gpus[{position}]"
        if not isinstance(raw, dict) or not isinstance(raw.get("index"), int) or isinstance(raw["index"], bool):
            raise SourceError(f"{where}: needs an integer 'index'")
        links = []
        for k, link in enumerate(_field(raw, "nvlinks", list, where) or []):
            if not isinstance(link, dict) or not isinstance(link.get("link"), int):
                raise SourceError(f"{where}.nvlinks[{k}]: needs an integer 'link'")
            links.append(
                NvLink(
                    link=link["link"],
                    active=bool(link.get("active")),
                    version=_field(link, "version", int, f"{where}.nvlinks[{k}]"),
                    remote_pci_address=_address(link.get("remote_pci_bus_id"), f"{where}.nvlinks[{k}]"),
                    remote_type=_field(link, "remote_type", str, f"{where}.nvlinks[{k}]"),
                )
            )
        p2p_raw = raw.get("p2p") or {}
        try:
            p2p = tuple(sorted((int(k), str(v)) for k, v in p2p_raw.items()))
        except (AttributeError, ValueError):
            raise SourceError(f"{where}.p2p: expected {{peer index: status}}") from None
        health = raw.get("health") or {}
        numa = raw.get("numa_node")
        cpu_affinity = _field(raw, "cpu_affinity", str, where)
        if cpu_affinity is not None:
            try:
                parse_cpulist(cpu_affinity)  # the one reading placement will use
            except CpuListError as exc:
                raise SourceError(f"{where}.cpu_affinity: {exc}") from None
        gpus.append(
            NvmlGpu(
                index=raw["index"],
                uuid=_field(raw, "uuid", str, where),
                name=_field(raw, "name", str, where),
                pci_address=_address(raw.get("pci_bus_id"), where),
                memory_total_bytes=_field(raw, "memory_total_bytes", int, where),
                numa_node=numa if isinstance(numa, int) and numa >= 0 else None,
                cpu_affinity=cpu_affinity,
                nvlinks=tuple(links),
                p2p=p2p,
                health=tuple(sorted(health.items())) if isinstance(health, dict) else (),
                fabric=_fabric(raw.get("fabric"), f"{where}.fabric"),
            )
        )
    return NvmlInfo(
        driver_version=_field(data, "driver_version", str, what),
        cuda_driver_version=_field(data, "cuda_driver_version", int, what),
        nvml_version=_field(data, "nvml_version", str, what),
        gpus=tuple(sorted(gpus, key=lambda g: g.index)),
    )


def _fabric(raw: object, where: str) -> GpuFabric | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise SourceError(f"{where}: expected an object")
    uuid = _field(raw, "cluster_uuid", str, where)
    state = _field(raw, "state", str, where)
    if state is not None and state not in _RECORDED_FABRIC_STATES:
        raise SourceError(f"{where}: state {state[:40]!r} is not one of {', '.join(_RECORDED_FABRIC_STATES)}")
    unknown = _field(raw, "unknown", str, where)
    return GpuFabric(
        cluster_uuid=None if uuid is None or not uuid.strip("0-") else uuid.lower(),  # all zero: no cluster
        clique_id=_field(raw, "clique_id", int, where),
        state=state,
        status=_field(raw, "status", int, where),
        unknown=None if unknown is None else unknown[:80],
    )


def _address(value: object, where: str) -> str | None:
    if value is None:
        return None
    try:
        if not isinstance(value, str):
            raise PciParseError(type(value).__name__)
        return normalize_address(value)
    except PciParseError:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise SourceError(f"{where}: {shown} is not a PCI bus id") from None


# --- live reader ---------------------------------------------------------------------


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def driver_present() -> bool:
    """Whether NVML can answer here: the NVIDIA driver's /proc entry or its control device
    (as containers get them), or WSL's GPU device.  Asked before importing pynvml, which
    costs a one-shot command on a node without GPUs a tenth of its start-up."""
    return any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg"))


def read_live() -> dict | None:
    """Ask the NVML library; None when there is no library or no driver (no data)."""
    if not driver_present():
        return None
    try:
        import pynvml  # the only import of pynvml in the agent
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None
    try:
        return _read_all(pynvml)
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _read_all(nv: Any) -> dict:
    def ask(call: Callable[..., Any], *args: Any) -> Any:
        # Any single NVML call may be unsupported on this GPU/driver: that field is null.
        try:
            return call(*args)
        except Exception:
            return None

    count = ask(nv.nvmlDeviceGetCount) or 0
    handles = [ask(nv.nvmlDeviceGetHandleByIndex, i) for i in range(count)]
    gpus = []
    for index, handle in enumerate(handles):
        if handle is None:
            continue
        pci = ask(nv.nvmlDeviceGetPciInfo, handle)
        memory = _memory_info(nv, handle)
        links = []
        for link in range(_MAX_NVLINKS):
            state = ask(nv.nvmlDeviceGetNvLinkState, handle, link)
            if state is None:
                continue  # link does not exist on this GPU
            remote = ask(nv.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
            remote_type = ask(nv.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
            links.append(
                {
                    "link": link,
                    "active": bool(state),
                    "version": ask(nv.nvmlDeviceGetNvLinkVersion, handle, link),
                    "remote_pci_bus_id": _bus_id(remote),
                    "remote_type": _REMOTE_TYPES.get(remote_type) if remote_type is not None else None,
                }
            )
        p2p = {}
        for peer_index, peer in enumerate(handles):
            if peer is None or peer_index == index:
                continue
            status = ask(nv.nvmlDeviceGetP2PStatus, handle, peer, 0)  # 0 = P2P read caps
            if status is not None:
                p2p[str(peer_index)] = _P2P_STATUS.get(status, str(status))
        affinity = ask(nv.nvmlDeviceGetCpuAffinity, handle, 64)
        ecc_u = ask(nv.nvmlDeviceGetTotalEccErrors, handle, 1, 0)  # uncorrected, volatile
        ecc_c = ask(nv.nvmlDeviceGetTotalEccErrors, handle, 0, 0)
        power = ask(nv.nvmlDeviceGetPowerUsage, handle)
        util = ask(nv.nvmlDeviceGetUtilizationRates, handle)
        processes = ask(nv.nvmlDeviceGetComputeRunningProcesses, handle) or []
        numa = ask(nv.nvmlDeviceGetNumaNodeId, handle)
        fabric = _fabric_info(nv, handle)
        gpus.append(
            {
                "index": index,
                "uuid": _maybe_text(ask(nv.nvmlDeviceGetUUID, handle)),
                "name": _maybe_text(ask(nv.nvmlDeviceGetName, handle)),
                "pci_bus_id": _bus_id(pci),
                "memory_total_bytes": getattr(memory, "total", None),
                "numa_node": numa if isinstance(numa, int) and numa >= 0 else None,
                "cpu_affinity": _affinity_to_cpulist(affinity),
                "nvlinks": links,
                "p2p": p2p,
                "fabric": fabric,
                "health": {
                    "temperature_c": ask(nv.nvmlDeviceGetTemperature, handle, 0),
                    "power_w": round(power / 1000.0, 1) if isinstance(power, (int, float)) else None,
                    "memory_used_bytes": getattr(memory, "used", None),
                    "memory_free_bytes": getattr(memory, "free", None),
                    "memory_reserved_bytes": getattr(memory, "reserved", None),
                    "ecc_uncorrected_total": ecc_u,
                    "ecc_corrected_total": ecc_c,
                    "utilization_gpu_percent": getattr(util, "gpu", None),
                    "utilization_memory_percent": getattr(util, "memory", None),
                    "processes": [getattr(p, "pid", None) for p in processes],
                },
            }
        )
    return {
        "driver_version": _maybe_text(ask(nv.nvmlSystemGetDriverVersion)),
        "cuda_driver_version": ask(nv.nvmlSystemGetCudaDriverVersion),
        "nvml_version": _maybe_text(ask(nv.nvmlSystemGetNVMLVersion)),
        "gpus": gpus,
    }


def _fabric_info(nv: Any, handle: Any) -> dict | None:
    """The GPU's fabric answer in nvml.json's shape: None where NVML has none (the call not
    supported, or a driver or pynvml without it); "unknown" for any other error."""
    call = getattr(nv, "nvmlDeviceGetGpuFabricInfo", None)
    if call is None:
        return None
    try:
        info = call(handle)
    except Exception as exc:  # pynvml's NVMLError carries the nvmlReturn_t in .value
        code = getattr(exc, "value", None)
        if code in _NO_FABRIC_ANSWER:
            return None
        said = f"error {code}" if isinstance(code, int) else type(exc).__name__
        return {"cluster_uuid": None, "clique_id": None, "state": FABRIC_UNKNOWN, "status": None, "unknown": said}
    return _fabric_answer(info)


def _fabric_answer(info: object) -> dict | None:
    """nvmlGpuFabricInfo_t -> nvml.json's ``fabric``; clusterUuid's 16 bytes as a UUID."""
    if info is None:
        return None
    raw = getattr(info, "clusterUuid", None)
    try:
        digits = bytes(bytearray(raw)).hex() if raw is not None else None
    except (TypeError, ValueError):
        digits = None
    uuid = None
    if digits is not None and len(digits) == 32:
        uuid = f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"
    state = getattr(info, "state", None)
    status = getattr(info, "status", None)
    clique = getattr(info, "cliqueId", None)
    answer = {
        "cluster_uuid": uuid,
        "clique_id": clique if isinstance(clique, int) else None,
        "state": _FABRIC_STATES.get(state, FABRIC_UNKNOWN) if isinstance(state, int) else None,
        "status": status if isinstance(status, int) else None,
    }
    if answer["state"] == FABRIC_UNKNOWN:
        answer["unknown"] = f"state {state}"
    return answer


def _memory_info(nv: Any, handle: Any) -> Any:
    """nvmlDeviceGetMemoryInfo_v2 where the driver has it (R510+): its ``used`` leaves out
    the memory the driver reserves, and ``reserved`` says how much, as DCGM's FB_USED and
    FB_RESERVED do; else v1, whose ``used`` includes the reserved part and has no ``reserved``."""
    version = getattr(nv, "nvmlMemory_v2", None)
    if version is not None:
        answer = _ask(nv.nvmlDeviceGetMemoryInfo, handle, version)
        if answer is not None:
            return answer
    return _ask(nv.nvmlDeviceGetMemoryInfo, handle)


def _maybe_text(value: object) -> str | None:
    return None if value is None else _text(value)


def _bus_id(pci: object) -> str | None:
    bus_id = getattr(pci, "busId", None)
    if bus_id is None:
        return None
    try:
        return normalize_address(_text(bus_id))
    except PciParseError:
        return None


def _affinity_to_cpulist(words: Iterable[int] | None) -> str | None:
    """NVML's CPU affinity (64-bit words, lowest CPUs first) -> cpulist."""
    if not words:
        return None
    cpus = {w * 64 + bit for w, word in enumerate(words) for bit in range(64) if int(word) >> bit & 1}
    return format_cpulist(frozenset(cpus)) or None


def read_live_activity() -> dict | None:
    """Just what each GPU is doing now (utilization, compute processes), in the
    nvml.json shape: two NVML calls per GPU, cheap enough to ask every few seconds."""
    if not driver_present():
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        gpus = []
        for index in range(_ask(pynvml.nvmlDeviceGetCount) or 0):
            handle = _ask(pynvml.nvmlDeviceGetHandleByIndex, index)
            if handle is None:
                continue
            util = _ask(pynvml.nvmlDeviceGetUtilizationRates, handle)
            processes = _ask(pynvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
            gpus.append({"index": index, "health": {
                "utilization_gpu_percent": getattr(util, "gpu", None),
                "processes": [getattr(p, "pid", None) for p in processes],
            }})
        return {"gpus": gpus}
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _ask(call: Callable[..., Any], *args: Any) -> Any:
    try:
        return call(*args)
    except Exception:
        return None


@dataclass(frozen=True, slots=True)
class GpuActivityReading:
    """What one GPU runs now, as NVML says; the agent reads it between discoveries."""

    index: int
    utilization_percent: float | None
    processes: tuple[int, ...]  # PIDs of compute processes (0: one NVML could not name)


def read_activity(host: Host) -> tuple[GpuActivityReading, ...] | None:
    """What each GPU runs now; a replayed node answers from its recording.  None when
    the node has no NVML.  Blocking: call it off the event loop."""
    data = read_live_activity() if host.live else host.nvml()
    if data is None:
        return None
    info = parse_nvml(data)
    return tuple(GpuActivityReading(g.index, g.utilization_percent, g.processes) for g in info.gpus)


# --- collector -----------------------------------------------------------------------


async def collect(host: Host) -> CollectorResult[NvmlInfo]:
    async def read() -> tuple[NvmlInfo, tuple[str, ...]]:
        if host.live:
            data = await off_loop(read_live)
            if data is None:
                raise NoData(NO_NVML)
            host.note_nvml(data)
        else:
            data = host.nvml()
            if data is None:
                raise NoData(NO_NVML)
        info = parse_nvml(data)
        if not info.gpus:
            raise NoData("NVML sees no GPUs")
        return info, ()

    return await run_collector("nvml", read)


# --- counters and health (the telemetry loop; docs/snapshot-format.md, telemetry.json) --

# NVML field ids (nvml.h): NVLink data counters in KiB, asked per link (scopeId = link).
_FI_NVLINK_THROUGHPUT_DATA_TX = 138
_FI_NVLINK_THROUGHPUT_DATA_RX = 139
_FI_PCIE_REPLAY_COUNTER = 94
_FI_PCIE_COUNT_TX_BYTES = 197  # Hopper and later
_FI_PCIE_COUNT_RX_BYTES = 198
_FI_DEV_MEMORY_TEMP = 82  # HBM temperature, degrees C
_CLOCK_SM, _CLOCK_MEM = 1, 2  # nvmlClockType_t
# nvmlNvLinkErrorCounter_t -> the `counter` label
_NVLINK_ERRORS = {0: "replay", 1: "recovery", 2: "crc_flit", 3: "crc_data"}
_EVENT_XID = 0x8  # nvmlEventTypeXidCriticalError
_NVML_SUCCESS = 0
# nvmlClocksThrottleReason* bits -> the `reason` label
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}
# Xids NVIDIA's Xid catalogue says need action (reset the GPU, drain the node, call
# support): 48 DBE, 63/64 row remapping, 74 NVLink error, 79 fallen off the bus, 92 high
# single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP errors.
ACTIONABLE_XIDS = frozenset({"48", "63", "64", "74", "79", "92", "94", "95", "119", "120"})

# The families the counters fill, in the order /metrics lists them within each subsystem.
_GPU, _LINK = ("gpu",), ("gpu", "link")
NVLINK_TRANSMITTED = Family("nvlink_transmitted_bytes_total", "Data bytes a GPU sent over an NVLink (NVML throughput counter).",
                            COUNTER, _LINK, "bytes")
NVLINK_RECEIVED = Family("nvlink_received_bytes_total", "Data bytes a GPU received over an NVLink.", COUNTER, _LINK, "bytes")
# Replays and recoveries are judged (THRESHOLDS) and served by default; CRC counts with
# [metrics] detail "errors" (the series budget).
NVLINK_ERRORS = Family("nvlink_errors_total", "NVLink error counters: replay, recovery; crc_flit, crc_data with [metrics] detail \"errors\".",
                       COUNTER, (*_LINK, "counter"), detail=MetricsDetail.ERRORS, default=(("counter", frozenset({"replay", "recovery"})),))
PCIE_REPLAYS = Family("pcie_replays_total", "PCIe replays of a GPU's link (NVML).", COUNTER, _GPU)
PCIE_TRANSMITTED = Family("pcie_transmitted_bytes_total", "Bytes a GPU sent over PCIe (NVML; Hopper and later).", COUNTER, _GPU, "bytes")
PCIE_RECEIVED = Family("pcie_received_bytes_total", "Bytes a GPU received over PCIe (NVML; Hopper and later).", COUNTER, _GPU, "bytes")
TEMPERATURE = Family("gpu_temperature_celsius", "GPU core temperature.", GAUGE, _GPU, "celsius")
POWER = Family("gpu_power_watts", "GPU power draw.", GAUGE, _GPU, "watts")
# A setting, not a measurement (the throttle bitmask says when the cap holds clocks down):
# served with [metrics] detail "settings" (the series budget).
POWER_LIMIT = Family("gpu_power_limit_watts", "GPU enforced power limit ([metrics] detail \"settings\").", GAUGE, _GPU, "watts",
                     detail=MetricsDetail.SETTINGS)
MEMORY_USED = Family("gpu_memory_used_bytes", "GPU memory allocated (framebuffer; without the driver's reserve where NVML reports one).",
                     GAUGE, _GPU, "bytes")
MEMORY_FREE = Family("gpu_memory_free_bytes", "GPU memory free (framebuffer).", GAUGE, _GPU, "bytes")
MEMORY_RESERVED = Family("gpu_memory_reserved_bytes", "GPU memory the driver reserves for itself (NVML memory info v2).",
                         GAUGE, _GPU, "bytes")
UTILIZATION = Family("gpu_utilization_ratio", "Share of NVML's last sample period (1/6 s to 1 s) in which a kernel ran on the GPU.",
                     GAUGE, _GPU, "ratio")
MEMORY_UTILIZATION = Family("gpu_memory_utilization_ratio",
                            "Share of NVML's last sample period in which device memory was read or written.", GAUGE, _GPU, "ratio")
# The video engines sit idle on a training node: served with [metrics] detail "video".
ENCODER_UTILIZATION = Family("gpu_encoder_utilization_ratio", "Share of NVML's last sample period the video encoder was busy "
                             "([metrics] detail \"video\").", GAUGE, _GPU, "ratio", detail=MetricsDetail.VIDEO)
DECODER_UTILIZATION = Family("gpu_decoder_utilization_ratio", "Share of NVML's last sample period the video decoder was busy "
                             "([metrics] detail \"video\").", GAUGE, _GPU, "ratio", detail=MetricsDetail.VIDEO)
SM_CLOCK = Family("gpu_sm_clock_hertz", "Current SM clock.", GAUGE, _GPU, "hertz")
MEMORY_CLOCK = Family("gpu_memory_clock_hertz", "Current memory clock.", GAUGE, _GPU, "hertz")
MEMORY_TEMPERATURE = Family("gpu_memory_temperature_celsius", "GPU memory (HBM) temperature.", GAUGE, _GPU, "celsius")
ENERGY = Family("gpu_energy_joules_total", "Energy the GPU consumed since the driver was loaded (Volta and later).",
                COUNTER, _GPU, "joules")
# Corrected ECC errors were corrected: counted, not judged; with [metrics] detail "errors".
ECC_ERRORS = Family("gpu_ecc_errors_total", "ECC errors since the driver loaded (volatile): uncorrected; corrected with [metrics] detail \"errors\".",
                    COUNTER, (*_GPU, "type"), detail=MetricsDetail.ERRORS, default=(("type", frozenset({"uncorrected"})),))
RETIRED_PAGES_PENDING = Family("gpu_retired_pages_pending", "1 when retired pages wait for a GPU reset (pre-Ampere page retirement).",
                               GAUGE, _GPU)
# Rows remapped for correctable errors were remapped in time: counted, not judged, like
# corrected ECC errors; with [metrics] detail "errors".  Uncorrectable, pending (a reset is
# due) and failure (service) by default.
REMAPPED_ROWS = Family("gpu_remapped_rows",
                       "Remapped memory rows (Ampere and later): uncorrectable count; pending, failure flags; correctable count with "
                       "[metrics] detail \"errors\".", GAUGE, (*_GPU, "state"), detail=MetricsDetail.ERRORS,
                       default=(("state", frozenset({"uncorrectable", "pending", "failure"})),))
# The series budget (issue #29): per GPU, the throttle bitmask as dcgm-exporter serves it and
# the Xids by class; one series per reason bit and per Xid with [metrics] detail.
THROTTLE_MASK = Family("gpu_clock_throttle_reasons", "Why the GPU's clocks are held down now: NVML's clocks throttle reasons "
                       "bitmask (dcgm-exporter's DCGM_FI_DEV_CLOCK_THROTTLE_REASONS; 0x20 sw_thermal, 0x40 hw_thermal, "
                       "0x4 sw_power_cap, 0x80 hw_power_brake).", GAUGE, _GPU)
THROTTLE_REASON = Family("gpu_clock_throttle_reason", "1 when the reason currently holds the GPU's clocks down ([metrics] detail \"throttle\").",
                         GAUGE, (*_GPU, "reason"), detail=MetricsDetail.THROTTLE)
XID_EVENTS = Family("gpu_xid_events_total", "Xid events NVML reported since the agent started, by class: actionable (from 0) "
                    "or application (from its first event).", COUNTER, (*_GPU, "class"), from_zero=True)
XID_LAST = Family("gpu_xid_last", "The last Xid NVML reported since the agent started (dcgm-exporter's DCGM_FI_DEV_XID_ERRORS); "
                  "no series before the GPU's first.", GAUGE, _GPU)
XID_ERRORS = Family("gpu_xid_errors_total", "Xid events NVML reported since the agent started, by Xid (the actionable ones from 0; "
                    "[metrics] detail \"xid\").", COUNTER, (*_GPU, "xid"),
                    from_zero=True,  # NVIDIA keeps no Xid counter: LiveCounterReader counts them
                    detail=MetricsDetail.XID)
FAMILIES = (NVLINK_TRANSMITTED, NVLINK_RECEIVED, NVLINK_ERRORS, PCIE_REPLAYS, PCIE_TRANSMITTED, PCIE_RECEIVED,
            TEMPERATURE, MEMORY_TEMPERATURE, POWER, POWER_LIMIT, ENERGY, UTILIZATION, MEMORY_UTILIZATION, ENCODER_UTILIZATION,
            DECODER_UTILIZATION, SM_CLOCK, MEMORY_CLOCK, MEMORY_USED, MEMORY_FREE, MEMORY_RESERVED,
            ECC_ERRORS, RETIRED_PAGES_PENDING, REMAPPED_ROWS, THROTTLE_MASK, THROTTLE_REASON, XID_EVENTS, XID_LAST, XID_ERRORS)
THRESHOLDS = (
    Threshold("nvlink_replay_per_s", NVLINK_ERRORS, label_is("counter", "replay"), 0.0,
              FindingKind.NVLINK_ERRORS_RISING, Severity.WARNING, "NVLink replays"),
    Threshold("nvlink_recovery_per_s", NVLINK_ERRORS, label_is("counter", "recovery"), 0.0,
              FindingKind.NVLINK_ERRORS_RISING, Severity.CRITICAL, "NVLink recoveries"),
    Threshold("xid_per_s", XID_ERRORS, {"xid": ACTIONABLE_XIDS}, 0.0,
              FindingKind.GPU_XID, Severity.CRITICAL, "Xid events that need action", summed_in=XID_EVENTS),
    Threshold("ecc_uncorrected_per_s", ECC_ERRORS, label_is("type", "uncorrected"), 0.0,
              FindingKind.GPU_ECC_UNCORRECTED, Severity.CRITICAL, "uncorrectable ECC errors"),
    Threshold("remapped_rows_failure", REMAPPED_ROWS, label_is("state", "failure"), 0.0,
              FindingKind.GPU_ROW_REMAP_FAILED, Severity.CRITICAL, "row remapping failure (the GPU needs service)"),
)



@dataclass(frozen=True, slots=True)
class DcgmField:
    """One of dcgm-exporter's default fields (its etc/default-counters.csv) and our series for it."""

    field: str  # DCGM_FI_...
    unit: str  # dcgm-exporter's unit, as its help text gives it ("" for a count)
    family: Family | None  # None: NVML does not give it (DCGM's profiling fields, vGPU licences)
    labels: tuple[tuple[str, str], ...] = ()  # the series of our family that is DCGM's field, where it has several

    @property
    def select(self) -> str:
        """``labels`` as a PromQL selector: ``{state="failure"}``."""
        return "{" + ",".join(f'{k}="{v}"' for k, v in self.labels) + "}" if self.labels else ""
    factor: str = "1"  # ours = DCGM's × factor (our names carry base units)
    note: str = ""


_MIB = str(1 << 20)
# dcgm-exporter's defaults in its csv order; README's DCGM table is rendered from this.
DCGM_FIELDS = (
    DcgmField("DCGM_FI_DEV_SM_CLOCK", "MHz", SM_CLOCK, factor="1000000"),
    DcgmField("DCGM_FI_DEV_MEM_CLOCK", "MHz", MEMORY_CLOCK, factor="1000000"),
    DcgmField("DCGM_FI_DEV_MEMORY_TEMP", "C", MEMORY_TEMPERATURE),
    DcgmField("DCGM_FI_DEV_GPU_TEMP", "C", TEMPERATURE),
    DcgmField("DCGM_FI_DEV_POWER_USAGE", "W", POWER),
    DcgmField("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "mJ", ENERGY, factor="0.001", note="both count from the driver's load"),
    DcgmField("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "", PCIE_REPLAYS),
    DcgmField("DCGM_FI_DEV_GPU_UTIL", "%", UTILIZATION, factor="0.01"),
    DcgmField("DCGM_FI_DEV_MEM_COPY_UTIL", "%", MEMORY_UTILIZATION, factor="0.01"),
    DcgmField("DCGM_FI_DEV_ENC_UTIL", "%", ENCODER_UTILIZATION, factor="0.01"),
    DcgmField("DCGM_FI_DEV_DEC_UTIL", "%", DECODER_UTILIZATION, factor="0.01"),
    DcgmField("DCGM_FI_DEV_XID_ERRORS", "", XID_LAST,
              note="no series before the GPU's first Xid since the agent started (DCGM's reads 0); `gpu_xid_events_total` counts them by class"),
    DcgmField("DCGM_FI_DEV_FB_FREE", "MiB", MEMORY_FREE, factor=_MIB),
    DcgmField("DCGM_FI_DEV_FB_USED", "MiB", MEMORY_USED, factor=_MIB),
    DcgmField("DCGM_FI_DEV_FB_RESERVED", "MiB", MEMORY_RESERVED, factor=_MIB),
    DcgmField("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "", None,
              note="a count over all links; ours are bytes per link: `nvlink_transmitted_bytes_total`, `_received_`"),
    DcgmField("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "", None, note="vGPU only"),
    DcgmField("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "", REMAPPED_ROWS, (("state", "uncorrectable"),)),
    DcgmField("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "", REMAPPED_ROWS, (("state", "correctable"),)),
    DcgmField("DCGM_FI_DEV_ROW_REMAP_FAILURE", "", REMAPPED_ROWS, (("state", "failure"),)),
    DcgmField("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "ratio", None, note="profiling: needs DCGM"),
    DcgmField("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "ratio", None, note="profiling: needs DCGM"),
    DcgmField("DCGM_FI_PROF_DRAM_ACTIVE", "ratio", None, note="profiling: needs DCGM"),
    DcgmField("DCGM_FI_PROF_PCIE_TX_BYTES", "B/s", PCIE_TRANSMITTED, factor="—",
              note="DCGM's is a rate: compare `rate()` of ours (Hopper and later)"),
    DcgmField("DCGM_FI_PROF_PCIE_RX_BYTES", "B/s", PCIE_RECEIVED, factor="—",
              note="DCGM's is a rate: compare `rate()` of ours (Hopper and later)"),
)


def dcgm_table() -> str:
    """docs/telemetry.md's table of dcgm-exporter's default fields beside ours (markdown)."""
    lines = ["| dcgm-exporter field | its unit | ours (`topoagent_`) | ours = DCGM × | note |", "|---|---|---|---|---|"]
    for f in DCGM_FIELDS:
        ours = f"`{f.family.name}{f.select}`" if f.family is not None else "—"
        factor = f.factor if f.family is not None else "—"
        note = f.note
        if f.family is not None and not f.family.served(f.labels, frozenset()):
            note = "; ".join(filter(None, (f'with `[metrics] detail = ["{f.family.detail}"]`', note)))
        lines.append(f"| `{f.field}` | {f.unit or '—'} | {ours} | {factor} | {note} |")
    return "\n".join(lines) + "\n"


class LiveCounterReader:
    """Reads each GPU's counters and health through NVML, keeping NVML initialised and
    one Xid event set registered for the agent's life (events arrive between reads and
    are counted here, per GPU and Xid, since the agent started)."""

    def __init__(self) -> None:
        self._nv: Any = None
        self._events: Any = None
        self._xids: dict[tuple[int, int], int] = {}
        self._last_xid: dict[int, int] = {}  # GPU index -> its last Xid

    def _open(self) -> Any:
        if self._nv is None:
            if not driver_present():
                raise NoData(NO_NVML)
            try:
                import pynvml
            except ImportError:
                raise NoData(NO_NVML) from None
            try:
                pynvml.nvmlInit()
            except Exception:
                raise NoData(NO_NVML) from None
            self._nv = pynvml
            with contextlib.suppress(Exception):
                self._events = pynvml.nvmlEventSetCreate()
                for index in range(pynvml.nvmlDeviceGetCount()):
                    with contextlib.suppress(Exception):  # not every GPU supports Xid events
                        pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(index), _EVENT_XID, self._events)
        return self._nv

    def close(self) -> None:
        if self._nv is not None:
            with contextlib.suppress(Exception):
                if self._events is not None:
                    self._nv.nvmlEventSetFree(self._events)
                self._nv.nvmlShutdown()
        self._nv = self._events = None

    def _drain_events(self, nv: Any, index_of: dict[Any, int]) -> None:
        # A zero timeout returns what is queued; NVML raises Timeout when the queue is empty.
        for _ in range(10_000):
            try:
                event = nv.nvmlEventSetWait_v2(self._events, 0)
            except Exception:
                return
            index = index_of.get(getattr(event.device, "value", event.device), -1)
            key = (index, int(event.eventData))
            self._xids[key] = self._xids.get(key, 0) + 1
            self._last_xid[index] = key[1]

    def read(self) -> dict:
        nv = self._open()
        count = _ask(nv.nvmlDeviceGetCount) or 0
        handles = {i: _ask(nv.nvmlDeviceGetHandleByIndex, i) for i in range(count)}
        if self._events is not None:
            self._drain_events(nv, {getattr(h, "value", h): i for i, h in handles.items() if h is not None})
        gpus = []
        for index, handle in handles.items():
            if handle is not None:
                gpus.append(self._gpu(nv, index, handle))
        return {"gpus": gpus}

    def _gpu(self, nv: Any, index: int, handle: Any) -> dict:
        def field_values(ids: list[Any]) -> list[int | None]:
            values = _ask(nv.nvmlDeviceGetFieldValues, handle, ids)
            if values is None:
                return [None] * len(ids)
            return [_field_int(v) for v in values]

        links = []
        for link in range(_MAX_NVLINKS):
            if _ask(nv.nvmlDeviceGetNvLinkState, handle, link) is None:
                continue
            tx, rx = field_values([(_FI_NVLINK_THROUGHPUT_DATA_TX, link), (_FI_NVLINK_THROUGHPUT_DATA_RX, link)])
            errors = {name: _ask(nv.nvmlDeviceGetNvLinkErrorCounter, handle, link, code) for code, name in _NVLINK_ERRORS.items()}
            links.append({"link": link, "tx_bytes_total": None if tx is None else tx * 1024,
                          "rx_bytes_total": None if rx is None else rx * 1024, "errors": errors})
        replays, pcie_tx, pcie_rx, memory_temp = field_values(
            [_FI_PCIE_REPLAY_COUNTER, _FI_PCIE_COUNT_TX_BYTES, _FI_PCIE_COUNT_RX_BYTES, _FI_DEV_MEMORY_TEMP])
        memory = _memory_info(nv, handle)
        util = _ask(nv.nvmlDeviceGetUtilizationRates, handle)
        encoder = _ask(nv.nvmlDeviceGetEncoderUtilization, handle)  # [percent, sampling period in µs]
        decoder = _ask(nv.nvmlDeviceGetDecoderUtilization, handle)
        power = _ask(nv.nvmlDeviceGetPowerUsage, handle)
        limit = _ask(nv.nvmlDeviceGetEnforcedPowerLimit, handle)
        remapped = _ask(nv.nvmlDeviceGetRemappedRows, handle)  # (correctable, uncorrectable, pending, failure)
        pending = _ask(nv.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        counters = {
            "temperature_c": _ask(nv.nvmlDeviceGetTemperature, handle, 0),
            "power_w": power / 1000.0 if isinstance(power, (int, float)) else None,
            "power_limit_w": limit / 1000.0 if isinstance(limit, (int, float)) else None,
            "memory_temperature_c": memory_temp,
            "energy_mj_total": _ask(nv.nvmlDeviceGetTotalEnergyConsumption, handle),
            "utilization_gpu_percent": getattr(util, "gpu", None),
            "utilization_memory_percent": getattr(util, "memory", None),
            "encoder_utilization_percent": encoder[0] if isinstance(encoder, list) and encoder else None,
            "decoder_utilization_percent": decoder[0] if isinstance(decoder, list) and decoder else None,
            "sm_clock_mhz": _ask(nv.nvmlDeviceGetClockInfo, handle, _CLOCK_SM),
            "memory_clock_mhz": _ask(nv.nvmlDeviceGetClockInfo, handle, _CLOCK_MEM),
            "memory_used_bytes": getattr(memory, "used", None),
            "memory_free_bytes": getattr(memory, "free", None),
            "memory_reserved_bytes": getattr(memory, "reserved", None),
            "ecc_corrected_total": _ask(nv.nvmlDeviceGetTotalEccErrors, handle, 0, 0),
            "ecc_uncorrected_total": _ask(nv.nvmlDeviceGetTotalEccErrors, handle, 1, 0),
            "retired_pages_pending": None if pending is None else bool(pending),
            "remapped_rows": None if not isinstance(remapped, tuple) else dict(zip(("correctable", "uncorrectable", "pending", "failure"), remapped, strict=False)),
            "throttle_reasons": _ask(nv.nvmlDeviceGetCurrentClocksThrottleReasons, handle),
            "pcie_replays_total": replays,
            "pcie_tx_bytes_total": pcie_tx,
            "pcie_rx_bytes_total": pcie_rx,
            "xid_errors": {str(xid): n for (gpu, xid), n in sorted(self._xids.items()) if gpu == index},
            "xid_last": self._last_xid.get(index),
        }
        return {"index": index, "counters": counters, "nvlinks": links}


def _field_int(value: Any) -> int | None:
    if getattr(value, "nvmlReturn", 1) != _NVML_SUCCESS:
        return None
    for member in ("ullVal", "ulVal", "uiVal", "sllVal", "siVal"):
        with contextlib.suppress(AttributeError):
            return int(getattr(value.value, member))
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    return float(value) if isinstance(value, (int, float)) else None


def parse_counters(data: dict) -> list[Series]:
    """One NVML counter sample (telemetry.json's ``nvml_counters``) -> series.  Fields
    NVML did not give (null, absent) are no series: absent, not zero."""
    out: list[Series] = []
    for raw in data.get("gpus") or []:
        if not isinstance(raw, dict) or not isinstance(raw.get("index"), int):
            raise SourceError("nvml counters: every gpu needs an integer 'index'")
        gpu = (("gpu", str(raw["index"])),)
        c = raw.get("counters") or {}

        def put(family: Family, value: Any, labels: tuple[tuple[str, str], ...] = gpu, times: float = 1, per: float = 1) -> None:
            number = _number(value)
            if number is not None:
                out.append((family.name, labels, number * times / per))  # per: 37 / 100 is 0.37, 37 * 0.01 is not

        put(TEMPERATURE, c.get("temperature_c"))
        put(MEMORY_TEMPERATURE, c.get("memory_temperature_c"))
        put(POWER, c.get("power_w"))
        put(POWER_LIMIT, c.get("power_limit_w"))
        put(ENERGY, c.get("energy_mj_total"), per=1000)  # NVML: millijoules
        put(UTILIZATION, c.get("utilization_gpu_percent"), per=100)
        put(MEMORY_UTILIZATION, c.get("utilization_memory_percent"), per=100)
        put(ENCODER_UTILIZATION, c.get("encoder_utilization_percent"), per=100)
        put(DECODER_UTILIZATION, c.get("decoder_utilization_percent"), per=100)
        put(SM_CLOCK, c.get("sm_clock_mhz"), times=1_000_000)  # NVML: MHz
        put(MEMORY_CLOCK, c.get("memory_clock_mhz"), times=1_000_000)
        put(MEMORY_USED, c.get("memory_used_bytes"))
        put(MEMORY_FREE, c.get("memory_free_bytes"))
        put(MEMORY_RESERVED, c.get("memory_reserved_bytes"))
        put(ECC_ERRORS, c.get("ecc_corrected_total"), (*gpu, ("type", "corrected")))
        put(ECC_ERRORS, c.get("ecc_uncorrected_total"), (*gpu, ("type", "uncorrected")))
        put(RETIRED_PAGES_PENDING, c.get("retired_pages_pending"))
        for state, value in sorted((c.get("remapped_rows") or {}).items()):
            put(REMAPPED_ROWS, value, (*gpu, ("state", state)))
        reasons = c.get("throttle_reasons")
        if isinstance(reasons, int) and not isinstance(reasons, bool):
            put(THROTTLE_MASK, reasons)
            for bit, reason in THROTTLE_REASONS.items():
                put(THROTTLE_REASON, 1 if reasons & bit else 0, (*gpu, ("reason", reason)))
        put(PCIE_REPLAYS, c.get("pcie_replays_total"))
        put(PCIE_TRANSMITTED, c.get("pcie_tx_bytes_total"))
        put(PCIE_RECEIVED, c.get("pcie_rx_bytes_total"))
        xids = c.get("xid_errors")
        if isinstance(xids, dict):
            # Actionable Xids are served from 0 from the first read on: their first event is
            # then a rise increase() sees (an alert on a series born at 1 sees none).  Other
            # Xids, mostly the application's own faults, appear at their first event.
            xids = {**dict.fromkeys(ACTIONABLE_XIDS, 0), **{str(k): v for k, v in xids.items()}}
            for xid, count in sorted(xids.items(), key=lambda kv: int(kv[0])):
                put(XID_ERRORS, count, (*gpu, ("xid", xid)))
            by_class = {"actionable": 0.0}  # the application class, like its Xids, from its first event
            for xid, count in xids.items():
                kind = "actionable" if xid in ACTIONABLE_XIDS else "application"
                by_class[kind] = by_class.get(kind, 0.0) + (_number(count) or 0.0)
            for kind, count in sorted(by_class.items()):
                put(XID_EVENTS, count, (*gpu, ("class", kind)))
        put(XID_LAST, c.get("xid_last"))
        for link in raw.get("nvlinks") or []:
            if not isinstance(link, dict) or not isinstance(link.get("link"), int):
                raise SourceError(f"nvml counters: gpu {raw['index']}: every nvlink needs an integer 'link'")
            at = (*gpu, ("link", str(link["link"])))
            put(NVLINK_TRANSMITTED, link.get("tx_bytes_total"), at)
            put(NVLINK_RECEIVED, link.get("rx_bytes_total"), at)
            for name, value in sorted((link.get("errors") or {}).items()):
                put(NVLINK_ERRORS, value, (*at, ("counter", name)))
    return out


def read_counters(context: Context) -> Any:
    """One live read of every GPU's counters; a recording replays its telemetry.json instead."""
    if context.host.live:
        return context.nvml.read()
    raise NoData(NO_NVML + " (this recording has no telemetry.json)")


COUNTERS = CounterSource("nvml_counters", read_counters, parse_counters, FAMILIES, THRESHOLDS)
