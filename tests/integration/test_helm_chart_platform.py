"""The knobs a platform team expects of the chart (issue 32), rendered with Helm's engine:
placement and disruption, probes and security contexts, exposure of the agent's endpoints,
scraping without label clashes, NetworkPolicies, RBAC and namespace overrides, extra objects,
the image registry, alerts' runbooks and the supported Kubernetes versions."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from support.helm_render import CHART, NAMESPACE, helm_python, render


def operator_pod(values: dict[str, Any] | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = render(values).one("Deployment", "-operator")["spec"]["template"]
    return pod


def agent_container(values: dict[str, Any] | None = None) -> dict[str, Any]:
    ds = render(values).one("DaemonSet")
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return dict(container)


SELECTOR = {
    "app.kubernetes.io/name": "perseus",
    "app.kubernetes.io/instance": "perseus",
    "app.kubernetes.io/component": "operator",
}


def test_the_operator_replicas_are_spread_and_protected_from_drains() -> None:
    rendered = render()
    pdb = rendered.one("PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": SELECTOR}}
    affinity = operator_pod()["spec"]["affinity"]["podAntiAffinity"]
    (preferred,) = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["podAffinityTerm"] == {
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": SELECTOR},
    }
    hard = operator_pod({"operator": {"podAntiAffinity": "hard"}})["spec"]["affinity"]
    (required,) = hard["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["topologyKey"] == "kubernetes.io/hostname"
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}
    assert operator_pod({"operator": {"affinity": own}})["spec"]["affinity"] == own
    zone = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone"}
    spread = {**zone, "whenUnsatisfiable": "ScheduleAnyway"}
    pod = operator_pod({"operator": {"topologySpreadConstraints": [spread]}})
    assert pod["spec"]["topologySpreadConstraints"] == [
        {**spread, "labelSelector": {"matchLabels": SELECTOR}}
    ]
    assert not render({"operator": {"podDisruptionBudget": {"enabled": False}}}).of_kind(
        "PodDisruptionBudget"
    )
    with pytest.raises(helm_python.HelmValuesError, match="podAntiAffinity"):
        render({"operator": {"podAntiAffinity": "always"}})
    with pytest.raises(helm_python.HelmValuesError, match="topologySpreadConstraints"):
        render({"operator": {"topologySpreadConstraints": [zone]}})  # no whenUnsatisfiable


def test_probes_and_security_contexts_can_be_overridden() -> None:
    values = {
        "operator": {
            "livenessProbe": {"periodSeconds": 7},
            "podSecurityContext": {"fsGroup": 65532},
            "securityContext": {"runAsUser": 1001},
        },
        "agent": {
            "readinessProbe": {"timeoutSeconds": 9},
            "securityContext": {"seLinuxOptions": {}},
        },
    }
    (container,) = operator_pod(values)["spec"]["containers"]
    assert container["livenessProbe"]["periodSeconds"] == 7
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["securityContext"]["runAsUser"] == 1001
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert operator_pod(values)["spec"]["securityContext"]["fsGroup"] == 65532
    agent = agent_container(values)
    assert agent["readinessProbe"]["timeoutSeconds"] == 9
    assert agent["securityContext"]["capabilities"]["add"] == ["SYS_ADMIN"]
    assert agent["securityContext"]["seLinuxOptions"] == {}


def test_the_agent_serves_metrics_on_its_pod_address_not_all_of_them() -> None:
    container = agent_container()
    assert "--metrics-address=$(POD_IP)" in container["args"]
    assert "--metrics-port=7461" in container["args"]  # not dcgm-exporter's 9400
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    local = agent_container({"agent": {"metricsAddress": "127.0.0.1"}})
    assert "--metrics-address=127.0.0.1" in local["args"]
    # The kubelet probes a host-network pod from the node: 127.0.0.1 reaches it there.
    assert local["livenessProbe"]["httpGet"]["host"] == "127.0.0.1"
    with pytest.raises(helm_python.HelmRenderError, match="loopback"):
        render({"agent": {"metricsAddress": "127.0.0.1", "tcp": {"enabled": False}}})


def test_scrapes_keep_target_labels_and_take_relabelings() -> None:
    extra = [{"action": "drop", "sourceLabels": ["__name__"], "regex": "python_gc_.*"}]
    values = {
        "metrics": {
            "serviceMonitor": {
                "enabled": True,
                "annotations": {"team": "gpu"},
                "relabelings": [
                    {"action": "replace", "targetLabel": "cluster", "replacement": "a"}
                ],
                "metricRelabelings": extra,
            }
        }
    }
    monitors = {m["metadata"]["name"]: m for m in render(values).of_kind("ServiceMonitor")}
    for monitor in monitors.values():
        assert monitor["metadata"]["annotations"] == {"team": "gpu"}
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["honorLabels"] is False
        assert endpoint["relabelings"][-1]["targetLabel"] == "cluster"
        assert endpoint["metricRelabelings"][-1] == extra[0]
    agent = monitors["perseus-node-agent"]["spec"]["endpoints"][0]
    assert {"action": "labeldrop", "regex": "exported_node"} in agent["metricRelabelings"]
    # _created series off by default in both processes.
    for container in (agent_container(), operator_pod()["spec"]["containers"][0]):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["PROMETHEUS_DISABLE_CREATED_SERIES"] == "True"
    on = agent_container({"metrics": {"createdSeries": True}})
    assert "PROMETHEUS_DISABLE_CREATED_SERIES" not in {e["name"] for e in on["env"]}


def test_network_policies_admit_what_each_component_serves() -> None:
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}]
    rendered = render({"networkPolicy": {"enabled": True, "metricsFrom": peers}})
    policies = {p["metadata"]["name"]: p["spec"] for p in rendered.of_kind("NetworkPolicy")}
    operator = policies["perseus-operator"]["ingress"]
    ports = [rule["ports"][0]["port"] for rule in operator]
    assert ports == ["webhook", "health", "metrics"]
    assert operator[2]["from"] == peers and "from" not in operator[0]
    agent = policies["perseus-node-agent"]["ingress"]
    assert agent[0]["ports"][0]["port"] == "clients"
    selector = agent[0]["from"][0]["podSelector"]["matchLabels"]
    assert selector == {"perseus.energy/agent-client": "true"}
    assert agent[1]["from"] == peers
    assert not render().of_kind("NetworkPolicy")


def test_rbac_namespace_registry_and_extra_objects() -> None:
    kinds = {o["kind"] for o in render({"rbac": {"create": False}}).objects}
    assert not kinds & {"Role", "RoleBinding"}
    cluster_roles = render({"rbac": {"create": False}}).of_kind("ClusterRole")
    assert [r["metadata"]["name"] for r in cluster_roles] == ["perseus-operator-uninstall"]
    moved = render({"namespaceOverride": "gpu-system"})
    namespaced = [o for o in moved.objects if "namespace" in o["metadata"]]
    assert namespaced and {o["metadata"]["namespace"] for o in namespaced} == {"gpu-system"}
    assert NAMESPACE not in yaml.safe_dump(moved.one("Deployment", "-operator"))
    image = operator_pod({"global": {"imageRegistry": "mirror.example.com"}})["spec"]
    assert image["containers"][0]["image"].startswith("mirror.example.com/perseus-k8s/")
    extra = render(
        {
            "extraObjects": [
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-x"
            ]
        }
    )
    assert extra.one("ConfigMap", "-x")["metadata"]["name"] == "perseus-x"


def test_alerts_have_runbooks_and_an_absent_operator_alerts() -> None:
    rule = render({"prometheusRule": {"enabled": True}}).one("PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    for name, alert in alerts.items():
        assert alert["annotations"]["runbook_url"].endswith(f"#{name.lower()}"), name
    assert alerts["PerseusOperatorAbsent"]["expr"] == 'absent(up{job="perseus-operator"})'
    assert "perseus_operator_leader" in alerts["PerseusOperatorNoLeader"]["expr"]
    assert "job_name" in alerts["PerseusStragglerPersistent"]["expr"]


def test_the_chart_wants_kubernetes_1_30_as_the_readme_says() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.30.0-0"
    for key in ("home", "sources", "maintainers", "icon"):
        assert chart[key], key
    assert sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))
    # (helm install and helm template refuse an older cluster by kubeVersion; the SDK's lint
    # does not check it.)
    new = helm_python.lint(str(CHART), {}, strict=True, kube_version="1.30.0")
    assert not new["messages"], new


def test_artifact_hub_lists_every_crd_the_chart_ships() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    listed = yaml.safe_load(chart["annotations"]["artifacthub.io/crds"])
    shipped = [yaml.safe_load(p.read_text()) for p in sorted((CHART / "crds").glob("*.yaml"))]
    assert sorted(c["kind"] for c in listed) == sorted(c["spec"]["names"]["kind"] for c in shipped)
    for crd in listed:
        assert crd["version"] == "v1alpha1" and crd["description"], crd


def test_helm_refuses_a_cluster_older_than_1_30() -> None:
    helm = os.environ.get("PERSEUS_HELM_BIN") or shutil.which("helm")
    if not helm:
        pytest.skip("no helm CLI (scripts/build_test_control_plane.sh --only helm builds one)")

    def template(version: str) -> subprocess.CompletedProcess[str]:
        command = [helm, "template", "p", str(CHART), "--kube-version", version]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)

    old = template("1.29.0")
    assert old.returncode != 0 and "requires kubeVersion: >=1.30.0-0" in old.stderr, old.stderr
    new = template("1.30.0")
    assert new.returncode == 0, new.stderr
    assert "kind: ValidatingAdmissionPolicy" in new.stdout  # rendered wherever it installs
