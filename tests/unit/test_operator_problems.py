"""The operator-log check of the kmock tests: kopf's retries of its discovery requests while it
stops are not problems; every other ERROR or traceback is, before or after the stop."""

from __future__ import annotations

from support.operator_harness import operator_problems

RETRY = (
    "2026-12-02 17:11:07,266 ERROR kopf._core.reactor.observation: Request attempt #1/9 failed;"
    " will retry: GET http://127.0.0.1:42673/apis/kubeflow.org/v1 -> ClientConnectionError("
    "'Connector is closed.')"
)
STOPPING = (
    "2026-12-02 17:11:06,822 INFO kopf._core.reactor.running: Signal SIGTERM is received. "
    "Operator is stopping."
)
OURS = "2026-12-02 17:11:07,300 ERROR perseus_operator.handlers: reconcile failed"


def test_discovery_retries_after_the_stop_are_not_problems() -> None:
    assert operator_problems("\n".join([STOPPING, RETRY])) == []


def test_the_same_retry_while_running_is_a_problem() -> None:
    assert operator_problems("\n".join([RETRY, STOPPING])) == [RETRY]


def test_other_errors_and_tracebacks_are_problems_after_the_stop_too() -> None:
    log = "\n".join([STOPPING, OURS, "Traceback (most recent call last):"])
    assert operator_problems(log) == [OURS, "Traceback (most recent call last):"]
