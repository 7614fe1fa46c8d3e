"""The Helm chart ``helm/perseus``: it lints and renders with default and non-default values, the
output validates against the Kubernetes schemas (``kubernetes-validate --strict``), bad values
are rejected by ``values.schema.json``, the generated parts (CRDs, dashboards, the policy schema)
match their sources, and the workloads are what the operator and the agent need (flags the
programs accept, probes, privileges, volumes). Also the Grafana dashboards' structure. (The
Dockerfile: tests/unit/test_image_build.py.)
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from support.helm_render import (
    CHART,
    NAMESPACE,
    REPO_ROOT,
    Rendered,
    crds,
    helm_python,
    lint,
    render,
    validate_values,
    walk,
)

kubernetes_validate = pytest.importorskip("kubernetes_validate")

# Kubernetes releases the output is validated against: the first with
# ValidatingAdmissionPolicy v1 (rendered by default), and the newest kubernetes-validate knows.
KUBE_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
OLDEST_KUBE = "1.30.0"  # the chart's kubeVersion floor

NON_DEFAULT: dict[str, Any] = {
    "fullnameOverride": "energy",
    "commonLabels": {"team": "ml-infra"},
    "image": {"registry": "registry.example.com", "pullSecrets": [{"name": "regcred"}]},
    "defaultPolicy": {
        "mode": "Intrinsic",
        "granularity": "Stage",
        "maxSlowdown": 0.02,
        "frequencyMHz": {"minMHz": 900, "maxMHz": 1410},
    },
    "clusterPolicy": {
        "enabled": True,
        "name": "ml-teams",
        "spec": {
            "namespaceSelector": {"matchLabels": {"team": "ml"}},
            "workloads": [{"kind": "PyTorchJob"}],
            "policy": {"mode": "StragglerAware", "maxSlowdown": 0.01},
        },
    },
    "operator": {
        "image": {"digest": "sha256:" + "a" * 64},
        "watchNamespaces": ["ml", "research"],
        "logLevel": "debug",
        "plannerWorkers": 4,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "4"}},
        "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops"}],
        "extraEnv": [{"name": "PERSEUS_OPERATOR_PLANNER_TIMEOUT_S", "value": "900"}],
        "priorityClassName": "system-cluster-critical",
    },
    "agent": {
        "backend": "emulated",
        "emulated": {"gpus": 4},
        "image": {"tag": "dev"},
        "nodeSelector": {},
        "tolerations": [],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}
                    ]
                }
            }
        },
        "socketDir": "/var/run/perseus-demo",
        "terminationGracePeriodSeconds": 90,
        "restrictReportsToOwnNode": False,
    },
    "metrics": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}, "interval": "30s"},
    "prometheusRule": {"enabled": True, "labels": {"release": "kps"}},
    "dashboards": {"label": "grafana_dashboard", "labelValue": "perseus", "namespace": "grafana"},
}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "non-default": NON_DEFAULT,
    "nvml-privileged-servicemonitor": {
        "agent": {"privileged": True, "runtimeClassName": "nvidia"},
        "metrics": {"serviceMonitor": {"enabled": True}, "scrapeAnnotations": True},
        "prometheusRule": {"enabled": True, "kubeStateMetrics": False},
    },
    "operator-only": {"agent": {"enabled": False}, "dashboards": {"enabled": False}},
    "agents-only": {
        "operator": {"enabled": False},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
}

# Prometheus Operator's, and the chart's own (its CRD is in crds/).
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "PerseusPolicy"}


def containers(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = obj["spec"]["template"]["spec"]["containers"]
    return result


def env_of(container: Mapping[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def load_script(name: str) -> ModuleType:
    path = REPO_ROOT / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -- lint, render, validate ----------------------------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_chart_lints_clean(values: dict[str, Any]) -> None:
    report = lint(values, strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_rendered_objects_validate_strictly(values: dict[str, Any], kube_version: str) -> None:
    rendered = render(values)
    assert rendered.objects
    for obj in rendered.objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue  # no schema offline; their shape is checked below
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{obj['kind']} {obj['metadata']['name']}: {exc.message} at {list(exc.path)}"
            )


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_rendered_output_passes_the_kubernetes_validate_command(
    values: dict[str, Any], tmp_path: Path
) -> None:
    """``kubernetes-validate --strict`` on the whole output, as a user would run it on
    ``helm template``'s output (custom resources only get a warning: no schema offline)."""
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(render(values).objects))

    def validate(path: Path) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet"]
        return subprocess.run(
            [*command, "-k", KUBE_VERSIONS[0], str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    result = validate(manifest)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text(manifest.read_text().replace("containerPort:", "containerPorts:", 1))
    assert validate(broken).returncode != 0


def test_chart_validates_on_the_oldest_supported_kubernetes() -> None:
    rendered = render({"agent": {"restrictReportsToOwnNode": False}})
    for obj in rendered.objects:
        kubernetes_validate.validate(obj, OLDEST_KUBE, strict=True)


def test_kubernetes_validate_does_catch_an_unknown_field() -> None:
    """The harness: --strict really rejects what the API server would prune."""
    deployment = render().one("Deployment")
    containers(deployment)[0]["securityContext"]["runAsNonRot"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)


def test_every_object_is_labelled_and_namespaced_correctly() -> None:
    rendered = render(NON_DEFAULT)
    cluster_scoped = {
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "MutatingWebhookConfiguration",
        "PerseusPolicy",
    }
    for obj in rendered.objects:
        meta = obj["metadata"]
        assert meta["labels"]["app.kubernetes.io/instance"] == "perseus"
        assert meta["labels"]["team"] == "ml-infra"
        assert len(meta["name"]) <= 63
        if obj["kind"] in cluster_scoped:
            assert "namespace" not in meta
        elif obj["kind"] == "RoleBinding" and not meta["name"].endswith("-leader-election"):
            assert meta["namespace"] in ("ml", "research")
        elif obj["kind"] == "ConfigMap":
            assert meta["namespace"] == "grafana"
        else:
            assert meta["namespace"] == NAMESPACE, obj["kind"]
    names = [
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in rendered.objects
    ]
    assert len(names) == len(set(names))


# -- values.schema.json ------------------------------------------------------------------------

BAD_VALUES: dict[str, dict[str, Any]] = {
    "unknown top-level key": {"replicaCount": 2},
    "unknown nested key": {"operator": {"replicaCount": 2}},
    "no operator replica": {"operator": {"replicas": 0}},
    "lease too short": {"operator": {"leaderElection": {"leaseDurationSeconds": 1}}},
    "backend": {"agent": {"backend": "cuda"}},
    "planner workers": {"operator": {"plannerWorkers": 0}},
    "policy mode": {"defaultPolicy": {"mode": "Fast"}},
    "policy slowdown": {"defaultPolicy": {"maxSlowdown": 0.9}},
    "policy clamp": {"defaultPolicy": {"frequencyMHz": {"minMHz": 900}}},
    "policy unknown field": {"defaultPolicy": {"granularity": "Stage", "speed": 1}},
    "scrape interval": {"metrics": {"interval": "15 seconds"}},
    "port": {"agent": {"metricsPort": 70000}},
    "namespace name": {"operator": {"watchNamespaces": ["Not_A_Namespace"]}},
    "digest": {"agent": {"image": {"digest": "latest"}}},
    "straggler slowdown": {"prometheusRule": {"straggler": {"slowdown": 0.9}}},
    "grace period": {"agent": {"terminationGracePeriodSeconds": 1}},
    "socket group": {"agent": {"socketGroup": 0}},
    "log level": {"agent": {"logLevel": "verbose"}},
    "relative state dir": {"agent": {"stateDir": "var/lib/perseus"}},
    "dashboard label": {"dashboards": {"label": ""}},
    "electricity price": {"dashboards": {"electricity": {"pricePerKWh": -0.1}}},
    "carbon intensity": {"dashboards": {"electricity": {"carbonIntensityGramsPerKWh": "400g"}}},
    "currency": {"dashboards": {"electricity": {"currency": ""}}},
    "cluster policy kind": {"clusterPolicy": {"spec": {"workloads": [{"kind": "Deployment"}]}}},
    "cluster policy name": {"clusterPolicy": {"name": "Default_Policy"}},
    "cluster policy field": {"clusterPolicy": {"spec": {"namespaces": ["ml"]}}},
}


@pytest.mark.parametrize("values", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_values_violating_the_schema_are_rejected(values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        validate_values(values)
    with pytest.raises(helm_python.HelmValuesError):
        render(values)
    assert lint(values)["errors"], "helm lint must report the schema violation"


def test_a_values_file_that_violates_the_schema_is_rejected(tmp_path: Path) -> None:
    """As with ``helm install -f bad.yaml``: the YAML file's values are checked."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("agent:\n  backend: nvml\n  emulated:\n    gpus: -1\n")
    values = helm_python.values_from_yaml(bad.read_text())
    with pytest.raises(helm_python.HelmValuesError, match="gpus"):
        render(values)


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_good_values_pass_the_schema(values: dict[str, Any]) -> None:
    validate_values(values)


def test_the_default_values_document_every_key_in_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def check(node: Mapping[str, Any], sch: Mapping[str, Any], path: str) -> None:
        props = sch.get("properties", {})
        for key, value in node.items():
            assert key in props, f"{path}{key} is in values.yaml but not in values.schema.json"
            if isinstance(value, Mapping) and props[key].get("additionalProperties") is False:
                check(value, props[key], f"{path}{key}.")

    check(values, schema, "")


def test_both_monitor_kinds_at_once_are_refused() -> None:
    both = {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}
    with pytest.raises(helm_python.HelmError, match="choose one"):
        render(both)


# -- generated parts are in sync -----------------------------------------------------------------


def test_generated_chart_files_match_their_sources() -> None:
    stale = load_script("sync_chart").stale_files()
    assert stale == [], f"stale: {stale}; run: python scripts/sync_chart.py"


def test_chart_crds_are_the_repository_crds() -> None:
    repo = [yaml.safe_load(p.read_text()) for p in sorted((REPO_ROOT / "crds").glob("*.yaml"))]
    assert crds() == repo
    assert {c["spec"]["names"]["plural"] for c in crds()} == {
        "perseusjobs",
        "perseusnodeplans",
        "perseuspolicies",
        "perseuspowerbudgets",
    }


def test_default_policy_schema_is_the_crd_policy() -> None:
    sync = load_script("sync_chart")
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["defaultPolicy"] == sync.policy_schema()
    from perseus_api.job import Policy

    default = yaml.safe_load((CHART / "values.yaml").read_text())["defaultPolicy"]
    Policy.model_validate(default)  # the operator's own model accepts it


def test_the_cluster_policy_is_off_by_default_and_a_valid_policy_when_on() -> None:
    assert render().of_kind("PerseusPolicy") == []
    from perseus_api.policy import parse_policy

    default = render({"clusterPolicy": {"enabled": True}}).one("PerseusPolicy")
    spec = parse_policy(default)  # the operator's own model accepts it
    assert default["metadata"]["name"] == "perseus-default"
    assert [w.kind.value for w in spec.workloads] == ["PyTorchJob", "JobSet", "TrainJob"]
    assert spec.namespace_selector.match_labels == {"perseus.energy/enabled": "true"}
    assert (spec.priority, spec.policy.mode.value if spec.policy.mode else None) == (
        -100,
        "Observe",
    )
    custom = render(NON_DEFAULT).one("PerseusPolicy")
    assert custom["metadata"]["name"] == "ml-teams"
    # The user's selector replaces the default one (Helm would merge two maps).
    assert custom["spec"]["namespaceSelector"] == {"matchLabels": {"team": "ml"}}
    assert parse_policy(custom).policy.max_slowdown == 0.01
    assert custom["spec"]["workloads"] == [{"kind": "PyTorchJob"}]  # lists replace defaults


def test_cluster_policy_schema_is_the_crd_spec() -> None:
    sync = load_script("sync_chart")
    schema = json.loads((CHART / "values.schema.json").read_text())
    spec = schema["properties"]["clusterPolicy"]["properties"]["spec"]
    assert spec == sync.cluster_policy_spec_schema()
    assert spec["required"] == ["namespaceSelector", "workloads"]


# -- operator Deployment -----------------------------------------------------------------------


def test_operator_deployment() -> None:
    deployment = render().one("Deployment")
    spec = deployment["spec"]
    # Two replicas, one leading (the Lease): a rolling update never leaves none.
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 8080, "health": 8081, "webhook": 9443}
    # Every replica answers them, the standby too (test_operator_probes_kmock.py).
    for probe, path in (
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        assert container[probe]["httpGet"] == {"path": path, "port": "health"}
    # A writable /tmp for the caches the read-only root cannot hold.
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert env_of(container)["NUMBA_CACHE_DIR"].startswith("/tmp/")


def test_operator_command_and_settings_are_what_the_operator_accepts() -> None:
    from perseus_operator.config import PREFIX, OperatorConfig
    from perseus_operator.main import build_parser

    for values in VALUE_SETS.values():
        rendered = render(values)
        if not rendered.of_kind("Deployment"):
            continue
        (container,) = containers(rendered.one("Deployment"))
        assert container["command"] == ["perseus-operator"]
        args = build_parser().parse_args(container["args"])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert args.liveness.endswith(f":{ports['health']}/healthz")
        env = env_of(container)
        # The holder identity is the pod's name (downward API); the rest are literals.
        identity = env.pop(PREFIX + "LEADER_ELECTION_IDENTITY")
        assert identity == {"fieldRef": {"fieldPath": "metadata.name"}}
        settings = {k: v for k, v in env.items() if k.startswith(PREFIX)}
        config = OperatorConfig.from_env(settings)
        assert config.leader_election_namespace == NAMESPACE
        assert config.leader_election_lease == rendered.one("Deployment")["metadata"]["name"]
        assert config.metrics_port == ports["metrics"]
        known = {PREFIX + f.upper() for f in OperatorConfig.__dataclass_fields__}
        assert set(settings) <= known  # every setting is one the operator reads
        default = yaml.safe_load((CHART / "values.yaml").read_text())["defaultPolicy"]
        assert config.default_policy_fields() == values.get("defaultPolicy", default)


def test_operator_settings_follow_the_values() -> None:
    (container,) = containers(render(NON_DEFAULT).one("Deployment"))
    env = env_of(container)
    assert env["PERSEUS_OPERATOR_PLANNER_WORKERS"] == "4"
    assert json.loads(env["PERSEUS_OPERATOR_DEFAULT_POLICY"]) == NON_DEFAULT["defaultPolicy"]
    assert "--log-level=debug" in container["args"]
    assert (
        container["image"] == "registry.example.com/perseus-k8s/perseus-operator@sha256:" + "a" * 64
    )


# -- node agent DaemonSet ----------------------------------------------------------------------


def agent_container(rendered: Rendered) -> dict[str, Any]:
    (container,) = containers(rendered.one("DaemonSet"))
    return container


def test_agent_daemonset_runs_on_gpu_nodes_with_the_least_nvml_needs() -> None:
    ds = render().one("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["terminationGracePeriodSeconds"] >= 30  # the reset and the last status writes
    container = agent_container(render())
    sc = container["securityContext"]
    assert sc["runAsUser"] == 0  # NVML locks clocks only for root ...
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}  # ... with SYS_ADMIN
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False  # no_new_privs keeps the capability
    assert sc["readOnlyRootFilesystem"] is True
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])  # takes no GPU away
    env = env_of(container)
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # The host network for the TCP transport (agent.tcp): pods reach it at the node's address.
    assert pod.get("hostNetwork") is True and not pod.get("hostPID")
    socket_only = render({"agent": {"tcp": {"enabled": False}}}).one("DaemonSet")
    assert not socket_only["spec"]["template"]["spec"].get("hostNetwork")


def test_agent_host_paths_hold_the_socket_and_the_reset_state() -> None:
    rendered = render(NON_DEFAULT)
    pod = rendered.one("DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    container = agent_container(rendered)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in container["args"]}
    socket, state = mounts[args["--socket-dir"]], mounts[args["--state-dir"]]
    assert volumes[socket]["hostPath"] == {
        "path": "/var/run/perseus-demo",
        "type": "DirectoryOrCreate",
    }
    assert volumes[state]["hostPath"] == {"path": "/var/lib/perseus", "type": "DirectoryOrCreate"}
    assert args["--emulated-state-file"].startswith(args["--state-dir"] + "/")
    assert container["securityContext"]["runAsGroup"] == 2940  # the socket's group


def test_agent_flags_are_what_the_agent_accepts() -> None:
    from perseus_agent.main import build_parser
    from perseus_agent.modes.agent_config import check_args

    for values in VALUE_SETS.values():
        rendered = render(values)
        if not rendered.of_kind("DaemonSet"):
            continue
        container = agent_container(rendered)
        assert container["command"] == ["perseus-node-agent"]
        # The kubelet expands $(HOST_IP) (status.hostIP) in the arguments.
        expanded = [a.replace("$(HOST_IP)", "10.0.0.5") for a in container["args"]]
        if any("$(HOST_IP)" in a for a in container["args"]):
            assert env_of(container)["HOST_IP"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
        args = build_parser().parse_args([*expanded, "--node-name=n1"])
        config = check_args(args)
        assert not config.standalone  # plans come from the API
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
        assert config.metrics_port == port
        assert config.backend == (values.get("agent", {}).get("backend") or "nvml")


def test_emulated_agents_have_no_privileges() -> None:
    container = agent_container(render({"agent": {"backend": "emulated"}}))
    sc = container["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False
    assert "NVIDIA_VISIBLE_DEVICES" not in env_of(container)
    assert "--emulated-gpus=8" in container["args"]


def test_privileged_agents_only_on_request() -> None:
    rendered = render({"agent": {"privileged": True, "runtimeClassName": "nvidia"}})
    assert agent_container(rendered)["securityContext"]["privileged"] is True
    assert rendered.one("DaemonSet")["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    assert all(
        v.get("privileged") is not True for v in walk(render().objects) if isinstance(v, dict)
    )


# -- services, monitors, dashboards, notes -----------------------------------------------------


@pytest.mark.parametrize("monitor", ["serviceMonitor", "podMonitor"])
def test_services_and_monitors_select_the_pods(monitor: str) -> None:
    rendered = render({"metrics": {monitor: {"enabled": True, "labels": {"release": "kps"}}}})
    pods = {
        o["kind"]: o["spec"]["template"]["metadata"]["labels"]
        for o in (rendered.one("Deployment"), rendered.one("DaemonSet"))
    }
    services = {s["metadata"]["name"]: s for s in rendered.of_kind("Service")}
    kinds = {"Deployment": "perseus-operator", "DaemonSet": "perseus-node-agent"}
    for kind, name in kinds.items():
        service = services[name]
        assert service["spec"]["selector"].items() <= pods[kind].items()
        assert [p["targetPort"] for p in service["spec"]["ports"]] == ["metrics"]
    assert services["perseus-node-agent"]["spec"]["clusterIP"] == "None"
    kind = "ServiceMonitor" if monitor == "serviceMonitor" else "PodMonitor"
    monitors = {m["metadata"]["name"]: m for m in rendered.of_kind(kind)}
    assert set(monitors) == set(kinds.values())
    for kind_, name in kinds.items():
        m = monitors[name]
        assert m["metadata"]["labels"]["release"] == "kps"
        selected = (
            services[name]["metadata"]["labels"] if monitor == "serviceMonitor" else pods[kind_]
        )
        assert m["spec"]["selector"]["matchLabels"].items() <= selected.items()
        assert m["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        (endpoint,) = m["spec"][
            "endpoints" if monitor == "serviceMonitor" else "podMetricsEndpoints"
        ]
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
        # The series name the training job job_namespace/job_name/pod_name: no clash.
        assert endpoint["honorLabels"] is False
        assert set(endpoint) <= {
            "port",
            "path",
            "interval",
            "scrapeTimeout",
            "honorLabels",
            "relabelings",
            "metricRelabelings",
        }


def test_dashboards_are_configmaps_for_the_grafana_sidecar() -> None:
    rendered = render()
    maps = rendered.of_kind("ConfigMap")
    assert len(maps) == 3
    files = {p.name: p.read_text() for p in (CHART / "dashboards").glob("*.json")}
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "Perseus"}
        ((name, text),) = cm["data"].items()
        assert json.loads(text) == json.loads(files[name])
    custom = render({"dashboards": {"label": "my_dash", "labelValue": "yes", "folder": ""}})
    for cm in custom.of_kind("ConfigMap"):
        assert cm["metadata"]["labels"]["my_dash"] == "yes"
        assert "annotations" not in cm["metadata"]
    assert render({"dashboards": {"enabled": False}}).of_kind("ConfigMap") == []


def test_the_dashboards_price_and_carbon_intensity_come_from_the_values() -> None:
    """The cost and CO2e panels multiply by hidden constant variables the chart sets (the
    queries' arithmetic runs against Prometheus in tests/e2e/test_dashboards.py)."""
    electricity = {"pricePerKWh": 0.0825, "currency": "CHF", "carbonIntensityGramsPerKWh": 31}
    rendered = render({"dashboards": {"electricity": electricity}})
    seen = set()
    for cm in rendered.of_kind("ConfigMap"):
        ((name, text),) = cm["data"].items()
        dashboard = json.loads(text)
        constants = {
            v["name"]: (v["query"], v["current"]["value"])
            for v in dashboard["templating"]["list"]
            if v["type"] == "constant"
        }
        exprs = " ".join(t["expr"] for p in panels_of(dashboard) for t in p.get("targets", []))
        if "$price_per_kwh" in exprs:
            seen.add(name)
            assert constants == {
                "price_per_kwh": ("0.0825", "0.0825"),
                "currency": ("CHF", "CHF"),
                "carbon_g_per_kwh": ("31", "31"),
            }
            assert "$carbon_g_per_kwh" in exprs
        # The rest of the dashboard is the file's.
        original = json.loads((CHART / "dashboards" / name).read_text())
        assert dashboard["panels"] == original["panels"]
    assert seen == {"perseus-cluster.json", "perseus-job.json"}
    # Values missing (an upgrade with --reuse-values from a release without them; null removes
    # a key as that does) keep the defaults.
    for electricity, expected in (
        ({"pricePerKWh": 0.3, "currency": None}, ["0.3", "USD", "400"]),
        (None, ["0.15", "USD", "400"]),
    ):
        for cm in render({"dashboards": {"electricity": electricity}}).of_kind("ConfigMap"):
            (text,) = cm["data"].values()
            variables = json.loads(text)["templating"]["list"]
            constants = [v["query"] for v in variables if v["type"] == "constant"]
            assert constants in ([], expected), electricity


def test_notes_tell_what_to_do_next() -> None:
    notes = render().notes
    assert "kind: PerseusJob" in notes
    assert "PERSEUS_AGENT_ADDRESS=tcp://$(PERSEUS_HOST_IP):7460" in notes
    assert "supplementalGroups" not in notes  # nothing to add by hand
    assert "supplementalGroups: [2940]" in render({"injection": {"enabled": False}}).notes
    assert "metrics.serviceMonitor.enabled=true" in notes
    assert "grafana_dashboard=1" in notes
    emulated = render({"agent": {"backend": "emulated"}}).notes
    assert "EMULATED" in emulated
    scoped = render(NON_DEFAULT).notes
    assert "ml, research" in scoped and "PodMonitors are installed" in scoped
    assert "PerseusPolicy" in notes and "PerseusPolicy perseus-default" not in notes
    policy = render({"clusterPolicy": {"enabled": True}}).notes
    assert "PerseusPolicy perseus-default is installed (mode Observe)" in policy
    assert "Mode Observe changes no clock, so its jobs never profile" in policy
    assert "Mode Observe" not in scoped  # that policy's mode is StragglerAware
    assert "fails with NoTrainingProcess" in notes
    assert "kubectl label namespace my-namespace perseus.energy/enabled=true" in policy
    assert "PerseusPolicy ml-teams is installed (mode StragglerAware)" in scoped
    assert "kubectl label namespace my-namespace team=ml" in scoped


def test_the_sample_in_the_notes_is_a_valid_perseusjob() -> None:
    notes = render().notes
    block = notes.split("kubectl apply -f -\n", 1)[1].split("EOT", 1)[0]
    job = yaml.safe_load("\n".join(line[5:] for line in block.splitlines()))
    from perseus_api.job import PerseusJobSpec

    PerseusJobSpec.model_validate(job["spec"])
    (crd,) = [c for c in crds() if c["spec"]["names"]["kind"] == job["kind"]]
    assert job["apiVersion"] == f"{crd['spec']['group']}/{crd['spec']['versions'][0]['name']}"


# -- Grafana dashboards (structure; every query runs in tests/e2e/test_dashboards.py) ------------


def dashboards() -> dict[str, dict[str, Any]]:
    return {
        p.stem: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))
    }


def panels_of(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def exported_metric_names() -> set[str]:
    """Names the agent and the operator really export (from their registries)."""
    from perseus_agent.exporter import AgentMetrics, GpuCollector, ManagedGpu
    from perseus_agent.gpu.emulated import EmulatedBackend
    from perseus_operator.metrics import OperatorMetrics

    profile = (
        REPO_ROOT / "operator" / "perseus_planner" / "profiles" / "gpt3-175b+a100_sxm_bf16.csv"
    )
    backend = EmulatedBackend.from_csv(1, profile, blocking_power_w=83.6, node_name="n1")
    metrics = AgentMetrics("n1")
    managed = {0: ManagedGpu({"namespace": "ml", "job": "j", "dp_rank": "0"}, target_mhz=1005)}
    metrics.registry.register(GpuCollector(backend, backend.devices(), metrics, lambda: managed))
    metrics.observe_iteration({"rank": "0"}, 1.0)
    operator = OperatorMetrics()
    operator.planner.observe(1.0)
    names = set()
    for registry in (metrics.registry, operator.registry):
        for family in registry.collect():
            names |= {s.name for s in family.samples}
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


DCGM_METRICS = {"DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_UTIL"}


def test_dashboards_are_current_grafana_json() -> None:
    assert set(dashboards()) == {"perseus-cluster", "perseus-job", "perseus-node"}
    uids = set()
    for uid, dash in dashboards().items():
        assert dash["uid"] == uid and uid not in uids
        uids.add(uid)
        assert dash["schemaVersion"] >= 39
        assert "id" not in dash or dash["id"] is None  # Grafana assigns ids
        variables = dash["templating"]["list"]
        assert variables[0]["type"] == "datasource" and variables[0]["query"] == "prometheus"
        ids = [p["id"] for p in panels_of(dash)]
        assert len(ids) == len(set(ids))
        occupied: set[tuple[int, int]] = set()
        for panel in panels_of(dash):
            assert panel["type"] in {"row", "timeseries", "stat", "bargauge", "table"}
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
            cells = {
                (grid["x"] + dx, grid["y"] + dy)
                for dx in range(grid["w"])
                for dy in range(grid["h"])
            }
            assert not cells & occupied, f"{uid}: panel {panel['title']!r} overlaps another"
            occupied |= cells
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["title"] and panel["targets"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs))
            for target in panel["targets"]:
                assert target["datasource"] == panel["datasource"] and target["expr"].strip()


def test_dashboard_queries_use_only_exported_metrics() -> None:
    exported = exported_metric_names()
    for uid, dash in dashboards().items():
        queries = [t["expr"] for p in panels_of(dash) for t in p.get("targets", [])]
        queries += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
        for query in queries:
            for name in re.findall(r"\b(perseus_\w+|DCGM_\w+)", query):
                assert name in exported | DCGM_METRICS, f"{uid}: {name} is not exported"
            used = set(re.findall(r"\$\{?([A-Za-z_]\w*)", query)) - {
                "__range",
                "__rate_interval",
                "__interval",
            }
            names = {v["name"] for v in dash["templating"]["list"]}
            assert used <= names, f"{uid}: unknown variable in {query}"
            assert "exported_" not in query  # the scrape honors the series' labels


def needs_dcgm(panel: Mapping[str, Any], target: Mapping[str, Any]) -> bool:
    """A target declared to return data only with dcgm-exporter (legend or panel title say so);
    other targets that read dcgm-exporter fall back to Perseus's own series without it."""
    marker = "(dcgm-exporter)"
    return marker in target.get("legendFormat", "") or marker in panel["title"]


def test_every_dashboard_panel_works_without_dcgm_exporter() -> None:
    """Only a panel that says so in its title and description needs dcgm-exporter; every other
    panel has a query that does not (tests/e2e/test_dashboards.py runs them without it)."""
    for dash in dashboards().values():
        for panel in panels_of(dash):
            targets = panel.get("targets", [])
            if targets and all(needs_dcgm(panel, t) for t in targets):
                assert "(dcgm-exporter)" in panel["title"]
                assert "without dcgm-exporter" in panel["description"]
            for target in targets:
                if needs_dcgm(panel, target):
                    assert "DCGM_" in target["expr"]


def test_agents_read_gpu_ownership_from_the_kubelet() -> None:
    rendered = render()
    pod = rendered.one("DaemonSet")["spec"]["template"]["spec"]
    container = agent_container(rendered)
    assert "--gpu-ownership=kubelet" in container["args"]
    assert "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock" in container["args"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "pod-resources")
    assert mount == {
        "name": "pod-resources",
        "mountPath": "/var/lib/kubelet/pod-resources",
        "readOnly": True,
    }
    volume = next(v for v in pod["volumes"] if v["name"] == "pod-resources")
    assert volume["hostPath"] == {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}
    assert not pod.get("hostPID")  # only on request: it widens what the agent sees

    verified = render({"agent": {"gpuOwnership": {"hostPID": True}}})
    assert verified.one("DaemonSet")["spec"]["template"]["spec"]["hostPID"] is True

    # Emulated GPUs are no device plugin's: no kubelet to ask.
    emulated = agent_container(render({"agent": {"backend": "emulated"}}))
    assert "--gpu-ownership=local-rank-index" in emulated["args"]
    assert all(m["name"] != "pod-resources" for m in emulated["volumeMounts"])
    assert not any(a.startswith("--pod-resources-socket") for a in emulated["args"])


def test_operator_replicas_and_leader_election_follow_the_values() -> None:
    from perseus_operator.config import OperatorConfig

    election = {"leaseDurationSeconds": 30, "renewDeadlineSeconds": 20, "retryPeriodSeconds": 4}
    rendered = render({"operator": {"replicas": 3, "leaderElection": election}})
    deployment = rendered.one("Deployment")
    assert deployment["spec"]["replicas"] == 3
    (container,) = containers(deployment)
    env = {k: v for k, v in env_of(container).items() if isinstance(v, str)}
    timings = OperatorConfig.from_env(env).leader_election_timings()
    assert (timings.lease_duration_s, timings.renew_deadline_s, timings.retry_period_s) == (
        30,
        20,
        4,
    )


def test_leader_election_timings_out_of_order_fail_the_render() -> None:
    election = {"leaseDurationSeconds": 10, "renewDeadlineSeconds": 10, "retryPeriodSeconds": 2}
    with pytest.raises(helm_python.HelmRenderError, match="renewDeadlineSeconds < leaseDuration"):
        render({"operator": {"leaderElection": election}})


@pytest.mark.parametrize("watched", [[], ["ml", "research"]])
def test_hook_pods_run_commands_the_operator_accepts(watched: list[str]) -> None:
    """The pre-delete and test hooks: the operator's image and account, a --hook it knows,
    the watched namespaces (the uninstall hook deletes jobs there only), and settings it reads."""
    from perseus_operator.config import OperatorConfig
    from perseus_operator.main import build_parser

    rendered = render({"operator": {"watchNamespaces": watched}})
    operator_pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    hooks = {}
    for pod in rendered.of_kind("Pod"):
        hooks[pod["metadata"]["annotations"]["helm.sh/hook"]] = pod
        spec = pod["spec"]
        if pod["metadata"]["annotations"]["helm.sh/hook"] == "test":
            assert spec["serviceAccountName"] == operator_pod["serviceAccountName"]
        else:  # the uninstall clean-up, with rights of its own (test_helm_rbac.py)
            assert spec["serviceAccountName"] == "perseus-operator-uninstall"
        assert spec["restartPolicy"] == "Never"
        (container,) = spec["containers"]
        assert container["image"] == operator_pod["containers"][0]["image"]
        args = build_parser().parse_args(container["args"])
        assert args.namespace == watched
        kubernetes_validate.validate(pod, KUBE_VERSIONS[-1], strict=True)
        config = OperatorConfig.from_env(env_of(container))
        assert config.leader_election_namespace == NAMESPACE
    assert set(hooks) == {"pre-delete", "test"}
    pre_delete = build_parser().parse_args(hooks["pre-delete"]["spec"]["containers"][0]["args"])
    assert pre_delete.hook == "before-uninstall"
    assert pre_delete.hook_timeout_s == 300
    assert build_parser().parse_args(hooks["test"]["spec"]["containers"][0]["args"]).hook == "test"
