"""The series budget at 128 GPUs (issue #29, item 3), on a real agent serving a generated
recording (tests/big_node.py: 16 hgx-h100 blocks, 128 GPUs, 128 ConnectX-7, 2,304 NVLinks).

Before: 56,644 series a scrape, 50k of them the pairwise levels (n x n) and one series per
NVLink.  By default those are now in /topology only, and NVLink series are per GPU.  Then
11,201, most of them one series per IB error counter, per Xid and per throttle reason: by
default now the counters the agent judges, the Xids by class, the throttle bitmask.  Then
6,085: settings (power limits, port rates), the video engines, corrected remaps, capacity by
job size and each device's PCIe link left the default page too.  [metrics] detail brings
each back."""

from __future__ import annotations

import gzip
import json
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.big_node import write_big_node
from tests.service_helpers import start_agent, wait_for
from topoagent.collectors import ib_counters, nvml
from topoagent.collectors.registry import FAMILIES
from topoagent.exporters.prometheus import SERVED_WITH_DETAIL, detail_table
from topoagent.service.served import etag_of
from topoagent.vocabulary import MetricsDetail

SNAPSHOTS = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots"
GPUS = NICS = 128
# Families [metrics] detail serves (the big node's count of each), none by default.
DETAIL = {"topoagent_gpu_xid_errors_total": GPUS * len(nvml.ACTIONABLE_XIDS), "topoagent_gpu_clock_throttle_reason": GPUS * 9,
          "topoagent_infiniband_port_transmitted_packets_total": NICS, "topoagent_infiniband_port_received_packets_total": NICS,
          "topoagent_pcie_link_speed_transfers_per_second": (GPUS + NICS) * 2, "topoagent_pcie_link_width_lanes": (GPUS + NICS) * 2,
          "topoagent_pcie_link_degraded": GPUS + NICS, "topoagent_gpu_power_limit_watts": GPUS,
          "topoagent_infiniband_port_rate_bytes_per_second": NICS, "topoagent_gpu_encoder_utilization_ratio": GPUS,
          "topoagent_gpu_decoder_utilization_ratio": GPUS}
# What a default scrape of the 128-GPU node may hold (issue #29: ~5,000): 4,933 when this was
# written, less than one per-GPU family (128) below it: a new default family comes with a cut.  Most of it is ~26 families of one series per GPU or port (dcgm-exporter's own
# defaults are ~3.2k for the GPUs alone); the largest are the judged IB error counters (4 a
# port) and AER by severity (2 a GPU or NIC).
BUDGET = 5_000
PAIRWISE = {"topoagent_gpu_pair_link_level": GPUS * (GPUS - 1) // 2,
            "topoagent_gpu_pair_expected_bandwidth_bytes_per_second": GPUS * (GPUS - 1) // 2,
            "topoagent_gpu_nic_link_level": GPUS * NICS}
FAST = "[telemetry]\ninterval_s = 0.5\n"
BIG_READY_S = 120  # the 128-GPU node's first discovery, on a loaded machine


@pytest.fixture(scope="module")
def big_node(tmp_path_factory):
    return write_big_node(tmp_path_factory.mktemp("big") / "hgx-h100-x16")


def scrape_with_counters(agent, timeout: float = 60) -> str:
    """/metrics once the NVML counters' first read is served (poll, never a fixed wait)."""
    deadline = time.monotonic() + timeout
    while True:
        text = agent.get("/metrics").body.decode()
        if 'collector="nvml_counters"' in text:
            return text
        assert time.monotonic() < deadline, "the counters were never served"
        time.sleep(0.2)


def families(text: str) -> Counter[str]:
    return Counter(line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#"))


def test_a_default_scrape_of_128_gpus_keeps_to_the_budget_and_topology_gzips_under_2_mb(tmp_path, big_node):
    agent = start_agent(tmp_path, root=big_node, config=FAST, ready_timeout=BIG_READY_S)
    try:
        text = scrape_with_counters(agent)
        plain = agent.get("/topology")
        zipped = agent.get("/topology", headers={"Accept-Encoding": "gzip"})
        again = agent.get("/topology", headers={"Accept-Encoding": "gzip", "If-None-Match": zipped.headers["etag"]})
    finally:
        agent.stop()
    count = families(text)
    assert count["topoagent_gpu_info"] == GPUS and count["topoagent_gpu_nvlinks_active"] == GPUS
    assert count["topoagent_nvlink_errors_total"] == GPUS * 2  # replay, recovery per GPU: those the agent judges
    assert count["topoagent_infiniband_port_errors_total"] == NICS * len(ib_counters.JUDGED)
    assert count["topoagent_gpu_xid_events_total"] == GPUS  # the actionable class, from 0
    assert count["topoagent_gpu_clock_throttle_reasons"] == GPUS
    # H100s: remapped rows (uncorrectable, pending, failure), no page-retirement status.
    assert count["topoagent_gpu_remapped_rows"] == GPUS * 3 and "topoagent_gpu_retired_pages_pending" not in count
    assert not set(PAIRWISE) & set(count) and "topoagent_nvlink_up" not in count
    assert not set(DETAIL) & set(count), set(DETAIL) & set(count)
    assert "topoagent_capacity_fits" not in count  # GET /capacity has it (and [metrics] detail "capacity")
    assert max(count.values()) <= 4 * (GPUS + NICS), count.most_common(3)  # a few per device, never n x n
    assert sum(count.values()) <= BUDGET, count.most_common(10)
    # /topology keeps every pairwise level; gzipped it is far from cluster-topology's 8 MiB cap.
    assert zipped.status == 200 and zipped.headers["content-encoding"] == "gzip" and "content-encoding" not in plain.headers
    assert len(zipped.body) < 2_000_000 < len(plain.body)
    # The very document the ETag names (a telemetry read may change it between two requests).
    assert etag_of(gzip.decompress(zipped.body))[:-1] + '-gzip"' == zipped.headers["etag"]
    # Its own ETag (another representation); a 304 for it unless a telemetry read changed the document since.
    assert zipped.headers["etag"].endswith('-gzip"') and zipped.headers["vary"] == "Accept-Encoding"
    assert again.status == 304 or again.headers["etag"] != zipped.headers["etag"]
    doc = json.loads(plain.body)
    assert len(doc["gpus"]) == GPUS


def test_the_opt_ins_bring_back_the_pairwise_per_link_and_detail_series(tmp_path, big_node):
    every = ", ".join(f'"{d}"' for d in MetricsDetail)
    agent = start_agent(tmp_path, root=big_node, config=FAST + f"[metrics]\npairwise = true\nper_link = true\ndetail = [{every}]\n",
                        ready_timeout=BIG_READY_S)
    try:
        count = families(scrape_with_counters(agent))
    finally:
        agent.stop()
    assert {name: count[name] for name in PAIRWISE} == PAIRWISE
    assert count["topoagent_nvlink_up"] == GPUS * 18 and count["topoagent_nvlink_errors_total"] == GPUS * 18 * 4
    assert {name: count[name] for name in DETAIL} == DETAIL
    assert count["topoagent_infiniband_port_errors_total"] == NICS * 15 and count["topoagent_pcie_aer_errors_total"] == (GPUS + NICS) * 3
    assert count["topoagent_gpu_ecc_errors_total"] == GPUS * 2 and count["topoagent_gpu_remapped_rows"] == GPUS * 4
    assert sum(count.values()) > 50_000  # the page the budget keeps from being the default


# What each [metrics] detail adds to the degraded recording's page: the families it serves
# whole, and nothing else.
ADDS = {
    MetricsDetail.XID: {"topoagent_gpu_xid_errors_total"},
    MetricsDetail.THROTTLE: {"topoagent_gpu_clock_throttle_reason"},
    MetricsDetail.ERRORS: {"topoagent_infiniband_port_errors_total", "topoagent_nvlink_errors_total", "topoagent_pcie_aer_errors_total",
                           "topoagent_gpu_ecc_errors_total", "topoagent_gpu_remapped_rows"},
    MetricsDetail.PACKETS: {"topoagent_infiniband_port_transmitted_packets_total", "topoagent_infiniband_port_received_packets_total"},
    MetricsDetail.PCIE_LINK: {"topoagent_pcie_link_degraded", "topoagent_pcie_link_speed_transfers_per_second", "topoagent_pcie_link_width_lanes"},
    MetricsDetail.SETTINGS: {"topoagent_gpu_power_limit_watts", "topoagent_infiniband_port_rate_bytes_per_second"},
    MetricsDetail.VIDEO: {"topoagent_gpu_encoder_utilization_ratio", "topoagent_gpu_decoder_utilization_ratio"},
    MetricsDetail.CAPACITY: {"topoagent_capacity_fits"},
}


def test_each_detail_brings_back_its_own_series_and_no_other(tmp_path):
    # One agent, its [metrics] changed by SIGHUP reloads: /metrics reads the config per page.
    agent = start_agent(tmp_path, root=SNAPSHOTS / "degraded", config=FAST)
    try:
        pages = {None: families(scrape_with_counters(agent))}
        for reloads, detail in enumerate(MetricsDetail, start=1):
            (tmp_path / "topoagent.toml").write_text(FAST + f'[metrics]\ndetail = ["{detail}"]\n')
            agent.proc.send_signal(signal.SIGHUP)
            wait_for(f"reload {reloads}", lambda n=reloads: agent.log().count("event=reloaded") >= n or None, agent, 30, 0.05)
            pages[detail] = families(scrape_with_counters(agent))
    finally:
        agent.stop()
    # Each family the exporter gates by a word (its names written there) is one a word here adds.
    assert {f"topoagent_{name}" for name in SERVED_WITH_DETAIL} <= set().union(*ADDS.values())
    default = pages.pop(None)
    for detail, count in pages.items():
        grown = {name for name in count if count[name] > default[name]}
        assert grown == ADDS[detail] and all(count[name] >= default[name] for name in default), (detail, grown)
    # The Xids and throttle reasons are summed up by default, never lost: one class, one bitmask.
    assert default["topoagent_gpu_xid_events_total"] == default["topoagent_gpu_clock_throttle_reasons"] == default["topoagent_gpu_info"]


def test_the_docs_table_of_detail_words_is_what_the_code_serves():
    """docs/telemetry.md's [metrics] detail table is rendered from the families' own
    declarations: a family that moves in or out of the default page moves there too."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "telemetry.md").read_text()
    table = text.split("<!-- metrics-detail -->\n", 1)[1].split("<!-- /metrics-detail -->", 1)[0]
    assert table == detail_table(FAMILIES), "docs/telemetry.md's detail table is out of date; paste exporters/prometheus.py's detail_table()"
