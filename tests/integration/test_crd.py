"""The generated CRDs: current, structural, and agreeing with the pydantic models."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import BaseModel, ValidationError

from perseus_api import crd
from perseus_api.job import (
    FREQUENCY_RULES,
    PARALLELISM_RULES,
    REQUIREMENT_RULES,
    SELECTOR_RULES,
    STRAGGLER_RULES,
    WORKLOAD_RULES,
    Mode,
    PerseusJobSpec,
    Policy,
    Stragglers,
)
from perseus_api.job_profiling import Profiling
from perseus_api.job_status import PerseusJobStatus
from perseus_api.node_plan import NodePlan
from perseus_api.plan import Granularity
from perseus_api.resources import node_plan_object
from perseus_api.structural_schema import SchemaConversionError, structural_schema
from support.factories import pipeline_plan_fields

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = REPO_ROOT / "crds"
SAMPLES_DIR = CRD_DIR / "samples"
SAMPLES = ("perseusjob-minimal.yaml", "perseusjob-full.yaml", "perseusjob-no-code-change.yaml")
REGENERATE = "python -m perseus_api.crd --out crds/"

Crd = dict[str, Any]
CRDS: dict[str, Callable[[], Crd]] = {
    "job": crd.get_job_crd,
    "node plan": crd.get_node_plan_crd,
    "policy": crd.get_policy_crd,
}


def _open_api_schema(definition: Crd) -> dict[str, Any]:
    (version,) = definition["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def _sample(name: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((SAMPLES_DIR / name).read_text(encoding="utf-8"))
    return document


def _as_json_schema(node: Any) -> Any:
    """A structural schema as JSON Schema draft 4, which has no ``nullable``: null is added to
    the node's type (and enum) instead. Kubernetes-only keywords are dropped."""
    if isinstance(node, list):
        return [_as_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key in ("properties",):
            out[key] = {name: _as_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = _as_json_schema(value)
        else:
            out[key] = value
    if node.get("nullable"):
        out["type"] = [node["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def _validator(schema: dict[str, Any]) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(_as_json_schema(schema))


def _schema_errors(schema: dict[str, Any], instance: Any) -> list[tuple[str, str]]:
    """``(path, keyword)`` of each JSON Schema error of ``instance``."""
    errors = _validator(schema).iter_errors(instance)
    return sorted((".".join(map(str, e.absolute_path)), str(e.validator)) for e in errors)


def _nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node under (and including) ``node``, with its path."""
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")


def _at(schema: dict[str, Any], dotted: str) -> dict[str, Any]:
    """The schema node of the field at ``dotted`` (``spec.policy.frequencyMHz``; ``[]``: the
    items of a list)."""
    node = schema
    for name in dotted.split("."):
        node = node["items"] if name == "[]" else node["properties"][name]
    return node


# -- drift -----------------------------------------------------------------------------------------


def test_committed_crds_are_current() -> None:
    problems = crd.check_files(CRD_DIR)
    assert not problems, (
        "The CRDs in crds/ differ from the models in perseus_api; regenerate them with "
        f"`{REGENERATE}` and commit the result.\n" + "\n".join(problems)
    )


@pytest.mark.parametrize("name", sorted(CRDS))
def test_committed_yaml_loads_as_the_generated_crd(name: str) -> None:
    definition = CRDS[name]()
    path = CRD_DIR / f"perseus.energy_{definition['spec']['names']['plural']}.yaml"
    text = path.read_text(encoding="utf-8")
    assert text.startswith(crd.HEADER)
    assert yaml.safe_load(text) == definition


def test_check_reports_missing_and_stale_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert crd.main(["--out", str(tmp_path), "--check"]) == 1
    assert "missing" in capsys.readouterr().err

    assert crd.main(["--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "perseus.energy_perseusjobs.yaml",
        "perseus.energy_perseusnodeplans.yaml",
        "perseus.energy_perseuspolicies.yaml",
        "perseus.energy_perseuspowerbudgets.yaml",
    ]
    assert crd.main(["--out", str(tmp_path), "--check"]) == 0

    stale = tmp_path / "perseus.energy_perseusjobs.yaml"
    stale.write_text(stale.read_text().replace("maximum: 256", "maximum: 128"))
    assert crd.main(["--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "-                    maximum: 128\n+                    maximum: 256\n" in err
    assert f"python -m perseus_api.crd --out {tmp_path}" in err


def test_module_runs_as_a_command() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "operator")}
    result = subprocess.run(
        [sys.executable, "-m", "perseus_api.crd", "--out", str(CRD_DIR), "--check"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr


# -- structural schemas ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CRDS))
def test_schemas_are_structural(name: str) -> None:
    schema = _open_api_schema(CRDS[name]())
    assert schema["type"] == "object"
    assert schema["required"] == ["spec"]
    assert schema["properties"]["metadata"] == {"type": "object"}
    for path, node in _nodes(schema):
        where = path or "<root>"
        assert (
            "type" in node
            or node.get("x-kubernetes-preserve-unknown-fields")
            or node.get("x-kubernetes-int-or-string")
        ), f"{where}: no type"
        forbidden = {"$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "title", "const"}
        assert not forbidden & node.keys(), f"{where}: {forbidden & node.keys()}"
        assert "additionalProperties" not in node or isinstance(
            node["additionalProperties"], dict
        ), f"{where}: additionalProperties must be a schema"
        assert not ("properties" in node and "additionalProperties" in node), where
        assert set(node.get("required", ())) <= node.get("properties", {}).keys(), where
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, where
        if "default" in node:
            assert node["default"] is not None, f"{where}: null default"
            assert not _schema_errors(node, node["default"]), f"{where}: invalid default"
        for value in node.get("enum", ()):
            assert not _schema_errors({"type": node["type"]}, value), f"{where}: enum {value!r}"
        if "nullable" in node:
            assert node["nullable"] is True, where


def test_cel_rules_are_only_on_objects() -> None:
    for definition in (crd.get_job_crd(), crd.get_node_plan_crd()):
        for path, node in _nodes(_open_api_schema(definition)):
            for rule in node.get("x-kubernetes-validations", ()):
                assert node["type"] == "object", path
                assert rule.keys() == {"rule", "message"}
                assert "\n" not in rule["message"]


class _Union(BaseModel):
    value: int | str


class _Untyped(BaseModel):
    value: Any


@pytest.mark.parametrize(
    ("model", "message"),
    [(_Union, "only X | None unions are supported"), (_Untyped, "_Untyped.value: no type")],
)
def test_unstructural_models_are_refused(model: type[BaseModel], message: str) -> None:
    with pytest.raises(SchemaConversionError, match=re.escape(message)):
        structural_schema(model)


def test_conversions() -> None:
    spec = _at(_open_api_schema(crd.get_job_crd()), "spec")
    assert _at(spec, "policy.blockingPowerWatts") == {
        "description": "GPU power while blocked on communication; measured when unset.",
        "type": "number",
        "nullable": True,
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 2000,
    }
    assert _at(spec, "workload.podSelector.matchLabels") == {
        "description": "Labels an object must carry, each with this value.",
        "type": "object",
        "additionalProperties": {"type": "string"},
    }
    mode = _at(spec, "policy.mode")
    assert (mode["type"], mode["enum"]) == ("string", ["Observe", "Intrinsic", "StragglerAware"])
    # No server-side defaults in the policy: the operator fills unset fields from its default
    # policy first, so it must see them unset.
    assert not [n for n, field in _at(spec, "policy")["properties"].items() if "default" in field]
    assert _at(spec, "stragglers.slowdownThreshold")["default"] == 1.05
    # A field's own description wins over its enum's docstring.
    granularity = _at(spec, "policy.granularity")
    assert granularity["description"].startswith("Stage: one locked clock per GPU")

    node_plan = _at(_open_api_schema(crd.get_node_plan_crd()), "spec")
    plans = _at(node_plan, "plans")
    assert plans["type"] == "object"
    assert plans["additionalProperties"]["properties"]["kind"]["enum"] == ["PipelinePlan"]
    # camelCase keys, none of several words required: objects of the snake_case spec of older
    # operators stay valid (see tests/unit/test_node_plan_upgrade.py).
    assert "numStages" in plans["additionalProperties"]["properties"]
    assert plans["additionalProperties"]["required"] == [
        "schedule",
        "granularity",
        "objective",
        "stages",
    ]
    assert _at(node_plan, "profiling")["nullable"] is True


def test_node_plan_status_is_the_agents_model_and_keeps_an_older_agents_keys() -> None:
    from perseus_agent.plans.plan_status import invalid_status, report_status
    from support.factories import OLD_AGENT_STATUS, merge_patch, node_report

    status = _at(_open_api_schema(crd.get_node_plan_crd()), "status")
    assert status["x-kubernetes-preserve-unknown-fields"] is True
    assert status["properties"]["observedRevision"]["type"] == "integer"
    condition = status["properties"]["conditions"]["items"]
    assert condition["required"] == ["type", "status"]
    assert _at(status, "ranks.[].meanIterationSeconds")["type"] == "number"
    assert _at(status, "gpus.[].appliedMHz")["nullable"] is True
    for path, node in _nodes(status):
        # The API server would add e.g. dpRank: 0 beside an older agent's dp_rank: 1.
        assert "default" not in node, path
        assert all(name == name.lower() for name in node.get("required", ())), path
        if node.get("type") == "object":
            assert node.get("x-kubernetes-preserve-unknown-fields") is True, path
    # What the API server stores: the agents' merge patches applied.
    written = [
        merge_patch({}, report_status(node_report())),
        merge_patch(OLD_AGENT_STATUS, invalid_status("spec.node is n2, not this node", None)),
        OLD_AGENT_STATUS,
    ]
    for document in written:
        assert not _schema_errors(status, document)
    assert _schema_errors(status, {**written[0], "observedRevision": "7"}) == [
        ("observedRevision", "type")
    ]
    bad_rank = {**written[0]["ranks"][0], "meanIterationSeconds": "slow"}
    assert _schema_errors(status, {**written[0], "ranks": [bad_rank]}) == [
        ("ranks.0.meanIterationSeconds", "type")
    ]


# -- samples ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SAMPLES)
def test_samples_validate_against_the_crd(name: str) -> None:
    sample = _sample(name)
    assert not _schema_errors(_open_api_schema(crd.get_job_crd()), sample)
    assert sample["apiVersion"] == "perseus.energy/v1alpha1"
    assert sample["kind"] == "PerseusJob"


@pytest.mark.parametrize("name", SAMPLES)
def test_samples_parse_with_the_model(name: str) -> None:
    spec = PerseusJobSpec.model_validate(_sample(name)["spec"])
    assert spec.parallelism.world_size >= spec.parallelism.pipeline_stages


def test_policy_sample_validates_and_parses() -> None:
    from perseus_api.policy import parse_policy

    sample = _sample("perseuspolicy.yaml")
    assert not _schema_errors(_open_api_schema(crd.get_policy_crd()), sample)
    assert "namespace" not in sample["metadata"]
    spec = parse_policy(sample)
    assert [w.kind.value for w in spec.workloads] == ["PyTorchJob", "JobSet", "Pods"]


def test_minimal_sample() -> None:
    spec = PerseusJobSpec.model_validate(_sample("perseusjob-minimal.yaml")["spec"])
    assert (spec.workload.kind, spec.workload.name) == ("PyTorchJob", "gpt3-xl")
    assert (spec.parallelism.pipeline_stages, spec.parallelism.microbatches) == (8, 24)
    assert (spec.policy, spec.profiling, spec.stragglers) == (Policy(), Profiling(), Stragglers())


def test_full_sample_sets_every_field() -> None:
    spec_schema = _at(_open_api_schema(crd.get_job_crd()), "spec")
    sample = _sample("perseusjob-full.yaml")["spec"]

    def unset(schema: dict[str, Any], value: Any, path: str) -> Iterator[str]:
        for name, sub in schema.get("properties", {}).items():
            if not isinstance(value, dict) or name not in value:
                yield f"{path}.{name}"
            else:
                yield from unset(sub, value[name], f"{path}.{name}")

    # kind Pods names its pods by selector: a name is an error there (a CEL rule).
    assert list(unset(spec_schema, sample, "spec")) == ["spec.workload.name"]
    spec = PerseusJobSpec.model_validate(sample)
    assert spec.workload.kind == "Pods"
    assert (spec.policy.mode, spec.policy.granularity) == ("StragglerAware", "Instruction")


def test_job_status_validates_against_the_crd() -> None:
    status_schema = _at(_open_api_schema(crd.get_job_crd()), "status")
    empty = PerseusJobStatus().model_dump(mode="json", by_alias=True)
    assert not _schema_errors(status_schema, empty)
    full = PerseusJobStatus.model_validate(
        {
            "phase": "Running",
            "observedGeneration": 3,
            "conditions": [
                {"type": "PlanApplied", "status": "True", "reason": "Applied", "message": "8/8"}
            ],
            "frontier": {
                "tMinSeconds": 1.0,
                "tStarSeconds": 1.3,
                "tMaxSeconds": 1.6,
                "points": 40,
                "profileConfigMap": "gpt3-profile",
            },
            "plan": {"targetIterationSeconds": 1.0, "expectedSavingsRatio": 0.12, "revision": 2},
            "stragglers": [
                {"dataParallelRank": 1, "node": "n1", "slowdown": 1.2, "since": "2025-01-01T00:00Z"}
            ],
            "nodes": ["n1", "n2"],
        }
    )
    assert not _schema_errors(status_schema, full.model_dump(mode="json", by_alias=True))


def test_node_plan_objects_validate_against_the_crd() -> None:
    plan = NodePlan.model_validate(
        {
            "node": "gpu-node-1",
            "namespace": "ml",
            "job": "gpt3",
            "revision": 1,
            "granularity": "Instruction",
            "plans": {"tmin": pipeline_plan_fields(num_stages=2)},
            "assignments": [{"gpu_index": 0, "plan": "tmin", "stage": 0}],
        }
    )
    body = node_plan_object(plan)
    # The operator writes unset optional fields as null: the schema must take them.
    assert body["spec"]["assignments"][0]["gpuUuid"] is None
    schema = _open_api_schema(crd.get_node_plan_crd())
    assert not _schema_errors(schema, body)
    body["spec"]["plans"]["tmin"]["numStages"] = 0
    assert _schema_errors(schema, body) == [("spec.plans.tmin.numStages", "minimum")]


# -- malformed specs -------------------------------------------------------------------------------


def _minimal_spec() -> dict[str, Any]:
    return copy.deepcopy(_sample("perseusjob-minimal.yaml")["spec"])


def _full_spec() -> dict[str, Any]:
    return copy.deepcopy(_sample("perseusjob-full.yaml")["spec"])


def _set(spec: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    *parents, last = dotted.split(".")
    node = spec
    for name in parents:
        node = node.setdefault(name, {})
    node[last] = value
    return spec


def _delete(spec: dict[str, Any], dotted: str) -> dict[str, Any]:
    *parents, last = dotted.split(".")
    node = spec
    for name in parents:
        node = node[name]
    del node[last]
    return spec


def _model_errors(spec: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    with pytest.raises(ValidationError) as caught:
        PerseusJobSpec.model_validate(spec)
    return [(tuple(e["loc"]), e["msg"]) for e in caught.value.errors()]


# (spec, the model's errors as (location, message), the schema's errors as (path, keyword))
SCHEMA_CASES: dict[str, tuple[dict[str, Any], list[Any], list[tuple[str, str]]]] = {
    "pipelineStages not a number": (
        _set(_minimal_spec(), "parallelism.pipelineStages", "eight"),
        [
            (
                ("parallelism", "pipelineStages"),
                "Input should be a valid integer, unable to parse string as an integer",
            )
        ],
        [("parallelism.pipelineStages", "type")],
    ),
    "workload name not a string": (
        _set(_minimal_spec(), "workload.name", 42),
        [(("workload", "name"), "Input should be a valid string")],
        [("workload.name", "type")],
    ),
    "missing workload": (
        _delete(_minimal_spec(), "workload"),
        [(("workload",), "Field required")],
        [("", "required")],
    ),
    "missing microbatches": (
        _delete(_minimal_spec(), "parallelism.microbatches"),
        [(("parallelism", "microbatches"), "Field required")],
        [("parallelism", "required")],
    ),
    "one pipeline stage": (
        _set(_minimal_spec(), "parallelism.pipelineStages", 1),
        [(("parallelism", "pipelineStages"), "Input should be greater than or equal to 2")],
        [("parallelism.pipelineStages", "minimum")],
    ),
    "unknown mode": (
        _set(_minimal_spec(), "policy.mode", "Turbo"),
        [(("policy", "mode"), "Input should be 'Observe', 'Intrinsic' or 'StragglerAware'")],
        [("policy.mode", "enum")],
    ),
    "unknown workload kind": (
        _set(_minimal_spec(), "workload.kind", "Deployment"),
        [
            (
                ("workload", "kind"),
                "Input should be 'PyTorchJob', 'JobSet', 'TrainJob' or 'Pods'",
            )
        ],
        [("workload.kind", "enum")],
    ),
    "negative maxSlowdown": (
        _set(_minimal_spec(), "policy.maxSlowdown", -0.1),
        [(("policy", "maxSlowdown"), "Input should be greater than or equal to 0")],
        [("policy.maxSlowdown", "minimum")],
    ),
    "zero blocking power (exclusive minimum)": (
        _set(_minimal_spec(), "policy.blockingPowerWatts", 0),
        [(("policy", "blockingPowerWatts"), "Input should be greater than 0")],
        [("policy.blockingPowerWatts", "minimum")],
    ),
    "slowdownThreshold of 1 (exclusive minimum)": (
        _set(_full_spec(), "stragglers.slowdownThreshold", 1.0),
        [(("stragglers", "slowdownThreshold"), "Input should be greater than 1")],
        [("stragglers.slowdownThreshold", "minimum")],
    ),
    "clock above range": (
        _set(_full_spec(), "policy.frequencyMHz.maxMHz", 9000),
        [
            (
                ("policy", "frequencyMHz", "maxMHz"),
                "Input should be less than or equal to 5000",
            )
        ],
        [("policy.frequencyMHz.maxMHz", "maximum")],
    ),
    "empty profile ConfigMap name": (
        _set(_full_spec(), "profiling.profileRef.configMapName", ""),
        [
            (
                ("profiling", "profileRef", "configMapName"),
                "String should have at least 1 character",
            )
        ],
        [("profiling.profileRef.configMapName", "minLength")],
    ),
    "unknown selector operator": (
        _set(
            _full_spec(), "workload.podSelector.matchExpressions", [{"key": "a", "operator": "Is"}]
        ),
        [
            (
                ("workload", "podSelector", "matchExpressions", 0, "operator"),
                "Input should be 'In', 'NotIn', 'Exists' or 'DoesNotExist'",
            )
        ],
        [("workload.podSelector.matchExpressions.0.operator", "enum")],
    ),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_CASES))
def test_malformed_specs_are_rejected_by_model_and_schema(case: str) -> None:
    spec, model_errors, schema_errors = SCHEMA_CASES[case]
    assert _model_errors(spec) == model_errors
    spec_schema = _at(_open_api_schema(crd.get_job_crd()), "spec")
    assert _schema_errors(spec_schema, spec) == schema_errors


def test_unknown_fields_are_errors_for_the_model_and_pruned_by_the_server() -> None:
    spec = _set(_minimal_spec(), "policy.turbo", True)
    assert _model_errors(spec) == [(("policy", "turbo"), "Extra inputs are not permitted")]
    # Structural schemas cannot forbid fields: the API server drops them (and kubectl's
    # strict field validation reports them), so the schema itself accepts the object.
    assert _schema_errors(_at(_open_api_schema(crd.get_job_crd()), "spec"), spec) == []


# (spec, field whose CEL rules hold the rule, the rule, the model's error)
CEL_CASES: dict[str, tuple[dict[str, Any], str, tuple[str, str], tuple[tuple[str, ...], str]]] = {
    "fewer microbatches than stages under 1F1B": (
        _set(_minimal_spec(), "parallelism.microbatches", 4),
        "parallelism",
        PARALLELISM_RULES[0],
        (
            ("parallelism",),
            "Value error, 1F1B needs at least as many microbatches as pipeline stages "
            "(got 4 microbatches for 8 stages)",
        ),
    ),
    "Interleaved1F1B with one virtual stage": (
        _set(_minimal_spec(), "parallelism.schedule", "Interleaved1F1B"),
        "parallelism",
        PARALLELISM_RULES[1],
        (
            ("parallelism",),
            "Value error, Interleaved1F1B needs virtualStages >= 2 and microbatches a multiple "
            "of pipelineStages (got 24 microbatches for 8 stages, virtualStages 1)",
        ),
    ),
    "Interleaved1F1B with microbatches not a multiple of stages": (
        _set(
            _set(
                _set(_minimal_spec(), "parallelism.schedule", "Interleaved1F1B"),
                "parallelism.virtualStages",
                2,
            ),
            "parallelism.microbatches",
            20,
        ),
        "parallelism",
        PARALLELISM_RULES[1],
        (
            ("parallelism",),
            "Value error, Interleaved1F1B needs virtualStages >= 2 and microbatches a multiple "
            "of pipelineStages (got 20 microbatches for 8 stages, virtualStages 2)",
        ),
    ),
    "virtual stages under ZBH1": (
        _set(_set(_minimal_spec(), "parallelism.schedule", "ZBH1"), "parallelism.virtualStages", 2),
        "parallelism",
        PARALLELISM_RULES[2],
        (
            ("parallelism",),
            "Value error, virtualStages above 1 need schedule Interleaved1F1B (got 2 with ZBH1)",
        ),
    ),
    "minMHz above maxMHz": (
        _set(_full_spec(), "policy.frequencyMHz", {"minMHz": 1500, "maxMHz": 1000}),
        "policy.frequencyMHz",
        FREQUENCY_RULES[0],
        (
            ("policy", "frequencyMHz"),
            "Value error, minMHz must not exceed maxMHz (got 1500 > 1000)",
        ),
    ),
    "recoveryThreshold at slowdownThreshold": (
        _set(_full_spec(), "stragglers.recoveryThreshold", 1.10),
        "stragglers",
        STRAGGLER_RULES[0],
        (
            ("stragglers",),
            "Value error, recoveryThreshold must be below slowdownThreshold (hysteresis) "
            "(got 1.1 >= 1.1)",
        ),
    ),
    "kind Pods with a name": (
        _set(_full_spec(), "workload.name", "gpt3-175b"),
        "workload",
        WORKLOAD_RULES[0],
        (
            ("workload",),
            "Value error, kind Pods needs podSelector (and no name); other kinds need name "
            "(and no podSelector)",
        ),
    ),
    "In without values": (
        _set(
            _full_spec(),
            "workload.podSelector.matchExpressions",
            [{"key": "role", "operator": "In"}],
        ),
        "workload.podSelector.matchExpressions.[]",
        REQUIREMENT_RULES[0],
        (
            ("workload", "podSelector", "matchExpressions", 0),
            "Value error, operators In and NotIn need values; Exists and DoesNotExist take none "
            "(got In with 0 values)",
        ),
    ),
    "empty pod selector": (
        _set(_full_spec(), "workload.podSelector", {}),
        "workload.podSelector",
        SELECTOR_RULES[0],
        (
            ("workload", "podSelector"),
            "Value error, a pod selector must have matchLabels or matchExpressions",
        ),
    ),
    "kind PyTorchJob without a name": (
        _delete(_minimal_spec(), "workload.name"),
        "workload",
        WORKLOAD_RULES[0],
        (
            ("workload",),
            "Value error, kind Pods needs podSelector (and no name); other kinds need name "
            "(and no podSelector)",
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(CEL_CASES))
def test_cross_field_rules_are_in_model_and_crd(case: str) -> None:
    spec, field, (rule, message), model_error = CEL_CASES[case]
    assert _model_errors(spec) == [model_error]
    assert model_error[1].startswith(f"Value error, {message}")
    spec_schema = _at(_open_api_schema(crd.get_job_crd()), "spec")
    assert {"rule": rule, "message": message} in _at(spec_schema, field)["x-kubernetes-validations"]
    # The per-field schema lets these through: only the CEL rule (or the model) catches them.
    assert _schema_errors(spec_schema, spec) == []


def test_every_cel_rule_is_tested() -> None:
    tested = {case[2] for case in CEL_CASES.values()}
    placed = set()
    for _, node in _nodes(_open_api_schema(crd.get_job_crd())):
        placed |= {(r["rule"], r["message"]) for r in node.get("x-kubernetes-validations", ())}
    assert placed == tested


# -- printer columns -------------------------------------------------------------------------------


def test_names_and_printer_columns() -> None:
    job, node_plan, policy = crd.get_job_crd(), crd.get_node_plan_crd(), crd.get_policy_crd()
    assert job["metadata"]["name"] == "perseusjobs.perseus.energy"
    assert node_plan["metadata"]["name"] == "perseusnodeplans.perseus.energy"
    assert policy["metadata"]["name"] == "perseuspolicies.perseus.energy"
    assert job["spec"]["names"]["shortNames"] == ["pj"]
    assert node_plan["spec"]["names"]["shortNames"] == ["pnp"]
    assert policy["spec"]["names"]["shortNames"] == ["ppol"]
    for definition, scope in ((job, "Namespaced"), (node_plan, "Namespaced"), (policy, "Cluster")):
        spec = definition["spec"]
        assert spec["scope"] == scope
        assert spec["names"]["categories"] == ["perseus"]
        (version,) = spec["versions"]
        assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
        assert version["subresources"] == {"status": {}}
    columns = {
        name: [c["name"] for c in CRDS[name]()["spec"]["versions"][0]["additionalPrinterColumns"]]
        for name in CRDS
    }
    assert columns == {
        "job": ["Phase", "Mode", "Target T", "Expected savings", "Stragglers", "Age"],
        "node plan": ["Node", "Job", "Revision", "Applied", "Age"],
        "policy": ["Priority", "Mode", "Workloads", "Jobs", "Expected savings", "Age"],
    }


_SEGMENT = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)(\[[^\]]*\])?")
_OBJECT_META = frozenset({"name", "namespace", "labels", "annotations", "creationTimestamp"})


def _field_at(schema: dict[str, Any], json_path: str) -> dict[str, Any]:
    """The schema node a printer column's JSONPath selects (``[...]``: any list item)."""
    node, position = schema, 0
    while position < len(json_path):
        segment = _SEGMENT.match(json_path, position)
        assert segment is not None, f"{json_path}: cannot parse at {position}"
        name, index = segment.groups()
        if node is schema["properties"]["metadata"]:
            assert name in _OBJECT_META and segment.end() == len(json_path), json_path
            return {"type": "string"}
        assert name in node.get("properties", {}), f"{json_path}: no field {name}"
        node = node["properties"][name]
        if index is not None:
            assert node["type"] == "array", f"{json_path}: {name} is not a list"
            node = node["items"]
        position = segment.end()
    return node


@pytest.mark.parametrize("name", sorted(CRDS))
def test_printer_columns_point_at_schema_fields(name: str) -> None:
    definition = CRDS[name]()
    schema = _open_api_schema(definition)
    for column in definition["spec"]["versions"][0]["additionalPrinterColumns"]:
        field = _field_at(schema, column["jsonPath"])
        if column["type"] in ("integer", "number"):
            assert field["type"] == column["type"], column
        elif column["type"] == "date":
            assert column["jsonPath"] == ".metadata.creationTimestamp"


def test_no_code_change_sample_needs_no_hooks() -> None:
    """What its comments promise: a stored profile, one clock per GPU, no straggler handling,
    so that nothing waits for the training loop to call perseus_client."""
    spec = PerseusJobSpec.model_validate(_sample("perseusjob-no-code-change.yaml")["spec"])
    assert spec.profiling.profile_ref is not None  # planned from it: no profiling sweep
    assert spec.policy.granularity == Granularity.STAGE  # no instruction hooks
    assert spec.policy.mode == Mode.INTRINSIC  # no iteration times needed (no stragglers)
