"""Our GPU series beside dcgm-exporter's default fields: the same NVML answers, the units
the README's table says, and that table rendered from the code."""

from __future__ import annotations

import pytest
from conftest import REPO
from nvml_stub import recording

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


def stub_answers(nvml_stub) -> None:
    """The suite's NVML (a C-ABI stand-in under the real nvidia-ml-py) answering NVML_ANSWERS
    for the real H200's GPU: only what dcgm-exporter's defaults read, the rest unsupported."""
    a = NVML_ANSWERS
    recorded, _ = recording(REPO / "fixtures" / "snapshots" / "h200-vm")
    recorded["gpus"][0]["health"] = {"memory_used_bytes": a["used"], "memory_free_bytes": a["free"],
                                     "memory_reserved_bytes": a["reserved"]}
    recorded["gpus"][0]["memory_total_bytes"] = a["total"]
    counters = {"index": 0, "counters": {
        "sm_clock_mhz": a["sm_clock_mhz"], "memory_clock_mhz": a["memory_clock_mhz"], "memory_temperature_c": a["memory_temp_c"],
        "temperature_c": a["temperature_c"], "power_w": a["power_mw"] / 1000, "energy_mj_total": a["energy_mj"],
        "utilization_gpu_percent": a["util_gpu"], "utilization_memory_percent": a["util_memory"],
        "encoder_utilization_percent": a["encoder"], "decoder_utilization_percent": a["decoder"]}}
    nvml_stub.serve(recorded, {"gpus": [counters]})


def live_series() -> dict[str, float]:
    reader = nvml.LiveCounterReader()
    try:
        raw = reader.read()
    finally:
        reader.close()
    return {metric + "".join(f'{{{k}="{v}"}}' for k, v in labels if k != "gpu"): value
            for metric, labels, value in nvml.parse_counters(raw)}


def test_each_field_nvml_gives_is_dcgms_value_times_the_tables_factor(nvml_stub):
    stub_answers(nvml_stub)
    ours = live_series()
    compared = 0
    for field in nvml.DCGM_FIELDS:
        if field.field not in DCGM_SAYS:
            continue
        assert field.family is not None, field.field
        assert ours[field.family.name + field.select] == pytest.approx(DCGM_SAYS[field.field] * float(field.factor)), field.field
        compared += 1
    assert compared == len(DCGM_SAYS) == 13


def test_a_field_nvml_does_not_give_is_no_series_not_zero(nvml_stub):
    stub_answers(nvml_stub)
    ours = live_series()
    for absent in ("gpu_power_limit_watts", "gpu_clock_throttle_reasons", "pcie_replays_total"):
        assert absent not in ours
    assert ours["gpu_decoder_utilization_ratio"] == 0.09


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
