"""Shared fixtures: frontiers of the shipped Perseus profiles, each solved once per session."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from perseus_api.profile import Profile, load_profile
from perseus_planner.dag import build_pipeline_dag
from perseus_planner.frontier import Frontier, compute_frontier
from perseus_planner.solver import build_problem
from support.agent_process import Agent
from support.loopback_guard import Sampler, describe

# The end-to-end tests' Kubernetes control plane (a fixture module, not a second conftest.py:
# test modules import helpers from this one as ``conftest``).
pytest_plugins = ["support.cluster_harness", "support.kwok_cluster"]

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = REPO_ROOT / "tests"
# The tier of a test is its folder (markers registered in pyproject.toml): `-m unit` runs what
# needs nothing but the interpreter, `-m integration` adds real local processes, servers, kmock
# and real time, `-m e2e` the real control plane, Prometheus and helm.
TIERS = ("unit", "integration", "e2e")
PROFILES_DIR = REPO_ROOT / "operator" / "perseus_planner" / "profiles"
PUBLISHED_FRONTIERS_DIR = REPO_ROOT / "tests" / "data" / "perseus-sosp24" / "frontiers"

NUM_STAGES = 8
MODELS = ("gpt3-175b", "bloom")
GPUS = ("a100_sxm", "a40")
# Solver settings of the Perseus artifact per GPU: (unit time in s, blocking power in W).
GPU_SETTINGS: dict[str, tuple[float, float]] = {
    "a100_sxm": (0.001, 83.64),
    "a40": (0.0001, 70.38),
}

SolveFrontier = Callable[[str, str, int], Frontier]


def profile_path(model: str, gpu: str) -> Path:
    return PROFILES_DIR / f"{model}+{gpu}_bf16.csv"


@pytest.fixture(scope="session")
def shipped_profile() -> Callable[[str, str], Profile]:
    """``shipped_profile(model, gpu)``: a bundled profile, loaded once per session."""

    @functools.cache
    def load(model: str, gpu: str) -> Profile:
        return load_profile(profile_path(model, gpu))

    return load


@pytest.fixture(scope="session")
def solved_frontier(shipped_profile: Callable[[str, str], Profile]) -> SolveFrontier:
    """``solved_frontier(model, gpu, microbatches)``: 8-stage 1F1B frontier with the artifact's
    settings for ``gpu``, solved at most once per session however many tests use it."""

    @functools.cache
    def solve(model: str, gpu: str, microbatches: int) -> Frontier:
        unit_time_s, blocking_power_w = GPU_SETTINGS[gpu]
        dag = build_pipeline_dag("1f1b", NUM_STAGES, microbatches)
        problem = build_problem(shipped_profile(model, gpu), dag, unit_time_s, blocking_power_w)
        return compute_frontier(problem)

    return solve


@pytest.fixture(scope="session", autouse=True)
def loopback_only() -> Iterator[Sampler]:
    """The house rule: every server a test starts binds to 127.0.0.1 only. Watches the listening
    sockets of this process and its descendants all session (support.loopback_guard: twice a
    second, from a thread) and fails the session's last teardown naming each one it saw on
    another address."""
    sampler = Sampler(os.getpid()).start()
    yield sampler
    if found := sampler.stop():
        pytest.fail(
            f"test processes listened off loopback (bind to 127.0.0.1):\n{describe(found)}",
            pytrace=False,
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.relative_to(TESTS_DIR).parts[0]
        if tier in TIERS:
            item.add_marker(tier)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A fresh directory under /tmp for Unix sockets (AF_UNIX paths are short: no tmp_path)."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="perseus-sock-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def agent(tmp_path: Path, socket_dir: Path) -> Iterator[Agent]:
    """A node agent process (support.agent_process), killed if a test leaves it running."""
    agent = Agent(tmp_path, socket_dir / "run")
    yield agent
    agent.kill_if_running()
