"""perseus_client stays standard-library only; the torch adapter's device identity (no torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from perseus_client import torch as adapter

REPO_ROOT = Path(__file__).resolve().parents[3]

_IMPORTS = """
import sys
before = set(sys.modules)
import perseus_client, perseus_client.torch, perseus_client.torch.ddp
new = sorted(set(sys.modules) - before)
print("\\n".join(m for m in new
                 if m.split(".")[0] not in sys.stdlib_module_names
                 and m.split(".")[0] != "perseus_client"))
"""


def test_perseus_client_and_its_torch_adapter_import_the_standard_library_only() -> None:
    """A training image may have nothing else; torch is imported by attach(), not before."""
    result = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            f"import sys; sys.path.insert(0, {str(REPO_ROOT / 'node_agent')!r})\n{_IMPORTS}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.split() == []


class FakeCuda:
    def __init__(self, uuid: str) -> None:
        self.uuid = uuid

    def get_device_properties(self, device: Any) -> Any:
        return SimpleNamespace(uuid=self.uuid)


def fake_torch(uuid: str) -> Any:
    return SimpleNamespace(cuda=FakeCuda(uuid))


def cuda(index: int) -> Any:
    return SimpleNamespace(type="cuda", index=index)


@pytest.fixture(autouse=True)
def no_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_a_cuda_stage_reports_its_own_device_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Of the four GPUs the process sees, only the stage's device is reported."""
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb,GPU-cccc,GPU-dddd")
    assert adapter._gpu_uuid(fake_torch("cccc"), cuda(2)) == "GPU-cccc"


def test_a_mig_instance_keeps_the_containers_spelling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234-5678")
    assert adapter._gpu_uuid(fake_torch("1234-5678"), cuda(0)) == "MIG-1234-5678"


def test_without_a_uuid_list_the_uuid_gets_nvmls_prefix() -> None:
    assert adapter._gpu_uuid(fake_torch("e3b0c442-98fc"), cuda(0)) == "GPU-e3b0c442-98fc"
    assert adapter._gpu_uuid(fake_torch("GPU-e3b0c442"), cuda(0)) == "GPU-e3b0c442"


def test_a_cpu_stage_reports_no_gpu_and_needs_no_synchronization() -> None:
    cpu = SimpleNamespace(type="cpu", index=None)
    assert adapter._gpu_uuid(fake_torch("x"), cpu) is None
    assert adapter._device_sync(fake_torch("x"), cpu) is None
