"""The operator's own errors are not malformed-data errors: a network failure or a workload
whose pods cannot run the spec is no ``ValueError`` (which ``ApiError`` and the planner's
errors are), so an ``except ValueError`` around parsing never swallows one."""

from __future__ import annotations

import pytest

from perseus_api.errors import ApiError
from perseus_operator.cluster.kube.client import KubeError
from perseus_operator.policies.parallelism import UnreadableParallelismError
from perseus_operator.workloads.pods import WorkloadError


@pytest.mark.parametrize("error", [KubeError, WorkloadError, UnreadableParallelismError])
def test_operator_errors_are_not_value_errors(error: type[Exception]) -> None:
    assert not issubclass(error, ValueError)
    assert not issubclass(error, ApiError)


@pytest.mark.parametrize(
    ("status", "not_found"), [(404, True), (403, False), (500, False), (None, False)]
)
def test_kube_error_not_found_is_http_404(status: int | None, not_found: bool) -> None:
    assert KubeError("HTTP", status).not_found is not_found
