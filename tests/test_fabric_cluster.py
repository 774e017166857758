"""`topoagent cluster-topology` over 16 recorded nodes cabled as recorded fabrics: the Slurm
and Kueue files it writes hold each node under the leaf the recorded wiring says."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from fabric_cluster import FABRIC, REPO, IbSwitch, build_node, host_port, leaves, parse_ibnetdiscover
from service_helpers import start_agent
from slurm_cluster import SlurmCluster, SlurmNode

from topoagent.documents.schema import node_document
from topoagent.exporters.cluster_topology import ClusterNode, hostlist, slurm_topology_yaml, switch_name
from topoagent.exporters.nfd import nfd_features
from topoagent.node.discovery import discover_sync
from topoagent.node.host import Host

FAT_TREE = parse_ibnetdiscover((FABRIC / "ibnetdiscover-edr-fat-tree.txt").read_text())
RAILS = parse_ibnetdiscover((FABRIC / "ibnetdiscover-rail-optimised-synthetic.txt").read_text())
# Four hosts on each of the real dump's four leaves; each is the recorded DGX-1 (one HCA).
FAT_TREE_HOSTS = ["gpu001", "gpu002", "gpu003", "node001", "gpu004", "gpu005", "gpu006", "gpu007",
                  "gpu021", "gpu022", "gpu023", "gpu024", "node021", "node023", "node025", "node027"]
RAIL_HOSTS = [f"h100-{n:03d}" for n in range(1, 17)]
KUEUE_CRD = yaml.safe_load((REPO / "tests" / "data" / "kueue" / "kueue.x-k8s.io_topologies.yaml").read_text())

# topology.yaml as topology.yaml(5) (Slurm 24.05+) describes it, written here from the man
# page: Debian's slurmctld 22.05 reads topology.conf only, so it cannot load this file.
SLURM_TOPOLOGY_YAML = {
    "type": "array", "minItems": 1,
    "items": {
        "type": "object", "required": ["topology"], "additionalProperties": False,
        "properties": {
            "topology": {"type": "string", "minLength": 1},
            "cluster_default": {"type": "boolean"},
            "flat": {"type": "boolean"},
            "tree": {"type": "object", "required": ["switches"], "additionalProperties": False, "properties": {
                "switches": {"type": "array", "items": {
                    "type": "object", "required": ["switch"], "additionalProperties": False,
                    "properties": {"switch": {"type": "string"}, "children": {"type": "string"}, "nodes": {"type": "string"}}}}}},
            "block": {"type": "object", "required": ["blocks"], "additionalProperties": False, "properties": {
                "block_sizes": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                "blocks": {"type": "array", "items": {
                    "type": "object", "required": ["block"], "additionalProperties": False,
                    "properties": {"block": {"type": "string"}, "nodes": {"type": "string"}}}}}},
        },
        "oneOf": [{"required": ["tree"]}, {"required": ["block"]}, {"required": ["flat"]}],
    },
}


def expand(expression: str) -> list[str]:
    """Slurm's hostlist expression, expanded (written apart from the code under test)."""
    out = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", expression):
        match = re.fullmatch(r"(.*)\[(.*)\]", part)
        if not match:
            out.append(part)
            continue
        for item in match.group(2).split(","):
            low, _, high = item.partition("-")
            for n in range(int(low), int(high or low) + 1):
                out.append(f"{match.group(1)}{n:0{len(low)}d}")
    return out


def topology_conf_switches(text: str) -> dict[str, dict[str, list[str]]]:
    switches = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        fields = dict(item.split("=", 1) for item in line.split())
        switches[fields.pop("SwitchName")] = {k: expand(v) for k, v in fields.items()}
    return switches


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "topoagent", "cluster-topology", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def write_documents(tmp_path: Path, base: str, hosts: list[str], cabling_of) -> list[str]:
    """Build each node, discover it as `topoagent discover --json` would, save its document."""
    paths = []
    for host in hosts:
        root = build_node(base, tmp_path / "nodes" / host, host, cabling_of(host))
        with Host(root) as replay:
            document = node_document(discover_sync(replay), timings=False)
        path = tmp_path / f"{host}.json"
        path.write_text(json.dumps(document))
        paths.append(str(path))
    return paths


def fat_tree_cabling(host: str) -> dict[str, tuple[IbSwitch, int]]:
    return {"mlx5_0": host_port(FAT_TREE, f"{host} HCA-1")}


def rail_cabling(host: str) -> dict[str, tuple[IbSwitch, int]]:
    return {f"mlx5_{k}": host_port(RAILS, f"{host} mlx5_{k}") for k in range(8)}


def validate_kueue(text: str) -> dict:
    topology = yaml.safe_load(text)
    (version,) = [v for v in KUEUE_CRD["spec"]["versions"] if v["name"] == topology["apiVersion"].split("/")[1]]
    assert topology["apiVersion"].split("/")[0] == KUEUE_CRD["spec"]["group"] and topology["kind"] == KUEUE_CRD["spec"]["names"]["kind"]
    assert version["served"] and not version.get("deprecated")
    jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"]).validate(topology)
    # The CRD's CEL rules, which a JSON Schema validator does not run.
    labels = [level["nodeLabel"] for level in topology["spec"]["levels"]]
    assert len(set(labels)) == len(labels)
    assert "kubernetes.io/hostname" not in labels[:-1]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", topology["metadata"]["name"])
    return topology


def test_a_real_two_tier_fat_tree_files_each_node_under_its_recorded_leaf(tmp_path: Path) -> None:
    files = write_documents(tmp_path, "dgx1-v100", FAT_TREE_HOSTS, fat_tree_cabling)
    out = tmp_path / "out"
    out.mkdir()
    done = cli("--topology-files", *files, "--write", str(out))
    assert done.returncode == 0, done.stderr
    switches = topology_conf_switches((out / "topology.conf").read_text())
    # Each host under the leaf the dump cables its HCA to; one top switch over the leaves,
    # as the dump's two spines each reach all four leaves.
    expected: dict[str, list[str]] = {}
    for host in FAT_TREE_HOSTS:
        leaf, _ = host_port(FAT_TREE, f"{host} HCA-1")
        expected.setdefault(switch_name(leaf.guid), []).append(host)
    spines = {guid for guid, s in FAT_TREE.items() if not s.hosts}
    assert len(spines) == 2 and all(s.uplinks == spines for s in leaves(FAT_TREE).values())
    assert {name: sorted(s["Nodes"]) for name, s in switches.items() if "Nodes" in s} == {k: sorted(v) for k, v in expected.items()}
    assert len(expected) == 4 and sorted(switches["fabric"]["Switches"]) == sorted(expected)

    tree = yaml.safe_load((out / "topology.yaml").read_text())
    jsonschema.Draft202012Validator(SLURM_TOPOLOGY_YAML).validate(tree)
    (fabric,) = tree
    assert next(iter(fabric)) == "topology"  # topology.yaml(5): "Must be the first attribute"
    yaml_leaves = {s["switch"]: sorted(expand(s["nodes"])) for s in fabric["tree"]["switches"] if "nodes" in s}
    assert yaml_leaves == {k: sorted(v) for k, v in expected.items()}

    kueue = validate_kueue((out / "kueue-topology.yaml").read_text())
    levels = [level["nodeLabel"] for level in kueue["spec"]["levels"]]
    assert levels == ["topoagent.io/fabric.leaf", "kubernetes.io/hostname"]
    # The label each node carries for the leaf level (what `export nfd` writes) is the leaf
    # of the recorded wiring: nodes Kueue sees in one domain share a leaf.
    for host in FAT_TREE_HOSTS:
        with Host(tmp_path / "nodes" / host) as replay:
            labels = nfd_features(discover_sync(replay))
        leaf, _ = host_port(FAT_TREE, f"{host} HCA-1")
        assert labels[levels[0]] == leaf.guid


def shown_topology(text: str) -> dict[str, tuple[str, list[str]]]:
    """`scontrol show topology` -> switch name -> (level, its nodes expanded)."""
    out = {}
    for m in re.finditer(r"SwitchName=(?P<name>\S+) Level=(?P<level>\d) .*?Nodes=(?P<nodes>\S+)", text):
        out[m["name"]] = (m["level"], sorted(expand(m["nodes"])))
    return out


def test_a_real_slurmctld_loads_the_fat_tree_and_says_each_leaf_holds_its_recorded_hosts(tmp_path: Path) -> None:
    files = write_documents(tmp_path, "dgx1-v100", FAT_TREE_HOSTS, fat_tree_cabling)
    done = cli("--topology-files", *files)
    assert done.returncode == 0, done.stderr
    nodes = [SlurmNode(hostlist(FAT_TREE_HOSTS), slurmd=False)]
    with SlurmCluster(tmp_path / "slurm", nodes, topology_conf=done.stdout) as cluster:
        shown = cluster.run("scontrol", "show", "topology").stdout
    expected: dict[str, tuple[str, list[str]]] = {}
    for host in FAT_TREE_HOSTS:
        leaf, _ = host_port(FAT_TREE, f"{host} HCA-1")
        expected.setdefault(switch_name(leaf.guid), ("0", []))[1].append(host)
    expected = {name: (level, sorted(hosts)) for name, (level, hosts) in expected.items()}
    expected["fabric"] = ("1", sorted(FAT_TREE_HOSTS))
    assert shown_topology(shown) == expected, shown


def test_a_rail_optimised_cluster_is_one_group_of_its_eight_rail_leaves(tmp_path: Path) -> None:
    files = write_documents(tmp_path, "hgx-h100", RAIL_HOSTS, rail_cabling)
    done = cli("--topology-files", *files)
    assert done.returncode == 0, done.stderr
    switches = topology_conf_switches(done.stdout)
    (group,) = switches.values()  # every node reaches the same eight leaves: one unit, no top switch
    assert sorted(group["Nodes"]) == RAIL_HOSTS
    rail_leaves = sorted(switch_name(guid) for guid in leaves(RAILS))
    assert len(rail_leaves) == 8 and f"# 8 rails, leaves: {', '.join(rail_leaves)}" in done.stdout.splitlines()
    with SlurmCluster(tmp_path / "slurm", [SlurmNode(hostlist(RAIL_HOSTS), slurmd=False)], topology_conf=done.stdout) as cluster:
        shown = shown_topology(cluster.run("scontrol", "show", "topology").stdout)
    assert list(shown.values()) == [("0", RAIL_HOSTS)]

    kueue = cli("--topology-files", *files, "--format", "kueue", "--topograph-labels")
    assert kueue.returncode == 0, kueue.stderr
    levels = [level["nodeLabel"] for level in validate_kueue(kueue.stdout)["spec"]["levels"]]
    assert levels == ["network.topology.nvidia.com/leaf", "kubernetes.io/hostname"]


def test_nvlink_domains_become_slurm_blocks() -> None:
    nodes = [ClusterNode(f"gb{n:02d}", "0xaa", (("0xaa", None),), f"7a3f.{n // 4}") for n in range(8)]
    tree, blocks = yaml.safe_load(slurm_topology_yaml(nodes))
    jsonschema.Draft202012Validator(SLURM_TOPOLOGY_YAML).validate([tree, blocks])
    assert blocks["block"]["block_sizes"] == [4]
    assert [expand(b["nodes"]) for b in blocks["block"]["blocks"]] == [[f"gb{n:02d}" for n in range(4)], [f"gb{n:02d}" for n in range(4, 8)]]


def test_hostlists_keep_padding_and_join_runs() -> None:
    assert hostlist(["gpu003", "gpu001", "gpu002", "node7", "gpu010", "login"]) == "gpu[001-003,010],login,node7"
    assert expand(hostlist(FAT_TREE_HOSTS)) == sorted(FAT_TREE_HOSTS)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_agents_over_http_and_a_dead_one_named(tmp_path: Path) -> None:
    hosts = ["gpu004", "gpu021", "node025"]
    agents = []
    try:
        for host in hosts:
            root = build_node("dgx1-v100", tmp_path / "nodes" / host, host, fat_tree_cabling(host))
            (tmp_path / host).mkdir()
            # The first guards reads with its token: --token-file passes it.
            guard = "[http]\nrequire_token_for_reads = true\n" if not agents else None
            agents.append(start_agent(tmp_path / host, root=root, config=guard, token_value="s3cret-fabric-token"))
        dead = f"http://127.0.0.1:{closed_port()}"
        urls = [a.url for a in agents]

        unauthorised = cli("--agents", *urls)
        assert unauthorised.returncode == 1 and f"{urls[0]}: HTTP 401" in unauthorised.stderr
        token_file = tmp_path / "token.txt"
        token_file.write_text("s3cret-fabric-token\n")

        refused = cli("--agents", *urls, dead, "--token-file", str(token_file))
        assert refused.returncode == 1 and refused.stdout == ""
        assert f"topoagent cluster-topology: {dead}: " in refused.stderr and "Connection refused" in refused.stderr
        assert "1 of 4 agents failed; nothing written" in refused.stderr

        listed = tmp_path / "agents.txt"
        listed.write_text("# the rack's agents\n" + "\n".join([*urls, dead]) + "\n")
        partial = cli("--agents-file", str(listed), "--partial", "--token-file", str(token_file))
        assert partial.returncode == 0 and dead in partial.stderr
        switches = topology_conf_switches(partial.stdout)
        assert {name: s["Nodes"] for name, s in switches.items() if "Nodes" in s} == {
            switch_name(host_port(FAT_TREE, f"{h} HCA-1")[0].guid): [h] for h in hosts}
    finally:
        for agent in agents:
            agent.stop()


@pytest.mark.parametrize("content, says", [
    ("not json", "not JSON"),
    ('{"schema_version": 2, "hostname": null, "fabric": {"rails": []}}', "names no hostname"),
    ('{"schema_version": 2, "hostname": "gpu001", "gpus": []}', "no fabric in the document"),
    ('{"schema_version": 2, "hostname": "bad name", "fabric": {"rails": []}}', "is not a Slurm node name"),
    ('{"schema_version": 2, "hostname": ".lan", "fabric": {"rails": []}}', "is not a Slurm node name"),
    # Not parsed as a number (Python refuses past 4300 digits): no node name is that long.
    ('{"schema_version": 2, "hostname": "gpu%s", "fabric": {"rails": []}}' % ("1" * 5000), "is not a Slurm node name"),
    ('{"schema_version": 999, "hostname": "gpu001", "fabric": {"rails": []}}',
     "the document has schema_version 999; this build reads schema_version 2, 3"),
    ('{"schema_version": "2", "hostname": "gpu001", "fabric": {"rails": []}}', 'schema_version "2"'),
    ('{"hostname": "gpu001", "fabric": {"rails": []}}', "the document has no schema_version"),
    ('{"schema_version": 2, "hostname": "gpu001", "fabric": {"rails": []}, "nvlink_domain": {"cluster_uuid": "x", "clique_id": true}}',
     "nvlink_domain.clique_id is true, not a whole number"),
    ('{"schema_version": 2, "hostname": "gpu001", "fabric": {"rails": []}, "nvlink_domain": {"cluster_uuid": 7, "clique_id": 1}}',
     "nvlink_domain.cluster_uuid is 7"),
    ('{"schema_version": 2, "hostname": "gpu001", "fabric": {"rails": []}, "nvlink_domain": ["x"]}', "nvlink_domain is [\"x\"], not an object"),
    ('{"schema_version": 2, "hostname": "gpu001", "fabric": {"leaf": 5, "rails": []}}', "fabric.leaf is 5"),
    ('{"schema_version": 2, "hostname": "gpu001", "fabric": {"rails": [{"leaf": "a", "leaf_name": ["n"]}]}}',
     "fabric.rails[0].leaf_name is [\"n\"], not text"),
])
def test_a_bad_document_is_an_error_naming_the_file(tmp_path: Path, content: str, says: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    done = cli("--topology-files", str(bad))
    assert done.returncode == 1 and f"{bad}" in done.stderr and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 2, done.stderr


def test_text_from_an_agent_cannot_add_lines_to_topology_conf(tmp_path: Path) -> None:
    document = {"schema_version": 2, "hostname": "gpu001", "fabric": {"leaf": "0xaa\nSwitchName=evil Nodes=gpu001",
                "rails": [{"leaf": "0xaa", "leaf_name": "sw\nSwitchName=evil Nodes=gpu001"}]}}
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(document))
    done = cli("--topology-files", str(path))
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stdout.splitlines() if not line.startswith("#")] == ["SwitchName=leaf-aa-SwitchName-evil-Nodes-gpu001 Nodes=gpu001"]


def test_agents_of_schema_2_and_3_are_read_alike(tmp_path: Path) -> None:
    """Version 3 changed placement answers only: during an upgrade, agents still on 2 and
    those on 3 write one cluster topology; a version this build does not know is refused."""
    files = write_documents(tmp_path, "dgx1-v100", ["gpu001", "gpu002"], fat_tree_cabling)
    assert [json.loads(Path(f).read_text())["schema_version"] for f in files] == [3, 3]
    both = cli("--topology-files", *files)
    assert both.returncode == 0, both.stderr
    older = json.loads(Path(files[0]).read_text()) | {"schema_version": 2}
    Path(files[0]).write_text(json.dumps(older))
    mixed = cli("--topology-files", *files)
    assert mixed.returncode == 0 and mixed.stdout == both.stdout, mixed.stderr
    Path(files[0]).write_text(json.dumps(older | {"schema_version": 1}))
    refused = cli("--topology-files", *files)
    assert refused.returncode == 1 and "schema_version 1; this build reads schema_version 2, 3" in refused.stderr


def test_two_agents_with_one_hostname_are_refused(tmp_path: Path) -> None:
    files = write_documents(tmp_path, "dgx1-v100", ["gpu001"], fat_tree_cabling)
    done = cli("--topology-files", files[0], files[0])
    assert done.returncode == 2 and "gpu001 is reported twice" in done.stderr


def test_a_hostile_or_broken_agent_is_an_error_naming_it_never_a_hang_or_a_traceback() -> None:
    """Not HTTP, a port that is no number, an agent that trickles its answer a byte at a
    time: each is one error line; the trickle meets --timeout in all, not per byte."""
    import time

    def trickle(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while True:  # a byte at a time, until the reader goes (an OSError ends it)
            conn.sendall(b" ")
            time.sleep(0.2)

    not_http, a = _one_shot_server("127.0.0.1", lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n"))
    trickling, b = _one_shot_server("127.0.0.1", trickle)
    urls = [f"http://127.0.0.1:{a}", f"http://127.0.0.1:{b}", "http://127.0.0.1:notaport"]
    try:
        done = cli("--agents", *urls, "--timeout", "1.5")  # cli() bounds the whole run: a hang fails it
    finally:
        not_http.close()
        trickling.close()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 4 and all(line.startswith("topoagent cluster-topology: ") for line in lines), done.stderr
    assert lines[0].startswith(f"topoagent cluster-topology: {urls[0]}: BadStatusLine: SSH-2.0")
    assert lines[1] == f"topoagent cluster-topology: {urls[1]}: no answer within 1.5 s"
    assert lines[2].startswith(f"topoagent cluster-topology: {urls[2]}: InvalidURL: nonnumeric port")
    for timeout in ("nan", "inf", "0"):
        bad = cli("--agents", urls[0], "--timeout", timeout)
        assert bad.returncode == 2 and "--timeout" in bad.stderr


def test_leaves_whose_ids_read_as_one_switch_name_stay_two_switches(tmp_path: Path) -> None:
    paths = []
    for host, leaf in (("gpu001", "a b"), ("gpu002", "a-b"), ("gpu003", "a:b"), ("gpu004", "0xcc")):
        path = tmp_path / f"{host}.json"
        path.write_text(json.dumps({"schema_version": 2, "hostname": host, "fabric": {"leaf": leaf, "rails": [{"leaf": leaf}]}}))
        paths.append(str(path))
    done = cli("--topology-files", *paths)
    assert done.returncode == 0, done.stderr
    switches = topology_conf_switches(done.stdout)
    under = {name: s["Nodes"] for name, s in switches.items() if "Nodes" in s}
    assert sorted(under.values()) == [["gpu001"], ["gpu002"], ["gpu003"], ["gpu004"]]
    assert under["leaf-cc"] == ["gpu004"]  # a name no other leaf shares is left as it was
    assert sorted(switches["fabric"]["Switches"]) == sorted(under)
    written = yaml.safe_load(cli("--topology-files", *paths, "--format", "topology.yaml").stdout)
    assert sorted(s["switch"] for s in written[0]["tree"]["switches"]) == sorted([*under, "fabric"])


@pytest.mark.parametrize("name", ["x\nspec: evil", "Upper", "", "a" * 254])
def test_the_kueue_name_is_a_kubernetes_name_or_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / "gpu001.json"
    path.write_text(json.dumps({"schema_version": 2, "hostname": "gpu001", "fabric": {"leaf": "0xaa", "rails": [{"leaf": "0xaa"}]}}))
    done = cli("--topology-files", str(path), "--format", "kueue", "--kueue-name", name)
    assert done.returncode == 2 and done.stdout == "" and "--kueue-name" in done.stderr, done.stderr


def _one_shot_server(host: str, answer) -> tuple[socket.socket, int]:
    """A listener on ``host`` that answers its first connection with ``answer(conn)``.
    Daemon threads, closed by the caller."""
    import threading

    listener = socket.socket()
    listener.bind((host, 0))
    listener.listen(4)
    listener.settimeout(30)

    def run() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            try:
                conn.recv(65536)
                answer(conn)
            except OSError:
                pass

    threading.Thread(target=run, daemon=True).start()
    return listener, listener.getsockname()[1]


def test_a_redirect_is_never_followed_so_the_token_stays_with_the_agent_asked(tmp_path: Path) -> None:
    """An agent answering 302 to another host: the token would go along if the redirect
    were followed.  It is that agent's error, on one line; the other host hears nothing."""
    import select

    token = tmp_path / "token"
    token.write_text("s3cret-not-for-others\n")
    token.chmod(0o600)
    # The other host only listens: a connection made to it waits in its backlog, to be seen below.
    elsewhere = socket.socket()
    elsewhere.bind(("127.0.0.2", 0))
    elsewhere.listen(4)
    port_b = elsewhere.getsockname()[1]
    redirect = f"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.2:{port_b}/topology\r\nContent-Length: 0\r\n\r\n".encode()
    redirecting, port_a = _one_shot_server("127.0.0.1", lambda conn: conn.sendall(redirect))
    looping, port_c = _one_shot_server("127.0.0.1", lambda conn: conn.sendall(
        b"HTTP/1.1 301 Moved Permanently\r\nLocation: /topology\r\nContent-Length: 0\r\n\r\n"))
    urls = [f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_c}"]
    try:
        done = cli("--agents", *urls, "--token-file", str(token), "--timeout", "5")
        # The command has exited: any connection it made to the other host is in the backlog now.
        followed, _, _ = select.select([elsewhere], [], [], 0)
    finally:
        for listener in (elsewhere, redirecting, looping):
            listener.close()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert followed == [], "the redirect was followed to the other host"
    assert done.stderr.splitlines() == [
        f"topoagent cluster-topology: {urls[0]}: HTTP 302 redirect to http://127.0.0.2:{port_b}/topology; not followed",
        f"topoagent cluster-topology: {urls[1]}: HTTP 301 redirect to /topology; not followed",
        "topoagent cluster-topology: 2 of 2 agents failed; nothing written (--partial writes what the others said)",
    ]


def test_timeout_bounds_the_answers_head_and_an_oversized_answer_is_refused() -> None:
    """An agent sending one header line at a time, never ending its head, meets --timeout
    in all (not per line); one sending more than 8 MiB is refused once it passes that."""
    import time

    def slow_head(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        for n in range(90):  # past any --timeout below; http.client allows 100 header lines
            time.sleep(0.2)
            conn.sendall(b"X-Slow-%d: x\r\n" % n)

    def too_big(conn: socket.socket) -> None:
        size = 9 << 20
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n[" % size)
        chunk = b"{}," * 21845
        for _ in range(size // len(chunk) + 1):
            conn.sendall(chunk)

    slow, port_a = _one_shot_server("127.0.0.1", slow_head)
    big, port_b = _one_shot_server("127.0.0.1", too_big)
    urls = [f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"]
    try:
        done = cli("--agents", *urls, "--timeout", "1.5")
    finally:
        slow.close()
        big.close()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    # The line says the deadline fired: were each header line to reset the clock, the
    # agent's 90 lines would end with its connection closing, and another error.
    assert lines[0] == f"topoagent cluster-topology: {urls[0]}: no answer within 1.5 s", done.stderr
    assert lines[1] == f"topoagent cluster-topology: {urls[1]}: answer is larger than 8 MiB", done.stderr


def test_nodes_without_a_switch_are_never_written_as_a_success(tmp_path: Path) -> None:
    """A tree missing nodes would be scheduled by as if whole: nodes whose agents know no
    switch fail the run unless --partial says to leave them out, and a tree of no node at all
    fails even then."""
    placed = write_documents(tmp_path, "dgx1-v100", ["gpu001"], fat_tree_cabling)
    lone = tmp_path / "lone.json"
    lone.write_text(json.dumps({"schema_version": 2, "hostname": "gpu002", "fabric": {"rails": []}}))
    out = tmp_path / "out"
    out.mkdir()

    alone = cli("--topology-files", str(lone), "--write", str(out))
    assert alone.returncode == 1 and "none of the 1 nodes reported a switch" in alone.stderr, alone.stderr
    assert list(out.iterdir()) == []
    mixed = cli("--topology-files", placed[0], str(lone), "--write", str(out))
    assert mixed.returncode == 1 and "gpu002: its agent knows no neighbour switch" in mixed.stderr, mixed.stderr
    assert list(out.iterdir()) == []
    partial = cli("--topology-files", placed[0], str(lone), "--partial")
    assert partial.returncode == 0 and "1 of 2 nodes written, 1 left out" in partial.stderr, partial.stderr
    assert [s["Nodes"] for s in topology_conf_switches(partial.stdout).values()] == [["gpu001"]]
    still_nothing = cli("--topology-files", str(lone), "--partial")
    assert still_nothing.returncode == 1 and still_nothing.stdout == ""
