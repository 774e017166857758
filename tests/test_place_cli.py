"""`topoagent place`: single answers, --batch JSON lines, and one-line errors with exit 2."""

from __future__ import annotations

import io
import json
from pathlib import Path

from topoagent.cli import main

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpus" / "nvidia-smi-topo"
DGX1 = str(next(CORPUS.glob("dlperf-8xV100-SXM2-hybridcubemesh*")))


def test_place_json(capsys):
    assert main(["place", "--gpus", "2", "--from-nvidia-smi", DGX1, "--busy", "3,4,5,7", "--json", "--detail", "bindings"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [g["index"] for g in data["gpus"]] in ([1, 2], [2, 1])
    assert data["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(str(g["index"]) for g in data["gpus"])


def test_place_json_is_lean_unless_details_are_asked(capsys):
    """The lean answer is the choice; --detail adds the sections it names, `all` every one."""
    base = ["place", "--gpus", "4", "--from-nvidia-smi", DGX1, "--json"]
    assert main(base) == 0
    lean = json.loads(capsys.readouterr().out)
    assert set(lean) == {"schema_version", "fit", "gpus", "pattern", "bandwidth_gbps", "worst_level", "score", "objective",
                         "affinity", "satisfaction", "proven_optimal", "bandwidth_bound_gbps", "unverified", "reasons"}
    assert all(set(g) == {"rank", "index", "uuid", "pci_address", "numa_node"} for g in lean["gpus"])
    assert "bottleneck" in lean["reasons"]
    assert main([*base, "--detail", "launch,bindings"]) == 0
    some = json.loads(capsys.readouterr().out)
    assert set(some) - set(lean) == {"numa_nodes", "cpus", "nics", "env", "numactl", "launch"}
    assert all({"cpus", "memory_node", "nic", "numactl"} <= set(g) for g in some["gpus"])
    assert some["launch"]["srun"][0] == "--ntasks-per-node=4"
    assert main([*base, "--detail", "all"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert set(full) - set(some) == {"links", "broken_zones", "estimate", "explain", "request"}
    assert full["request"]["detail"] == ["bindings", "launch", "explain"]
    assert len(full["explain"]) == len(full["reasons"])
    # The sections add to the lean answer and change nothing of it.
    assert {k: full[k] for k in lean if k != "gpus"} == {k: v for k, v in lean.items() if k != "gpus"}
    assert [{k: g[k] for k in lean["gpus"][0]} for g in full["gpus"]] == lean["gpus"]
    assert main([*base, "--detail", "bindings,numa"]) == 2
    assert "--detail: expected one of bindings, launch, explain, all, got \"numa\"" in capsys.readouterr().err
    # Without --json the text shows every section: a --detail there is a mistake, said so.
    assert main(["place", "--gpus", "4", "--from-nvidia-smi", DGX1, "--detail", "bindings"]) == 2
    assert "add --json" in capsys.readouterr().err


def test_place_text_and_no_fit(capsys):
    assert main(["place", "--gpus", "4", "--from-nvidia-smi", DGX1, "--pattern", "alltoall"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("GPUs in rank order: ") and "alltoall: 25 GB/s" in out
    assert main(["place", "--gpus", "8", "--from-nvidia-smi", DGX1, "--busy", "0"]) == 1
    captured = capsys.readouterr()
    assert "8 GPUs requested, 7 free" in captured.out and "no fit" in captured.err


def test_bad_input_is_one_line_exit_2(capsys):
    for argv in (
        ["place", "--gpus", "2", "--from-nvidia-smi", DGX1, "--min-level", "FAST"],
        ["place", "--gpus", "2", "--from-nvidia-smi", DGX1, "--busy", "x"],
        ["place", "--gpus", "2", "--from-nvidia-smi", DGX1, "--busy", "12"],
        ["place", "--gpus", "0", "--from-nvidia-smi", DGX1],
        ["place", "--from-nvidia-smi", DGX1],
        ["place", "--gpus", "2", "--from-nvidia-smi", "/nonexistent/topo.txt"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("topoagent place: ") and err.count("\n") == 1, err


def test_batch_answers_in_order(monkeypatch, capsys):
    lines = [
        '{"gpus": 2, "busy": [3, 4, 5, 7]}',
        "",
        '{"gpus": 0}',
        "not json",
        '{"gpus": 9}',
        '{"gpus": 2, "colour": "red"}',
        '{"gpus": 4, "pattern": "pipeline", "busy": "0"}',
        '{"gpus": 3, "single_numa": true, "nics": 1}',
    ]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(("\n".join(lines) + "\n").encode())))
    assert main(["place", "--batch", "--from-nvidia-smi", DGX1]) == 2  # the worst line: bad input
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(answers) == 7
    assert {g["index"] for g in answers[0]["gpus"]} == {1, 2}
    assert answers[1]["error"]["field"] == "gpus" and answers[1]["error"]["line"] == 3
    assert answers[2]["error"]["message"].startswith("not JSON")
    assert answers[3]["fit"] is False and answers[3]["constraint"] == "gpus"
    assert answers[4]["error"]["field"] == "colour"
    assert answers[5]["error"]["field"] == "busy"
    assert answers[6]["fit"] is True and len(answers[6]["gpus"]) == 3


TRUNCATED_NO_LEGEND = str(CORPUS / "nccl-933-8gpu-NV8-9nic-TRUNCATED-7rows.txt")
WITH_LEGEND = str(CORPUS / "sglang-20855-8xH100-NV18-8nic-misaligned-columns.txt")


def test_nic_labels_without_a_legend_stay_out_of_nccl_ib_hca(capsys):
    """NICn are nvidia-smi's labels, not RDMA devices: NCCL would match nothing."""
    assert main(["place", "--gpus", "2", "--from-nvidia-smi", TRUNCATED_NO_LEGEND, "--json", "--detail", "bindings,explain"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "NCCL_IB_HCA" not in data["env"]
    assert any("NCCL_IB_HCA leaves out NIC" in line and "unknown" in line for line in data["explain"])
    assert main(["place", "--gpus", "2", "--from-nvidia-smi", TRUNCATED_NO_LEGEND]) == 0
    assert "NCCL_IB_HCA" not in capsys.readouterr().out.split("launch:")[1].splitlines()[0]


def test_nics_named_by_the_legend_go_into_nccl_ib_hca(capsys):
    assert main(["place", "--gpus", "2", "--from-nvidia-smi", WITH_LEGEND, "--json", "--detail", "bindings,explain"]) == 0
    data = json.loads(capsys.readouterr().out)
    hcas = data["env"]["NCCL_IB_HCA"].lstrip("=").split(",")
    assert hcas and all(name.startswith("mlx5_") for name in hcas)
    assert not any("leaves out" in line for line in data["explain"])


VLLM_FRAGMENT = str(CORPUS / "vllm-16336-8xB200-GPU2-nvlink-down-FRAGMENT-noheader.txt")


def test_gpus_with_unknown_levels_are_left_out_and_named(capsys):
    """The fragment lacks GPU6's and GPU7's rows: their mutual level is unknown, the rest is exact."""
    assert main(["place", "--gpus", "2", "--exclude", "6,7", "--from-nvidia-smi", VLLM_FRAGMENT, "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    chosen = [g["index"] for g in data["gpus"]]
    assert len(chosen) == 2 and set(chosen) <= {0, 1, 3, 4, 5}  # GPU2's NVLink is down
    assert "left out GPU6, GPU7" in captured.err and captured.err.count("\n") == 1
    # Not asked to exclude them: still only GPUs 0-5 are candidates.
    assert main(["place", "--gpus", "6", "--from-nvidia-smi", VLLM_FRAGMENT, "--json"]) == 0
    assert sorted(g["index"] for g in json.loads(capsys.readouterr().out)["gpus"]) == [0, 1, 2, 3, 4, 5]
    assert main(["place", "--gpus", "2", "--include", "7", "--from-nvidia-smi", VLLM_FRAGMENT]) == 2
    assert "--include: GPU 7 was left out" in capsys.readouterr().err


def test_a_batch_line_names_left_out_gpus_as_the_flags_do(capsys, monkeypatch):
    """--batch and the flags share one rule for GPUs the text left out: busy or excluded is
    fine (they are no candidates anyway), included is refused in the same words."""
    lines = ['{"gpus": 2, "exclude": [6, 7]}', '{"gpus": 2, "busy": [7, 0]}', '{"gpus": 2, "include": [7]}']
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("\n".join(lines).encode() + b"\n")))
    assert main(["place", "--batch", "--from-nvidia-smi", VLLM_FRAGMENT]) == 2  # the worst line: bad input
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(["place", "--gpus", "2", "--exclude", "6,7", "--from-nvidia-smi", VLLM_FRAGMENT, "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert [g["index"] for g in answers[0]["gpus"]] == [g["index"] for g in alone["gpus"]]
    assert main(["place", "--gpus", "2", "--busy", "7,0", "--from-nvidia-smi", VLLM_FRAGMENT, "--json"]) == 0
    assert [g["index"] for g in answers[1]["gpus"]] == [g["index"] for g in json.loads(capsys.readouterr().out)["gpus"]]
    assert "GPU 7 was left out: its levels to other GPUs are unknown" in json.dumps(answers[2])


def test_explain_names_gpus_and_numa_nodes_unambiguously(capsys):
    """'NUMA node {0,1}' read like NUMA ids; the zones now list GPUs, then what they share."""
    argv = ["place", "--gpus", "2", "--include", "0,4", "--from-nvidia-smi", TRUNCATED_NO_LEGEND, "--json", "--detail", "explain"]
    assert main(argv) == 0
    explain = json.loads(capsys.readouterr().out)["explain"]
    assert "breaks whole free zones: GPUs 0,1,2,3 (all of NUMA node 0); GPUs 4,5,6 (all of NUMA node 1)" in explain
    # --include forced the split: no claim that it was the best on offer.
    assert "spans 2 NUMA nodes: include GPUs 0,4 alone span 2" in explain  # JSON names the field
    assert not any("no set on fewer has the same bandwidth" in line for line in explain)


def test_explain_says_when_include_forced_a_numa_split(capsys):
    argv = ["place", "--gpus", "3", "--include", "0", "--busy", "1,2,3", "--from-nvidia-smi", TRUNCATED_NO_LEGEND,
            "--json", "--detail", "explain"]
    assert main(argv) == 0
    explain = json.loads(capsys.readouterr().out)["explain"]
    assert any(line.startswith("spans 2 NUMA nodes: forced by include GPUs 0") for line in explain)
    assert any("no free set of 3 holding GPUs 0 does better" in line for line in explain)
    assert main(["place", "--gpus", "5", "--from-nvidia-smi", TRUNCATED_NO_LEGEND, "--json", "--detail", "explain"]) == 0
    assert "spans 2 NUMA nodes: no set on fewer has the same bandwidth" in json.loads(capsys.readouterr().out)["explain"]


def test_explain_names_flags_in_text_and_fields_in_json(capsys):
    """One typed reason, rendered per door: the CLI's text names its flag, JSON the field."""
    argv = ["place", "--gpus", "2", "--include", "0,4", "--from-nvidia-smi", TRUNCATED_NO_LEGEND]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "- spans 2 NUMA nodes: --include GPUs 0,4 alone span 2" in text
    assert main([*argv, "--json", "--detail", "explain"]) == 0
    assert not any("--include" in line for line in json.loads(capsys.readouterr().out)["explain"])


def test_flags_are_judged_by_the_request_parser(capsys):
    """Flags go through the JSON requests' parser: same rules, errors name the flag."""
    base = ["place", "--from-nvidia-smi", TRUNCATED_NO_LEGEND]
    assert main([*base, "--gpus", "2.0", "--json"]) == 0  # 2.0 is a whole number everywhere
    assert len(json.loads(capsys.readouterr().out)["gpus"]) == 2
    assert main([*base, "--gpus", "two"]) == 2
    assert '--gpus: expected an integer, got "two"' in capsys.readouterr().err
    assert main([*base, "--gpus", "2", "--include", "9"]) == 2
    assert "--include: GPU 9 is not on this node" in capsys.readouterr().err
    assert main([*base, "--gpus", "2", "--min-level", "NV0"]) == 2
    assert "--min-level: expected a GPU-to-GPU link level" in capsys.readouterr().err
