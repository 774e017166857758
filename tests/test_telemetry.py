"""Telemetry: counters read on their own interval, rates, findings, recorded samples.

Against the fixtures' telemetry.json (two samples 10 s apart; the degraded node's error
counters rise between them) through a real `topoagent serve` child, and the pure parts
(sysfs parsers, the rate rule) on their own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES, REAL_NODES, REPO
from schema_check import OPENAPI
from service_helpers import metric_value, promtool_complaints, start_agent, wait_for, wedge

from topoagent.collectors import aer, ib_counters, nvml
from topoagent.collectors.registry import FAMILIES
from topoagent.service.telemetry import THRESHOLDS, History, Sample, rate
from topoagent.vocabulary import MetricsDetail

SNAPSHOTS = FIXTURES / "snapshots"
FAST = "[telemetry]\ninterval_s = 0.2\n"


def samples_of(root: Path) -> list[dict]:
    return json.loads((root / "telemetry.json").read_text())["samples"]


def scrape_with_telemetry(agent, timeout: float = 20) -> str:
    """/metrics once the telemetry loop has served its first read."""
    def page() -> str | None:
        text = agent.get("/metrics").body.decode()
        return text if 'collector="pcie_aer"' in text else None

    return wait_for("the counters' first read on /metrics", page, agent, timeout=timeout)


def telemetry_findings(agent) -> list[dict]:
    return [f for f in agent.get("/topology").json()["findings"] if f["source"] == "telemetry"]


# --- the pure parts ----------------------------------------------------------------------


def test_a_counter_that_went_down_has_no_rate_never_a_negative_one():
    assert rate(100, 160, 10) == 6.0
    assert rate(2**32 - 10, 5, 10) is None  # reset (or wrap): no rate for that interval
    assert rate(7, 7, 10) == 0.0  # a saturated counter reads 0/s
    history = History()

    def parse(raw):
        return [("infiniband_port_errors_total", (("device", "mlx5_0"), ("port", "1"), ("counter", "symbol_error")), raw)]

    for taken, value in ((0.0, 50.0), (10.0, 3.0), (20.0, 13.0)):
        history.add(Sample("infiniband_counters", taken, value), parse)
        [reading] = history.readings()
        assert reading.rate_per_s is None or reading.rate_per_s >= 0
    assert reading.rate_per_s == 1.0  # after the reset, the next interval has a rate again


def test_a_series_read_again_keeps_its_rate_and_one_copy_of_its_labels():
    # A 128-GPU node holds 22,784 series in each of its last two samples: the second sample
    # of a series reuses the first one's label tuples instead of holding a copy of its own.
    history = History()

    def parse(raw):
        return [("gpu_energy_joules_total", (("gpu", str(gpu)),), value) for gpu, value in raw]

    history.add(Sample("nvml_counters", 0.0, [(0, 10.0), (1, 20.0)]), parse)
    first = {r.labels: r.labels for r in history.readings()}
    history.add(Sample("nvml_counters", 10.0, [(0, 30.0), (1, 20.0)]), parse)
    second = history.readings()
    assert [(r.labels, r.value, r.rate_per_s) for r in second] == [((("gpu", "0"),), 30.0, 2.0), ((("gpu", "1"),), 20.0, 0.0)]
    assert all(r.labels is first[r.labels] for r in second)
    history.add(Sample("nvml_counters", 20.0, [(0, 50.0), (2, 5.0)]), parse)  # GPU 1 gone, GPU 2 new
    third = [(r.labels, r.value, r.rate_per_s) for r in history.readings()]
    assert third == [((("gpu", "0"),), 50.0, 2.0), ((("gpu", "2"),), 5.0, None)]


def test_ib_data_counters_are_words_and_errors_keep_their_sysfs_name():
    raw = {"mlx5_0/1/counters/port_xmit_data": "250\n", "mlx5_0/1/counters/symbol_error": "7\n",
           "mlx5_0/1/hw_counters/out_of_buffer": "2\n", "mlx5_0/1/hw_counters/rx_write_requests": "9\n",
           "mlx5_0/1/counters/unicast_xmit_packets": "4\n", "mlx5_0/1/hw_counters/lifespan": "N/A\n"}
    got = {(m, dict(labels).get("counter")): v for m, labels, v in ib_counters.parse(raw)}
    assert got == {("infiniband_port_transmitted_bytes_total", None): 1000.0,
                   ("infiniband_port_errors_total", "symbol_error"): 7.0,
                   ("infiniband_port_errors_total", "out_of_buffer"): 2.0}


def test_aer_totals_come_from_the_total_line():
    gpu1 = json.loads((SNAPSHOTS / "degraded" / "nvml.json").read_text())["gpus"][1]["pci_bus_id"]
    second = samples_of(SNAPSHOTS / "degraded")[1]["sources"]["pcie_aer"]
    series = {(dict(labels)["device"], dict(labels)["severity"]): v for _, labels, v in aer.parse(second)}
    assert series[(gpu1, "nonfatal")] == 3.0
    assert series[(gpu1, "fatal")] == 0.0
    assert aer.parse_total("RxErr 2\nBadTLP 1\nTOTAL_ERR_COR 3\n") == 3
    assert aer.parse_total("RxErr 2\nBadTLP 1\n") == 3  # an older kernel without the total line


# --- a real agent on the recorded nodes ----------------------------------------------------


def test_every_telemetry_family_is_served_with_the_recorded_values(tmp_path):
    # Every [metrics] detail on: the families served only with it are served too.
    detail = ", ".join(f'"{d}"' for d in MetricsDetail)
    agent = start_agent(tmp_path, root=SNAPSHOTS / "degraded", config=FAST + f"[metrics]\ndetail = [{detail}]\n")
    try:
        text = scrape_with_telemetry(agent)
    finally:
        agent.stop()
    # H100s answer row remapping, not page retirement: every other family is served.
    for family in FAMILIES:
        assert (f"\ntopoagent_{family.name}{{" in text) == (family is not nvml.RETIRED_PAGES_PENDING), family.name
    last = samples_of(SNAPSHOTS / "degraded")[1]["sources"]
    words = int(last["infiniband_counters"]["mlx5_2/1/counters/port_xmit_data"])
    assert metric_value(text, "topoagent_infiniband_port_transmitted_bytes_total", {"device": "mlx5_2", "port": "1"}) == 4 * words
    assert metric_value(text, "topoagent_infiniband_port_errors_total", {"device": "mlx5_2", "counter": "symbol_error"}) == 40
    assert metric_value(text, "topoagent_gpu_xid_errors_total", {"gpu": "6", "xid": "79"}) == 1
    assert metric_value(text, "topoagent_gpu_xid_events_total", {"gpu": "6", "class": "actionable"}) == 1
    assert metric_value(text, "topoagent_gpu_xid_last", {"gpu": "6"}) == 79
    # NVLink counters are per GPU by default: the recorded links' sum, no `link` label.
    gpu2 = next(g for g in last["nvml_counters"]["gpus"] if g["index"] == 2)
    recoveries = sum(link["errors"]["recovery"] for link in gpu2["nvlinks"])
    assert recoveries >= 1 and metric_value(text, "topoagent_nvlink_errors_total", {"gpu": "2", "counter": "recovery"}) == recoveries
    assert 'link="' not in "".join(line for line in text.splitlines() if line.startswith("topoagent_nvlink_"))
    assert metric_value(text, "topoagent_gpu_clock_throttle_reason", {"gpu": "0", "reason": "gpu_idle"}) == 1
    assert metric_value(text, "topoagent_gpu_clock_throttle_reasons", {"gpu": "0"}) == 1  # the bitmask: gpu_idle is 0x1
    for source in ("infiniband_counters", "pcie_aer", "nvml_counters"):
        assert metric_value(text, "topoagent_collector_success", {"collector": source}) == 1
    assert promtool_complaints(text.encode()) == []


def test_a_v100_node_serves_page_retirement_and_no_remapped_rows(tmp_path):
    """Volta retires pages; row remapping came with Ampere: NVML answers one or the other."""
    agent = start_agent(tmp_path, root=SNAPSHOTS / "dgx1-v100", config=FAST)

    def counters_served() -> str | None:
        page = agent.get("/metrics").body.decode()
        return page if 'collector="nvml_counters"' in page else None

    try:
        text = wait_for("the NVML counters served", counters_served, agent, 60, 0.1)
    finally:
        agent.stop()
    assert [metric_value(text, "topoagent_gpu_retired_pages_pending", {"gpu": str(g)}) for g in range(8)] == [0] * 8
    assert "\ntopoagent_gpu_remapped_rows{" not in text


def test_per_link_serves_each_nvlinks_own_counters(tmp_path):
    agent = start_agent(tmp_path, root=SNAPSHOTS / "degraded", config=FAST + "[metrics]\nper_link = true\n")
    try:
        text = scrape_with_telemetry(agent)
    finally:
        agent.stop()
    gpu2 = next(g for g in samples_of(SNAPSHOTS / "degraded")[1]["sources"]["nvml_counters"]["gpus"] if g["index"] == 2)
    for link in gpu2["nvlinks"]:
        labels = {"gpu": "2", "link": str(link["link"]), "counter": "recovery"}
        assert metric_value(text, "topoagent_nvlink_errors_total", labels) == link["errors"]["recovery"], labels
    assert metric_value(text, "topoagent_nvlink_up", {"gpu": "2", "link": "3"}) == 1


def test_rising_errors_become_findings_with_the_rate_of_the_two_samples(tmp_path):
    first, second = samples_of(SNAPSHOTS / "degraded")
    seconds = second["monotonic_s"] - first["monotonic_s"]

    def ib(sample, name):
        return int(sample["sources"]["infiniband_counters"][f"mlx5_2/1/counters/{name}"])

    agent = start_agent(tmp_path, root=SNAPSHOTS / "degraded", config=FAST)
    try:
        scrape_with_telemetry(agent)
        findings = telemetry_findings(agent)
        metrics = agent.get("/metrics").body.decode()
    finally:
        agent.stop()
    got = {(f["kind"], f["subject"], f["severity"]): f["rate_per_s"] for f in findings}
    assert got == {
        ("ib-errors-rising", "mlx5_2 port 1", "warning"): (ib(second, "symbol_error") - ib(first, "symbol_error")) / seconds,
        ("ib-errors-rising", "mlx5_2 port 1", "critical"): (ib(second, "link_downed") - ib(first, "link_downed")) / seconds,
        ("nvlink-errors-rising", "GPU2 NVLink 3", "warning"): 0.5,
        ("nvlink-errors-rising", "GPU2 NVLink 3", "critical"): 0.1,
        ("pcie-aer-errors", "GPU1", "warning"): 0.3,
        ("gpu-xid", "GPU6", "critical"): 0.1,
        ("gpu-ecc-uncorrected", "GPU6", "critical"): 0.2,
        ("gpu-row-remap-failed", "GPU4", "critical"): None,
    }
    # Every rule of the table that the fixture exercises raised its finding kind.
    assert {f["kind"] for f in findings} == {str(t.kind) for t in THRESHOLDS}
    assert metric_value(metrics, "topoagent_findings", {"kind": "gpu-xid", "severity": "critical"}) == 1


def test_a_healthy_node_has_traffic_rates_but_no_telemetry_findings(tmp_path):
    agent = start_agent(tmp_path, root=SNAPSHOTS / "dgx-a100", config=FAST)
    try:
        text = scrape_with_telemetry(agent)
        findings = telemetry_findings(agent)
    finally:
        agent.stop()
    assert findings == []
    assert metric_value(text, "topoagent_infiniband_port_transmitted_bytes_total", {"device": "mlx5_0"}) is not None


def test_the_telemetry_page_documents_every_threshold():
    page = (REPO / "docs" / "telemetry.md").read_text()
    for rule in THRESHOLDS:
        assert f"| `{rule.key}` |" in page, rule.key


def test_thresholds_are_set_in_the_config(tmp_path):
    config = FAST + "symbol_error_per_s = 5\nlink_downed_per_s = 1\n"
    agent = start_agent(tmp_path, root=SNAPSHOTS / "degraded", config=config)
    try:
        scrape_with_telemetry(agent)
        kinds = {(f["kind"], f["subject"]) for f in telemetry_findings(agent)}
    finally:
        agent.stop()
    assert ("ib-errors-rising", "mlx5_2 port 1") not in kinds  # 2.8/s and 0.1/s are under them now
    assert ("gpu-xid", "GPU6") in kinds


def test_a_failing_source_fails_alone(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(SNAPSHOTS / "degraded", root, symlinks=True)
    document = json.loads((root / "telemetry.json").read_text())
    for sample in document["samples"]:
        sample["sources"]["nvml_counters"] = {"gpus": [{"no": "index"}]}
    (root / "telemetry.json").write_text(json.dumps(document))
    agent = start_agent(tmp_path, root=root, config=FAST)
    try:
        text = scrape_with_telemetry(agent)
    finally:
        agent.stop()
    assert metric_value(text, "topoagent_collector_success", {"collector": "nvml_counters"}) == 0
    assert metric_value(text, "topoagent_collector_success", {"collector": "infiniband_counters"}) == 1
    assert metric_value(text, "topoagent_infiniband_port_errors_total", {"device": "mlx5_2", "counter": "link_downed"}) == 2


def test_a_hung_source_times_out_alone_and_metrics_still_answer(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(SNAPSHOTS / "dgx-a100", root, symlinks=True)
    (root / "telemetry.json").unlink()  # read the recorded sysfs, as live
    counters = (root / "sys/class/infiniband/mlx5_0").resolve() / "ports" / "1" / "counters"
    counters.mkdir(parents=True)
    wedge(root, counters / "symbol_error")  # a read that never returns, like a wedged device
    agent = start_agent(tmp_path, root=root, config=FAST + "timeout_s = 0.5\n")
    try:
        text = scrape_with_telemetry(agent)
        wait_for("the first read stuck on the wedged counter", agent.wedged_reads, agent)

        def read_again_while_stuck() -> bool:  # a later read found the first one still hanging
            return any("the previous read has not returned" in f["message"] for f in telemetry_findings(agent))

        wait_for("a later read finding the first still stuck", read_again_while_stuck, agent)
        again = agent.get("/metrics").body.decode()  # answers from the cache while the read hangs
    finally:
        agent.stop()
    assert metric_value(text, "topoagent_collector_success", {"collector": "infiniband_counters"}) == 0
    assert metric_value(again, "topoagent_collector_success", {"collector": "infiniband_counters"}) == 0
    assert metric_value(again, "topoagent_collector_success", {"collector": "pcie_aer"}) == 1  # absent here: quiet


def test_a_source_whose_every_read_fails_is_a_finding_and_a_readyz_warning(tmp_path):
    """On the real H200 every NVML counter read failed and collector_success 0 was the only
    trace.  A source none of whose reads worked is a collector-error warning, named on
    /readyz, which stays 200: no placement needs a counter."""
    root = tmp_path / "root"
    shutil.copytree(SNAPSHOTS / "dgx-a100", root, symlinks=True)
    (root / "telemetry.json").unlink()  # read the recorded sysfs, as live
    counters = (root / "sys/class/infiniband/mlx5_0").resolve() / "ports" / "1" / "counters"
    counters.mkdir(parents=True)
    wedge(root, counters / "symbol_error")  # every read of the source times out
    agent = start_agent(tmp_path, root=root, config=FAST + "timeout_s = 0.2\n")
    try:
        def warned():
            reply = agent.get("/readyz")
            return reply if reply.status != 200 or reply.json()["warnings"] else None

        ready = wait_for("a failing source on /readyz", warned, agent)
        assert ready.status == 200, ready.body
        schema = OPENAPI["paths"]["/readyz"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        jsonschema.Draft202012Validator(schema).validate(ready.json())
        [warning] = ready.json()["warnings"]
        assert warning["kind"] == "collector-error" and warning["severity"] == "warning"
        assert warning["subject"] == "infiniband_counters"
        assert "every read of this counter source has failed (3 in a row" in warning["message"]
        assert "last error: " in warning["message"] and ("timed out" in warning["message"] or "has not returned" in warning["message"])
        found = [f for f in telemetry_findings(agent) if f["kind"] == "collector-error"]
        assert [(f["subject"], f["severity"]) for f in found] == [("infiniband_counters", "warning")]
        page = agent.get("/metrics").body.decode()
        assert metric_value(page, "topoagent_ready") == 1
        assert metric_value(page, "topoagent_findings", {"kind": "collector-error", "severity": "warning"}) == 1
        assert agent.post("/place", {"gpus": 2}).status == 200
    finally:
        agent.stop()


def test_a_source_that_worked_once_or_failed_twice_is_no_finding():
    history = History()
    parse = nvml.COUNTERS.parse
    fail = [Sample("nvml_counters", t, None, "NVMLError_Unknown: Unknown Error") for t in (1.0, 2.0, 3.0, 4.0)]
    for sample in fail[:2]:
        history.add(sample, parse)
    assert history.never_read() == {}
    history.add(fail[2], parse)
    assert history.never_read() == {"nvml_counters": 3}
    assert history.statuses["nvml_counters"].message == "NVMLError_Unknown: Unknown Error"
    history.add(Sample("nvml_counters", 5.0, {"gpus": []}), parse)
    for sample in fail:
        history.add(sample, parse)
    assert history.never_read() == {}  # it worked once: collector_success says the rest
    absent = History()
    for t in (1.0, 2.0, 3.0):
        absent.add(Sample("nvml_counters", t, None, "no NVML on this node", absent=True), parse)
    assert absent.never_read() == {}  # not on this node: quiet


def test_telemetry_off_serves_no_counters(tmp_path):
    agent = start_agent(tmp_path, root=SNAPSHOTS / "degraded", config="[telemetry]\nenabled = false\ninterval_s = 0.2\n")
    try:
        # With telemetry on, the counters' first read is served with the first snapshot
        # (tests/test_service_metrics.py), long before a second discovery run ends.
        assert agent.post("/refresh", token=agent.token).status == 200
        text = agent.get("/metrics").body.decode()
    finally:
        agent.stop()
    assert "topoagent_infiniband_port_errors_total" not in text


# --- recording ------------------------------------------------------------------------------


def snapshot(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "topoagent", "snapshot", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_snapshot_records_two_counter_samples_with_their_times(tmp_path):
    done = snapshot(str(tmp_path / "live"), "--counter-interval", "0.2")
    assert done.returncode == 0, done.stderr
    samples = samples_of(tmp_path / "live")
    assert len(samples) == 2
    assert samples[1]["monotonic_s"] - samples[0]["monotonic_s"] >= 0.2
    names = {"infiniband_counters", "pcie_aer", "nvml_counters"}
    for sample in samples:  # each source answered, failed or is absent here: none forgotten
        assert set(sample["sources"]) | set(sample["errors"]) | set(sample["no_data"]) == names


def test_a_re_recorded_node_keeps_its_samples_and_replays_the_same_findings(tmp_path):
    done = snapshot("--root", str(SNAPSHOTS / "degraded"), str(tmp_path / "again"))
    assert done.returncode == 0, done.stderr
    assert samples_of(tmp_path / "again") == samples_of(SNAPSHOTS / "degraded")


@pytest.mark.parametrize("name", sorted(p.name for p in SNAPSHOTS.iterdir()))
def test_every_fixture_has_two_samples(name):
    samples = samples_of(SNAPSHOTS / name)
    if name in REAL_NODES:  # as `topoagent snapshot` took them: --counter-interval 1 apart
        assert len(samples) == 2 and 1 <= samples[1]["monotonic_s"] - samples[0]["monotonic_s"] < 2
    else:
        assert [s["monotonic_s"] for s in samples] == [1000.0, 1010.0]


def test_placement_keeps_off_gpus_the_counters_call_critical(tmp_path):
    agent = start_agent(tmp_path, root=SNAPSHOTS / "degraded", config=FAST)
    try:
        scrape_with_telemetry(agent)
        assert ("gpu-xid", "GPU6") in {(f["kind"], f["subject"]) for f in telemetry_findings(agent)}
        six = agent.post("/place", {"gpus": 6, "detail": ["explain"]}).json()
        named = agent.post("/place", {"gpus": 2, "include": [6]}).json()
    finally:
        agent.stop()
    # GPU6 (Xid 79, uncorrectable ECC) and GPU4 (row remapping failed) are left out...
    assert {g["index"] for g in six["gpus"]} == {0, 1, 2, 3, 5, 7}
    assert any("left out GPU(s) 4,6" in line for line in six["explain"])
    # ...unless the request names one.
    assert 6 in {g["index"] for g in named["gpus"]}


def test_a_recordings_counters_are_read_once_and_a_new_root_read_afresh(tmp_path):
    # A replayed node gives every sample at the first read; the loop does not read its
    # telemetry.json again each interval (here: a file that could no longer be read is not
    # touched), and a root that a reload opens is a new recording, read in its turn.
    import asyncio

    from topoagent.config import Config
    from topoagent.node.discovery import discover_sync
    from topoagent.node.host import Host
    from topoagent.service.counter_loop import CounterLoop
    from topoagent.service.served import Board, Snapshot

    first, second = tmp_path / "first", tmp_path / "second"
    for root in (first, second):
        shutil.copytree(SNAPSHOTS / "dgx-a100", root, symlinks=True)
    hosts = [Host(first)]
    node = discover_sync(hosts[0])
    board = Board()
    board.publish(snapshot=Snapshot(1, node, node.distance_matrix(), 0.0, node.collectors, {}))
    loop = CounterLoop(board, Config, lambda: hosts[-1])
    try:
        asyncio.run(loop.read())
        served = board.served.snapshot
        assert served is not None and served.telemetry is not None and served.telemetry.readings
        (first / "telemetry.json").write_text("{not json")
        asyncio.run(loop.read())
        assert board.served.snapshot is served  # nothing read, nothing new published
        hosts.append(Host(second))
        asyncio.run(loop.read())
        assert board.served.snapshot is not served and board.served.snapshot.telemetry is not None
    finally:
        loop.close()
        for host in hosts:
            host.close()


def test_a_recordings_counters_once_parsed_give_their_memory_back(monkeypatch):
    # The recording's samples are parsed all at once (2.7 MB of JSON on the 128-GPU node);
    # the agent hands that peak back to the kernel then, whenever the answers' warming ends.
    import asyncio

    import topoagent.service.counter_loop as counter_loop
    from topoagent.config import Config
    from topoagent.node.discovery import discover_sync
    from topoagent.node.host import Host
    from topoagent.service.served import Board, Snapshot

    trims: list[int] = []
    with Host(SNAPSHOTS / "dgx-a100") as host:
        node = discover_sync(host)
        board = Board()
        board.publish(snapshot=Snapshot(1, node, node.distance_matrix(), 0.0, node.collectors, {}))
        monkeypatch.setattr(counter_loop, "release_free_memory", lambda: trims.append(board.version))
        loop = counter_loop.CounterLoop(board, Config, lambda: host)
        try:
            asyncio.run(loop.read())
            asyncio.run(loop.read())  # nothing new to read from a recording: nothing to give back
        finally:
            loop.close()
    assert board.served.snapshot is not None and board.served.snapshot.telemetry is not None
    assert trims == [board.version]  # once, after the new counters were served


def test_a_recordings_parsed_samples_are_gone_before_their_memory_is_given_back(monkeypatch):
    # Memory given back while the parsed samples are still held leaves them in the heap (the
    # history keeps only what it parsed of them): the trim waits till they are gone.
    import asyncio
    import weakref

    import topoagent.service.counter_loop as counter_loop
    import topoagent.service.telemetry as telemetry
    from topoagent.config import Config
    from topoagent.node.discovery import discover_sync
    from topoagent.node.host import Host
    from topoagent.service.served import Board, Snapshot

    class Samples(list):  # a list a weak reference can watch
        pass

    parsed: list[weakref.ref] = []
    recorded_samples = telemetry.recorded_samples

    def watched(host):
        samples = Samples(recorded_samples(host))
        parsed.append(weakref.ref(samples))
        return samples

    held_at_trim: list[bool] = []
    monkeypatch.setattr(telemetry, "recorded_samples", watched)
    monkeypatch.setattr(counter_loop, "release_free_memory", lambda: held_at_trim.append(parsed[-1]() is not None))
    with Host(SNAPSHOTS / "dgx-a100") as host:
        node = discover_sync(host)
        board = Board()
        board.publish(snapshot=Snapshot(1, node, node.distance_matrix(), 0.0, node.collectors, {}))
        loop = counter_loop.CounterLoop(board, Config, lambda: host)
        try:
            asyncio.run(loop.read())
        finally:
            loop.close()
    assert board.served.snapshot is not None and board.served.snapshot.telemetry is not None
    assert held_at_trim == [False]
