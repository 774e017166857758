"""The series budget at 128 GPUs (issue #29, item 3), on a real agent serving a generated
recording (tests/big_node.py: 16 hgx-h100 blocks, 128 GPUs, 128 ConnectX-7, 2,304 NVLinks).

Before: 56,644 series a scrape, 50k of them the pairwise levels (n x n) and one series per
NVLink.  By default those are now in /topology only, and NVLink series are per GPU."""

from __future__ import annotations

import gzip
import json
import time
from collections import Counter

import pytest

from tests.big_node import write_big_node
from tests.service_helpers import start_agent
from topoagent.service.served import etag_of

GPUS = NICS = 128
# What a default scrape of the 128-GPU node may hold: about 11.3k when this was written
# (docs/telemetry.md, figures:series), with room for a few new per-GPU families.  The largest left are
# per port or per GPU (IB error counters, Xids from 0, throttle reasons), none n x n.
BUDGET = 12_000
PAIRWISE = {"topoagent_gpu_pair_link_level": GPUS * (GPUS - 1) // 2,
            "topoagent_gpu_pair_expected_bandwidth_bytes_per_second": GPUS * (GPUS - 1) // 2,
            "topoagent_gpu_nic_link_level": GPUS * NICS}
FAST = "[telemetry]\ninterval_s = 0.5\n"


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
    agent = start_agent(tmp_path, root=big_node, config=FAST)
    try:
        text = scrape_with_counters(agent)
        plain = agent.get("/topology")
        zipped = agent.get("/topology", headers={"Accept-Encoding": "gzip"})
        again = agent.get("/topology", headers={"Accept-Encoding": "gzip", "If-None-Match": zipped.headers["etag"]})
    finally:
        agent.stop()
    count = families(text)
    assert count["topoagent_gpu_info"] == GPUS and count["topoagent_gpu_nvlinks_active"] == GPUS
    assert count["topoagent_nvlink_errors_total"] == GPUS * 4  # replay, recovery, crc_flit, crc_data per GPU
    assert not set(PAIRWISE) & set(count) and "topoagent_nvlink_up" not in count
    assert max(count.values()) <= 15 * NICS, count.most_common(3)  # per GPU or per port, never n x n
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


def test_the_opt_ins_bring_back_the_pairwise_and_per_link_series(tmp_path, big_node):
    agent = start_agent(tmp_path, root=big_node, config=FAST + "[metrics]\npairwise = true\nper_link = true\n")
    try:
        count = families(scrape_with_counters(agent))
    finally:
        agent.stop()
    assert {name: count[name] for name in PAIRWISE} == PAIRWISE
    assert count["topoagent_nvlink_up"] == GPUS * 18 and count["topoagent_nvlink_errors_total"] == GPUS * 18 * 4
    assert sum(count.values()) > 50_000  # the page the budget keeps from being the default
