"""Run ``examples/deepspeed_pipeline.py`` and the Megatron test worker as real processes whose
hooks reach a recording agent socket (:mod:`support.torch_job`'s), or a real agent.

DeepSpeed compiles a C++ op on its first start on the CPU (~90 s idle, minutes on a loaded
machine): :data:`TORCH_EXTENSIONS_DIR` keeps it in the project's cache, so it is compiled once
per cache (CI keeps ``~/.cache/perseus-k8s``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.torch_job import REPO_ROOT, Event, JobRun, recording_socket

DEEPSPEED_EXAMPLE = REPO_ROOT / "examples" / "deepspeed_pipeline.py"
MEGATRON_WORKER = REPO_ROOT / "tests" / "support" / "megatron_cpu_worker.py"
TORCH_EXTENSIONS_DIR = (
    Path(os.environ.get("PERSEUS_K8S_CACHE", Path.home() / ".cache" / "perseus-k8s"))
    / "torch_extensions"
)
JOB_TIMEOUT_S = 900  # a cold DeepSpeed op compile on a loaded 2-core machine included


def require(module: str, extra: str) -> None:
    """Skip (saying why) without ``module``; fail instead where CI requires it."""
    if importlib.util.find_spec("torch") is not None and importlib.util.find_spec(module):
        return
    reason = (
        f"{module} (with torch) is not installed (`make frameworks` installs it, "
        f"pip install -e '.[{extra}]')"
    )
    for var in ("PERSEUS_REQUIRE_TORCH", "PERSEUS_REQUIRE_E2E"):
        if os.environ.get(var) == "1":
            pytest.fail(f"{reason}, and {var}=1 requires the framework adapters' tests")
    pytest.skip(reason)


def run_script(
    script: Path, args: list[str], *, socket_path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` to completion (it stops its own processes); raise on failure."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT / "node_agent"), str(REPO_ROOT / "operator"), env.get("PYTHONPATH", "")]
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(TORCH_EXTENSIONS_DIR))
    env["DS_ACCELERATOR"] = "cpu"
    env.pop("PERSEUS_AGENT_SOCKET", None)
    if socket_path is not None:
        env["PERSEUS_AGENT_SOCKET"] = str(socket_path)
    result = subprocess.run(
        [sys.executable, str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"{script.name} failed:\n{result.stderr[-6000:]}"
    return result


def run_recorded(script: Path, args: list[str]) -> JobRun:
    with recording_socket() as (path, recorder):
        result = run_script(script, args, socket_path=path)
    return JobRun(result.stderr, recorder.by_rank())


def steps_of(events: list[Event]) -> list[list[Event]]:
    """The events of each step, ``step_begin`` .. ``step_end``; nothing may fall outside."""
    steps: list[list[Event]] = []
    current: list[Event] | None = None
    for event in events[1:]:  # after the hello
        if event.op == "step_begin":
            assert current is None, f"step_begin inside a step: {event}"
            current = [event]
        elif event.op == "step_end":
            assert current is not None, f"step_end outside a step: {event}"
            current.append(event)
            steps.append(current)
            current = None
        else:
            assert current is not None, f"{event.op} outside a step (eval?): {event}"
            current.append(event)
    assert current is None, "a step never ended"
    return steps
