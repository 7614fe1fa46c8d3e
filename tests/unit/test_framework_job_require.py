"""The DeepSpeed and Megatron tests skip without their framework, saying how to install it,
and fail instead where CI requires them (``PERSEUS_REQUIRE_E2E=1``, ``PERSEUS_REQUIRE_TORCH=1``)."""

from __future__ import annotations

import pytest

from support.framework_job import require

MISSING = "perseus_no_such_framework"


@pytest.fixture(autouse=True)
def _no_requirement(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PERSEUS_REQUIRE_E2E", "PERSEUS_REQUIRE_TORCH"):
        monkeypatch.delenv(var, raising=False)


def test_a_missing_framework_skips_saying_how_to_install_it() -> None:
    with pytest.raises(pytest.skip.Exception, match=r"make frameworks.*\[deepspeed\]"):
        require(MISSING, "deepspeed")


@pytest.mark.parametrize("var", ["PERSEUS_REQUIRE_E2E", "PERSEUS_REQUIRE_TORCH"])
def test_a_missing_framework_fails_where_ci_requires_it(
    monkeypatch: pytest.MonkeyPatch, var: str
) -> None:
    monkeypatch.setenv(var, "1")
    with pytest.raises(pytest.fail.Exception, match=f"{var}=1 requires"):
        require(MISSING, "megatron")
