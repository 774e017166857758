from __future__ import annotations

import pytest

from topoagent.node.levels import (
    LevelError,
    LevelKind,
    LinkLevel,
    expected_gbps,
    nvlink_generation_for_model,
    pcie_gbps,
)

ORDER = ["X", "NV18", "NV12", "NV2", "NV1", "PIX", "PXB", "PHB", "NODE", "SYS"]


def test_levels_sort_closest_first_and_more_links_closer():
    shuffled = [LinkLevel.parse(t) for t in reversed(ORDER)]
    assert [str(level) for level in sorted(shuffled)] == ORDER


def test_soc_from_old_drivers_reads_as_sys():
    assert LinkLevel.parse("SOC") == LinkLevel(LevelKind.SYS)
    assert str(LinkLevel.parse("SOC")) == "SYS"


@pytest.mark.parametrize("bad", ["NV", "NV0", "FOO", "", "NVX", "PI X"])
def test_non_levels_are_refused(bad):
    with pytest.raises(LevelError):
        LinkLevel.parse(bad)


def test_expected_bandwidth_follows_level_order():
    values = [expected_gbps(LinkLevel.parse(t)) for t in ORDER[1:]]
    assert values == sorted(values, reverse=True)
    assert expected_gbps(LinkLevel.parse("X")) is None


def test_nvlink_bandwidth_by_generation():
    nv18 = LinkLevel.parse("NV18")
    assert expected_gbps(nv18) == 450.0  # generic 25 GB/s per link
    assert expected_gbps(nv18, nvlink_generation=5) == 900.0  # B200: 50 GB/s per link
    assert expected_gbps(LinkLevel.parse("NV4"), nvlink_generation=1) == 80.0  # P100


def test_pcie_bandwidth_by_generation_and_width():
    assert pcie_gbps(4, 16) == pytest.approx(31.5, abs=0.1)
    assert pcie_gbps() == pcie_gbps(3, 16)  # unknown link: Gen3 x16
    assert pcie_gbps(3, 16) == pytest.approx(15.75, abs=0.05)
    assert pcie_gbps(4, 8) == pytest.approx(pcie_gbps(4, 16) / 2)
    # A degraded x8 link lowers a PIX pair's expectation.
    assert expected_gbps(LinkLevel.parse("PIX"), pcie_gen=4, pcie_width=8) < expected_gbps(LinkLevel.parse("PIX"), pcie_gen=4, pcie_width=16)


@pytest.mark.parametrize(
    "model,gen",
    [
        ("NVIDIA A100-SXM4-80GB", 3),
        ("Tesla V100-SXM2-16GB", 2),
        ("NVIDIA H100 80GB HBM3", 4),
        ("NVIDIA GH200 480GB", 4),
        ("NVIDIA B200", 5),
        ("NVIDIA GeForce RTX 4090", None),
        (None, None),
    ],
)
def test_nvlink_generation_from_model_name(model, gen):
    assert nvlink_generation_for_model(model) == gen


@pytest.mark.parametrize("text", ["NV1000", "NV" + "1" * 4301, "NV" + "0" * 5000 + "1000"])
def test_an_nvlink_count_is_at_most_999(text):
    with pytest.raises(LevelError, match="at most 999"):
        LinkLevel.parse(text)
    assert LinkLevel.parse("NV999").nvlinks == 999
    assert LinkLevel.parse("NV" + "0" * 5000 + "18").nvlinks == 18  # leading zeros are not digits of the count
    with pytest.raises(LevelError):
        LinkLevel(LevelKind.NV, 1000)
