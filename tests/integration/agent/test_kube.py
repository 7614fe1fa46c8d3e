"""Kubernetes mode of the node agent: the PerseusNodePlan format, GPU arbitration between jobs,
status documents, and the agent against an emulated API server (kmock,
``tests/support/kmock_server.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.kube.plan_source import NodePlanSource
from perseus_agent.kube.report_writer import ReportWriter
from perseus_agent.plans.gpu_arbitration import arbitrate_gpus
from perseus_agent.plans.job_plans import JobPlans
from perseus_agent.plans.plan_status import invalid_status, report_status
from perseus_agent.serving.client_dispatch import ClientSession
from perseus_api import resources
from perseus_api.node_plan import NodePlan
from perseus_api.node_report import GpuStatus
from support.agent_process import NODE, REPO_ROOT, TIMEOUT_S, Agent, wait_for
from support.factories import pipeline_plan_fields
from support.fake_gpu import FakeBackend

kubernetes = pytest.importorskip("kubernetes")
pytest.importorskip("kmock")
emulated = pytest.importorskip("perseus_agent.gpu.emulated")

from support.kmock_server import KmockServer  # noqa: E402  (needs kmock)

RESOURCE = f"{resources.GROUP}/{resources.VERSION}/{resources.NODE_PLAN_PLURAL}"
RESOURCE_INFO: dict[str, Any] = {
    "kind": resources.NODE_PLAN_KIND,
    "singular": resources.NODE_PLAN_SINGULAR,
    "namespaced": True,
    "shortnames": set(resources.NODE_PLAN_SHORT_NAMES),
    "subresources": {"status"},
}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?)?$")


def node_plan(
    *,
    job: str = "gpt3",
    node: str = NODE,
    revision: int = 1,
    granularity: str = "Stage",
    stage_mhz: tuple[int, int] = (1200, 1005),
    gpus: tuple[int, ...] = (0, 1),
    by_uuid: tuple[int, ...] = (),
    uuid_prefix: str = f"GPU-emu-{NODE}-",
) -> NodePlan:
    """A plan of ``job`` for GPUs ``gpus`` (stage = position % 2; by UUID if in ``by_uuid``)."""
    fields = pipeline_plan_fields(num_stages=2, num_microbatches=2)
    for stage in fields["stages"]:
        stage["frequency_mhz"] = stage_mhz[stage["stage"]]
        stage["instructions"][0]["frequency_mhz"] = stage_mhz[stage["stage"]] - 90
    assignments = []
    for rank, gpu in enumerate(gpus):
        where = {"gpu_uuid": f"{uuid_prefix}{gpu}"} if gpu in by_uuid else {"gpu_index": gpu}
        assignments.append({**where, "plan": "tmin", "stage": rank % 2, "rank": rank})
    return NodePlan.model_validate(
        {
            "node": node,
            "namespace": "ml",
            "job": job,
            "revision": revision,
            "granularity": granularity,
            "plans": {"tmin": fields},
            "assignments": assignments,
        }
    )


# -- the PerseusNodePlan object --------------------------------------------------------------------


def test_node_plan_object_round_trips() -> None:
    plan = node_plan()
    body = resources.node_plan_object(plan)
    assert body["apiVersion"] == "perseus.energy/v1alpha1"
    assert body["kind"] == "PerseusNodePlan"
    assert body["metadata"] == {
        "name": "gpt3-n1",
        "namespace": "ml",
        "labels": {"perseus.energy/node": "n1", "perseus.energy/job": "gpt3"},
    }
    assert body["spec"]["node"] == "n1" and body["spec"]["assignments"][0]["gpuIndex"] == 0
    assert resources.parse_node_plan_object(json.loads(json.dumps(body))) == plan
    assert resources.node_label_selector("n1") == "perseus.energy/node=n1"


def test_names_and_label_values_are_always_valid() -> None:
    assert resources.node_plan_name("gpt3", "ip-10-0-1-2.ec2.internal") == (
        "gpt3-ip-10-0-1-2.ec2.internal"
    )
    odd = resources.node_plan_name("GPT_3", "Node_A")
    assert DNS_SUBDOMAIN.match(odd) and odd.startswith("gpt-3-node-a-")
    assert odd != resources.node_plan_name("GPT-3", "Node_A")  # sanitized alike, still distinct
    long_name = resources.node_plan_name("j", "n" * 300)
    assert DNS_SUBDOMAIN.match(long_name) and len(long_name) <= 253

    assert resources.label_value("gpu-node-1") == "gpu-node-1"
    long_node = "node-" + "x" * 80 + ".example.com"
    value = resources.label_value(long_node)
    assert LABEL_VALUE.match(value) and len(value) <= 63
    assert value == resources.label_value(long_node)  # stable: operator and agent agree
    assert value != resources.label_value(long_node + "m")
    plan = node_plan(node=long_node)
    assert resources.node_plan_object(plan)["metadata"]["labels"][resources.NODE_LABEL] == value


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"metadata": {"namespace": "ml", "name": "x"}}, "PerseusNodePlan ml/x: spec is missing"),
        ({"metadata": {"namespace": "ml"}, "spec": {}}, "PerseusNodePlan ml/?: metadata.name"),
        (
            {"metadata": {"namespace": "ml", "name": "x"}, "spec": {"revision": -1}},
            "PerseusNodePlan ml/x: invalid spec: node: Field required; job: Field required; "
            "revision: Input should be greater than or equal to 0",
        ),
    ],
)
def test_malformed_objects_are_named_in_the_error(body: dict[str, Any], message: str) -> None:
    with pytest.raises(resources.NodePlanObjectError) as info:
        resources.parse_node_plan_object(body)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


# -- one job per GPU (no server) -------------------------------------------------------------------


def test_the_older_plan_keeps_a_contested_gpu() -> None:
    backend = FakeBackend(num_gpus=4)
    older = node_plan(job="a", gpus=(0, 1))
    newer = node_plan(job="b", gpus=(1, 2), by_uuid=(1,), uuid_prefix="GPU-")
    grants = arbitrate_gpus([("a", older), ("b", newer)], backend.devices())

    assert grants["a"].plan == older and grants["a"].gpu_indices == {0, 1}
    assert grants["a"].denied == ()
    b = grants["b"]
    assert b.gpu_indices == {2}
    assert [a.gpu_index for a in b.plan.assignments] == [2]
    [denied] = b.denied
    assert (denied.index, denied.uuid, denied.status) == (1, "GPU-1", GpuStatus.FAILED)
    assert denied.target_mhz == 1200  # stage 0 of job b
    assert "GPU 1 (GPU-1) is used by job ml/a, whose plan is older" in denied.message

    # Unknown GPUs are left to the applier to report.
    lost = node_plan(job="c", gpus=(7,))
    assert arbitrate_gpus([("c", lost)], backend.devices())["c"].plan == lost


def test_job_plans_hand_gpus_over_between_jobs(tmp_path: Path) -> None:
    backend = FakeBackend(num_gpus=4)
    jobs = JobPlans(backend, ResetState(tmp_path), NODE)
    a, b = ("ml", "a-n1"), ("ml", "b-n1")

    assert jobs.set_plan(a, node_plan(job="a", gpus=(0, 1), stage_mhz=(1200, 1005))) == [a]
    assert jobs.set_plan(b, node_plan(job="b", gpus=(1, 2), stage_mhz=(900, 810))) == [b]
    assert backend.locked() == {0: 1200, 1: 1005, 2: 810}
    status = jobs.status(b)
    assert status is not None
    assert [(g["index"], g["status"]) for g in status["gpus"]] == [(2, "Applied"), (1, "Failed")]
    [condition] = status["conditions"]
    assert (condition["status"], condition["reason"]) == ("False", "Failed")
    assert "GPU 1: gpu_conflict: GPU 1 (GPU-1) is used by job ml/a" in condition["message"]
    assert jobs.metrics.error_count("gpu_conflict") == 1
    assert jobs.objects() == [a, b]

    # The older job takes GPU 2 as well: job b releases it before job a locks it.
    changed = jobs.set_plan(a, node_plan(job="a", revision=2, gpus=(0, 1, 2)))
    assert changed == [a, b]
    assert backend.locked() == {0: 1200, 1: 1005, 2: 1200}
    assert jobs.report(b) is not None and jobs.managed_gpus().keys() == {0, 1, 2}

    # Job a goes: its GPUs are reset and job b gets the GPUs it asked for.
    assert jobs.remove(a) == [b]
    assert backend.locked() == {1: 900, 2: 810}
    status = jobs.status(b)
    assert status is not None and status["conditions"][0]["reason"] == "Applied"
    assert jobs.remove(a) == []

    jobs.clear()
    assert backend.locked() == {} and jobs.locked_gpus() == [] and jobs.objects() == []


def test_an_emptied_plan_resets_its_gpus_and_confirms_the_revision(tmp_path: Path) -> None:
    """How the operator releases a deleted job: it empties the node plan and waits for the
    agent to report the empty revision before deleting the object."""
    backend = FakeBackend(num_gpus=2)
    jobs = JobPlans(backend, ResetState(tmp_path), NODE)
    key = ("ml", "gpt3-n1")
    jobs.set_plan(key, node_plan())
    assert backend.locked() == {0: 1200, 1: 1005}
    emptied = node_plan(revision=2).model_copy(update={"assignments": [], "plans": {}})
    jobs.set_plan(key, NodePlan.model_validate(emptied.model_dump()))
    assert backend.locked() == {} and jobs.locked_gpus() == []
    status = jobs.status(key)
    assert status is not None
    assert (status["observedRevision"], status["gpus"]) == (2, [])
    assert status["conditions"][0]["status"] == "True"


def test_a_plan_object_speaks_for_its_own_namespace_only(tmp_path: Path) -> None:
    """Issue 30, case 1: a plan in team-b naming namespace serving (whose pods no job of
    team-b runs) is refused whole: no GPU is touched, the status says why."""
    backend = FakeBackend(num_gpus=2)
    jobs = JobPlans(backend, ResetState(tmp_path), NODE)
    key = ("team-b", "steal-n1")
    rogue = node_plan(job="steal").model_copy(update={"namespace": "serving"})
    assert jobs.set_plan(key, rogue) == [key]
    assert backend.locked() == {} and jobs.managed_gpus() == {}
    status = jobs.status(key)
    assert status is not None and status["observedRevision"] == 1
    [condition] = status["conditions"]
    assert (condition["status"], condition["reason"]) == ("False", "InvalidSpec")
    assert (
        "spec.namespace is 'serving' but the object is in namespace 'team-b'"
        in (condition["message"])
    )
    assert status.get("gpus") is None and jobs.report(key) is None
    # Fixed by its author: applied as any plan.
    jobs.set_plan(key, rogue.model_copy(update={"namespace": "team-b", "revision": 2}))
    assert backend.locked() == {0: 1200, 1: 1005}
    # Edited to name another namespace again: its clocks are reset, nothing else is touched.
    jobs.set_plan(key, rogue.model_copy(update={"revision": 3}))
    assert backend.locked() == {} and jobs.locked_gpus() == []
    status = jobs.status(key)
    assert status is not None and status["conditions"][0]["reason"] == "InvalidSpec"
    jobs.clear()


def test_a_node_applies_a_bounded_number_of_plans(tmp_path: Path) -> None:
    """Issue 30, case 8: past MAX_PLANS_PER_NODE a plan object waits, refused with the
    reason, and is applied when another goes."""
    from perseus_agent.plans.plan_limits import MAX_PLANS_PER_NODE

    backend = FakeBackend(num_gpus=2)
    jobs = JobPlans(backend, ResetState(tmp_path), NODE)
    for i in range(MAX_PLANS_PER_NODE):
        jobs.set_plan(("ml", f"j{i}-n1"), node_plan(job=f"j{i}", gpus=()))
    late = ("ml", "late-n1")
    jobs.set_plan(late, node_plan(job="late", gpus=(0,)))
    assert backend.locked() == {}
    status = jobs.status(late)
    assert status is not None
    message = status["conditions"][0]["message"]
    assert f"the most one agent applies ({MAX_PLANS_PER_NODE})" in message
    assert late in jobs.remove(("ml", "j0-n1"))
    assert backend.locked() == {0: 1200}
    status = jobs.status(late)
    assert status is not None and status["conditions"][0]["reason"] == "Applied"
    jobs.clear()


def test_a_plan_assigns_a_bounded_number_of_gpus() -> None:
    """Issue 30, case 8: 20,000 assignments are refused by the schema (the CRD's maxItems and
    the agent's parsing), with a message saying so, instead of being bound one by one."""
    from perseus_api.node_plan import MAX_ASSIGNMENTS

    body = resources.node_plan_object(node_plan())
    one = body["spec"]["assignments"][0]
    body["spec"]["assignments"] = [{**one, "gpuIndex": i} for i in range(20_000)]
    with pytest.raises(resources.NodePlanObjectError, match=f"at most {MAX_ASSIGNMENTS} items"):
        resources.parse_node_plan_object(body)
    crd = yaml.safe_load((REPO_ROOT / "crds" / "perseus.energy_perseusnodeplans.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["assignments"]["maxItems"] == MAX_ASSIGNMENTS


def _session(connection_id: int, **hello: Any) -> ClientSession:
    msg = {
        "op": "hello",
        "version": 1,
        "rank": None,
        "local_rank": None,
        "gpu_uuids": [],
        "pid": 1,
        "job": None,
        "namespace": None,
        "pod": None,
        **hello,
    }
    return ClientSession(connection_id, None, None, None, 0, hello=msg)


def test_training_processes_are_routed_to_their_jobs(tmp_path: Path) -> None:
    backend = FakeBackend(num_gpus=4)
    jobs = JobPlans(backend, ResetState(tmp_path), NODE)
    jobs.set_plan(("ml", "a"), node_plan(job="a", granularity="Instruction", gpus=(0, 1)))

    late = _session(1, rank=5, gpu_uuids=["GPU-3"], job="b")
    reply = jobs.hello(late, late.hello, 0)
    assert reply["managed"] is False
    begin = {"op": "instruction_begin", "name": "forward", "microbatch": 0}
    assert jobs.instruction_begin(late, begin, 0) == {"ok": True, "sm_clock_mhz": None}

    mine = _session(2, rank=1, gpu_uuids=["GPU-1"])
    assert jobs.hello(mine, mine.hello, 0)["managed"] is True
    jobs.step_begin(mine, {"op": "step_begin", "step": 0}, 0)
    assert jobs.instruction_begin(mine, begin, 0)["sm_clock_mhz"] == 1005 - 90
    assert backend.locked() == {1: 915}

    # Job b's plan arrives: the waiting process is handed to it.
    jobs.set_plan(("ml", "b"), node_plan(job="b", granularity="Instruction", gpus=(3,)))
    jobs.step_begin(late, {"op": "step_begin", "step": 0}, 0)
    assert jobs.instruction_begin(late, begin, 0)["sm_clock_mhz"] == 1200 - 90
    assert backend.locked() == {1: 915, 3: 1110}

    jobs.disconnected(late)
    assert backend.locked() == {1: 915}
    jobs.clear()
    assert backend.locked() == {}


# -- status documents and the report writer (no server) --------------------------------------------


class _ApiError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.reason = "Test"
        self.body = json.dumps({"message": f"test error {status}"})


class _FakeApi:
    def __init__(self, *errors: BaseException | None) -> None:
        self.errors = list(errors)
        self.calls: list[dict[str, Any]] = []

    def patch_namespaced_custom_object_status(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(args[5])
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error
        return {}


def _status(ok: bool = True) -> dict[str, Any]:
    plan = node_plan()
    jobs_report = {
        "node": NODE,
        "job": plan.job,
        "namespace": plan.namespace,
        "revision": 1,
        "granularity": "Stage",
        "gpus": [],
    }
    if ok:
        return {**jobs_report, "observedRevision": 1, "conditions": [_ok_condition()]}
    return invalid_status("broken", 1)


def _ok_condition() -> dict[str, Any]:
    return {"type": "Applied", "status": "True", "reason": "Applied", "message": "no GPUs"}


def test_status_documents(tmp_path: Path) -> None:
    backend = FakeBackend(num_gpus=2)
    jobs = JobPlans(backend, ResetState(tmp_path), NODE)
    jobs.set_plan(("ml", "a"), node_plan(gpus=(0, 5)))
    report = jobs.report(("ml", "a"))
    assert report is not None
    status = report_status(report)
    assert status["observedRevision"] == 1 and status["revision"] == 1
    assert [g["status"] for g in status["gpus"]] == ["Applied", "Failed"]
    [condition] = status["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "Applied",
        "False",
        "Failed",
    )
    assert condition["message"].startswith("1 Applied, 1 Failed: GPU 5: ")
    assert "index 5" in condition["message"]
    bad = invalid_status("PerseusNodePlan ml/x: invalid spec: ...", 3)
    assert bad["observedRevision"] == 3
    assert bad["gpus"] is None and bad["node"] is None  # removes a previous report (merge patch)
    assert bad["conditions"][0]["reason"] == "InvalidSpec"
    jobs.clear()


def test_report_writer_retries_a_bounded_number_of_times_and_never_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = _FakeApi(_ApiError(409), _ApiError(503), ConnectionResetError("reset"), None)
    writer = ReportWriter(api, attempts=4, retry_delay_s=0.001)
    assert writer.write("ml", "a", _status()) is True
    assert len(api.calls) == 4
    since = api.calls[-1]["status"]["conditions"][0]["lastTransitionTime"]

    assert writer.write("ml", "a", _status()) is True  # unchanged: not sent again
    assert len(api.calls) == 4
    changed = {**_status(), "ranks": [{"rank": 0}]}
    assert writer.write("ml", "a", changed) is True
    assert api.calls[-1]["status"]["conditions"][0]["lastTransitionTime"] == since  # same status

    api.errors = [_ApiError(404)]
    assert writer.write("ml", "gone", _status()) is False
    api.errors = [_ApiError(422)]
    assert writer.write("ml", "rejected", _status()) is False
    assert len(api.calls) == 7  # no retry for those
    api.errors = [_ApiError(500)] * 4
    assert writer.write("ml", "down", _status()) is False
    assert len(api.calls) == 11
    assert "cannot write the status of PerseusNodePlan ml/down (try 4 of 4): HTTP 500" in (
        caplog.text
    )
    api.errors = [RuntimeError("anything")] * 4
    assert writer.write("ml", "odd", _status()) is False  # never raises

    # Queued writes: the latest status of an object wins.
    api.errors = []
    writer.start()
    writer.submit("ml", "b", _status())
    writer.submit("ml", "b", _status(ok=False))
    writer.submit("ml", "c", _status())
    assert writer.flush(5.0)
    writer.stop()
    written = [c["status"]["conditions"][0]["reason"] for c in api.calls[-2:]]
    assert sorted(written) == ["Applied", "InvalidSpec"]


def test_report_writer_says_when_an_object_turns_out_to_be_gone() -> None:
    """A deletion the watch missed shows as a 404 on the status: the agent treats it as one."""
    gone: list[tuple[str, str]] = []
    api = _FakeApi(_ApiError(404), _ApiError(500), None)
    writer = ReportWriter(
        api, attempts=2, retry_delay_s=0.001, on_gone=lambda ns, n: gone.append((ns, n))
    )
    assert writer.write("ml", "gpt3-n1", _status()) is False
    assert gone == [("ml", "gpt3-n1")]
    assert writer.write("ml", "other", _status()) is True  # a 500, then written
    assert gone == [("ml", "gpt3-n1")]


# -- against an emulated API server (kmock) --------------------------------------------------------


@pytest.fixture
def api_server() -> Iterator[KmockServer]:
    with KmockServer({RESOURCE: RESOURCE_INFO}) as server:
        yield server


def custom_objects(server: KmockServer, tmp_path: Path) -> Any:
    kubeconfig = server.write_kubeconfig(tmp_path / f"kubeconfig-{server.port}")
    api_client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    return kubernetes.client.CustomObjectsApi(api_client)


@contextlib.contextmanager
def closing_api(api: Any) -> Iterator[Any]:
    try:
        yield api
    finally:
        api.api_client.close()


def create(api: Any, body: dict[str, Any]) -> None:
    namespace = body["metadata"]["namespace"]
    api.create_namespaced_custom_object(
        resources.GROUP, resources.VERSION, namespace, resources.NODE_PLAN_PLURAL, body
    )


def patch(api: Any, namespace: str, name: str, body: dict[str, Any]) -> None:
    api.patch_namespaced_custom_object(
        resources.GROUP, resources.VERSION, namespace, resources.NODE_PLAN_PLURAL, name, body
    )


def delete(api: Any, namespace: str, name: str) -> None:
    api.delete_namespaced_custom_object(
        resources.GROUP, resources.VERSION, namespace, resources.NODE_PLAN_PLURAL, name
    )


class Recorder:
    """The callbacks of a NodePlanSource, as a queue of events."""

    def __init__(self) -> None:
        self.events: queue.Queue[tuple[Any, ...]] = queue.Queue()

    def source(self, api: Any, **kwargs: Any) -> NodePlanSource:
        return NodePlanSource(
            api,
            NODE,
            on_plan=lambda ns, name, plan: self.events.put(("plan", ns, name, plan.revision)),
            on_delete=lambda ns, name: self.events.put(("delete", ns, name)),
            on_invalid=lambda ns, name, msg, rev: self.events.put(("invalid", ns, name, msg, rev)),
            **kwargs,
        )

    def next(self, timeout_s: float = TIMEOUT_S) -> tuple[Any, ...]:
        return self.events.get(timeout=timeout_s)

    def nothing_within(self, seconds: float) -> bool:
        try:
            event = self.events.get(timeout=seconds)
        except queue.Empty:
            return True
        pytest.fail(f"unexpected event {event}")


def test_source_delivers_the_plans_of_its_node_only(tmp_path: Path) -> None:
    # kmock ignores label selectors unless told otherwise: the agent must filter by itself.
    with (
        KmockServer({RESOURCE: RESOURCE_INFO}, enforce_label_selectors=False) as server,
        closing_api(custom_objects(server, tmp_path)) as api,
    ):
        create(api, resources.node_plan_object(node_plan(job="early")))
        recorder = Recorder()
        source = recorder.source(api, watch_timeout_s=1)  # watches end and resume every second
        source.start()
        try:
            assert recorder.next() == ("plan", "ml", "early-n1", 1)
            assert source.synced.wait(TIMEOUT_S)

            create(api, resources.node_plan_object(node_plan(job="elsewhere", node="n2")))
            mislabelled = resources.node_plan_object(node_plan(job="odd", node="n2"))
            mislabelled["metadata"]["labels"][resources.NODE_LABEL] = NODE
            create(api, mislabelled)
            kind, ns, name, message, revision = recorder.next()
            assert (kind, ns, name, revision) == ("invalid", "ml", "odd-n2", 1)
            listed = api.list_cluster_custom_object(
                resources.GROUP,
                resources.VERSION,
                resources.NODE_PLAN_PLURAL,
                label_selector=source.selector,
            )
            assert "elsewhere-n2" in {i["metadata"]["name"] for i in listed["items"]}
            assert "spec.node is 'n2' but the object is labelled perseus.energy/node=n1" in message

            patch(api, "ml", "early-n1", {"spec": {"revision": 2}})
            assert recorder.next() == ("plan", "ml", "early-n1", 2)
            # A status update (the agent's own report) and watch restarts deliver nothing.
            ReportWriter(api).write("ml", "early-n1", _status())
            assert recorder.nothing_within(2.5)

            patch(api, "ml", "early-n1", {"spec": {"assignments": [{"plan": "tmin"}]}})
            kind, ns, name, message, revision = recorder.next()
            assert (kind, name, revision) == ("invalid", "early-n1", 2)
            assert message.startswith("PerseusNodePlan ml/early-n1: invalid spec: assignments.0")

            delete(api, "ml", "early-n1")
            assert recorder.next() == ("delete", "ml", "early-n1")
            delete(api, "ml", "odd-n2")
            assert recorder.next() == ("delete", "ml", "odd-n2")
            assert recorder.nothing_within(0.5)
        finally:
            source.stop()


def test_source_refuses_a_plan_naming_another_namespace(tmp_path: Path) -> None:
    """Issue 30, case 1: the object's namespace is the plan's; spec.namespace only echoes it."""
    with (
        KmockServer({RESOURCE: RESOURCE_INFO}, enforce_label_selectors=False) as server,
        closing_api(custom_objects(server, tmp_path)) as api,
    ):
        rogue = resources.node_plan_object(node_plan(job="steal"))
        rogue["metadata"]["namespace"] = "team-b"  # spec.namespace stays "ml"
        create(api, rogue)
        create(api, resources.node_plan_object(node_plan(job="own")))
        recorder = Recorder()
        source = recorder.source(api)
        source.start()
        try:
            events = sorted([recorder.next(), recorder.next()], key=lambda e: e[0])
            kind, ns, name, message, revision = events[0]
            assert (kind, ns, name, revision) == ("invalid", "team-b", "steal-n1", 1)
            assert "spec.namespace is 'ml' but the object is in namespace 'team-b'" in message
            assert events[1] == ("plan", "ml", "own-n1", 1)
        finally:
            source.stop()


def test_source_waits_for_an_unreachable_api(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="perseus_agent.kube.plan_source")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    down = KmockServer({RESOURCE: RESOURCE_INFO}, port=port)
    with closing_api(custom_objects(down, tmp_path)) as api:
        recorder = Recorder()
        source = recorder.source(api, min_backoff_s=0.05, max_backoff_s=0.2)
        source.start()
        try:
            wait_for(lambda: "cannot list/watch perseusnodeplans" in caplog.text, "an error")
            assert not source.synced.is_set()
            with down:
                create(api, resources.node_plan_object(node_plan()))
                assert recorder.next() == ("plan", "ml", "gpt3-n1", 1)
                wait_for(lambda: "Kubernetes API reachable again" in caplog.text, "the log")
                source.stop()  # before the server goes
        finally:
            source.stop()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # then warnings, not an error per retry


def test_source_says_when_the_resource_is_not_installed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with KmockServer() as server, closing_api(custom_objects(server, tmp_path)) as api:
        source = Recorder().source(api, min_backoff_s=0.05, max_backoff_s=0.1)
        source.start()
        try:
            wait_for(lambda: "CustomResourceDefinition installed?" in caplog.text, "a hint")
        finally:
            source.stop()
    assert "HTTP 404" in caplog.text


def test_report_writer_patches_the_status_subresource(
    api_server: KmockServer, tmp_path: Path
) -> None:
    with closing_api(custom_objects(api_server, tmp_path)) as api:
        create(api, resources.node_plan_object(node_plan()))
        writer = ReportWriter(api, retry_delay_s=0.01)
        assert writer.write("ml", "gpt3-n1", _status(ok=False))
        assert writer.write("ml", "gpt3-n1", _status())
        obj = api_server.objects(RESOURCE)[("ml", "gpt3-n1")]
        assert obj["spec"] == node_plan().model_dump(mode="json", by_alias=True)
        assert obj["status"]["conditions"][0]["reason"] == "Applied"
        assert obj["status"]["gpus"] == [] and obj["status"]["job"] == "gpt3"
        assert writer.write("ml", "missing", _status()) is False


# -- the agent process in Kubernetes mode ----------------------------------------------------------


def test_agent_applies_reports_and_resets_plans_from_the_api(
    api_server: KmockServer, tmp_path: Path, socket_dir: Path
) -> None:
    with closing_api(custom_objects(api_server, tmp_path)) as api:
        kubeconfig = tmp_path / f"kubeconfig-{api_server.port}"
        agent = Agent(tmp_path, socket_dir / "run", kubeconfig=kubeconfig)
        try:
            agent.start()
            _drive_agent(agent, api, api_server)
        finally:
            agent.kill_if_running()


def test_the_agent_locks_only_the_gpus_the_kubelet_gave_the_pod(
    api_server: KmockServer, tmp_path: Path, socket_dir: Path
) -> None:
    pytest.importorskip("grpc")
    pytest.importorskip("google.protobuf")
    from support.kubelet_pod_resources import KubeletStandIn, StandInPod

    kubelet_sock = socket_dir / "kubelet.sock"
    plan = node_plan().model_dump(mode="json")
    for local, a in enumerate(plan["assignments"]):  # the operator's form: by process
        del a["gpu_index"]
        a.update(pod="gpt3-0", pod_uid="u-0", container="pytorch", local_rank=local)
    with (
        KubeletStandIn(kubelet_sock) as kubelet,
        closing_api(custom_objects(api_server, tmp_path)) as api,
    ):
        kubelet.set_pods(
            [
                StandInPod("ml", "gpt3-0", {"pytorch": [f"GPU-emu-{NODE}-5", f"GPU-emu-{NODE}-2"]}),
                StandInPod("other", "x", {"main": [f"GPU-emu-{NODE}-0"]}),
            ]
        )
        kubeconfig = tmp_path / f"kubeconfig-{api_server.port}"
        agent = Agent(
            tmp_path,
            socket_dir / "run",
            num_gpus=8,
            kubeconfig=kubeconfig,
            pod_resources_socket=kubelet_sock,
        )
        try:
            agent.start()
            body = resources.node_plan_object(NodePlan.model_validate(plan))
            create(api, body)
            expected = [None, None, 1200, None, None, 1005, None, None]
            wait_for(lambda: agent.clocks() == expected, "the pod's GPUs locked", agent)
            wait_for(
                lambda: _status_of(api_server, "gpt3-n1").get("observedRevision") == 1,
                "a report",
                agent,
            )
            status = _status_of(api_server, "gpt3-n1")
            assert [(g["index"], g["status"]) for g in status["gpus"]] == [
                (2, "Applied"),
                (5, "Applied"),
            ]
            assert kubelet.calls["List"] >= 1
        finally:
            agent.kill_if_running()


def _status_of(server: KmockServer, name: str) -> dict[str, Any]:
    obj = server.objects(RESOURCE).get(("ml", name)) or {}
    status: dict[str, Any] = obj.get("status") or {}
    return status


def _drive_agent(agent: Agent, api: Any, server: KmockServer) -> None:
    create(api, resources.node_plan_object(node_plan()))
    wait_for(lambda: agent.clocks() == [1200, 1005], "the plan's clocks", agent)
    wait_for(lambda: _status_of(server, "gpt3-n1").get("observedRevision") == 1, "a report", agent)
    status = _status_of(server, "gpt3-n1")
    assert [(g["index"], g["status"], g["appliedMHz"]) for g in status["gpus"]] == [
        (0, "Applied", 1200),
        (1, "Applied", 1005),
    ]
    assert status["conditions"][0]["status"] == "True"

    # A training process calls in: its iteration times are reported periodically.
    wait_for((agent.socket_dir / "agent.sock").exists, "the local socket", agent)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(agent.socket_dir / "agent.sock"))
        stream = sock.makefile("rwb")
        for msg in (
            {
                "op": "hello",
                "version": 1,
                "rank": 0,
                "local_rank": 0,
                "gpu_uuids": [f"GPU-emu-{NODE}-0"],
                "pid": 1,
                "job": "gpt3",
                "namespace": "ml",
                "pod": None,
            },
            {"op": "step_begin", "step": 0},
            {"op": "step_end", "step": 0},
        ):
            stream.write(json.dumps(msg).encode() + b"\n")
            stream.flush()
            assert json.loads(stream.readline())["ok"] is True
        wait_for(lambda: bool(_status_of(server, "gpt3-n1").get("ranks")), "iteration times", agent)
    [rank] = _status_of(server, "gpt3-n1")["ranks"]
    assert (rank["rank"], rank["dpRank"], rank["ppRank"], rank["iterations"]) == (0, 0, 0, 1)

    # Another node's plan is none of this agent's business.
    create(api, resources.node_plan_object(node_plan(job="other", node="n2", gpus=(0,))))

    # A new revision is applied and reported.
    new = node_plan(revision=2, stage_mhz=(900, 1005)).model_dump(mode="json", by_alias=True)
    patch(api, "ml", "gpt3-n1", {"spec": new})
    wait_for(lambda: agent.clocks() == [900, 1005], "the new revision's clocks", agent)
    wait_for(lambda: _status_of(server, "gpt3-n1").get("observedRevision") == 2, "a report", agent)

    # A malformed plan is reported on its object; the agent and the other plan go on.
    bad = resources.node_plan_object(node_plan(job="bad"))
    bad["spec"]["assignments"][0]["stage"] = 7
    create(api, bad)
    wait_for(
        lambda: bool(_status_of(server, "bad-n1").get("conditions")),
        "the bad plan's report",
        agent,
    )
    [condition] = _status_of(server, "bad-n1")["conditions"]
    assert (condition["status"], condition["reason"]) == ("False", "InvalidSpec")
    assert "PerseusNodePlan ml/bad-n1: invalid spec: " in condition["message"]
    assert "is at stage 7 but plan 'tmin' has 2 stages" in condition["message"]
    assert agent.proc is not None and agent.proc.poll() is None and agent.clocks() == [900, 1005]

    # Deleting the plan resets its GPUs.
    delete(api, "ml", "gpt3-n1")
    wait_for(lambda: agent.clocks() == [None, None], "the reset", agent)
    assert _status_of(server, "other-n2") == {}

    # SIGTERM resets everything, then the agent exits with status 0.
    create(api, resources.node_plan_object(node_plan(revision=3)))
    wait_for(lambda: agent.clocks() == [1200, 1005], "the plan's clocks again", agent)
    wait_for(lambda: _status_of(server, "gpt3-n1").get("observedRevision") == 3, "a report", agent)
    assert agent.stop() == 0
    assert agent.clocks() == [None, None]
    assert "every clock this agent changed is reset" in agent.log
    # ... and the plan's status no longer claims its clocks are applied.
    status = _status_of(server, "gpt3-n1")
    [condition] = status["conditions"]
    assert (condition["status"], condition["reason"]) == ("False", "AgentStopped")
    assert "reset every GPU clock of this plan" in condition["message"]
    assert status["observedRevision"] == 3 and status.get("gpus") is None
    assert _status_of(server, "bad-n1")["conditions"][0]["reason"] == "InvalidSpec"
