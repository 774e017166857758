"""`topoagent probe` input errors: one line on stderr, exit 2, and no worker started."""

import pytest

from topoagent.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["probe", "--root", "/nonexistent-root", "--backend", "cpu"], "/nonexistent-root: no such file"),
        (["probe", "--backend", "cuda"], "say which GPUs to probe"),
        (["probe", "--gpus", "0", "--backend", "cpu"], "--gpus needs at least 1"),
        (["probe", "--from-nvidia-smi", "/nonexistent/topo.txt"], "cannot read /nonexistent/topo.txt"),
        (["probe", "--backend", "cpu", "--timeout", "0"], "--timeout must be positive"),
        # 5000 once grew the agent to ~24 GB building every ordered pair before refusing.
        (["probe", "--backend", "cpu", "--gpus", "5000", "--timeout", "3"], "--gpus 5000: at most 64"),
        (["probe", "--backend", "cpu", "--gpus", "65"], "--gpus 65: at most 64"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("topoagent probe: ") and message in err
    assert err.count("\n") == 1


def test_unreadable_matrix_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "topo.txt"
    bad.write_text("\tGPU0\tGPU1\nGPU0\t X \tBOGUS\nGPU1\tPIX\t X\n")
    assert main(["probe", "--from-nvidia-smi", str(bad), "--backend", "cpu"]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "line" in err


def test_probe_a_recorded_node_on_the_cpu_backend(capsys):
    """--root discovers the recorded node, then measures every GPU pair for real (CPU), judging none."""
    import json

    from conftest import FIXTURES

    root = FIXTURES / "snapshots" / "dgx-a100"
    assert main(["probe", "--root", str(root), "--backend", "cpu", "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["failure"] is None
    assert len(doc["pairs"]) == 8 * 7 // 2
    # Host copies stand in for GPUs: no pair is judged by them, no finding made (issue #36).
    assert all(p["measured_gbps"] is None and p["level"] == "NV12" for p in doc["pairs"])
    assert doc["findings"] == []


def test_a_plan_above_the_limit_is_refused_before_it_is_built():
    from topoagent.probes.plan import MAX_PLAN_MEASUREMENTS, PlanError, build_round_plan, validate_plan

    full_64 = build_round_plan("cpu", range(64), range(8))  # the largest --gpus, 8 NUMA nodes
    assert len(full_64["measurements"]) <= MAX_PLAN_MEASUREMENTS
    with pytest.raises(PlanError, match=f"limit of {MAX_PLAN_MEASUREMENTS}"):
        build_round_plan("cpu", range(100_000))  # 35 billion measurements if it were built
    too_long = dict(full_64, measurements=[{"id": n, "kind": "local_copy", "device": 0}
                                           for n in range(MAX_PLAN_MEASUREMENTS + 1)])
    with pytest.raises(PlanError, match="more than the limit"):
        validate_plan(too_long)


def test_a_matrix_too_big_for_one_round_is_one_line_and_exit_2(tmp_path, capsys):
    """--from-nvidia-smi is not bounded by --gpus; the plan limit still answers cleanly."""
    n = 80
    names = [f"GPU{i}" for i in range(n)]
    rows = ["\t" + "\t".join(names) + "\tCPU Affinity\tNUMA Affinity"]
    for i in range(n):
        cells = [" X " if i == j else "SYS" for j in range(n)]
        rows.append(f"GPU{i}\t" + "\t".join(cells) + "\t0-63\t0")
    topo = tmp_path / "topo.txt"
    topo.write_text("\n".join(rows) + "\n")
    assert main(["probe", "--from-nvidia-smi", str(topo), "--backend", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("topoagent probe: a round over 80 GPUs") and err.count("\n") == 1


def test_timeout_covers_planning_too(monkeypatch, capsys):
    """Time spent before the worker starts counts against --timeout: no worker is started."""
    import time

    import topoagent.commands.probe as probe_cmd
    import topoagent.probes.runner as runner

    real_plan, real_clock = probe_cmd.build_round_plan, time.monotonic
    late = [0.0]  # how far planning moved the clock on

    def slow_plan(*args, **kwargs):
        late[0] += 0.3  # planning "took" 0.3 s of the command's clock; no real time need pass
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(time, "monotonic", lambda: real_clock() + late[0])

    def no_worker(*args, **kwargs):
        raise AssertionError("the worker must not start once the budget is spent")

    monkeypatch.setattr(probe_cmd, "build_round_plan", slow_plan)
    monkeypatch.setattr(runner.asyncio, "create_subprocess_exec", no_worker)
    assert main(["probe", "--backend", "cpu", "--gpus", "2", "--timeout", "0.2", "--json", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "timeout: the round ran past 0.2 s" in err


def test_help_says_what_the_timeout_covers(capsys):
    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "limit for the whole round" in help_text and "worker start-up" in help_text


def test_help_says_the_cpu_backend_probes_stand_ins_without_a_target(capsys):
    """`probe --backend cpu` alone measures 2 stand-in devices: --help says so."""
    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "2 stand-in devices" in text and "2 stand-in GPUs" in text
    assert "pip install '.[probes]'" in text
