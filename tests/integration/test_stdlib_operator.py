"""The source root is called ``operator/`` and sits on ``sys.path``; it must never shadow the
standard library's ``operator`` module (which numpy, scipy and pytest itself import)."""

from __future__ import annotations

import operator
import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOT = REPO_ROOT / "operator"


def test_source_root_is_on_sys_path() -> None:
    # Otherwise the checks below would pass trivially.
    assert SOURCE_ROOT.is_dir()
    assert str(SOURCE_ROOT) in [str(Path(p).resolve()) for p in sys.path if p]


def test_stdlib_operator_module_is_imported() -> None:
    assert operator.itemgetter(1)(["a", "b"]) == "b"
    assert operator.add(2, 3) == 5
    module_file = Path(operator.__file__).resolve()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert module_file.parent == stdlib
    assert SOURCE_ROOT not in module_file.parents


def test_source_root_is_not_a_package() -> None:
    assert not (SOURCE_ROOT / "__init__.py").exists()


def test_stdlib_operator_wins_with_source_root_first_on_path() -> None:
    # The worst case: the source root at the front of sys.path, as with PYTHONPATH=operator.
    # ``-S`` skips site, which would otherwise import ``operator`` before sys.path matters;
    # site-packages then go on PYTHONPATH, after the source root.
    code = (
        "import sys; "
        "preloaded = 'operator' in sys.modules; "
        "import operator, importlib.util, perseus_planner; "
        "print(preloaded); print(operator.__file__); print(operator.itemgetter(0)('x')); "
        "print(importlib.util.find_spec('operator').origin)"
    )
    paths = [SOURCE_ROOT, REPO_ROOT / "node_agent", *sorted(set(site.getsitepackages()))]
    result = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=REPO_ROOT,
        env={"PYTHONPATH": os.pathsep.join(map(str, paths)), "PATH": ""},
        capture_output=True,
        text=True,
        check=True,
    )
    preloaded, module_file, item, spec_origin = result.stdout.splitlines()
    assert preloaded == "False"
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(module_file).resolve().parent == stdlib
    assert Path(spec_origin).resolve().parent == stdlib
    assert item == "x"
