"""bench/gpu_check.sh, the check run on a real GPU machine, as far as a machine without a GPU
can check it (issue #35 item 6): shellcheck-clean; it runs the Python it is given, a venv
included, and never builds a venv on top of it (one made that way lost the venv's torch on
the real H200); and without a GPU, or without torch, it stops at once, non-zero, saying why."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO

SCRIPT = REPO / "bench" / "gpu_check.sh"
# What the script runs before it knows whether there is a GPU.
TOOLS = ("bash", "tee", "dirname", "mkdir", "grep", "tail", "head", "cat", "env")


def a_venv(tmp: Path) -> Path:
    """A plain venv's python (`python3 -m venv`): what a machine with torch in /opt/torch/.venv has."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    return venv / "bin" / "python3"  # the name the script looks for on PATH


def machine(tmp: Path, python: Path, *, gpu: bool) -> dict[str, str]:
    """An environment whose PATH is the venv's bin (as its activation makes it: `python3` is
    the venv's), the basic tools and, with ``gpu``, an `nvidia-smi` that lists one GPU."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} not found"
        (bin_dir / tool).symlink_to(found)
    if gpu:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-8aa1497e-909b-15e4-767c-dcfa583dff29)'\n")
        smi.chmod(0o755)
    return {"PATH": f"{python.parent}:{bin_dir}", "HOME": str(tmp), "LANG": "C.UTF-8"}


def venvs_in(*dirs: Path) -> set[Path]:
    return {p for d in dirs for p in d.rglob("pyvenv.cfg") if ".venv-test" not in p.parts}


def run(tmp: Path, env: dict[str, str]) -> tuple[int, str]:
    """Its exit status and what it said (stdout and stderr: it logs both to one file)."""
    done = subprocess.run([shutil.which("bash"), str(SCRIPT), str(tmp / "out")], env=env, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def test_gpu_check_is_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck not found: install the Debian package 'shellcheck' (scripts/test does)"
    done = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_without_a_gpu_it_runs_the_given_venv_builds_none_and_fails_saying_why(tmp_path):
    python = a_venv(tmp_path)
    before = venvs_in(REPO / "bench", tmp_path) | {p for p in REPO.glob("*/pyvenv.cfg")}
    rc, said = run(tmp_path, machine(tmp_path, python, gpu=False))
    assert rc == 1, said
    # It ran the venv's python itself, as a venv: this line is that python's own answer.
    assert f"python: {python} " in said and f"venv prefix {python.parent.parent}" in said, said
    assert "nvidia-smi not found: this is not a machine with NVIDIA GPUs" in said
    assert "stopped; nothing measured" in said
    assert venvs_in(REPO / "bench", tmp_path) | {p for p in REPO.glob("*/pyvenv.cfg")} == before, "gpu_check made a venv"
    assert not (REPO / ".venv-gpu").exists()
    assert (tmp_path / "out" / "gpu_check.log").read_text().count("nvidia-smi not found") == 1


def test_a_gpu_without_torch_in_the_given_python_stops_naming_it(tmp_path):
    python = a_venv(tmp_path)
    rc, said = run(tmp_path, machine(tmp_path, python, gpu=True))
    assert rc == 1, said
    assert "GPU 0: NVIDIA H200" in said
    assert f"{python} has no torch that sees a CUDA device: run with PYTHON=" in said
    assert "No module named 'torch'" in said
    assert venvs_in(tmp_path) == {tmp_path / "venv" / "pyvenv.cfg"}


def test_the_given_python_is_taken_from_PYTHON_before_PATH(tmp_path):
    python = a_venv(tmp_path)
    env = machine(tmp_path, Path(sys.executable), gpu=False)
    rc, said = run(tmp_path, {**env, "PYTHON": str(python)})
    assert rc == 1 and f"python: {python} " in said and f"venv prefix {python.parent.parent}" in said, said
    assert (tmp_path / "out" / "gpu_check.log").read_text().count("nvidia-smi not found") == 1


# Two samples as the real H200 gave them under load (load-parity, issue #35): the agent's
# page, and nvidia-smi --query-gpu with nounits.
H200_PAGE = """# sample 1 1796408410.781 status 200
topoagent_gpu_info{gpu="0",model="NVIDIA H200",uuid="GPU-8aa1497e-909b-15e4-767c-dcfa583dff29"} 1.0
topoagent_gpu_power_watts{gpu="0"} 683.9
topoagent_gpu_sm_clock_hertz{gpu="0"} 1.455e+09
topoagent_gpu_xid_events_total{class="actionable",gpu="0"} 0.0
topoagent_collector_success{collector="nvml_counters"} 1.0
# sample 2 1796408413.813 status 200
topoagent_gpu_info{gpu="0",model="NVIDIA H200",uuid="GPU-8aa1497e-909b-15e4-767c-dcfa583dff29"} 1.0
topoagent_gpu_power_watts{gpu="0"} 692.383
topoagent_gpu_sm_clock_hertz{gpu="0"} 1.47e+09
topoagent_gpu_xid_events_total{class="actionable",gpu="0"} 0.0
topoagent_collector_success{collector="nvml_counters"} 1.0
"""
H200_SMI = """index,utilization.gpu,utilization.memory,memory.used,memory.reserved,memory.free,power.draw,enforced.power.limit,temperature.gpu,temperature.memory,clocks.sm,clocks.mem,clocks_event_reasons.active,pcie.link.gen.current
0, 100, 25, 2011, 616, 141146, 683.68, 700.00, 53, 41, 1455, 3201, 0x0000000000000004, 5
0, 100, 24, 1139, 616, 142018, 689.89, 700.00, 54, 43, 1470, 3201, 0x0000000000000004, 5
"""


def parity(tmp: Path, page: str) -> tuple[int, str]:
    (tmp / "agent-metrics-samples.txt").write_text(page)
    (tmp / "nvidia-smi-query.csv").write_text(H200_SMI)
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "parity", str(tmp)],
                          capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr


def test_parity_sets_each_gpu_family_beside_nvidia_smi_in_the_agents_units(tmp_path):
    rc, said = parity(tmp_path, H200_PAGE)
    assert rc == 0, said
    rows = {line.split()[0] + " " + line.split()[-1]: line.split() for line in said.splitlines() if line.startswith("topoagent_")}
    assert rows["topoagent_gpu_power_watts power.draw"][2:4] == ["683.9..692.383", "683.68..689.89"]
    assert rows["topoagent_gpu_sm_clock_hertz clocks.sm"][2:4] == ["1.455e+09..1.47e+09", "1.455e+09..1.47e+09"]
    assert rows["topoagent_gpu_clock_throttle_reasons clocks_event_reasons.active"][2:4] == ["-", "4"]  # the hex mask, read
    assert rows['topoagent_gpu_xid_events_total{class="actionable"} -'][1:3] == ["0", "0"]  # served, nothing to set beside it
    assert "3 GPU counter families served" in said


def test_parity_fails_when_the_page_has_no_gpu_counter(tmp_path):
    """The landed code on the H200: gpu_info from discovery, and no counter at all."""
    dead = "\n".join(line for line in H200_PAGE.splitlines() if "power" not in line and "clock" not in line and "xid" not in line)
    rc, said = parity(tmp_path, dead.replace('nvml_counters"} 1.0', 'nvml_counters"} 0.0') + "\n")
    assert rc == 1
    assert "FAILED: /metrics carried no GPU counter family" in said


def test_the_nvml_cost_step_reads_a_gpu_through_the_binding_without_one_failure(nvml_stub, tmp_path):
    """The NVML timing step of the GPU check, on the suite's C-ABI NVML serving the real H200:
    the binding's calls and the agent's counter read each succeed 100 times (the landed code's
    read failed every time on that GPU)."""
    import json

    nvml_stub.serve_recording(REPO / "fixtures" / "snapshots" / "h200-vm")
    out = tmp_path / "nvml-costs.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "nvml-costs", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert "agent counter read (nvml_counters)" in figures and "nvmlDeviceGetPowerUsage" in figures
    assert not [name for name, figure in figures.items() if "error" in figure]
