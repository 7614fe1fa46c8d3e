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
from pathlib import Path

import pytest

from support import torch_job
from support.torch_job import REPO_ROOT, JobRun

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


def framework_env() -> dict[str, str]:
    """What a framework job needs on top of ours: DeepSpeed on the CPU, its compiled op kept
    in the project's cache (unless the environment says where)."""
    return {
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(TORCH_EXTENSIONS_DIR)),
        "DS_ACCELERATOR": "cpu",
    }


def run_script(
    script: Path, args: list[str], *, socket_path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a framework job to completion (see :func:`support.torch_job.run_script`)."""
    return torch_job.run_script(
        script, args, socket_path=socket_path, env=framework_env(), timeout_s=JOB_TIMEOUT_S
    )


def run_recorded(script: Path, args: list[str]) -> JobRun:
    """Run a framework job against a recording agent socket."""
    return torch_job.run_recorded(args, script=script, env=framework_env(), timeout_s=JOB_TIMEOUT_S)
