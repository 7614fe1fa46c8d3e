"""Build and drive the emulated NVML library (``tests/fixtures/fake_nvml/fake_nvml.c``).

The fake is a real ``libnvidia-ml.so.1`` that the real ``nvidia-ml-py`` bindings load through
``LD_LIBRARY_PATH``. The bindings load the library once per process (and the dynamic loader
reads ``LD_LIBRARY_PATH`` only at process start), so every scenario runs in a fresh Python
subprocess, configured through the fake's ``FAKE_NVML_*`` environment variables; its state
file lets a test see what a process locked, even after that process was killed.

Typical use (see ``tests/integration/agent/test_nvml_backend.py``)::

    fake = FakeNvml(build_fake_nvml(tmp_dir))
    result = fake.run_python("...", gpus=2, state=tmp_path / "state")
    read_state(tmp_path / "state")["gpu0.sm_locked_max_mhz"]
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent
SOURCE = TESTS_DIR / "fixtures" / "fake_nvml" / "fake_nvml.c"
LIBRARY_NAME = "libnvidia-ml.so.1"

# NVML return codes used to inject failures (nvml.h).
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_IN_USE = 19
NVML_ERROR_UNKNOWN = 999


class FakeNvmlUnavailableError(RuntimeError):
    """The fake cannot be built here (no C compiler)."""


def build_fake_nvml(out_dir: Path) -> Path:
    """Compile the fake into ``out_dir/libnvidia-ml.so.1``; return ``out_dir``."""
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise FakeNvmlUnavailableError("no C compiler (gcc) to build the fake NVML library")
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror"]
    command += ["-o", str(out_dir / LIBRARY_NAME), str(SOURCE), "-lpthread"]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return out_dir


def read_state(path: Path) -> dict[str, int]:
    """The fake's state file as ``{key: value}`` (empty if no process wrote it yet)."""
    if not path.exists():
        return {}
    state = {}
    for line in path.read_text().splitlines():
        key, value = line.split()
        state[key] = int(value)
    return state


def update_state(path: Path, values: Mapping[str, int]) -> None:
    """Set keys of the state file (e.g. ``fail.nvmlDeviceGetPowerUsage.1``), even while a
    process is using it: under the fake's lock, replaced atomically as the fake does."""
    with Path(f"{path}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = read_state(path)
        state.update(values)
        tmp = Path(f"{path}.tmp.{os.getpid()}")
        tmp.write_text("".join(f"{key} {value}\n" for key, value in state.items()))
        tmp.replace(path)


@dataclass(frozen=True)
class FakeNvml:
    """A built fake library and how to run Python processes against it."""

    lib_dir: Path

    def env(
        self,
        *,
        gpus: int = 2,
        state: Path | None = None,
        fail: Sequence[str] = (),
        no_energy: bool = False,
        lib_dir: Path | None = None,
    ) -> dict[str, str]:
        """Environment of a process that sees the fake (or whatever ``lib_dir`` holds).

        ``fail``: specs ``"<function>:<gpu index or *>:<nvml return code>"``.
        """
        env = {key: value for key, value in os.environ.items() if not key.startswith("FAKE_NVML")}
        # First on the path, so the fake wins over a real driver's library too.
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(lib_dir or self.lib_dir), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
        )
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT / "node_agent"), str(REPO_ROOT / "operator"), str(TESTS_DIR)]
        )
        env["FAKE_NVML_GPUS"] = str(gpus)
        if state is not None:
            env["FAKE_NVML_STATE"] = str(state)
        if fail:
            env["FAKE_NVML_FAIL"] = ",".join(fail)
        if no_energy:
            env["FAKE_NVML_NO_ENERGY"] = "1"
        return env

    def run_python(
        self,
        code: str,
        *,
        timeout_s: float = 30.0,
        gpus: int = 2,
        state: Path | None = None,
        fail: Sequence[str] = (),
        no_energy: bool = False,
        lib_dir: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``code`` in a fresh interpreter against the fake (not checked)."""
        env = self.env(gpus=gpus, state=state, fail=fail, no_energy=no_energy, lib_dir=lib_dir)
        return subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=REPO_ROOT,
            check=False,
        )
