"""Print each probe figure beside the physical limit of the link it crossed.

    python bench/gpu_limits.py PROBE_JSON GPU_CSV

PROBE_JSON: the output of `topoagent probe --json`; GPU_CSV: `nvidia-smi
--query-gpu=index,name,pci.bus_id,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max
--format=csv,noheader,nounits`.  Limits: PCIe generation x width (the GPU's maximum link;
the current one is shown too, since idle links train down to save power), the declared
level's rate for GPU pairs (NVLink links x rate, or PCIe), HBM bandwidth from the model.
Stdlib and topoagent.node.levels only.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys

from topoagent.node.levels import pcie_gbps

# Memory bandwidth, GB/s, from NVIDIA's data sheets (SXM parts unless named).
HBM_GBPS = (
    ("GH200", 4900.0), ("H200", 4800.0), ("H100 PCIE", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0),
    ("H800", 3350.0), ("H20", 4000.0), ("B200", 8000.0), ("B300", 8000.0), ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIE", 1935.0), ("A100", 1555.0), ("A800", 2039.0), ("V100", 900.0), ("L40S", 864.0),
    ("L40", 864.0), ("RTX 6000 ADA", 960.0), ("A10", 600.0), ("L4", 300.0), ("T4", 320.0),
)


def hbm_for(name: str) -> float | None:
    upper = name.upper()
    for model, gbps in HBM_GBPS:
        if model in upper:
            return gbps
    return None


def as_int(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def main(probe_json: str, gpu_csv: str) -> int:
    with open(probe_json) as probe_file:
        doc = json.load(probe_file)
    with open(gpu_csv) as csv_file:
        gpu_rows = list(csv.reader(csv_file))
    gpus = {}
    for row in gpu_rows:
        if len(row) < 7:
            continue
        index = int(row[0])
        gen_now, width_now, gen_max, width_max = (as_int(c) for c in row[3:7])
        gpus[index] = {
            "name": row[1].strip(),
            "bus": row[2].strip(),
            "pcie_max": pcie_gbps(gen_max, width_max),
            "pcie_now": pcie_gbps(gen_now, width_now),
            "link": f"Gen{gen_max} x{width_max} (now Gen{gen_now} x{width_now})",
            "hbm": hbm_for(row[1]),
        }
    pair_limit = {}
    for row in doc.get("pairs") or []:
        a, b = int(row["a"][3:]), int(row["b"][3:])
        pair_limit[(min(a, b), max(a, b))] = (row["level"], row["expected_gbps"])

    print(f"{'figure':<12} {'direction':<14} {'median':>9} {'p10..p90':>17}  {'limit':>8}  {'of limit':>8}  limit is")
    for f in doc["figures"]:
        kind = f["kind"]
        if kind == "peer_access":
            print(f"{kind:<12} {f['src']}->{f['dst']:<11} {'yes' if f['available'] else 'NO':>9}")
            continue
        limit, why = None, ""
        if kind in ("p2p", "p2p_bidir"):
            a, b = f["src"], f["dst"]
            level, expected = pair_limit.get((min(a, b), max(a, b)), (None, None))
            limit, why = expected, f"declared {level}"
            if level and not level.startswith("NV") and a in gpus and b in gpus:
                limit = min(gpus[a]["pcie_max"], gpus[b]["pcie_max"])
                why = f"{level}, PCIe {gpus[a]['link']}"
        elif kind in ("h2d", "d2h") and f["device"] in gpus:
            g = gpus[f["device"]]
            limit, why = g["pcie_max"], f"PCIe {g['link']}, NUMA node {f['numa_node']}"
        elif kind == "local_copy" and f["device"] in gpus:
            g = gpus[f["device"]]
            # A copy reads and writes every byte: it can move at most half the HBM rate.
            limit = g["hbm"] / 2 if g["hbm"] else None
            why = f"HBM {g['hbm']:.0f} GB/s / 2 (read + write), {g['name']}" if g["hbm"] else g["name"]
        elif kind == "latency":
            why = "microseconds per 4-byte copy"
        spread = f"{f['p10']:.2f}..{f['p90']:.2f}"
        share = f"{f['median'] / limit:.0%}" if limit else "-"
        shown_limit = f"{limit:.1f}" if limit else "-"
        print(
            f"{kind:<12} {f.get('direction', ''):<14} {f['median']:>9.2f} {spread:>17}  {shown_limit:>8}  {share:>8}  {why}"
        )
    for finding in doc.get("findings", []):
        print(f"finding: {finding['severity']} {finding['kind']}: {finding['message']}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`--help`, and a usage error rather than a traceback when an argument is missing."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe_json", metavar="PROBE_JSON", help="the output of `topoagent probe --json`")
    parser.add_argument("gpu_csv", metavar="GPU_CSV", help="nvidia-smi --query-gpu=... --format=csv,noheader,nounits (see above)")
    args = parser.parse_args(argv)
    return main(args.probe_json, args.gpu_csv)


if __name__ == "__main__":
    sys.exit(cli())
