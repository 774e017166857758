"""Live signals in placement decisions (issues #19 and #12): GPUs a job gave back and the
probes have not checked since, and the traffic each NIC carries now, break ties at equal
merit -- never trading away bandwidth, NUMA locality, NIC distance or damage -- and the
answer says so.  On the recorded DGX A100, whose GPU pairs each share two equally near
HCAs (GPU0 and GPU1: mlx5_0 and mlx5_1, both PXB)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from schema_check import validate
from service_helpers import DGX_A100, start_agent, wait_for
from test_probe_life import service_for

from topoagent.commands.discover import discover_root
from topoagent.config import Config
from topoagent.node.host import Host
from topoagent.node.matrix import DistanceMatrix
from topoagent.placement import Live, Placement, Request, place
from topoagent.service.agent import Agent
from topoagent.service.telemetry import nic_traffic, replayed

BUSY_GBS = 20.0  # of a 200 Gb/s (25 GB/s) HDR port: 8 steps of a tenth of its line rate


@pytest.fixture(scope="module")
def a100() -> DistanceMatrix:
    return discover_root(str(DGX_A100)).distance_matrix()


def loaded_root(base: Path, loads: dict[str, float] | None = None) -> Path:
    """A copy of the recorded DGX A100 whose counter samples show each device of ``loads``
    sending that many more GB/s between its two reads (10 s apart; default: mlx5_0 at
    BUSY_GBS).  The data counters count 4-byte words."""
    root = base / "loaded"
    shutil.copytree(DGX_A100, root, symlinks=True)
    document = json.loads((root / "telemetry.json").read_text())
    first, second = document["samples"]
    seconds = second["monotonic_s"] - first["monotonic_s"]
    for device, gbs in (loads or {"mlx5_0": BUSY_GBS}).items():
        key = f"{device}/1/counters/port_xmit_data"
        before = int(second["sources"]["infiniband_counters"][key])
        second["sources"]["infiniband_counters"][key] = f"{before + int(gbs * 1e9 * seconds / 4)}\n"
    (root / "telemetry.json").write_text(json.dumps(document))
    return root


def nics_of(answer: Placement) -> dict[int, str | None]:
    return {g.index: g.nic for g in answer.gpus}


# --- unverified GPUs (issue #19) ----------------------------------------------------------


def test_verified_gpus_are_preferred_at_equal_merit_and_the_answer_says_so(a100):
    plain = place(a100, Request(gpus=1))
    assert isinstance(plain, Placement) and plain.indices == (0,)
    answer = place(a100, Request(gpus=1), live=Live(unverified=frozenset({0})))
    assert isinstance(answer, Placement)
    assert answer.indices != (0,) and answer.unverified == ()
    assert answer.objective.damage == plain.objective.damage  # equal merit: nothing traded for it
    assert "verified GPUs preferred at equal merit: GPU(s) 0 unverified (a job gave them back; not probed since)" in answer.explain


def test_an_unverified_gpu_is_taken_when_no_verified_set_has_equal_merit(a100):
    """GPU1 is busy: best fit takes its NUMA-node partner GPU0, unverified or not (damage
    is merit); the answer lists it and says why."""
    answer = place(a100, Request(gpus=1), busy=[1], live=Live(unverified=frozenset({0})))
    assert isinstance(answer, Placement) and answer.indices == (0,)
    assert answer.unverified == (0,) and answer.objective.unverified_gpus == 1
    assert any("GPU(s) 0 unverified" in line and "no set of verified GPUs has equal merit" in line for line in answer.explain)
    validate_answer(answer)


def test_the_agent_passes_its_unverified_gpus_to_placement(tmp_path):
    """A lease's GPUs are unverified until probed (issue #19): the agent's own answers
    prefer the others meanwhile."""

    async def scenario() -> None:
        agent = Agent(Config(root=str(DGX_A100), state_dir=str(tmp_path / "s"), interval_s=3600, telemetry_enabled=False))
        await agent.start()
        try:
            await agent.request_refresh("test")
            before = await agent.place(Request(gpus=2))
            assert isinstance(before, Placement) and set(before.indices) == {0, 1}
            # The probe service (its loop not running, so nothing gets verified) hears that
            # a lease on GPUs 0 and 1 ended, as agent.release tells it.
            agent.probes, _clock = service_for(range(8), lambda plan: pytest.fail("no probe runs here"))
            agent.probes.on_lease_ended("lease-a", [0, 1])
            assert agent.unverified_gpus() == {0, 1}
            after = await agent.place(Request(gpus=2))
            assert isinstance(after, Placement) and not set(after.indices) & {0, 1}
            assert after.bandwidth_gbps == before.bandwidth_gbps and after.objective.damage == before.objective.damage
            assert any("GPU(s) 0,1 unverified" in line for line in after.explain)
        finally:
            agent.probes = None
            await agent.stop()

    asyncio.run(scenario())


# --- NIC traffic now (issue #12) ----------------------------------------------------------


def test_recorded_rates_reach_placement_as_nic_traffic(tmp_path):
    traffic = nic_traffic(replayed(Host(str(loaded_root(tmp_path))), None))
    assert traffic["mlx5_0"] == pytest.approx(BUSY_GBS * 1e9 + 0.1e9, rel=1e-3)  # on top of its recorded 0.1 GB/s
    assert traffic["mlx5_1"] == pytest.approx(0.2e9)  # the recording's own: 2e9 bytes sent in 10 s
    assert set(traffic) == {f"mlx5_{j}" for j in range(10)}


def test_a_busy_nic_is_passed_over_for_an_equally_near_quiet_one(a100, tmp_path):
    traffic = nic_traffic(replayed(Host(str(loaded_root(tmp_path))), None))
    quiet = place(a100, Request(gpus=1, include=[0]))
    assert isinstance(quiet, Placement) and nics_of(quiet) == {0: "mlx5_0"}  # the lower of two equals
    answer = place(a100, Request(gpus=1, include=[0]), live=Live(nic_traffic=traffic))
    assert isinstance(answer, Placement) and nics_of(answer) == {0: "mlx5_1"}
    assert answer.env["NCCL_IB_HCA"] == "=mlx5_1"
    assert "NIC mlx5_1 chosen over mlx5_0 (equally near): 0.2 vs 20.1 GB/s of traffic now" in answer.explain
    # Asked for one NIC: the quiet one too.
    one = place(a100, Request(gpus=1, include=[0], nics=1), live=Live(nic_traffic=traffic))
    assert isinstance(one, Placement) and one.nics == ("mlx5_1",)


def test_the_nic_line_quotes_each_reads_traffic_though_its_steps_are_unchanged(a100):
    """Answers are cached by traffic steps: 20 and 21 GB/s are both 8 steps of 2.5 GB/s,
    and the second answer must still quote its own read."""
    lines = []
    for gbs in (20e9, 21e9):
        answer = place(a100, Request(gpus=1, include=[0]), live=Live(nic_traffic={"mlx5_0": gbs}))
        assert isinstance(answer, Placement) and nics_of(answer) == {0: "mlx5_1"}
        lines.append([line for line in answer.explain if line.startswith("NIC mlx5_1 chosen over mlx5_0")])
    assert lines == [
        ["NIC mlx5_1 chosen over mlx5_0 (equally near): 0 vs 20 GB/s of traffic now"],
        ["NIC mlx5_1 chosen over mlx5_0 (equally near): 0 vs 21 GB/s of traffic now"],
    ]


def test_traffic_below_a_tenth_of_the_line_rate_changes_nothing(a100):
    """The recording's own rates (0.15-1.5 GB/s on 25 GB/s ports): noise, not load."""
    traffic = nic_traffic(replayed(Host(str(DGX_A100)), None))
    assert max(traffic.values()) > 0
    for request in (Request(gpus=1), Request(gpus=1, include=[0]), Request(gpus=2, nics=2), Request(gpus=4, pattern="alltoall")):
        plain, live = place(a100, request), place(a100, request, live=Live(nic_traffic=traffic))
        assert isinstance(plain, Placement) and isinstance(live, Placement)
        assert (live.indices, nics_of(live), live.explain) == (plain.indices, nics_of(plain), plain.explain)


def test_gpus_whose_nearest_nics_are_busy_come_last_among_equal_sets(a100):
    """Both HCAs of GPUs 0 and 1 busy: a 2-GPU job goes to an equal pair with quiet NICs."""
    plain = place(a100, Request(gpus=2))
    assert isinstance(plain, Placement) and set(plain.indices) == {0, 1}
    busy_nics = Live(nic_traffic={"mlx5_0": 15e9, "mlx5_1": 9e9})
    answer = place(a100, Request(gpus=2), live=busy_nics)
    assert isinstance(answer, Placement) and not set(answer.indices) & {0, 1}
    assert (answer.bandwidth_gbps, answer.objective.damage) == (plain.bandwidth_gbps, plain.objective.damage)
    assert any(line.startswith("GPUs with quieter NICs preferred at equal merit") and "GPU(s) 0,1" in line for line in answer.explain)
    # Merit first: holding GPU0, the job stays on its NVLink pair however busy their NICs.
    held = place(a100, Request(gpus=2, include=[0]), live=busy_nics)
    assert isinstance(held, Placement) and set(held.indices) == {0, 1}
    assert any("taken although their nearest NICs carry up to 9 GB/s" in line for line in held.explain)


def test_busy_nics_taken_for_fewer_unverified_gpus_are_not_said_to_have_no_quieter_equal(a100):
    """Term (6) weighs unverified GPUs first: GPUs 0 and 1 (busy NICs, verified) beat an
    equal pair whose NICs are quiet but whose GPUs are unverified.  A quieter set of equal
    merit exists, so the line may only say none with as few unverified GPUs has one."""
    live = Live(unverified=frozenset(range(2, 8)), nic_traffic={"mlx5_0": 15e9, "mlx5_1": 9e9})
    answer = place(a100, Request(gpus=2), live=live)
    quieter = place(a100, Request(gpus=2, include=[2]), live=Live(nic_traffic=live.nic_traffic))
    assert isinstance(answer, Placement) and isinstance(quieter, Placement)
    assert set(answer.indices) == {0, 1}
    assert answer.objective.nic_traffic_steps > quieter.objective.nic_traffic_steps  # the quieter set of equal merit
    assert (answer.bandwidth_gbps, answer.objective.damage) == (quieter.bandwidth_gbps, quieter.objective.damage)
    line = next(line for line in answer.explain if "taken although their nearest NICs" in line)
    assert line.endswith("no set of equal merit and as few unverified GPUs has quieter NICs"), line


def test_gpus_the_request_names_are_said_to_be_named_not_the_best_of_equals(a100):
    """include=[0] takes GPU0 whatever its signals: the lines say include names it, and
    for the GPUs chosen beside it compare only the sets that hold it."""
    alone = place(a100, Request(gpus=1, include=[0]), live=Live(unverified=frozenset({0})))
    assert isinstance(alone, Placement) and alone.unverified == (0,)
    assert "GPU(s) 0 unverified (a job gave them back; not probed since): taken because include names them" in alone.explain
    busy_nic = place(a100, Request(gpus=1, include=[0]), live=Live(nic_traffic={"mlx5_0": 15e9, "mlx5_1": 9e9}))
    assert isinstance(busy_nic, Placement)
    assert "GPU(s) 0 taken although their nearest NICs carry up to 9 GB/s of traffic now: include names them" in busy_nic.explain
    pair = place(a100, Request(gpus=2, include=[0]), live=Live(unverified=frozenset({0, 1})))
    assert isinstance(pair, Placement) and set(pair.indices) == {0, 1}
    assert any(line.endswith("taken because no set of equal merit holding GPUs 0 has fewer unverified GPUs") for line in pair.explain)
    for answer in (alone, busy_nic, pair):
        assert not any("no set of verified GPUs has equal merit" in line for line in answer.explain)
        validate_answer(answer)


def validate_answer(answer: Placement) -> None:
    from topoagent.documents.agent import answer_document

    validate(answer_document(answer), "Placement")


FAST_TELEMETRY = "[telemetry]\ninterval_s = 0.2\n"


def test_place_over_http_and_the_cli_pick_the_quiet_nic_and_say_why(tmp_path):
    """A real agent replays the recording's counters: mlx5_0 sends 20 GB/s more, mlx5_1
    4 GB/s more (both HCAs of GPUs 0 and 1 busy, mlx5_1 less).  /place, /capacity and
    `topoagent place` on the same recording give the same answers."""
    root = loaded_root(tmp_path, {"mlx5_0": BUSY_GBS, "mlx5_1": 4.0})
    agent = start_agent(tmp_path, root=root, config=FAST_TELEMETRY)
    try:
        def answered():
            doc = agent.post("/place", {"gpus": 1, "include": [0], "detail": ["bindings", "explain"]}).json()
            return doc if doc["gpus"][0]["nic"] == "mlx5_1" else None

        held = wait_for("an answer that weighs the counters' rates", answered, agent)
        pair = agent.post("/place", {"gpus": 2, "detail": ["bindings", "explain"]}).json()
        fits = {fit["gpus"]: fit for fit in agent.get("/capacity").json()["fits"]}
    finally:
        agent.stop()
    validate(held, "Placement")
    assert "NIC mlx5_1 chosen over mlx5_0 (equally near): 4.2 vs 20.1 GB/s of traffic now" in held["explain"]
    assert held["env"]["NCCL_IB_HCA"] == "=mlx5_1"
    # Every NVLink pair is as good: the job goes where the NICs are quiet, and says so.
    assert not {g["index"] for g in pair["gpus"]} & {0, 1}
    assert any(line.startswith("GPUs with quieter NICs preferred at equal merit") for line in pair["explain"])
    assert fits[2]["indices"] == [g["index"] for g in pair["gpus"]]

    def cli(*args: str) -> dict:
        run = subprocess.run([sys.executable, "-m", "topoagent", "place", "--root", str(root), "--json", "--detail", "bindings,explain", *args],
                             capture_output=True, text=True, timeout=120, check=True)
        return json.loads(run.stdout)

    for by_cli, by_http in ((cli("--gpus", "1", "--include", "0"), held), (cli("--gpus", "2"), pair)):
        assert (by_cli["gpus"], by_cli["explain"], by_cli["env"]) == (by_http["gpus"], by_http["explain"], by_http["env"])
