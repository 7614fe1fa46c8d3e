"""Interleaved 1F1B and ZB-H1 PerseusJobs through the whole flow: the operator process on
kmock's API, the real agent's applier and profiler on emulated GPUs (simulated time), training
ranks that call in with protocol v2 in torch's order (:mod:`schedule_agents`).

Pending → Profiling (the profiling plans already list each GPU's computations with their
virtual stages / backward halves) → the profile stored in the schedule's own form (``P * V``
model stages; ``backward_input``/``backward_weight``) → Optimizing → Running, with Instruction
plans whose per-GPU lists are torch's order and which the agent follows without a mismatch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from perseus_api import resources
from perseus_api.profile import Measurements, Profile, parse_profile
from perseus_api.schedule import Schedule, Step, gpu_computation_order
from perseus_operator.jobs.profile_source import PIPELINE_KEY, PROFILE_KEY
from perseus_planner.model_stages import derive_profile
from support.kmock_server import KmockServer
from support.operator_harness import (
    JOBS,
    PLANS,
    RESOURCES,
    OperatorProcess,
    operator_problems,
    perseus_job,
    pod,
    profile_of,
)
from support.schedule_agents import BLOCKING_W, ScheduleAgents

NS = "ml"
P, M = 2, 4
CLAMP = {"minMHz": 1200, "maxMHz": 1410}
CASES = [
    pytest.param("Interleaved1F1B", 2, ";virtualStages=2", id="interleaved-1f1b"),
    pytest.param("ZBH1", 1, ";backward=split", id="zb-h1"),
]
TORCH_NAMES = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


def torch_order(schedule: str, stage: int, virtual_stages: int) -> list[Step] | None:
    """Rank ``stage``'s computations as torch's own schedule class orders them (built without
    process groups: only the attributes the order depends on are set); None without torch."""
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:
        return None
    cls = (
        schedules.ScheduleInterleaved1F1B
        if virtual_stages > 1
        else schedules.ScheduleInterleavedZeroBubble
    )
    sched = cls.__new__(cls)
    sched.pp_group_size = P
    sched.n_local_stages = virtual_stages
    sched._n_microbatches = M
    sched.number_of_rounds = max(1, M // P)
    sched.microbatches_per_round = M // sched.number_of_rounds
    return [
        Step(TORCH_NAMES[a.computation_type.value], a.microbatch_index, a.stage_index)
        for a in sched._calculate_single_rank_operations(stage)
        if a is not None
    ]


def emulated_truth(sched: Schedule, virtual_stages: int) -> Profile:
    """The emulated GPUs' profile: the bundled GPT-3 one's first P stages in the schedule's
    form, each model stage slower than the one before and the backward split 0.6/0.4, so that
    a chunk or a half measured as another would show."""
    derived = derive_profile(profile_of(P), sched, virtual_stages, input_fraction=0.6)
    measurements = {
        (stage, name): Measurements(
            m.frequencies_mhz, m.times_s * (1 + 0.15 * stage), m.energies_j * (1 + 0.15 * stage)
        )
        for (stage, name), m in derived.measurements.items()
    }
    return Profile(derived.source, derived.num_stages, measurements)


def listed(stage_plan: dict[str, Any], stage: int) -> list[Step]:
    """A node plan's per-GPU instruction list as computations (model stage: the GPU's own
    when the plan names none)."""
    return [
        Step(i["instruction"], i["microbatch"], i.get("virtualStage", stage))
        for i in stage_plan["instructions"]
    ]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[KmockServer, Path]]:
    with KmockServer(RESOURCES) as server:
        yield server, server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)


@pytest.fixture
def operator(cluster: tuple[KmockServer, Path]) -> Iterator[OperatorProcess]:
    process = OperatorProcess(cluster[1])
    yield process
    process.stop()


@pytest.mark.parametrize(("schedule", "virtual_stages", "key_suffix"), CASES)
def test_a_job_of_the_schedule_profiles_and_runs(
    cluster: tuple[KmockServer, Path],
    operator: OperatorProcess,
    tmp_path: Path,
    schedule: str,
    virtual_stages: int,
    key_suffix: str,
) -> None:
    server, kubeconfig = cluster
    client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    wait_for = operator.wait_for
    sched = Schedule.parse(schedule)
    planner_order = {s: gpu_computation_order(sched, P, M, s, virtual_stages) for s in range(P)}
    torch_orders = {s: torch_order(schedule, s, virtual_stages) for s in range(P)}
    for s in range(P):  # the planner's order is torch's (where torch is installed)
        assert torch_orders[s] in (None, planner_order[s]), s
    for index in range(P):  # one GPU per pod, each pod on a node of its own
        core.create_namespaced_pod(NS, pod("llm", index, NS, 1))

    body = perseus_job("llm", NS, "llm", stages=P, dp=1, microbatches=M)
    body["spec"]["parallelism"]["schedule"] = schedule
    if virtual_stages > 1:
        body["spec"]["parallelism"]["virtualStages"] = virtual_stages
    # Blocking power measured by the agents, not given.
    body["spec"]["policy"] = {"granularity": "Instruction", "frequencyMHz": CLAMP}
    custom.create_namespaced_custom_object(
        resources.GROUP, resources.VERSION, NS, "perseusjobs", body
    )

    def job() -> dict[str, Any]:
        return server.objects(JOBS).get((NS, "llm")) or {}

    def plans() -> list[dict[str, Any]]:
        return [obj["spec"] for obj in server.objects(PLANS).values()]

    truth = emulated_truth(sched, virtual_stages)
    order_of = {s: torch_orders[s] or planner_order[s] for s in range(P)}.__getitem__
    with ScheduleAgents(
        custom, NS, "llm", truth, order_of, tmp_path / "agents", gpus_per_node=1
    ) as agents:
        profiling = wait_for(
            "the profiling plans",
            lambda: len(plans()) == P and all(p.get("profiling") for p in plans()) and plans(),
        )
        for spec in profiling:  # the agent's profiler needs the computations' chunks
            for a in spec["assignments"]:
                stage_plan = spec["plans"][a["plan"]]["stages"][a["stage"]]
                assert listed(stage_plan, a["stage"]) == planner_order[a["stage"]]

        status = wait_for(
            "Running",
            lambda: (
                agents.errors
                or (job().get("status", {}).get("phase") == "Running" and job()["status"])
            ),
            timeout_s=90,  # ~10-20 s here; the margin is for a loaded machine
        )
        assert not agents.errors, (agents.errors, job().get("status"))

        # The stored profile: the schedule's own form, measured per model stage / half.
        data = server.objects("v1/configmaps")[(NS, "llm-profile")]["data"]
        assert data[PIPELINE_KEY].endswith(key_suffix)
        stored = parse_profile(data[PROFILE_KEY], "stored")
        assert stored.num_stages == P * virtual_stages
        assert {i for _, i in stored.measurements} == set(sched.instructions)
        assert set(stored.measurements) == set(truth.measurements)
        for key, measured in stored.measurements.items():
            want = truth.measurements[key]
            clocks = [int(c) for c in measured.frequencies_mhz]
            in_clamp = [c for c in map(int, want.frequencies_mhz) if 1200 <= c <= 1410]
            assert sorted(clocks) == sorted(in_clamp), key
            for k, clock in enumerate(clocks):
                j = list(map(int, want.frequencies_mhz)).index(clock)
                assert measured.times_s[k] == pytest.approx(want.times_s[j], rel=1e-6), key
                assert measured.energies_j[k] == pytest.approx(want.energies_j[j], rel=1e-6), key
        assert float(data["blockingPowerWatts"]) == pytest.approx(BLOCKING_W, rel=1e-3)

        # The plan: savings expected, per-GPU lists in torch's order, followed by the agent.
        assert status["plan"]["expectedSavingsRatio"] > 0
        assert status["frontier"]["tMinSeconds"] > 0
        running = wait_for(
            "the Instruction plans",
            lambda: len(plans()) == P and not any(p.get("profiling") for p in plans()) and plans(),
        )
        for spec in running:
            assert spec["granularity"] == "Instruction"
            for a in spec["assignments"]:
                pipeline = spec["plans"][a["plan"]]
                assert (pipeline["schedule"], pipeline.get("virtualStages", 1)) == (
                    sched.value,
                    virtual_stages,
                )
                stage_plan = pipeline["stages"][a["stage"]]
                assert listed(stage_plan, a["stage"]) == order_of(a["stage"]), a["stage"]
                if virtual_stages == 1:
                    assert all("virtualStage" not in i for i in stage_plan["instructions"])
        wait_for(
            "PlanApplied",
            lambda: any(
                c["type"] == "PlanApplied" and c["status"] == "True"
                for c in job()["status"].get("conditions", [])
            ),
        )
        slowed = 0
        for spec in running:
            node = agents.nodes[spec["node"]]
            assert node.applier.metrics.error_count("schedule_mismatch") == 0
            for a in spec["assignments"]:
                planned = spec["plans"][a["plan"]]["stages"][a["stage"]]["instructions"]
                clocks = [i["frequencyMHz"] for i in planned]
                # The last iteration: every computation at its own planned clock.
                assert node.clocks[a["rank"]] == clocks, a["stage"]
                slowed += sum(c < CLAMP["maxMHz"] for c in clocks)
        assert slowed > 0  # computations off the critical path run slower
        assert not agents.errors, agents.errors

    log = operator.stop()
    problems = operator_problems(log)
    assert not problems, log
