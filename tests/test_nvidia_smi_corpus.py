"""Every real `nvidia-smi topo -m` capture in the corpus parses, with its key facts right."""

from __future__ import annotations

import pytest
from conftest import CORPUS, FIXTURES

from topoagent.collectors.nvidia_smi import parse_topo_matrix
from topoagent.node.levels import LevelKind

TOPO_DIR = CORPUS / "nvidia-smi-topo"

# file -> (GPUs, NICs, devices without a row, {pair: level}, {device: (cpu, numa, gpu numa)},
#          {NIC name: RDMA device})
FACTS: dict[str, tuple] = {
    "asus-esc8000a-e12-4xRTX6000Ada-2xEPYC-NODE-4nic.txt": (
        4, 4, 0,
        {("GPU0", "GPU1"): "NODE", ("GPU0", "GPU2"): "SYS", ("GPU2", "NIC2"): "NODE", ("NIC0", "NIC1"): "PIX"},
        {"GPU0": ("0-31", "0", None), "GPU3": ("32-63", "1", None)},
        {"NIC0": "mlx5_0", "NIC3": "mlx5_3"},
    ),
    "autodl-container-2xRTX2080Ti-PIX-numa1.txt": (
        2, 0, 0, {("GPU0", "GPU1"): "PIX"}, {"GPU1": ("24-47,72-95", "1", None)}, {},
    ),
    "club3090-1229-2xRTX5090-PHB-tabs.txt": (
        2, 0, 0, {("GPU0", "GPU1"): "PHB"}, {"GPU0": ("0-63", "0", None)}, {},
    ),
    "dcgm-149-dgxA100-320GB-10nic-TRUNCATED-6rows.txt": (
        8, 10, 12,
        {("GPU0", "GPU7"): "NV12", ("GPU5", "GPU6"): "NV12", ("NIC0", "NIC1"): None},
        {"GPU0": ("48-63,176-191", "3", None), "GPU2": ("16-31,144-159", "1", None)},
        {},
    ),
    "delos-4gpu-NV2-NV1-2socket-xeon.txt": (
        4, 0, 0,
        {("GPU0", "GPU1"): "NV2", ("GPU1", "GPU3"): "NV1", ("GPU0", "GPU3"): "SYS", ("GPU1", "GPU2"): "SYS"},
        {"GPU0": ("0-19,40-59", "0", None), "GPU3": ("20-39,60-79", "1", None)},
        {},
    ),
    "dgxA100-8gpu-11nic-numa-range-0-7-commented.txt": (
        8, 11, 0,
        {("GPU0", "GPU7"): "NV12", ("GPU0", "mlx5_0"): "PXB", ("mlx5_9", "mlx5_10"): "PIX", ("GPU0", "mlx5_4"): "SYS"},
        {"GPU0": ("0-14,16-30", "0-7", None), "GPU2": ("16-30,144-158", "1", None)},
        {"mlx5_10": "mlx5_10"},
    ),
    "dlperf-8xV100-SXM2-hybridcubemesh-1nic-drv440.txt": (
        8, 1, 0,
        {("GPU0", "GPU1"): "NV1", ("GPU0", "GPU3"): "NV2", ("GPU0", "GPU5"): "SYS", ("GPU0", "mlx5_0"): "NODE", ("GPU5", "mlx5_0"): "SYS"},
        {"GPU0": ("0-11,24-35", None, None)},
        {"mlx5_0": "mlx5_0"},
    ),
    "dlperf-hugectr-8xV100-SXM2-2nic-drv470-handedited-tabs.txt": (
        8, 2, 0,
        {("GPU0", "GPU1"): "NV1", ("GPU0", "GPU2"): "NV2", ("GPU0", "GPU7"): "NV2", ("GPU2", "mlx5_0"): "PIX", ("mlx5_0", "mlx5_1"): "SYS"},
        {"GPU0": ("0-23,48-71", "0", None), "GPU7": ("24-47,72-95", "1", None)},
        {"mlx5_1": "mlx5_1"},
    ),
    "gb200-4gpu-grace-openshift-8nic-numa-multivalue-drv580.txt": (
        4, 8, 0,
        {("GPU0", "GPU3"): "NV18", ("GPU0", "NIC0"): "SYS", ("NIC2", "NIC3"): "PIX", ("NIC6", "NIC7"): "PIX"},
        {"GPU0": ("0-71", "0,2-17", None), "GPU2": ("72-143", "1,18-33", None)},
        {"NIC0": "mlx5_0", "NIC3": "mlx5_3"},
    ),
    "hami-99-1xTeslaP4-numa-NA-tabs.txt": (1, 0, 0, {}, {"GPU0": ("0-7", None, None)}, {}),
    "ibm-ac922-power9-4xV100-NV3-6nic.txt": (
        4, 6, 0,
        {("GPU0", "GPU1"): "NV3", ("GPU0", "GPU2"): "SYS", ("GPU2", "mlx5_5"): "NODE", ("mlx5_4", "mlx5_5"): "PIX"},
        {"GPU0": ("0-63", "0", None), "GPU3": ("64-127", "8", None)},
        {"mlx5_2": "mlx5_2"},
    ),
    "lmdeploy-1944-2gpu-subset-NV12-8xmlx5-tabs.txt": (
        2, 8, 0,
        {("GPU0", "GPU1"): "NV12", ("GPU0", "mlx5_6"): "PXB", ("mlx5_0", "mlx5_1"): "PIX"},
        {"GPU1": ("48-95,144-191", "1", None)},
        {},
    ),
    "lmdeploy-4863-4xRTX2080Ti-PIX-tabs.txt": (
        4, 0, 0, {("GPU0", "GPU3"): "PIX"}, {"GPU2": ("0-19,40-59", "0", None)}, {},
    ),
    "nccl-933-8gpu-NV8-9nic-TRUNCATED-7rows.txt": (
        8, 9, 10,
        {("GPU0", "GPU7"): "NV8", ("GPU0", "NIC2"): "PIX", ("GPU1", "NIC4"): "PIX", ("GPU0", "NIC1"): "SYS", ("NIC0", "NIC1"): None},
        {"GPU0": ("0-47,96-143", "0", None), "GPU4": ("48-95,144-191", "1", None)},
        {},
    ),
    "nccl-tests-78-dgx2-16xV100-NV6-10nic-TRUNCATED-4rows.txt": (
        16, 10, 22,
        {("GPU0", "GPU15"): "NV6", ("GPU0", "mlx5_0"): "PIX", ("GPU0", "mlx5_1"): "PXB", ("GPU4", "GPU5"): None},
        {"GPU3": ("0-23,48-71", None, None)},
        {},
    ),
    "puget-wrx90-2xRTX6000Ada-PHB-2nic.txt": (
        2, 2, 0, {("GPU0", "GPU1"): "PHB", ("GPU1", "NIC1"): "NODE", ("NIC0", "NIC1"): "PIX"},
        {"GPU0": ("0-23", "0", None)}, {"NIC0": "mlx5_0", "NIC1": "mlx5_1"},
    ),
    "sglang-1xH100-PCIe-kvm-vm-1nic-cpu0-251.txt": (
        1, 1, 0, {("GPU0", "NIC0"): "PHB"}, {"GPU0": ("0-251", "0", None)}, {"NIC0": "mlx5_0"},
    ),
    "sglang-20855-8xH100-NV18-8nic-misaligned-columns.txt": (
        8, 8, 0,
        {("GPU0", "GPU7"): "NV18", ("GPU0", "NIC0"): "PIX", ("GPU0", "NIC1"): "PIX", ("GPU1", "NIC0"): "NODE", ("GPU0", "NIC4"): "SYS"},
        {"GPU0": ("0-47,96-143", "0", None), "GPU7": ("48-95,144-191", "1", None)},
        {},
    ),
    "sglang-24966-8xH20-NV18-8nic-tabs-drv535.txt": (
        8, 8, 0,
        {("GPU0", "GPU7"): "NV18", ("GPU0", "NIC0"): "PIX", ("GPU7", "NIC7"): "PIX", ("GPU0", "NIC4"): "SYS", ("NIC0", "NIC1"): "NODE"},
        {"GPU0": ("0-47,96-143", "0", None), "GPU4": ("48-95,144-191", "1", None)},
        {"NIC0": "mlx5_1", "NIC7": "mlx5_8"},
    ),
    "stas00-2gpu-NV2-consumer-example.txt": (
        2, 0, 0, {("GPU0", "GPU1"): "NV2"}, {"GPU0": ("0-23", None, None)}, {},
    ),
    "stas00-2gpu-PHB-consumer-example.txt": (
        2, 0, 0, {("GPU0", "GPU1"): "PHB"}, {"GPU1": ("0-11", None, None)}, {},
    ),
    "stas00-8xA100-2socket-24c-reformatted.txt": (
        8, 0, 0, {("GPU0", "GPU7"): "NV12"}, {"GPU0": ("0-23", "0", None), "GPU7": ("24-47", "1", None)}, {},
    ),
    "stas00-8xH100-2socket-52c-ht.txt": (
        8, 0, 0, {("GPU3", "GPU4"): "NV18"}, {"GPU4": ("52-103,156-207", "1", None)}, {},
    ),
    "tensorflow-gdr-4gpu-mlx4-PHB-SOC-tabs.txt": (
        4, 1, 0,
        {("GPU0", "GPU1"): "PHB", ("GPU0", "GPU2"): "SYS", ("GPU2", "mlx4_0"): "PHB", ("GPU0", "mlx4_0"): "SYS"},
        {"GPU0": ("0-5", None, None), "GPU3": ("6-11", None, None)},
        {"mlx4_0": "mlx4_0"},
    ),
    "thunderkittens-167-8xH100-NV18-noNIC-TRUNCATED-legend.txt": (
        8, 0, 0, {("GPU0", "GPU7"): "NV18"}, {"GPU7": ("48-95,144-191", "1", None)}, {},
    ),
    "unsloth-3872-8xB200-4numa-9nic-oddspacing-TRUNCATED-5rows.txt": (
        8, 9, 12,
        {("GPU0", "GPU7"): "NV18", ("GPU0", "NIC0"): "PIX", ("GPU4", "NIC4"): "PIX", ("GPU2", "NIC3"): "NODE"},
        {"GPU0": ("0-27", "0", None), "GPU4": ("56-83", "2", None)},
        {},
    ),
    "vllm-16336-8xB200-GPU2-nvlink-down-FRAGMENT-noheader.txt": (
        8, 12, 14,
        {("GPU0", "GPU1"): "NV18", ("GPU0", "GPU2"): "NODE", ("GPU2", "GPU4"): "SYS", ("GPU0", "GPU7"): "NV18"},
        {"GPU0": ("0-55,112-167", "0", None), "GPU5": ("56-111,168-223", "1", None)},
        {},
    ),
}


def test_every_corpus_file_is_covered():
    """A new capture in the corpus must get its facts written down here."""
    on_disk = {p.name for p in TOPO_DIR.iterdir() if p.suffix == ".txt"}
    assert on_disk - set(FACTS) == set(), "corpus files without asserted facts"


@pytest.mark.parametrize("name", sorted(FACTS))
def test_corpus_file_facts(corpus, name):
    gpus, nics, missing, pairs, affinities, legend = FACTS[name]
    topo = parse_topo_matrix((TOPO_DIR / name).read_text())
    assert len(topo.gpus) == gpus
    assert len(topo.nics) == nics
    assert len(topo.missing_rows) == missing
    for (a, b), level in pairs.items():
        got = topo.level(a, b)
        assert (None if got is None else str(got)) == level, (a, b)
        assert topo.level(b, a) == got  # symmetric
    for name_, (cpu, numa, gpu_numa) in affinities.items():
        device = topo.devices[topo.index(name_)]
        assert (device.cpu_affinity, device.numa_affinity, device.gpu_numa_id) == (cpu, numa, gpu_numa)
    for nic, rdma in legend.items():
        assert topo.devices[topo.index(nic)].device == rdma


def test_complete_captures_have_every_pair(corpus):
    for name, facts in FACTS.items():
        if facts[2]:
            continue
        topo = parse_topo_matrix((TOPO_DIR / name).read_text())
        assert all(level is not None for _, _, level in topo.pairs()), name
        assert topo.notes == (), name


def test_fragment_without_header_says_what_it_inferred(corpus):
    topo = parse_topo_matrix((TOPO_DIR / "vllm-16336-8xB200-GPU2-nvlink-down-FRAGMENT-noheader.txt").read_text())
    assert any("no header" in note for note in topo.notes)
    assert any("inferred" in note and "GPU6" in note for note in topo.notes)
    # GPU2 lost its NVLinks: no NV level to any peer.
    assert all(not topo.level("GPU2", f"GPU{i}").is_nvlink for i in range(8) if i != 2)


def test_a_real_driver_580_output_is_read_with_its_header_and_no_warning():
    """nvidia-smi 580.159.04 on an H200 (fixtures/SOURCES.md) underlines its header line with
    terminal escape codes and prints a GPU NUMA ID column: the header is read as one, and the
    row's three values land in their columns, with nothing to warn about."""
    text = (FIXTURES / "nvidia-smi" / "h200-vm-1gpu-drv580-escape-codes.txt").read_text()
    assert text.startswith("\t\x1b[4mGPU0\t") and "GPU NUMA ID\x1b[0m\n" in text  # the driver's own bytes
    topo = parse_topo_matrix(text)
    assert [(d.name, d.kind) for d in topo.devices] == [("GPU0", "gpu")]
    assert topo.level("GPU0", "GPU0").kind is LevelKind.SELF
    gpu = topo.gpus[0]
    assert (gpu.cpu_affinity, gpu.numa_affinity, gpu.gpu_numa_id) == ("0-15", "0", None)  # GPU NUMA ID: N/A
    assert topo.notes == () and topo.missing_rows == ()
