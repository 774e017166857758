"""NVML: GPUs, their NVLinks, P2P status and health — the only module that imports pynvml.

``read_live()`` asks the NVML library and answers in the ``nvml.json`` schema of
docs/snapshot-format.md; a replayed node serves the same dict from its recording, so
the rest of the agent sees one shape whichever way it came.  pynvml is imported only in
``NvmlSession.open``, so importing this module never needs the library.  Every NVML call
goes through ``NvmlSession.ask``: any one of them can be unsupported on a given GPU or
driver (the binding's ``NVMLError``: that field has no value), and anything else a call
raises is a fault of ours, raised for the collector to report as one.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from topoagent.collectors.base import CollectorResult, NoData, SourceError, off_loop, run_collector
from topoagent.collectors.counters import COUNTER, GAUGE, Context, CounterSource, Family, Series, Threshold, label_is
from topoagent.collectors.pci import PciParseError, normalize_address
from topoagent.node.cpulist import CpuListError, format_cpulist, parse_cpulist
from topoagent.node.host import Host
from topoagent.text import cut, machine_text
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
# written "unknown", with what NVML said (FabricUnknown): never taken as completed.
FABRIC_NOT_SUPPORTED, FABRIC_COMPLETED, FABRIC_UNKNOWN = "not_supported", "completed", "unknown"
_FABRIC_STATES = {0: FABRIC_NOT_SUPPORTED, 1: "not_started", 2: "in_progress", 3: FABRIC_COMPLETED}
_RECORDED_FABRIC_STATES = (*_FABRIC_STATES.values(), FABRIC_UNKNOWN)
UNNAMED_STATE, NVML_ERROR = "state", "error"  # FabricUnknown's kinds
_FABRIC_UNKNOWN_TEXT = re.compile(rf"({UNNAMED_STATE}|{NVML_ERROR}) (-?[0-9]{{1,20}})")


@dataclass(frozen=True, slots=True)
class FabricUnknown:
    """What NVML said where the fabric state is "unknown": a state number nvml.h does not
    name (UNNAMED_STATE) or an NVML error code (NVML_ERROR).  nvml.json writes it as its
    text, ``"state 7"`` or ``"error 4"``."""

    kind: str
    code: int

    def __str__(self) -> str:
        return f"{self.kind} {self.code}"


@dataclass(frozen=True, slots=True)
class GpuFabric:
    """nvmlDeviceGetGpuFabricInfo(V): the GPU's place in a multi-node NVLink fabric (GB200 NVL72)."""

    cluster_uuid: str | None  # the NVLink domain's cluster, "6f1e...-..."; None when all zero
    clique_id: int | None  # the partition (clique) within the cluster
    state: str | None  # "completed", "in_progress", "not_started", "not_supported", "unknown"
    status: int | None  # nvmlReturn_t of the registration: 0 = success
    unknown: FabricUnknown | None = None  # with state "unknown": what NVML said

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
    said = None
    if unknown is not None:
        match = _FABRIC_UNKNOWN_TEXT.fullmatch(unknown)
        if match is None:
            raise SourceError(f"{where}.unknown: {unknown[:40]!r} is not 'state N' or 'error N'")
        said = FabricUnknown(match[1], int(match[2]))
    return GpuFabric(
        cluster_uuid=None if uuid is None or not uuid.strip("0-") else uuid.lower(),  # all zero: no cluster
        clique_id=_field(raw, "clique_id", int, where),
        state=state,
        status=_field(raw, "status", int, where),
        unknown=said,
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
#
# Every NVML call goes through ``NvmlSession.ask``: the binding's own ``NVMLError`` is NVML's
# answer ("not supported", "GPU is lost", ...: that field has no value); any other exception
# is a fault of ours (a wrong signature, a handle used as a dict key) and is raised, with the
# call named, so the collector fails loudly as ``collector-error`` -- never read as a fact
# about the GPU.  Handles are ctypes pointers: not hashable, not comparable by value, so
# they are kept in lists by NVML index and matched by the address they point at.

# nvmlReturn_t codes that mean "this GPU or driver has no such answer".
NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND = 3, 13
_NO_ANSWER = frozenset({NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND})
# The library the binding loads (pynvml's _LoadNvmlLibrary on Linux).
NVML_LIBRARY = "libnvidia-ml.so.1"


def _text(value: object) -> str:
    """A string NVML answered, made safe where it enters (a recording's are, in Host.nvml)."""
    return machine_text(value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value))


def nvml_library_present() -> bool:
    """Whether NVML's library loads here: asked before importing pynvml, which costs a
    one-shot command on a node without GPUs a tenth of its start-up.  The library, not a
    driver file, is what the binding needs (a container gets the library from the NVIDIA
    runtime; a test suite puts its stand-in on the loader's path)."""
    import ctypes

    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return False
    return True


class NvmlSession:
    """NVML initialised, and the one way to call it (see above)."""

    def __init__(self, nv: Any) -> None:
        self.nv = nv

    @classmethod
    def open(cls) -> NvmlSession:
        """nvmlInit through the binding; NoData where there is no library, no binding or no
        driver (what NVML said, by the binding's own error)."""
        if not nvml_library_present():
            raise NoData(NO_NVML)
        try:
            import pynvml  # the only import of pynvml in the agent
        except ImportError:
            raise NoData(NO_NVML + " (nvidia-ml-py is not installed)") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:  # LibraryNotFound, DriverNotLoaded, NoPermission, ...
            raise NoData(f"{NO_NVML} (nvmlInit: {_said(exc)})") from None
        return cls(pynvml)

    def close(self) -> None:
        with contextlib.suppress(self.nv.NVMLError):  # already shut down, or the driver went away
            self.nv.nvmlShutdown()

    def ask(self, call: str, *args: Any) -> Any:
        """``pynvml.<call>(*args)``; None where NVML said no (``ask_with_code`` also gives its code)."""
        answer, _code = self.ask_with_code(call, *args)
        return answer

    def ask_with_code(self, call: str, *args: Any) -> tuple[Any, int | None]:
        """``(answer, None)``, or ``(None, nvmlReturn_t)`` where NVML said no."""
        try:
            return getattr(self.nv, call)(*args), None
        except self.nv.NVMLError as exc:
            return None, _code(exc)
        except Exception as exc:  # ours, not NVML's: raised, with the call named
            exc.add_note(f"in pynvml.{call}")
            raise

    def handles(self) -> list[Any]:
        """Each GPU's handle by NVML index (None where NVML gave none)."""
        count = self.ask("nvmlDeviceGetCount") or 0
        return [self.ask("nvmlDeviceGetHandleByIndex", i) for i in range(count)]


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)  # pynvml's NVMLError keeps the nvmlReturn_t in .value
    return value if isinstance(value, int) else None


def _said(exc: BaseException) -> str:
    code = _code(exc)
    return f"{exc} (error {code})" if code is not None else str(exc)


def handle_address(handle: Any) -> int:
    """What a handle points at: the one thing two handles of one GPU share."""
    import ctypes

    return ctypes.addressof(handle.contents)


def read_live() -> dict:
    """Ask the NVML library; NoData, saying why, where there is no library, binding or
    driver (as the counter reader says it)."""
    session = NvmlSession.open()
    try:
        return _read_all(session)
    finally:
        session.close()


def _read_all(nvml: NvmlSession) -> dict:
    ask = nvml.ask
    handles = nvml.handles()
    gpus = []
    for index, handle in enumerate(handles):
        if handle is None:
            continue
        pci = ask("nvmlDeviceGetPciInfo", handle)
        memory = _memory_info(nvml, handle)
        links = []
        for link in range(_MAX_NVLINKS):
            state = ask("nvmlDeviceGetNvLinkState", handle, link)
            if state is None:
                continue  # link does not exist on this GPU
            remote = ask("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
            remote_type = ask("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
            links.append(
                {
                    "link": link,
                    "active": bool(state),
                    "version": ask("nvmlDeviceGetNvLinkVersion", handle, link),
                    "remote_pci_bus_id": _bus_id(remote),
                    "remote_type": _REMOTE_TYPES.get(remote_type) if remote_type is not None else None,
                }
            )
        p2p = {}
        for peer_index, peer in enumerate(handles):
            if peer is None or peer_index == index:
                continue
            status = ask("nvmlDeviceGetP2PStatus", handle, peer, _P2P_CAPS_READ)
            if status is not None:
                p2p[str(peer_index)] = _P2P_STATUS.get(status, str(status))
        affinity = ask("nvmlDeviceGetCpuAffinity", handle, _AFFINITY_WORDS)
        ecc_u = ask("nvmlDeviceGetTotalEccErrors", handle, _ECC_UNCORRECTED, _ECC_VOLATILE)
        ecc_c = ask("nvmlDeviceGetTotalEccErrors", handle, _ECC_CORRECTED, _ECC_VOLATILE)
        power = ask("nvmlDeviceGetPowerUsage", handle)
        util = ask("nvmlDeviceGetUtilizationRates", handle)
        processes = ask("nvmlDeviceGetComputeRunningProcesses", handle) or []
        numa = ask("nvmlDeviceGetNumaNodeId", handle)
        gpus.append(
            {
                "index": index,
                "uuid": _maybe_text(ask("nvmlDeviceGetUUID", handle)),
                "name": _maybe_text(ask("nvmlDeviceGetName", handle)),
                "pci_bus_id": _bus_id(pci),
                "memory_total_bytes": getattr(memory, "total", None),
                "numa_node": numa if isinstance(numa, int) and numa >= 0 else None,
                "cpu_affinity": _affinity_to_cpulist(affinity),
                "nvlinks": links,
                "p2p": p2p,
                "fabric": _fabric_info(nvml, handle),
                "health": {
                    "temperature_c": ask("nvmlDeviceGetTemperature", handle, _TEMPERATURE_GPU),
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
        "driver_version": _maybe_text(ask("nvmlSystemGetDriverVersion")),
        "cuda_driver_version": ask("nvmlSystemGetCudaDriverVersion"),
        "nvml_version": _maybe_text(ask("nvmlSystemGetNVMLVersion")),
        "gpus": gpus,
    }


_AFFINITY_WORDS = 64  # 64-bit words of CPU affinity asked: 4,096 CPUs


def _fabric_info(nvml: NvmlSession, handle: Any) -> dict | None:
    """The GPU's fabric answer in nvml.json's shape.  The binding fills a struct the caller
    makes, passed by reference: ``nvmlDeviceGetGpuFabricInfoV`` (R550+, versioned), else the
    first form on a driver without it.  None where NVML has no answer (not supported, a
    driver before R535); "unknown", with NVML's code, for any other NVML error."""
    from ctypes import byref

    nv = nvml.nv
    info = nv.c_nvmlGpuFabricInfoV_t()
    _, code = nvml.ask_with_code("nvmlDeviceGetGpuFabricInfoV", handle, byref(info))
    if code == NVML_ERROR_FUNCTION_NOT_FOUND:
        info = nv.c_nvmlGpuFabricInfo_t()
        _, code = nvml.ask_with_code("nvmlDeviceGetGpuFabricInfo", handle, byref(info))
    if code in _NO_ANSWER:
        return None
    if code is not None:
        return {"cluster_uuid": None, "clique_id": None, "state": FABRIC_UNKNOWN, "status": None,
                "unknown": str(FabricUnknown(NVML_ERROR, code))}
    return _fabric_answer(info)


def _fabric_answer(info: object) -> dict | None:
    """nvmlGpuFabricInfo_t -> nvml.json's ``fabric``; clusterUuid's 16 bytes as a UUID."""
    if info is None:
        return None
    raw = getattr(info, "clusterUuid", None)
    digits = bytes(bytearray(raw)).hex() if raw is not None else None
    uuid = None
    if digits is not None and len(digits) == 32 and digits.strip("0"):  # all zero: no cluster
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
    if isinstance(state, int) and state not in _FABRIC_STATES:
        answer["unknown"] = str(FabricUnknown(UNNAMED_STATE, state))
    return answer


def _memory_info(nvml: NvmlSession, handle: Any) -> Any:
    """nvmlDeviceGetMemoryInfo_v2 where the driver has it (R510+): its ``used`` leaves out
    the memory the driver reserves, and ``reserved`` says how much, as DCGM's FB_USED and
    FB_RESERVED do; else v1, whose ``used`` includes the reserved part and has no ``reserved``."""
    answer = nvml.ask("nvmlDeviceGetMemoryInfo", handle, nvml.nv.nvmlMemory_v2)
    if answer is not None:
        return answer
    return nvml.ask("nvmlDeviceGetMemoryInfo", handle)


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
    try:
        nvml = NvmlSession.open()
    except NoData:
        return None
    try:
        gpus = []
        for index, handle in enumerate(nvml.handles()):
            if handle is None:
                continue
            util = nvml.ask("nvmlDeviceGetUtilizationRates", handle)
            processes = nvml.ask("nvmlDeviceGetComputeRunningProcesses", handle) or []
            gpus.append({"index": index, "health": {
                "utilization_gpu_percent": getattr(util, "gpu", None),
                "processes": [getattr(p, "pid", None) for p in processes],
            }})
        return {"gpus": gpus}
    finally:
        nvml.close()


@dataclass(frozen=True, slots=True)
class GpuActivityReading:
    """What one GPU runs now, as NVML says; the agent reads it between discoveries."""

    index: int
    utilization_percent: float | None
    processes: tuple[int, ...]  # PIDs of compute processes (0: one NVML could not name)


def read_activity(host: Host) -> tuple[GpuActivityReading, ...] | None:
    """What each GPU runs now; a replayed node answers from its recording.  None when
    the node has no NVML.  Blocking: call it off the event loop."""
    try:
        data = read_live_activity() if host.live else recorded_nvml(host)
    except NoData:
        return None
    if data is None:
        return None
    info = parse_nvml(data)
    return tuple(GpuActivityReading(g.index, g.utilization_percent, g.processes) for g in info.gpus)


_NO_DATA_MAX_CHARS = 500  # nvmlInit's error is one short line


def recorded_nvml(host: Host) -> dict | None:
    """A recording's NVML answers; None where it has none (an older recording of a node
    without NVML); NoData, in the words the live reader said, where it recorded why NVML
    was absent (``{"no_data": why}``)."""
    data = host.nvml()
    if data is None or "no_data" not in data:
        return data
    why = data["no_data"]
    if not isinstance(why, str) or not why or len(why) > _NO_DATA_MAX_CHARS:
        raise SourceError(f"nvml.json: 'no_data' must be text of 1 to {_NO_DATA_MAX_CHARS} characters")
    raise NoData(why)


# --- collector -----------------------------------------------------------------------


async def collect(host: Host) -> CollectorResult[NvmlInfo]:
    async def read() -> tuple[NvmlInfo, tuple[str, ...]]:
        data: dict | None
        if host.live:
            try:
                data = await off_loop(read_live)
            except NoData as exc:
                # A snapshot keeps why, for its replay to say: cut to what the replay reads back.
                why = cut(str(exc), _NO_DATA_MAX_CHARS)
                host.note_nvml({"no_data": why})
                raise NoData(why) from None
            host.note_nvml(data)
        else:
            data = recorded_nvml(host)
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
_TEMPERATURE_GPU = 0  # nvmlTemperatureSensors_t
_ECC_CORRECTED, _ECC_UNCORRECTED, _ECC_VOLATILE = 0, 1, 0  # nvmlMemoryErrorType_t, nvmlEccCounterType_t
_P2P_CAPS_READ = 0  # nvmlGpuP2PCapsIndex_t
# nvmlNvLinkErrorCounter_t -> the `counter` label
_NVLINK_ERRORS = {0: "replay", 1: "recovery", 2: "crc_flit", 3: "crc_data"}
_EVENT_XID = 0x8  # nvmlEventTypeXidCriticalError
_NVML_SUCCESS = 0
# nvmlClocksEventReason* bits (formerly "throttle reasons") -> the `reason` label
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
        self._nvml: NvmlSession | None = None
        self._events: Any = None
        self._xids: dict[tuple[int, int], int] = {}
        self._last_xid: dict[int, int] = {}  # GPU index -> its last Xid

    def _open(self) -> NvmlSession:
        if self._nvml is None:
            nvml = NvmlSession.open()
            self._nvml = nvml
            self._events = nvml.ask("nvmlEventSetCreate")
            if self._events is not None:
                for handle in nvml.handles():
                    if handle is not None:  # a GPU without Xid events (NOT_SUPPORTED) is simply not registered
                        nvml.ask("nvmlDeviceRegisterEvents", handle, _EVENT_XID, self._events)
        return self._nvml

    def close(self) -> None:
        if self._nvml is not None:
            if self._events is not None:
                self._nvml.ask("nvmlEventSetFree", self._events)
            self._nvml.close()
        self._nvml = self._events = None

    def _drain_events(self, nvml: NvmlSession, index_of: dict[int, int]) -> None:
        """Count the Xids queued since the last read.  A zero timeout returns what is
        queued; NVML answers TIMEOUT (or any other error) when nothing more is."""
        for _ in range(10_000):
            event = nvml.ask("nvmlEventSetWait_v2", self._events, 0)
            if event is None:
                return
            index = index_of.get(handle_address(event.device), -1)
            key = (index, int(event.eventData))
            self._xids[key] = self._xids.get(key, 0) + 1
            self._last_xid[index] = key[1]

    def read(self) -> dict:
        nvml = self._open()
        handles = nvml.handles()
        if self._events is not None:
            self._drain_events(nvml, {handle_address(h): i for i, h in enumerate(handles) if h is not None})
        return {"gpus": [self._gpu(nvml, index, handle) for index, handle in enumerate(handles) if handle is not None]}

    def _gpu(self, nvml: NvmlSession, index: int, handle: Any) -> dict:
        ask = nvml.ask

        def field_values(ids: list[Any]) -> list[int | None]:
            values = ask("nvmlDeviceGetFieldValues", handle, ids)
            if values is None:
                return [None] * len(ids)
            return [_field_int(v) for v in values]

        links = []
        for link in range(_MAX_NVLINKS):
            if ask("nvmlDeviceGetNvLinkState", handle, link) is None:
                continue
            tx, rx = field_values([(_FI_NVLINK_THROUGHPUT_DATA_TX, link), (_FI_NVLINK_THROUGHPUT_DATA_RX, link)])
            errors = {name: ask("nvmlDeviceGetNvLinkErrorCounter", handle, link, code) for code, name in _NVLINK_ERRORS.items()}
            links.append({"link": link, "tx_bytes_total": None if tx is None else tx * 1024,
                          "rx_bytes_total": None if rx is None else rx * 1024, "errors": errors})
        replays, pcie_tx, pcie_rx, memory_temp = field_values(
            [_FI_PCIE_REPLAY_COUNTER, _FI_PCIE_COUNT_TX_BYTES, _FI_PCIE_COUNT_RX_BYTES, _FI_DEV_MEMORY_TEMP])
        memory = _memory_info(nvml, handle)
        util = ask("nvmlDeviceGetUtilizationRates", handle)
        encoder = ask("nvmlDeviceGetEncoderUtilization", handle)  # [percent, sampling period in µs]
        decoder = ask("nvmlDeviceGetDecoderUtilization", handle)
        power = ask("nvmlDeviceGetPowerUsage", handle)
        limit = ask("nvmlDeviceGetEnforcedPowerLimit", handle)
        remapped = ask("nvmlDeviceGetRemappedRows", handle)  # (correctable, uncorrectable, pending, failure)
        pending = ask("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        counters = {
            "temperature_c": ask("nvmlDeviceGetTemperature", handle, _TEMPERATURE_GPU),
            "power_w": power / 1000.0 if isinstance(power, (int, float)) else None,
            "power_limit_w": limit / 1000.0 if isinstance(limit, (int, float)) else None,
            "memory_temperature_c": memory_temp,
            "energy_mj_total": ask("nvmlDeviceGetTotalEnergyConsumption", handle),
            "utilization_gpu_percent": getattr(util, "gpu", None),
            "utilization_memory_percent": getattr(util, "memory", None),
            "encoder_utilization_percent": encoder[0] if isinstance(encoder, list) and encoder else None,
            "decoder_utilization_percent": decoder[0] if isinstance(decoder, list) and decoder else None,
            "sm_clock_mhz": ask("nvmlDeviceGetClockInfo", handle, _CLOCK_SM),
            "memory_clock_mhz": ask("nvmlDeviceGetClockInfo", handle, _CLOCK_MEM),
            "memory_used_bytes": getattr(memory, "used", None),
            "memory_free_bytes": getattr(memory, "free", None),
            "memory_reserved_bytes": getattr(memory, "reserved", None),
            "ecc_corrected_total": ask("nvmlDeviceGetTotalEccErrors", handle, _ECC_CORRECTED, _ECC_VOLATILE),
            "ecc_uncorrected_total": ask("nvmlDeviceGetTotalEccErrors", handle, _ECC_UNCORRECTED, _ECC_VOLATILE),
            "retired_pages_pending": None if pending is None else bool(pending),
            "remapped_rows": None if not isinstance(remapped, tuple) else dict(zip(("correctable", "uncorrectable", "pending", "failure"), remapped, strict=False)),
            # The "event reasons" name; "throttle reasons" is its deprecated alias (R535+).
            "throttle_reasons": ask("nvmlDeviceGetCurrentClocksEventReasons", handle),
            "pcie_replays_total": replays,
            "pcie_tx_bytes_total": pcie_tx,
            "pcie_rx_bytes_total": pcie_rx,
            "xid_errors": {str(xid): n for (gpu, xid), n in sorted(self._xids.items()) if gpu == index},
            "xid_last": self._last_xid.get(index),
        }
        return {"index": index, "counters": counters, "nvlinks": links}


# nvmlValueType_t -> the member of nvmlValue_t the driver wrote (a union: reading another
# member reads bytes it did not write).
_FIELD_MEMBERS = {1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}


def _field_int(value: Any) -> int | None:
    if value.nvmlReturn != _NVML_SUCCESS:
        return None
    member = _FIELD_MEMBERS.get(value.valueType)
    if member is None:  # a double, or a type this reader does not know: no integer
        return None
    return int(getattr(value.value, member))


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
