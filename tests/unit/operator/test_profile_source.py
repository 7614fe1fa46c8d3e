"""Which stored profile a job plans from, and whether it may measure one (pure decisions)."""

from __future__ import annotations

from typing import Any

import pytest

from perseus_api.job import PerseusJobSpec
from perseus_operator.jobs.profile_source import (
    GPU_PRODUCT_LABEL,
    MODEL_LABEL,
    NODE_GPU_PRODUCT_LABEL,
    PIPELINE_KEY,
    StartAction,
    StoredProfile,
    choose_shared_profile,
    decide_start,
    gpu_product,
    may_profile,
    pipeline_key,
    profile_labels,
)


def spec(mode: str = "Observe", granularity: str = "Instruction", **profiling: Any) -> Any:
    return PerseusJobSpec.model_validate(
        {
            "workload": {"kind": "PyTorchJob", "name": "gpt3"},
            "parallelism": {"pipelineStages": 4, "microbatches": 8},
            "policy": {"mode": mode, "granularity": granularity},
            "profiling": profiling,
        }
    )


def stored(name: str, created: str, model: str, product: str, pipeline: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "creationTimestamp": created,
            "labels": {MODEL_LABEL: model, GPU_PRODUCT_LABEL: product},
        },
        "data": {"profile.csv": f"csv of {name}", PIPELINE_KEY: pipeline},
    }


def node(product: str | None) -> dict[str, Any]:
    labels = {} if product is None else {NODE_GPU_PRODUCT_LABEL: product}
    return {"metadata": {"labels": labels}}


@pytest.mark.parametrize(
    ("mode", "opt_in", "profiles"),
    [
        ("Observe", False, False),
        ("Observe", True, True),
        ("Intrinsic", False, True),
        ("StragglerAware", False, True),
    ],
)
def test_only_modes_that_change_clocks_or_an_opt_in_may_profile(
    mode: str, opt_in: bool, profiles: bool
) -> None:
    job = spec(mode, profileInObserve=opt_in)
    assert may_profile(job) is profiles
    expected = StartAction.PROFILE if profiles else StartAction.REQUIRE_PROFILE
    assert decide_start(job, None, product=None, stages=4).action == expected


def test_a_stored_profile_is_planned_from_in_every_mode() -> None:
    found = StoredProfile("csv", 80.0, "kept")
    for mode in ("Observe", "Intrinsic", "StragglerAware"):
        decision = decide_start(spec(mode), found, product=None, stages=4)
        assert (decision.action, decision.message) == (StartAction.PLAN, "kept")


def test_the_newest_profile_of_the_model_gpu_and_pipeline_is_chosen() -> None:
    key = pipeline_key(spec())
    a100 = "NVIDIA-A100-SXM4-80GB"
    maps = [
        stored("old", "2026-11-01T00:00:00Z", "gpt3", a100, key),
        stored("new", "2026-11-02T00:00:00Z", "gpt3", a100, key),
        stored("newer-other-gpu", "2026-11-03T00:00:00Z", "gpt3", "NVIDIA-H100", key),
        stored("newer-other-model", "2026-11-03T00:00:00Z", "llama", a100, key),
        stored("newer-other-pipeline", "2026-11-03T00:00:00Z", "gpt3", a100, "stages=8"),
    ]
    found = choose_shared_profile(maps, model="gpt3", product=a100, pipeline=key)
    assert found == StoredProfile("csv of new", None, "new")
    assert choose_shared_profile(maps, model="gpt3", product=None, pipeline=key) is None
    assert choose_shared_profile(maps, model="bert", product=a100, pipeline=key) is None


def test_the_gpu_product_is_known_only_when_every_node_says_the_same() -> None:
    assert gpu_product([node("A100"), node("A100")]) == "A100"
    assert gpu_product([node("A100"), node("H100")]) is None
    assert gpu_product([node("A100"), node(None)]) is None
    assert gpu_product([node("A100"), None]) is None  # a node that cannot be read


def test_profiles_are_labelled_only_for_a_named_model() -> None:
    assert profile_labels(spec(), "A100") == {}
    assert profile_labels(spec(model="gpt3"), "A100") == {
        MODEL_LABEL: "gpt3",
        GPU_PRODUCT_LABEL: "A100",
    }
    assert profile_labels(spec(model="gpt3"), None) == {MODEL_LABEL: "gpt3"}


def test_a_model_name_must_be_a_label_value() -> None:
    with pytest.raises(ValueError, match=r"profiling\.model"):
        spec(model="gpt3 175b")
