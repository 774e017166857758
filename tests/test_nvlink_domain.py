"""Multi-node NVLink domains from NVML's GPU fabric info: recorded, modelled, exposed."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import FIXTURES
from fakenode import FakeNode
from schema_check import validate

from topoagent.collectors.base import SourceError
from topoagent.collectors.nvml import _fabric_answer, parse_nvml
from topoagent.documents.schema import node_document
from topoagent.exporters.nfd import nfd_features
from topoagent.exporters.prometheus import SnapshotCollector
from topoagent.node.discovery import discover_sync
from topoagent.node.host import Host
from topoagent.service.served import Snapshot

TRAY = FIXTURES / "nvml" / "gb200-nvl72-tray.json"
CLUSTER = "7a3f9c2e-4b1d-4e8a-9c6f-2d5e8b1a0c34"


def gb200_tray(tmp_path):
    FakeNode(tmp_path, numa={0: "0-71", 1: "72-143"})
    shutil.copy(TRAY, tmp_path / "nvml.json")
    with Host(tmp_path) as host:
        return discover_sync(host)


def test_a_gb200_tray_reports_its_nvlink_domain_in_the_topology_document(tmp_path):
    node = gb200_tray(tmp_path)
    doc = node_document(node)
    validate(doc, "Node")
    # GPU3's registration is still in progress: it is not (yet) in the domain.
    assert doc["nvlink_domain"] == {"cluster_uuid": CLUSTER, "clique_id": 32766, "gpus": ["GPU0", "GPU1", "GPU2"]}


def test_the_domain_is_a_metric_and_nfd_labels(tmp_path):
    node = gb200_tray(tmp_path)
    snapshot = Snapshot(1, node, node.distance_matrix(), 0.0, node.collectors, {})
    families = {f.name: f for f in SnapshotCollector(snapshot).collect()}
    (sample,) = families["topoagent_nvlink_domain"].samples
    assert sample.name == "topoagent_nvlink_domain_info"
    assert sample.labels == {"cluster_uuid": CLUSTER, "clique_id": "32766"}
    labels = nfd_features(node)  # checked against Kubernetes' label syntax inside
    assert labels["topoagent.io/nvlink.cluster-uuid"] == CLUSTER
    assert labels["topoagent.io/nvlink.clique-id"] == "32766"


def test_recordings_without_fabric_info_have_no_domain(tmp_path):
    FakeNode(tmp_path)
    data = json.loads(TRAY.read_text())
    for gpu in data["gpus"]:
        del gpu["fabric"]  # what recordings made before the fabric was asked hold
    (tmp_path / "nvml.json").write_text(json.dumps(data))
    with Host(tmp_path) as host:
        node = discover_sync(host)
    assert node_document(node)["nvlink_domain"] is None
    snapshot = Snapshot(1, node, node.distance_matrix(), 0.0, node.collectors, {})
    assert "topoagent_nvlink_domain" not in {f.name for f in SnapshotCollector(snapshot).collect()}
    assert not any("nvlink.cluster" in key for key in nfd_features(node))


def test_an_all_zero_cluster_uuid_is_no_cluster():
    fabric = {"cluster_uuid": "00000000-0000-0000-0000-000000000000", "clique_id": 0, "state": "completed", "status": 0}
    info = parse_nvml({"gpus": [{"index": 0, "fabric": fabric}]})
    assert info.gpus[0].fabric is not None and not info.gpus[0].fabric.registered


def test_a_bad_fabric_state_names_the_field():
    with pytest.raises(SourceError, match=r"gpus\[0\]\.fabric: state 'done'"):
        parse_nvml({"gpus": [{"index": 0, "fabric": {"state": "done"}}]})


def test_nvml_fabric_struct_is_written_in_the_recording_shape():
    """The binding's own struct, as NVML fills it (tests/test_nvml_real_binding.py reads every
    state through the binding over the suite's C-ABI NVML)."""
    import pynvml

    struct = pynvml.c_nvmlGpuFabricInfoV_t()
    struct.clusterUuid[:] = [0x7A, 0x3F, 0x9C, 0x2E, 0x4B, 0x1D, 0x4E, 0x8A, 0x9C, 0x6F, 0x2D, 0x5E, 0x8B, 0x1A, 0x0C, 0x34]
    struct.cliqueId, struct.state, struct.status = 32766, 3, 0
    assert _fabric_answer(struct) == {"cluster_uuid": CLUSTER, "clique_id": 32766, "state": "completed", "status": 0}
    assert _fabric_answer(None) is None
    # A state a newer driver may add is recorded as one nobody can read, not dropped as "no answer".
    struct.state = 7
    unknown = _fabric_answer(struct)
    assert unknown is not None and (unknown["state"], unknown["unknown"]) == ("unknown", "state 7")
