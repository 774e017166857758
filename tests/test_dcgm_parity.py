"""Our GPU series beside dcgm-exporter's default fields: the same NVML answers, the units
the README's table says, and that table rendered from the code."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from conftest import REPO

from topoagent.collectors import nvml
from topoagent.collectors.registry import FAMILIES

# One A100 as NVML answers (pynvml's return shapes), and what dcgm-exporter prints for
# the same answers in its units (DCGM reads NVML: MHz, %, C, W, mJ; framebuffer in MiB).
MIB = 1 << 20
NVML_ANSWERS = {"sm_clock_mhz": 1410, "memory_clock_mhz": 1215, "memory_temp_c": 47, "temperature_c": 52, "power_mw": 301_250,
                "energy_mj": 123_456_789, "util_gpu": 37, "util_memory": 12, "encoder": 3, "decoder": 9,
                "total": 40_960 * MIB, "reserved": 512 * MIB, "used": 20_000 * MIB, "free": 20_448 * MIB}
DCGM_SAYS = {"DCGM_FI_DEV_SM_CLOCK": 1410, "DCGM_FI_DEV_MEM_CLOCK": 1215, "DCGM_FI_DEV_MEMORY_TEMP": 47, "DCGM_FI_DEV_GPU_TEMP": 52,
             "DCGM_FI_DEV_POWER_USAGE": 301.25, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 123_456_789, "DCGM_FI_DEV_GPU_UTIL": 37,
             "DCGM_FI_DEV_MEM_COPY_UTIL": 12, "DCGM_FI_DEV_ENC_UTIL": 3, "DCGM_FI_DEV_DEC_UTIL": 9,
             "DCGM_FI_DEV_FB_FREE": 20_448, "DCGM_FI_DEV_FB_USED": 20_000, "DCGM_FI_DEV_FB_RESERVED": 512}


class FieldValue:
    def __init__(self, ok: bool, value: int = 0) -> None:
        self.nvmlReturn = 0 if ok else 3  # NVML_ERROR_NOT_SUPPORTED
        self.value = SimpleNamespace(uiVal=value)


def unsupported(*_: object) -> None:
    raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")


class Nvml(SimpleNamespace):
    """pynvml with every device call we give no answer for unsupported on this GPU."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("nvmlDevice"):
            return unsupported
        raise AttributeError(name)


def fake_pynvml(v1_only: bool = False) -> Nvml:
    a = NVML_ANSWERS

    def memory(handle: object, version: object = None) -> SimpleNamespace:
        if version is None:  # v1: used includes what the driver reserves, no reserved field
            return SimpleNamespace(total=a["total"], free=a["free"], used=a["used"] + a["reserved"])
        return SimpleNamespace(total=a["total"], free=a["free"], used=a["used"], reserved=a["reserved"])

    fake = Nvml(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlEventSetCreate=unsupported,
        nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: f"handle{i}",
        nvmlDeviceGetNvLinkState=unsupported,
        nvmlDeviceGetFieldValues=lambda h, ids: [FieldValue(i == nvml._FI_DEV_MEMORY_TEMP, a["memory_temp_c"]) for i in ids],
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=a["util_gpu"], memory=a["util_memory"]),
        nvmlDeviceGetEncoderUtilization=lambda h: [a["encoder"], 167_000],
        nvmlDeviceGetDecoderUtilization=lambda h: [a["decoder"], 167_000],
        nvmlDeviceGetClockInfo=lambda h, kind: {1: a["sm_clock_mhz"], 2: a["memory_clock_mhz"]}[kind],
        nvmlDeviceGetTotalEnergyConsumption=lambda h: a["energy_mj"],
        nvmlDeviceGetTemperature=lambda h, sensor: a["temperature_c"],
        nvmlDeviceGetPowerUsage=lambda h: a["power_mw"],
    )
    if not v1_only:
        fake.nvmlMemory_v2 = 0x2000028
    return fake


def live_series(monkeypatch, fake: Nvml) -> dict[str, float]:
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(nvml, "driver_present", lambda: True)
    reader = nvml.LiveCounterReader()
    try:
        raw = reader.read()
    finally:
        reader.close()
    return {metric + "".join(f'{{{k}="{v}"}}' for k, v in labels if k != "gpu"): value
            for metric, labels, value in nvml.parse_counters(raw)}


def test_each_field_nvml_gives_is_dcgms_value_times_the_tables_factor(monkeypatch):
    ours = live_series(monkeypatch, fake_pynvml())
    compared = 0
    for field in nvml.DCGM_FIELDS:
        if field.field not in DCGM_SAYS:
            continue
        assert field.family is not None, field.field
        assert ours[field.family.name + field.select] == pytest.approx(DCGM_SAYS[field.field] * float(field.factor)), field.field
        compared += 1
    assert compared == len(DCGM_SAYS) == 13


def test_memory_info_v1_still_gives_used_and_free_but_no_reserved(monkeypatch):
    ours = live_series(monkeypatch, fake_pynvml(v1_only=True))
    a = NVML_ANSWERS
    assert ours["gpu_memory_used_bytes"] == a["used"] + a["reserved"] and ours["gpu_memory_free_bytes"] == a["free"]
    assert "gpu_memory_reserved_bytes" not in ours


def test_a_field_nvml_does_not_give_is_no_series_not_zero(monkeypatch):
    fake = fake_pynvml()
    del fake.nvmlDeviceGetEncoderUtilization, fake.nvmlDeviceGetTotalEnergyConsumption
    fake.nvmlDeviceGetFieldValues = lambda h, ids: [FieldValue(False) for _ in ids]
    ours = live_series(monkeypatch, fake)
    for absent in ("gpu_encoder_utilization_ratio", "gpu_energy_joules_total", "gpu_memory_temperature_celsius"):
        assert absent not in ours
    assert ours["gpu_decoder_utilization_ratio"] == 0.09


def test_the_last_xid_is_dcgms_xid_field_and_the_classes_count_every_event(monkeypatch):
    """DCGM_FI_DEV_XID_ERRORS is the value of the last Xid the GPU raised: Xid 13, then 79
    reads 79; our classes count both (an application's 13, an actionable 79)."""
    fake = fake_pynvml()
    queued = [SimpleNamespace(device="handle0", eventData=13), SimpleNamespace(device="handle0", eventData=79)]

    def wait(event_set: object, timeout_ms: int) -> SimpleNamespace:
        if not queued:
            raise RuntimeError("NVML_ERROR_TIMEOUT")
        return queued.pop(0)

    fake.nvmlEventSetCreate = lambda: "events"
    fake.nvmlDeviceRegisterEvents = lambda handle, kinds, event_set: None
    fake.nvmlEventSetWait_v2 = wait
    fake.nvmlEventSetFree = lambda event_set: None
    ours = live_series(monkeypatch, fake)
    assert ours["gpu_xid_last"] == 79
    assert ours['gpu_xid_events_total{class="actionable"}'] == ours['gpu_xid_events_total{class="application"}'] == 1
    assert ours['gpu_xid_errors_total{xid="13"}'] == ours['gpu_xid_errors_total{xid="79"}'] == 1


def test_before_any_xid_the_actionable_class_reads_0_and_there_is_no_last_xid(monkeypatch):
    ours = live_series(monkeypatch, fake_pynvml())
    assert ours['gpu_xid_events_total{class="actionable"}'] == 0
    assert "gpu_xid_last" not in ours and 'gpu_xid_events_total{class="application"}' not in ours


def test_every_family_the_table_names_is_one_the_agent_serves():
    served = set(FAMILIES)
    for field in nvml.DCGM_FIELDS:
        assert field.family is None or field.family in served, field.field
        assert field.factor == "—" or float(field.factor) > 0, field.field


def test_the_telemetry_page_table_is_the_one_the_code_renders():
    page = (REPO / "docs" / "telemetry.md").read_text()
    start = page.index("<!-- dcgm-fields -->\n") + len("<!-- dcgm-fields -->\n")
    table = page[start:page.index("<!-- /dcgm-fields -->")]
    assert table == nvml.dcgm_table(), "docs/telemetry.md's DCGM table is out of date; paste collectors/nvml.py's dcgm_table() between its markers"
