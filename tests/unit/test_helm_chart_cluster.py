"""Chart defaults for a real cluster: the agent's priority class, extra volumes and mounts,
a percentage rollout, and the notes on PodSecurity and Bottlerocket (issue 17, item 4).

The PodSecurity level itself is checked on the real kube-apiserver in
``tests/e2e/test_chart_pod_security.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from support.helm_render import NAMESPACE, helm_python, lint, render, validate_values

EXTRA: dict[str, Any] = {
    "agent": {
        "extraVolumes": [{"name": "driver", "hostPath": {"path": "/opt/nvidia/lib64"}}],
        "extraVolumeMounts": [{"name": "driver", "mountPath": "/usr/local/nvidia/lib64"}],
    }
}


def _pod(values: dict[str, Any] | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = render(values).one("DaemonSet")["spec"]["template"]["spec"]
    return pod


def _agent(values: dict[str, Any] | None = None) -> dict[str, Any]:
    [container] = [c for c in _pod(values)["containers"] if c["name"] == "agent"]
    return container


def test_agents_are_node_critical_by_default_as_dcgm_exporter_is() -> None:
    assert _pod()["priorityClassName"] == "system-node-critical"
    assert "priorityClassName" not in _pod({"agent": {"priorityClassName": ""}})
    assert _pod({"agent": {"priorityClassName": "gpu-infra"}})["priorityClassName"] == "gpu-infra"


def test_the_rollout_takes_a_percentage_of_the_nodes_by_default() -> None:
    strategy = render().one("DaemonSet")["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}
    counted = {"agent": {"updateStrategy": {"rollingUpdate": {"maxUnavailable": 3}}}}
    assert render(counted).one("DaemonSet")["spec"]["updateStrategy"]["rollingUpdate"] == {
        "maxUnavailable": 3
    }


@pytest.mark.parametrize(
    "strategy",
    [
        {"rollingUpdate": {"maxUnavailable": "ten percent"}},
        {"rollingUpdate": {"maxUnavailable": "0%"}},
        {"rollingUpdate": {"maxUnavailable": 0}},
        {"rollingUpdate": {"maxUnavailable": "150%"}},
        {"type": "Recreate"},
        {"rollingUpdate": {"maxUnavaliable": 1}},
    ],
    ids=["words", "zero-percent", "zero", "over-100", "deployment-type", "typo"],
)
def test_bad_rollouts_are_refused_by_the_schema(strategy: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        validate_values({"agent": {"updateStrategy": strategy}})


def test_extra_volumes_and_mounts_reach_the_agent_pod() -> None:
    volumes = {v["name"]: v for v in _pod(EXTRA)["volumes"]}
    assert volumes["driver"] == {"name": "driver", "hostPath": {"path": "/opt/nvidia/lib64"}}
    assert {"socket", "state", "tmp"} <= set(volumes)  # the chart's own stay
    mounts = {m["name"]: m["mountPath"] for m in _agent(EXTRA)["volumeMounts"]}
    assert mounts["driver"] == "/usr/local/nvidia/lib64"
    assert not lint(EXTRA)["errors"]
    assert "extraVolumes" not in str(_pod())  # nothing extra by default


def test_a_mount_of_an_unknown_volume_is_refused_with_what_to_fix() -> None:
    bad = {"agent": {"extraVolumeMounts": [{"name": "drivers", "mountPath": "/x"}]}}
    with pytest.raises(helm_python.HelmError, match='names volume "drivers", which is neither'):
        render(bad)
    # A mount of one of the chart's volumes is fine (e.g. the state directory elsewhere too).
    render({"agent": {"extraVolumeMounts": [{"name": "state", "mountPath": "/state"}]}})


@pytest.mark.parametrize(
    "values",
    [
        {"agent": {"extraVolumes": [{"name": "state", "emptyDir": {}}]}},  # shadows the chart's
        {"agent": {"extraVolumes": [{"hostPath": {"path": "/x"}}]}},
        {"agent": {"extraVolumeMounts": [{"name": "x", "mountPath": "relative"}]}},
    ],
    ids=["chart-name", "no-name", "relative-path"],
)
def test_bad_extra_volumes_are_refused_by_the_schema(values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        validate_values(values)


def test_notes_say_which_pod_security_level_the_namespace_needs() -> None:
    notes = render().notes
    assert 'need the "privileged" level' in notes
    assert (
        f"kubectl label --overwrite namespace {NAMESPACE} "
        "pod-security.kubernetes.io/enforce=privileged"
    ) in notes
    assert "SYS_ADMIN" in notes
    emulated = render({"agent": {"backend": "emulated"}}).notes
    assert 'need the "privileged" level (hostPath volumes, root)' in emulated


def test_notes_tell_bottlerocket_users_how_the_agent_sees_the_gpus() -> None:
    notes = render().notes
    assert "settings.nvidia-container-runtime.visible-devices-envvar-when-unprivileged" in notes
    assert "agent.privileged=true" in notes
    assert "Bottlerocket" not in render({"agent": {"backend": "emulated"}}).notes
    assert "priorityClassName system-node-critical" in notes


def test_clocks_of_other_owners_are_left_alone_unless_the_values_say_so() -> None:
    from perseus_agent.main import build_parser

    for values, expected in (({}, "leave"), ({"agent": {"foreignClocks": "override"}}, "override")):
        args = build_parser().parse_args([*_agent(values)["args"], "--node-name=n1"])
        assert args.foreign_clocks == expected
    with pytest.raises(helm_python.HelmValuesError):
        validate_values({"agent": {"foreignClocks": "reset"}})
