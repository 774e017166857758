#!/usr/bin/env bash
# One prepared check on a machine with NVIDIA GPUs, offline, in a few minutes (every step has
# a time limit of its own; together they bound it at about twelve): record
# the node, run discover / place / serve on it, sample every GPU family of /metrics beside
# `nvidia-smi --query-gpu` under a load it makes itself, run one CUDA probe round and print
# its figures beside their physical limits, time NVML calls, and pack it all in one tarball.
#
#   bash bench/gpu_check.sh [OUT]        (OUT defaults to $OUT, else ./gpu-check-out)
#   PYTHON=/opt/torch/.venv/bin/python bash bench/gpu_check.sh
#
# The Python is the one given ($PYTHON, else python3 on PATH), used as it is: often a venv
# that holds torch.  No venv is made on top of it (one made with --system-site-packages on
# top of a venv sees the base interpreter's packages, not that venv's, and loses its torch),
# and nothing is installed into it.  topoagent runs from this checkout through PYTHONPATH:
# that needs neither network nor pip nor setuptools in that venv, leaves the venv as it was,
# and runs this checkout's code even where another topoagent is installed.  Its
# dependencies (aiohttp, prometheus-client, nvidia-ml-py) must be importable there; the
# check says which are not.
#
# Every step that fails is named at the end and the exit status is 1; no GPU, no torch with
# CUDA or a missing dependency stop it at once, with the reason.
set -uo pipefail
OUT="${1:-${OUT:-./gpu-check-out}}"  # relative to where it is run from
mkdir -p "$OUT/raw" || exit 1
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.." || exit 1
CHECKOUT="$PWD"
exec > >(tee "$OUT/gpu_check.log") 2>&1
FAILED=()

fail() {  # a step that failed: said now, counted for the exit status
  echo "gpu_check: FAILED: $*"
  FAILED+=("$*")
}

stop() {  # a fatal precondition: no point going on
  echo "gpu_check: $*" >&2
  echo "gpu_check: stopped; nothing measured. The log: $OUT/gpu_check.log" >&2
  exit 1
}

# 1. The Python, as given.
PY="${PYTHON:-$(command -v python3 || command -v python || true)}"
if [ -z "$PY" ] || ! command -v "$PY" >/dev/null; then stop "no python3 on PATH (or PYTHON=$PY is not one); set PYTHON=/path/to/python"; fi
PY="$(command -v "$PY")"
export PYTHONPATH="$CHECKOUT${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck disable=SC2016  # the Python program is single-quoted on purpose
"$PY" -c 'import sys; print("python:", sys.executable, sys.version.split()[0], "venv" if sys.prefix != sys.base_prefix else "no venv", "prefix", sys.prefix)' ||
  stop "$PY does not run"

# 2. A GPU, torch with CUDA, the agent's dependencies.
command -v nvidia-smi >/dev/null || stop "nvidia-smi not found: this is not a machine with NVIDIA GPUs (or the driver is not installed)"
nvidia-smi -L > "$OUT/raw/nvidia-smi_-L.out" 2>&1 || stop "nvidia-smi -L failed: $(tail -n 1 "$OUT/raw/nvidia-smi_-L.out")"
grep -q '^GPU [0-9]' "$OUT/raw/nvidia-smi_-L.out" || stop "nvidia-smi lists no GPU: $(head -n 1 "$OUT/raw/nvidia-smi_-L.out")"
cat "$OUT/raw/nvidia-smi_-L.out"
"$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count()); sys.exit(0 if torch.cuda.is_available() else 1)' ||
  stop "$PY has no torch that sees a CUDA device: run with PYTHON=/path/to/a/python/with/torch (a venv is fine)"
"$PY" -c 'import aiohttp, prometheus_client, pynvml, topoagent.cli' 2> "$OUT/raw/imports.err" ||
  stop "topoagent's dependencies are not importable by $PY (no network to install them): $(tail -n 1 "$OUT/raw/imports.err")"
TOPOAGENT=("$PY" -m topoagent)
"${TOPOAGENT[@]}" --version

# 3. The node: a snapshot, and the raw outputs beside it.
timeout 90 "${TOPOAGENT[@]}" snapshot --force "$OUT/snapshot.tar.gz" || fail "topoagent snapshot"
nvidia-smi topo -m > "$OUT/raw/nvidia-smi_topo_-m.out" 2>&1
nvidia-smi -q > "$OUT/raw/nvidia-smi_-q.out" 2>&1
nvidia-smi > "$OUT/raw/nvidia-smi.out" 2>&1
nvidia-smi nvlink -s > "$OUT/raw/nvidia-smi_nvlink_-s.out" 2>&1 || true
nvidia-smi --query-gpu=index,name,pci.bus_id,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max \
  --format=csv,noheader,nounits > "$OUT/raw/gpus.csv" || fail "nvidia-smi --query-gpu"
if command -v numactl >/dev/null; then numactl -H > "$OUT/raw/numactl_-H.out" 2>&1; fi
if command -v lscpu >/dev/null; then lscpu > "$OUT/raw/lscpu.out" 2>&1; fi
cat "$OUT/raw/nvidia-smi_topo_-m.out"
GPUS=$(grep -c '^GPU [0-9]' "$OUT/raw/nvidia-smi_-L.out")

# 4. discover and place, as one-shot commands.
TIMEFORMAT="%R s"
{ time timeout 60 "${TOPOAGENT[@]}" discover --json > "$OUT/discover.json"; } 2> "$OUT/discover.time" || fail "topoagent discover"
echo "discover --json: $(tail -n 1 "$OUT/discover.time")"
timeout 60 "${TOPOAGENT[@]}" discover > "$OUT/discover.txt" 2>&1 || fail "topoagent discover (text)"
timeout 60 "${TOPOAGENT[@]}" place --gpus 1 --json > "$OUT/place-1.json" || fail "topoagent place --gpus 1"
timeout 60 "${TOPOAGENT[@]}" place --gpus "$((GPUS + 1))" > "$OUT/place-too-many.txt" 2>&1
rc=$?
[ "$rc" = 3 ] || fail "topoagent place --gpus $((GPUS + 1)) exited $rc, not 3 (never fits)"

# 5. serve, and its GPU series beside nvidia-smi's under a load of our own.
"${TOPOAGENT[@]}" serve --root / --listen 127.0.0.1:0 --state-dir "$OUT/state" > "$OUT/serve.out" 2> "$OUT/serve.log" &
SERVE=$!
LOAD=""
cleanup() {
  if [ -n "$LOAD" ]; then kill "$LOAD" 2>/dev/null; fi
  if [ -n "$SERVE" ]; then kill "$SERVE" 2>/dev/null; fi
}
trap cleanup EXIT
if URL=$("$PY" bench/gpu_check.py wait-ready "$OUT/serve.out" 60); then
  "$PY" bench/gpu_check.py save "$URL/readyz" "$OUT/readyz.json"
  "$PY" bench/gpu_check.py save "$URL/topology" "$OUT/topology.json"
  "$PY" bench/gpu_check.py sample "$URL" "$OUT/idle" 2 3 || fail "idle samples"
  "$PY" bench/gpu_check.py http-costs "$URL" "$OUT/http-costs-ms.json" > /dev/null || fail "timing /metrics and /place (see http-costs-ms.json)"
  "$PY" bench/gpu_check.py load 60 "$OUT/load.started" > "$OUT/load.log" 2>&1 &
  LOAD=$!
  for _ in $(seq 1 600); do
    if [ -e "$OUT/load.started" ] || ! kill -0 "$LOAD" 2>/dev/null; then break; fi
    sleep 0.1
  done
  if [ -e "$OUT/load.started" ]; then
    "$PY" bench/gpu_check.py sample "$URL" "$OUT/load-parity" 8 3 || fail "samples under load"
    "$PY" bench/gpu_check.py parity "$OUT/load-parity" | tee "$OUT/load-parity/parity.txt" || fail "GPU series on /metrics (see load-parity/parity.txt)"
  else
    fail "the load did not start (load.log: $(tail -n 1 "$OUT/load.log"))"
  fi
  kill "$LOAD" 2>/dev/null; wait "$LOAD" 2>/dev/null; LOAD=""
  "$PY" bench/gpu_check.py save "$URL/metrics" "$OUT/metrics-after-load.prom"
else
  fail "topoagent serve never loaded a topology (serve.log: $(tail -n 1 "$OUT/serve.log"))"
fi
kill "$SERVE" 2>/dev/null; wait "$SERVE"; rc=$?; SERVE=""
[ "$rc" = 0 ] || fail "topoagent serve exited $rc on SIGTERM"

# 6. One probe round on CUDA, its figures beside the physical limits.
PROBE_TIMEOUT="${PROBE_TIMEOUT:-120}"  # the round's limit; a big node's full round may want more
timeout "$((PROBE_TIMEOUT + 30))" "${TOPOAGENT[@]}" probe --backend cuda --root / --timeout "$PROBE_TIMEOUT" --json --no-progress > "$OUT/probe.json" 2> "$OUT/probe.log"
rc=$?
echo "probe exit status: $rc"
[ "$rc" = 0 ] || fail "topoagent probe --backend cuda exited $rc (see probe.log: $(tail -n 1 "$OUT/probe.log"))"
if [ -s "$OUT/probe.json" ]; then
  "$PY" bench/gpu_limits.py "$OUT/probe.json" "$OUT/raw/gpus.csv" | tee "$OUT/figures.txt" || fail "gpu_limits.py"
fi

# 7. What NVML costs here.
timeout 120 "$PY" bench/gpu_check.py nvml-costs "$OUT/nvml-call-costs-ms.json" || fail "timing NVML calls (see nvml-call-costs-ms.json)"

# 8. All of it in one tarball.
echo "gpu_check: ${SECONDS} s; ${#FAILED[@]} step(s) failed${FAILED[*]:+: ${FAILED[*]}}"
TARBALL="$OUT.tar.gz"
tar -czf "$TARBALL" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "gpu_check: everything in $TARBALL"
[ "${#FAILED[@]}" = 0 ]
