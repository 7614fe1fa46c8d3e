"""Cluster-wide PerseusPolicies: which workloads they select, which policy wins, the
parallelism read from a workload, and the PerseusJob created for it."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from perseus_api.job import Mode, Parallelism, PerseusJobSpec, WorkloadKind, with_default_policy
from perseus_api.job_status import PerseusJob
from perseus_api.policy import (
    MANAGED_BY_POLICY_LABEL,
    OPT_OUT_ANNOTATION,
    PerseusPolicy,
    PerseusPolicySpec,
    PerseusPolicyStatus,
    PolicyError,
    parse_policy,
)
from perseus_api.structural_schema import structural_schema
from perseus_operator.policies.parallelism import UnreadableParallelismError, infer_parallelism
from perseus_operator.policies.selection import (
    MAX_JOB_NAME,
    PodGroup,
    PolicyChoice,
    choose_policy,
    get_perseus_job,
    group_pods,
    opted_out,
    perseus_job_name,
    policy_matches,
    user_job_for,
    workload_kind,
)
from perseus_operator.workloads.selectors import matches
from support.workload_objects import NAMESPACES, container, job_pod, jobset, pytorch_job, train_job

Obj = dict[str, Any]


def pods_workload(job: str = "mistral", pods: int = 2, **kwargs: Any) -> PodGroup:
    (group,) = group_pods([job_pod(job, i, **kwargs) for i in range(pods)])
    return group


def policy(**spec: Any) -> PerseusPolicySpec:
    fields = {
        "namespaceSelector": {"matchLabels": {"perseus.energy/enabled": "true"}},
        "workloads": [{"kind": "PyTorchJob"}, {"kind": "JobSet"}],
    } | spec
    return parse_policy({"metadata": {"name": "p"}, "spec": fields})


# -- the model -------------------------------------------------------------------------------------


def test_a_full_policy_parses_with_job_defaults() -> None:
    spec = parse_policy(
        {
            "apiVersion": "perseus.energy/v1alpha1",
            "kind": "PerseusPolicy",
            "metadata": {"name": "research"},
            "spec": {
                "namespaceSelector": {
                    "matchExpressions": [
                        {"key": "team", "operator": "In", "values": ["research", "serving"]},
                        {"key": "tier", "operator": "DoesNotExist"},
                    ]
                },
                "workloads": [
                    {"kind": "PyTorchJob", "labelSelector": {"matchLabels": {"team": "llm"}}},
                    {"kind": "Pods", "labelSelector": {"matchLabels": {"app": "trainer"}}},
                ],
                "priority": 10,
                "policy": {"mode": "Observe", "maxSlowdown": 0.02},
                "profiling": {"frequencyStepMHz": 30},
                "stragglers": {"slowdownThreshold": 1.1},
                "rankMapping": {"gpusPerPod": 8},
            },
        }
    )
    assert spec.priority == 10
    assert spec.policy.mode == Mode.OBSERVE
    assert spec.profiling.frequency_step_mhz == 30
    assert spec.rank_mapping.gpus_per_pod == 8
    assert [w.kind for w in spec.workloads] == [WorkloadKind.PYTORCH_JOB, WorkloadKind.PODS]
    # What is left out has the PerseusJob's defaults.
    defaults = PerseusJobSpec.model_validate(
        {
            "workload": {"kind": "JobSet", "name": "x"},
            "parallelism": {"pipelineStages": 2, "microbatches": 2},
        }
    )
    minimal = policy()
    assert minimal.priority == 0
    assert (minimal.policy, minimal.profiling, minimal.stragglers, minimal.rank_mapping) == (
        defaults.policy,
        defaults.profiling,
        defaults.stragglers,
        defaults.rank_mapping,
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"namespaceSelector": {}},
            "namespaceSelector: Value error, namespaceSelector must have matchLabels or "
            "matchExpressions: an empty selector would select every namespace",
        ),
        (
            {"namespaceSelector": {"matchLabels": {}, "matchExpressions": []}},
            "an empty selector would select every namespace",
        ),
        ({"namespaceSelector": None}, "namespaceSelector: Input should be a valid dictionary"),
        (
            {"workloads": [{"kind": "Pods"}]},
            "workloads.0: Value error, kind Pods needs labelSelector",
        ),
        (
            {"workloads": [{"kind": "Pods", "labelSelector": {}}]},
            "workloads.0.labelSelector: Value error, labelSelector must have matchLabels or "
            "matchExpressions",
        ),
        (
            {"workloads": [{"kind": "Deployment"}]},
            "workloads.0.kind: Input should be 'PyTorchJob', 'JobSet', 'TrainJob' or 'Pods'",
        ),
        ({"workloads": []}, "workloads: List should have at least 1 item"),
        ({"nameSpaceSelector": {}}, "nameSpaceSelector: Extra inputs are not permitted"),
        (
            {"policy": {"mode": "Aggressive"}},
            "policy.mode: Input should be 'Observe', 'Intrinsic' or 'StragglerAware'",
        ),
        ({"policy": {"maxSlowdown": 0.9}}, "policy.maxSlowdown: Input should be less than"),
        ({"priority": "high"}, "priority: Input should be a valid integer"),
        (
            {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In"}]}},
            "operators In and NotIn need values",
        ),
        (
            {"stragglers": {"slowdownThreshold": 1.02, "recoveryThreshold": 1.05}},
            "recoveryThreshold must be below slowdownThreshold",
        ),
    ],
)
def test_malformed_policies_are_named_precisely(spec: Obj, message: str) -> None:
    fields = {
        "namespaceSelector": {"matchLabels": {"perseus.energy/enabled": "true"}},
        "workloads": [{"kind": "PyTorchJob"}],
    } | spec
    with pytest.raises(PolicyError) as caught:
        parse_policy({"metadata": {"name": "research"}, "spec": fields})
    assert str(caught.value).startswith("PerseusPolicy research: invalid spec: ")
    assert message in str(caught.value)


def test_a_policy_without_name_or_spec_is_rejected() -> None:
    with pytest.raises(PolicyError, match=r"PerseusPolicy \?: metadata.name is missing"):
        parse_policy({"spec": {}})
    with pytest.raises(PolicyError, match="PerseusPolicy p: spec is missing or not an object"):
        parse_policy({"metadata": {"name": "p"}})


def test_the_models_convert_to_structural_schemas() -> None:
    """As the CRD generator needs (perseus_api.structural_schema), with the CEL rules and no
    defaults in spec.policy (the operator's default policy fills them)."""
    spec = structural_schema(PerseusPolicySpec)
    assert spec["required"] == ["namespaceSelector", "workloads"]
    rules = spec["properties"]["namespaceSelector"]["x-kubernetes-validations"]
    assert "select every namespace" in rules[0]["message"]
    entry = spec["properties"]["workloads"]["items"]
    assert entry["x-kubernetes-validations"][0]["rule"] == (
        "self.kind != 'Pods' || has(self.labelSelector)"
    )
    assert spec["properties"]["workloads"]["minItems"] == 1
    assert "default" not in spec["properties"]["policy"]["properties"]["mode"]
    assert spec["properties"]["profiling"]["default"] == {}
    status = structural_schema(PerseusPolicyStatus, mode="serialization")
    assert {"matchedWorkloads", "managedJobs", "expectedSavingsRatio", "conditions"} <= set(
        status["properties"]
    )
    whole = PerseusPolicy.model_validate(
        {"metadata": {"name": "p"}, "spec": policy().model_dump(by_alias=True)}
    )
    assert whole.status.matched_workloads == 0


# -- selection -------------------------------------------------------------------------------------


def test_workloads_in_an_opted_in_namespace_are_picked_up_and_others_ignored() -> None:
    policies = {"research": policy()}
    inside = [pytorch_job("gpt3"), jobset("bloom")]
    outside = pytorch_job("gpt3", "web")
    for workload in inside:
        choice = choose_policy(policies, NAMESPACES["ml"], workload)
        assert choice is not None
        assert (choice.policy, choice.others) == ("research", ())
    assert not policy_matches(policies["research"], NAMESPACES["web"], outside)
    assert choose_policy(policies, NAMESPACES["web"], outside) is None
    # Kinds the policy does not list are not selected.
    assert choose_policy(policies, NAMESPACES["ml"], train_job()) is None
    assert choose_policy(policies, NAMESPACES["ml"], pods_workload().workload) is None


@pytest.mark.parametrize(
    ("expression", "selected"),
    [
        ({"key": "team", "operator": "In", "values": ["research", "serving"]}, {"ml", "ml-prod"}),
        ({"key": "team", "operator": "NotIn", "values": ["research"]}, {"ml-prod", "web"}),
        ({"key": "tier", "operator": "Exists"}, {"ml-prod"}),
        ({"key": "tier", "operator": "DoesNotExist"}, {"ml", "web"}),
        ({"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["web"]}, {"web"}),
    ],
)
def test_namespace_match_expressions(expression: Obj, selected: set[str]) -> None:
    spec = policy(namespaceSelector={"matchExpressions": [expression]})
    found = {
        namespace
        for namespace, labels in NAMESPACES.items()
        if policy_matches(spec, labels, pytorch_job(namespace=namespace))
    }
    assert found == selected


def test_workload_label_selectors() -> None:
    spec = policy(
        workloads=[
            {"kind": "PyTorchJob", "labelSelector": {"matchLabels": {"team": "llm"}}},
            {
                "kind": "JobSet",
                "labelSelector": {
                    "matchExpressions": [{"key": "perseus.energy/skip", "operator": "DoesNotExist"}]
                },
            },
        ]
    )
    ml = NAMESPACES["ml"]
    assert policy_matches(spec, ml, pytorch_job())
    assert not policy_matches(spec, ml, pytorch_job(labels={"team": "vision"}))
    assert policy_matches(spec, ml, jobset())
    assert not policy_matches(spec, ml, jobset(labels={"perseus.energy/skip": ""}))


def test_labelled_pods_are_grouped_by_their_controller() -> None:
    pods = [job_pod("mistral", i) for i in range(2)] + [job_pod("phi", 0, app="phi-train")]
    # Pods of a PyTorchJob or JobSet are managed as that workload; bare pods as none.
    operator_pod = job_pod("gpt3", 0)
    operator_pod["metadata"]["labels"]["training.kubeflow.org/job-name"] = "gpt3"
    bare = copy.deepcopy(job_pod("scratch", 0))
    del bare["metadata"]["ownerReferences"]
    groups = group_pods([*pods, operator_pod, bare])
    assert [g.workload["metadata"]["name"] for g in groups] == ["mistral", "phi"]
    mistral, phi = groups
    assert len(mistral.pods) == 2 and len(phi.pods) == 1
    # The shared labels, without the per-pod completion index (even for one pod).
    assert mistral.workload["spec"]["podSelector"] == {
        "matchLabels": {
            "app": "mistral-train",
            "batch.kubernetes.io/controller-uid": "uid-job-mistral",
            "batch.kubernetes.io/job-name": "mistral",
            "controller-uid": "uid-job-mistral",
            "job-name": "mistral",
        }
    }
    assert "batch.kubernetes.io/job-completion-index" not in phi.workload["metadata"]["labels"]
    assert (
        "batch.kubernetes.io/job-completion-index"
        not in mistral.workload["metadata"]["annotations"]
    )
    assert workload_kind(mistral.workload) == WorkloadKind.PODS

    spec = policy(
        workloads=[{"kind": "Pods", "labelSelector": {"matchLabels": {"app": "phi-train"}}}]
    )
    assert [policy_matches(spec, NAMESPACES["ml"], g.workload) for g in groups] == [False, True]


def test_opt_out_is_respected() -> None:
    policies = {
        "research": policy(
            workloads=[
                {"kind": "PyTorchJob"},
                {"kind": "Pods", "labelSelector": {"matchLabels": {"app": "mistral-train"}}},
            ]
        )
    }
    ml = NAMESPACES["ml"]
    opted = pytorch_job(annotations={OPT_OUT_ANNOTATION: "true"})
    assert opted_out(opted)
    assert policy_matches(policies["research"], ml, opted)  # selected, but opted out
    assert choose_policy(policies, ml, opted) is None
    assert choose_policy(policies, ml, pytorch_job(annotations={OPT_OUT_ANNOTATION: "false"}))
    # One pod of a group opting out opts the whole group out.
    pods = [job_pod("mistral", 0), job_pod("mistral", 1, annotations={OPT_OUT_ANNOTATION: "True"})]
    (group,) = group_pods(pods)
    assert choose_policy(policies, ml, group.workload) is None
    assert choose_policy(policies, ml, pods_workload().workload) is not None


def test_a_users_own_perseus_job_wins() -> None:
    workload = pytorch_job()
    mine: Obj = {
        "metadata": {"name": "gpt3-energy", "namespace": "ml"},
        "spec": {"workload": {"kind": "PyTorchJob", "name": "gpt3"}},
    }
    managed = copy.deepcopy(mine)
    managed["metadata"] |= {"name": "gpt3", "labels": {MANAGED_BY_POLICY_LABEL: "research"}}
    elsewhere = copy.deepcopy(mine)
    elsewhere["metadata"]["namespace"] = "ml-prod"
    other = copy.deepcopy(mine)
    other["spec"]["workload"]["name"] = "bloom"
    assert user_job_for([managed, elsewhere, other], workload) is None
    assert user_job_for([managed, mine], workload) == "gpt3-energy"
    claimed = user_job_for([mine], workload) is not None
    assert (
        choose_policy({"research": policy()}, NAMESPACES["ml"], workload, claimed_by_user=claimed)
        is None
    )

    # A TrainJob runs as a JobSet of its name: a job for either covers both.
    by_jobset = {
        "metadata": {"name": "mine", "namespace": "ml"},
        "spec": {"workload": {"kind": "JobSet", "name": "llama"}},
    }
    assert user_job_for([by_jobset], train_job("llama")) == "mine"
    # Labelled pods: a user's job whose pod selector covers the group's pods.
    group = pods_workload()
    selecting: Obj = {
        "metadata": {"name": "mistral-by-hand", "namespace": "ml"},
        "spec": {
            "workload": {"kind": "Pods", "podSelector": {"matchLabels": {"app": "mistral-train"}}}
        },
    }
    broken = copy.deepcopy(selecting)
    broken["spec"]["workload"]["podSelector"] = {}
    assert user_job_for([selecting, broken], group.workload) == "mistral-by-hand"
    assert user_job_for([broken], group.workload) is None
    # A user's kind Pods job may also cover a PyTorchJob's pods: known from the pods.
    pytorch_pod = job_pod("gpt3-master", 0, app="gpt3")
    pytorch_pod["metadata"]["labels"]["training.kubeflow.org/job-name"] = "gpt3"
    by_pods = copy.deepcopy(selecting)
    by_pods["spec"]["workload"]["podSelector"] = {
        "matchLabels": {"training.kubeflow.org/job-name": "gpt3"}
    }
    assert user_job_for([by_pods], workload) is None
    assert user_job_for([by_pods], workload, [pytorch_pod]) == "mistral-by-hand"
    assert user_job_for([selecting], workload, [pytorch_pod]) is None


def test_a_jobset_of_a_trainjob_is_managed_as_the_trainjob() -> None:
    owned = jobset("llama")
    owned["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "trainer.kubeflow.org/v1alpha1",
            "kind": "TrainJob",
            "name": "llama",
            "uid": "uid-trainjob-llama",
            "controller": True,
        }
    ]
    spec = policy(workloads=[{"kind": "JobSet"}, {"kind": "TrainJob"}])
    assert workload_kind(owned) is None
    assert not policy_matches(spec, NAMESPACES["ml"], owned)
    assert policy_matches(spec, NAMESPACES["ml"], train_job("llama"))
    assert workload_kind({"kind": "Deployment"}) is None


# -- precedence ------------------------------------------------------------------------------------

BY_KIND = {"namespaceSelector": {"matchLabels": {"perseus.energy/enabled": "true"}}}


def test_the_most_specific_policy_wins_and_the_others_are_named() -> None:
    policies = {
        # kind only, but many namespace requirements and a high priority
        "cluster-wide": policy(
            namespaceSelector={
                "matchLabels": {"perseus.energy/enabled": "true", "team": "research"},
                "matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}],
            },
            workloads=[{"kind": "PyTorchJob"}],
            priority=100,
        ),
        # by workload labels: beats every kind-only policy
        "llm-team": policy(
            workloads=[{"kind": "PyTorchJob", "labelSelector": {"matchLabels": {"team": "llm"}}}],
            policy={"mode": "Intrinsic"},
        ),
        # by workload labels with one more requirement: beats llm-team
        "llm-gpt": policy(
            workloads=[
                {"kind": "JobSet"},
                {
                    "kind": "PyTorchJob",
                    "labelSelector": {
                        "matchLabels": {"team": "llm"},
                        "matchExpressions": [
                            {"key": "team", "operator": "NotIn", "values": ["vision"]}
                        ],
                    },
                },
            ],
        ),
        "elsewhere": policy(namespaceSelector={"matchLabels": {"tier": "prod"}}),
    }
    choice = choose_policy(policies, NAMESPACES["ml"], pytorch_job())
    assert isinstance(choice, PolicyChoice)
    assert choice.policy == "llm-gpt"
    assert choice.others == ("llm-team", "cluster-wide")
    assert choice.entry.kind == WorkloadKind.PYTORCH_JOB  # the entry that selected it
    assert choice.requirements == 3
    assert choice.message == (
        "PerseusPolicy llm-gpt manages this PyTorchJob (selected by its labels, 3 selector "
        "requirements, priority 0); also selected by llm-team, cluster-wide, less specific, "
        "of lower priority or later by name"
    )
    # Without labels on the workload, only the kind-only policy selects it.
    alone = choose_policy(policies, NAMESPACES["ml"], pytorch_job(labels={"team": "vision"}))
    assert alone is not None and (alone.policy, alone.others) == ("cluster-wide", ())
    assert "selected by kind only" in alone.message

    # More namespace requirements win among kind-only policies.
    narrower = {
        "any": policy(priority=5),
        "research": policy(
            namespaceSelector={
                "matchLabels": {"team": "research"},
                "matchExpressions": [{"key": "perseus.energy/enabled", "operator": "Exists"}],
            }
        ),
    }
    chosen = choose_policy(narrower, NAMESPACES["ml"], jobset())
    assert chosen is not None and (chosen.policy, chosen.others) == ("research", ("any",))


def test_priority_then_name_break_ties() -> None:
    ml = NAMESPACES["ml"]
    tied = {"b-low": policy(), "c-high": policy(priority=7), "a-low": policy()}
    chosen = choose_policy(tied, ml, pytorch_job())
    assert chosen is not None
    assert (chosen.policy, chosen.others) == ("c-high", ("a-low", "b-low"))
    same = {"zeta": policy(priority=1), "alpha": policy(priority=1), "mid": policy(priority=1)}
    chosen = choose_policy(same, ml, pytorch_job())
    assert chosen is not None and (chosen.policy, chosen.others) == ("alpha", ("mid", "zeta"))
    # The order of the mapping does not matter.
    reordered = dict(reversed(list(same.items())))
    assert choose_policy(reordered, ml, pytorch_job()) == chosen
    assert choose_policy({}, ml, pytorch_job()) is None


# -- parallelism -----------------------------------------------------------------------------------


def test_parallelism_of_a_pytorch_job() -> None:
    # Master + 3 Workers x 8 GPUs = 32 processes; 4 stages -> 8 data-parallel replicas.
    assert infer_parallelism(pytorch_job()) == Parallelism(
        pipeline_stages=4, data_parallel=8, microbatches=8
    )
    stated = pytorch_job(
        annotations={
            "perseus.energy/tensor-parallel": "2",
            "perseus.energy/data-parallel": "4",
            "perseus.energy/schedule": "GPipe",
        }
    )
    assert infer_parallelism(stated) == Parallelism(
        pipeline_stages=4, data_parallel=4, tensor_parallel=2, microbatches=8, schedule="GPipe"
    )
    # Container variables when there are no annotations; nprocPerNode as a number.
    plain = pytorch_job(
        workers=1, env={"PERSEUS_PIPELINE_STAGES": "2", "PERSEUS_MICROBATCHES": "4"}
    )
    plain["metadata"]["annotations"] = {}
    plain["spec"]["nprocPerNode"] = "8"
    assert infer_parallelism(plain) == Parallelism(
        pipeline_stages=2, data_parallel=8, microbatches=4
    )
    # rankMapping.gpusPerPod replaces the GPUs requested.
    assert infer_parallelism(pytorch_job(gpus=None), gpus_per_pod=4) == Parallelism(
        pipeline_stages=4, data_parallel=4, microbatches=8
    )


def test_parallelism_of_a_jobset_a_trainjob_and_pods() -> None:
    # 2 jobs x 2 pods x 4 GPUs = 16; 4 stages -> 4 replicas; the initializer has no GPU.
    assert infer_parallelism(jobset()) == Parallelism(
        pipeline_stages=4, data_parallel=4, microbatches=16
    )
    # 2 nodes x 8 GPUs, 8 stages.
    assert infer_parallelism(train_job()) == Parallelism(
        pipeline_stages=8, data_parallel=2, microbatches=32
    )
    # The runtime decides the nodes: the pods say how many (PET_NNODES) and their GPUs.
    runtime_sized = train_job(numNodes=None, resourcesPerNode=None)
    trainer_pods = [
        _edit(job_pod("llama-node", i, nnodes="4"), "metadata/annotations", {}) for i in range(2)
    ]
    assert infer_parallelism(runtime_sized, trainer_pods) == Parallelism(
        pipeline_stages=8, data_parallel=4, microbatches=32
    )
    # An annotation (here on the pods) wins over a container variable.
    annotated = [job_pod("llama-node", i, nnodes="4") for i in range(2)]
    assert infer_parallelism(runtime_sized, annotated) == Parallelism(
        pipeline_stages=2, data_parallel=16, microbatches=8
    )
    # Labelled pods: annotations on the pods, PET_NNODES 2 x 8 GPUs, 2 stages.
    group = pods_workload()
    assert infer_parallelism(group.workload, group.pods) == Parallelism(
        pipeline_stages=2, data_parallel=8, microbatches=8
    )


def _edit(obj: Obj, path: str, value: Any) -> Obj:
    obj = copy.deepcopy(obj)
    *parents, last = path.split("/")
    node: Any = obj
    for step in parents:
        node = node[int(step)] if isinstance(node, list) else node[step]
    key: Any = int(last) if isinstance(node, list) else last
    if value is None:
        del node[key]
    else:
        node[key] = value
    return obj


def _without_layout(workload: Obj) -> Obj:
    return _edit(workload, "metadata/annotations", {})


MASTER = "spec/pytorchReplicaSpecs/Master"
TRAINER = "spec/replicatedJobs/1/template/spec/template/spec/containers/0"


@pytest.mark.parametrize(
    ("workload", "pods", "reason"),
    [
        (
            _without_layout(pytorch_job()),
            None,
            "PyTorchJob ml/gpt3: pipeline stages unknown (Perseus never guesses the pipeline "
            "layout): annotate the PyTorchJob with perseus.energy/pipeline-stages, or set "
            "PERSEUS_PIPELINE_STAGES on the training container",
        ),
        (
            _edit(pytorch_job(), "metadata/annotations", {"perseus.energy/pipeline-stages": "4"}),
            None,
            "PyTorchJob ml/gpt3: microbatches unknown (microbatches per iteration and replica): "
            "annotate the PyTorchJob with perseus.energy/microbatches",
        ),
        (
            pytorch_job(annotations={"perseus.energy/pipeline-stages": "four"}),
            None,
            "annotation perseus.energy/pipeline-stages of PyTorchJob is 'four', not a positive "
            "integer",
        ),
        (
            pytorch_job(annotations={"perseus.energy/pipeline-stages": "1"}),
            None,
            "invalid parallelism: pipelineStages: Input should be greater than or equal to 2",
        ),
        (
            pytorch_job(annotations={"perseus.energy/microbatches": "2"}),
            None,
            "1F1B needs at least as many microbatches as pipeline stages (got 2 microbatches "
            "for 4 stages)",
        ),
        (
            pytorch_job(annotations={"perseus.energy/schedule": "interleaved"}),
            None,
            "invalid parallelism: schedule: Input should be '1F1B', 'GPipe', 'Interleaved1F1B' or "
            "'ZBH1'",
        ),
        (
            pytorch_job(annotations={"perseus.energy/pipeline-stages": "6"}),
            None,
            "the workload runs 32 processes (4 pods x 8 GPUs), not a multiple of 6 pipeline "
            "stages x 1 tensor parallel = 6; fix perseus.energy/pipeline-stages",
        ),
        (
            pytorch_job(annotations={"perseus.energy/data-parallel": "2"}),
            None,
            "data parallel 2 x 4 pipeline stages x 1 tensor parallel = 8 processes, but the "
            "workload runs 32 (4 pods x 8 GPUs); fix perseus.energy/data-parallel",
        ),
        (
            _edit(
                _without_layout(
                    pytorch_job(env={"PERSEUS_PIPELINE_STAGES": "4", "PERSEUS_MICROBATCHES": "8"})
                ),
                f"{MASTER}/template/spec/containers/1/env/0/value",
                "2",
            ),
            None,
            "pipeline stages is stated differently: '2' (variable PERSEUS_PIPELINE_STAGES of "
            "PyTorchJob Master template), '4' (variable PERSEUS_PIPELINE_STAGES of PyTorchJob "
            "Worker template)",
        ),
        (
            _edit(pytorch_job(), "spec/nprocPerNode", "4"),
            None,
            "Master replicas request 8 nvidia.com/gpu but run 4 processes per pod; Perseus "
            "runs one process per GPU; or annotate perseus.energy/data-parallel",
        ),
        (
            _edit(pytorch_job(), "spec/nprocPerNode", "cpu"),
            None,
            "Master replicas run 'cpu' processes per pod",
        ),
        (
            pytorch_job(gpus=None),
            None,
            "Master replicas request no nvidia.com/gpu; set rankMapping.gpusPerPod in the "
            "PerseusPolicy if the training pods get their GPUs another way",
        ),
        (
            pytorch_job(gpus="eight"),
            None,
            "Master replicas: pod <unnamed pod>: limits nvidia.com/gpu of container pytorch is "
            "'eight', not a non-negative integer",
        ),
        (
            _edit(pytorch_job(), "spec/elasticPolicy", {"minReplicas": 2, "maxReplicas": 4}),
            None,
            "elastic between 2 and 4 replicas, so the processes are not fixed; or annotate "
            "perseus.energy/data-parallel",
        ),
        (
            _edit(pytorch_job(), f"{MASTER}/replicas", "one"),
            None,
            "spec.pytorchReplicaSpecs.Master.replicas is 'one', not a non-negative integer",
        ),
        (
            _edit(pytorch_job(), "spec/pytorchReplicaSpecs/Launcher", {"replicas": 1}),
            None,
            "replica type Launcher: Perseus ranks Master and Worker replicas",
        ),
        (
            _edit(
                jobset(),
                "spec/replicatedJobs/0/template/spec/template/spec/containers/0",
                container("init", 1),
            ),
            None,
            "replicated jobs initializer, trainer all request nvidia.com/gpu",
        ),
        (
            _edit(jobset(), f"{TRAINER}/resources", None),
            None,
            "JobSet ml/bloom: no replicated job requests nvidia.com/gpu",
        ),
        (
            train_job(numNodes=None),
            None,
            "TrainJob ml/llama: spec.trainer.numNodes is unset (its runtime decides) and no "
            "pod states PET_NNODES yet; or annotate perseus.energy/data-parallel",
        ),
        (
            train_job(numProcPerNode=4),
            None,
            "spec.trainer.resourcesPerNode request 8 nvidia.com/gpu but run 4 processes per pod",
        ),
        (
            train_job(resourcesPerNode=None),
            None,
            "spec.trainer.resourcesPerNode request no nvidia.com/gpu; set "
            "rankMapping.gpusPerPod in the PerseusPolicy",
        ),
        (
            pods_workload().workload,
            None,
            "Pods ml/mistral: no pods; or annotate perseus.energy/data-parallel",
        ),
        (
            pods_workload(nnodes=None).workload,
            pods_workload(nnodes=None).pods,
            "Pods ml/mistral: how many training pods there will be is not stated: set "
            "PET_NNODES on the training container",
        ),
        (
            pods_workload().workload,
            [job_pod("mistral", 0), job_pod("mistral", 1, gpus=4)],
            "the pods request different numbers of nvidia.com/gpu: 4, 8",
        ),
        (
            pods_workload().workload,
            [job_pod("mistral", 0), job_pod("mistral", 1, nnodes="3")],
            "the pods state different PET_NNODES: 2, 3",
        ),
        (
            pods_workload().workload,
            [
                job_pod("mistral", 0, annotations={"perseus.energy/pipeline-stages": "4"}),
                job_pod("mistral", 1),
            ],
            "pipeline stages is stated differently: '2' (annotation "
            "perseus.energy/pipeline-stages of Pods), '4' (annotation "
            "perseus.energy/pipeline-stages of pod mistral-0-x7k2p)",
        ),
        (
            {"kind": "Deployment", "metadata": {"name": "web", "namespace": "ml"}},
            None,
            "Deployment ml/web: not a PyTorchJob, JobSet, TrainJob or group of Pods",
        ),
    ],
)
def test_parallelism_that_cannot_be_read_says_why(
    workload: Obj, pods: list[Obj] | None, reason: str
) -> None:
    with pytest.raises(UnreadableParallelismError) as info:
        infer_parallelism(workload, pods)
    assert reason in str(info.value)


# -- the PerseusJob --------------------------------------------------------------------------------


def _validated(body: Obj) -> PerseusJobSpec:
    """The job as the operator reads it (lifecycle.reconcile), with a default policy."""
    PerseusJob.model_validate(body)
    return PerseusJobSpec.model_validate(
        with_default_policy(body["spec"], {"mode": "Observe", "granularity": "Stage"})
    )


def test_the_perseus_job_of_a_pytorch_job_validates_and_is_owned_by_it() -> None:
    spec = policy(
        policy={"maxSlowdown": 0.05, "frequencyMHz": {"minMHz": 900, "maxMHz": 1410}},
        profiling={"iterationsPerFrequency": 3},
        rankMapping={"order": "tp-pp-dp"},
    )
    workload = pytorch_job()
    parallelism = infer_parallelism(workload)
    body = get_perseus_job("research", spec, workload, parallelism)
    assert body["apiVersion"] == "perseus.energy/v1alpha1" and body["kind"] == "PerseusJob"
    assert body["metadata"] == {
        "name": "gpt3",
        "namespace": "ml",
        "labels": {MANAGED_BY_POLICY_LABEL: "research"},
        "ownerReferences": [
            {
                "apiVersion": "kubeflow.org/v1",
                "kind": "PyTorchJob",
                "name": "gpt3",
                "uid": "uid-pytorchjob-gpt3",
                "controller": True,
                "blockOwnerDeletion": False,
            }
        ],
    }
    # Only what the policy sets: the rest is defaulted as for a hand-written job.
    assert body["spec"]["policy"] == {
        "maxSlowdown": 0.05,
        "frequencyMHz": {"minMHz": 900, "maxMHz": 1410},
    }
    assert body["spec"]["profiling"] == {"iterationsPerFrequency": 3}
    assert body["spec"]["stragglers"] == {}
    job = _validated(body)
    assert job.workload.kind == WorkloadKind.PYTORCH_JOB and job.workload.name == "gpt3"
    assert job.parallelism == parallelism
    assert job.policy.mode == Mode.OBSERVE  # from the operator's default policy
    assert job.policy.max_slowdown == 0.05
    assert job.profiling.iterations_per_frequency == 3
    assert job.profiling.warmup_iterations == 2  # the PerseusJob default
    assert job.rank_mapping.order == "tp-pp-dp"
    # A job the policy creates is not a user's: it does not block the policy.
    assert user_job_for([body], workload) is None


def test_the_perseus_jobs_of_a_jobset_and_of_labelled_pods() -> None:
    spec = policy(policy={"mode": "Intrinsic"}, rankMapping={"gpusPerPod": 8})
    workload = jobset()
    parallelism = infer_parallelism(workload)
    job = _validated(get_perseus_job("research", spec, workload, parallelism))
    assert (job.workload.kind, job.workload.name) == (WorkloadKind.JOB_SET, "bloom")
    assert job.policy.mode == Mode.INTRINSIC

    group = pods_workload()
    parallelism = infer_parallelism(group.workload, group.pods, gpus_per_pod=8)
    body = get_perseus_job("research", spec, group.workload, parallelism)
    assert body["metadata"]["name"] == "mistral"
    assert body["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": "mistral",
            "uid": "uid-job-mistral",
            "controller": True,
            "blockOwnerDeletion": False,
        }
    ]
    job = _validated(body)
    assert job.workload.kind == WorkloadKind.PODS and job.workload.name is None
    assert job.workload.pod_selector is not None
    assert all(matches(job.workload.pod_selector, p["metadata"]["labels"]) for p in group.pods)
    assert not matches(job.workload.pod_selector, job_pod("phi", 0)["metadata"]["labels"])
    assert job.rank_mapping.gpus_per_pod == 8


def test_long_names_are_cut_with_a_hash_and_policy_labels_are_valid() -> None:
    long_name = "pretrain-" + "x" * 80
    body = get_perseus_job(
        "p" * 100,
        policy(),
        pytorch_job(long_name),
        Parallelism(pipeline_stages=4, data_parallel=8, microbatches=8),
    )
    name = body["metadata"]["name"]
    assert len(name) <= MAX_JOB_NAME and name.startswith("pretrain-xxx")
    assert name != perseus_job_name("pretrain-" + "x" * 81)
    assert len(body["metadata"]["labels"][MANAGED_BY_POLICY_LABEL]) <= 63
    assert body["spec"]["workload"]["name"] == long_name  # the workload keeps its name
    _validated(body)
    assert perseus_job_name("gpt3") == "gpt3"
    assert perseus_job_name("GPT_3") != "GPT_3"
    assert perseus_job_name("GPT_3").startswith("gpt-3-")


def test_a_workload_that_cannot_own_a_job_is_an_error() -> None:
    parallelism = Parallelism(pipeline_stages=4, data_parallel=8, microbatches=8)
    no_uid = pytorch_job()
    del no_uid["metadata"]["uid"]
    with pytest.raises(ValueError, match="PyTorchJob ml/gpt3: its owner has no apiVersion or uid"):
        get_perseus_job("research", policy(), no_uid, parallelism)
    with pytest.raises(ValueError, match="is not a named workload"):
        get_perseus_job("research", policy(), {"kind": "Deployment"}, parallelism)
    ownerless = copy.deepcopy(pods_workload().workload)
    ownerless["metadata"]["ownerReferences"] = []
    with pytest.raises(ValueError, match="has no controller"):
        get_perseus_job("research", policy(), ownerless, parallelism)
