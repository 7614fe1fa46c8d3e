"""The operator's one reader of Kubernetes object fields (perseus_operator.workloads.objects)."""

from __future__ import annotations

from perseus_operator.workloads.objects import (
    INTEGER,
    get_path,
    labels_of,
    listed,
    terminating,
    training_container,
)


def test_get_path_reads_absent_for_missing_or_mistyped_steps() -> None:
    pod = {"metadata": {"name": "w0", "labels": ["not", "a", "mapping"]}}
    assert get_path(pod, "metadata", "name") == "w0"
    assert get_path(pod, "metadata", "labels", "app") is None
    assert get_path(pod, "spec", "nodeName") is None
    assert get_path(None, "metadata") is None


def test_labels_are_strings_and_none_values_are_left_out() -> None:
    pod = {"metadata": {"labels": {"app": "gpt3", "index": 0, "gone": None}}}
    assert labels_of(pod) == {"app": "gpt3", "index": "0"}
    assert labels_of({"metadata": "odd"}) == {}
    assert not terminating(pod)
    assert terminating({"metadata": {"deletionTimestamp": "2026-12-02T05:00:00Z"}})


def test_the_training_container_is_the_pytorch_one_else_the_first() -> None:
    sidecar, pytorch = {"name": "sidecar"}, {"name": "pytorch"}
    assert training_container({"spec": {"containers": [sidecar, pytorch]}}) is pytorch
    assert training_container({"spec": {"containers": [sidecar, "junk"]}}) is sidecar
    assert training_container({"spec": {}}) is None


def test_listed_shows_the_first_items_then_how_many_more() -> None:
    names = [f"w{i}" for i in range(7)]
    assert listed(names[:3], 5) == "w0, w1, w2"
    assert listed(names, 5) == "w0, w1, w2, w3, w4, and 2 more"
    assert listed(names[:6], 5, "; ") == "w0; w1; w2; w3; w4; and 1 more"


def test_integer_is_a_non_negative_integer() -> None:
    assert INTEGER.fullmatch("12") and not INTEGER.fullmatch("-1") and not INTEGER.fullmatch("1:4")
