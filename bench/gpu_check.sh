#!/usr/bin/env bash
# One prepared check on a machine with NVIDIA GPUs: install, record a snapshot, run one
# probe round on CUDA, and print every figure beside its physical limit.
#
#   bash bench/gpu_check.sh [OUT]        (OUT defaults to $OUT, else ./gpu-check-out)
#
# Works offline: it reuses a torch that is already installed (a venv with
# --system-site-packages), and installs the project itself without dependencies (the
# probe path needs only the standard library on the agent side).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-./gpu-check-out}}"
mkdir -p "$OUT/raw"
exec > >(tee "$OUT/gpu_check.log") 2>&1

if ! command -v nvidia-smi >/dev/null; then
  echo "gpu_check: nvidia-smi not found; this is not an NVIDIA GPU machine" >&2
  exit 1
fi

# 1. A Python that already has torch with CUDA.
PY=""
for candidate in python3 python /opt/conda/bin/python /usr/bin/python3; do
  if command -v "$candidate" >/dev/null &&
     "$candidate" -c 'import sys, torch; sys.exit(0 if sys.version_info >= (3, 10) and torch.cuda.is_available() else 1)' 2>/dev/null; then
    PY="$(command -v "$candidate")"; break
  fi
done
if [ -z "$PY" ]; then
  echo "gpu_check: no Python here has a CUDA-enabled torch; trying the pinned one"
  PY=python3
  NEED_TORCH=1
fi
echo "python: $PY ($("$PY" --version 2>&1))"

# 2. Install the project into a venv that sees the system torch.
VENV=.venv-gpu
"$PY" -m venv --system-site-packages "$VENV"
if [ "${NEED_TORCH:-0}" = 1 ]; then
  "$VENV/bin/pip" install -q 'torch==2.13.0' || echo "gpu_check: could not install torch; probes will fail"
fi
if "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . 2>"$OUT/raw/pip.err"; then
  TOPOAGENT=("$VENV/bin/python" -m topoagent.cli)
else
  # No setuptools/pip offline: lay the package out by hand (same mapping as pyproject).
  echo "gpu_check: pip install failed (see raw/pip.err); using a source tree on PYTHONPATH"
  SHIM="$OUT/.pkg"; rm -rf "$SHIM"; mkdir -p "$SHIM/topoagent"
  cp -r topoagent/. "$SHIM/topoagent/"
  for sub in collectors probes exporters; do cp -r "$sub" "$SHIM/topoagent/$sub"; done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  TOPOAGENT=("$VENV/bin/python" -m topoagent.cli)
fi
"$VENV/bin/python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'

# 3. Snapshot of the node (the command may not be in this build yet), plus raw outputs.
if "${TOPOAGENT[@]}" --help 2>/dev/null | grep -qw snapshot; then
  "${TOPOAGENT[@]}" snapshot "$OUT/snapshot.tar.gz" || echo "gpu_check: snapshot failed"
else
  echo "gpu_check: no 'topoagent snapshot' in this build; keeping raw outputs only"
fi
nvidia-smi topo -m > "$OUT/raw/nvidia-smi_topo_-m.out" 2>&1
nvidia-smi -q > "$OUT/raw/nvidia-smi_-q.out" 2>&1
nvidia-smi nvlink -s > "$OUT/raw/nvidia-smi_nvlink_-s.out" 2>&1 || true
nvidia-smi --query-gpu=index,name,pci.bus_id,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max \
  --format=csv,noheader,nounits > "$OUT/raw/gpus.csv"
command -v numactl >/dev/null && numactl -H > "$OUT/raw/numactl_-H.out" 2>&1
command -v lscpu >/dev/null && lscpu > "$OUT/raw/lscpu.out" 2>&1
for node in /sys/devices/system/node/node[0-9]*; do
  [ -e "$node/cpulist" ] && echo "$(basename "$node") cpus $(cat "$node/cpulist")"
done > "$OUT/raw/numa_cpus.txt"
cat "$OUT/raw/nvidia-smi_topo_-m.out"

# 4. One probe round on CUDA (progress on stderr, JSON kept).
"${TOPOAGENT[@]}" probe --backend cuda --from-nvidia-smi "$OUT/raw/nvidia-smi_topo_-m.out" \
  --timeout "${PROBE_TIMEOUT:-420}" --json --progress > "$OUT/probe.json"
rc=$?
echo "probe exit status: $rc"

# 5. Figures beside their physical limits.
if [ -s "$OUT/probe.json" ]; then
  "$VENV/bin/python" bench/gpu_limits.py "$OUT/probe.json" "$OUT/raw/gpus.csv" | tee "$OUT/figures.txt"
fi
exit $rc
