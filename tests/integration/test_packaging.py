"""Packaging: perseus-client installs alone with no dependencies, each extra of perseus-k8s
provides the modules its console script checks for, and a console script started without its
extra says which one to install."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from perseus_api.extras import DISTRIBUTION, EXIT_MISSING_EXTRA, EXTRA_MODULES

REPO_ROOT = Path(__file__).resolve().parents[2]
CLIENT_PROJECT = REPO_ROOT / "node_agent"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _project(path: Path) -> dict[str, object]:
    project: dict[str, object] = tomllib.loads(path.read_text())["project"]
    return project


def _build_client_wheel(tmp_path: Path) -> Path:
    # A copy of the client's project, so that the build writes its egg-info and build/ there,
    # not into the source tree that other tests read.
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(CLIENT_PROJECT / "pyproject.toml", source)
    shutil.copytree(
        CLIENT_PROJECT / "perseus_client",
        source / "perseus_client",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    wheels = tmp_path / "wheels"
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    command += ["--no-index", "--quiet", "--wheel-dir", str(wheels), str(source)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("perseus_client-*.whl")
    return wheel


def test_perseus_client_builds_and_runs_alone_in_a_bare_environment(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools (dev extra)")
    wheel = _build_client_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        meta = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {
        "perseus_client"
    }
    assert "perseus_client/torch/__init__.py" in names
    assert {"perseus_client/deepspeed.py", "perseus_client/megatron.py"} <= set(names)
    assert "perseus_client/py.typed" in names
    requires = [line for line in meta.decode().splitlines() if line.startswith("Requires-Dist:")]
    assert all("extra ==" in line for line in requires), requires  # nothing unconditional

    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps"]
    install += ["--no-index", "--quiet", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    # -I: no PYTHONPATH (which points at the source roots here), no user site-packages; the
    # environment has no site-packages but the client's.
    check = textwrap.dedent(
        """
        import sys
        import perseus_client, perseus_client.client, perseus_client.protocol
        import perseus_client.default_client, perseus_client.identity, perseus_client.wire
        import perseus_client.torch, perseus_client.torch.ddp
        import perseus_client.deepspeed, perseus_client.megatron
        ours = {"perseus_client", "__main__"}
        foreign = sorted(
            name for name in sys.modules
            if name.split(".")[0] not in sys.stdlib_module_names | ours
        )
        assert not foreign, foreign
        assert perseus_client.__file__.startswith(sys.prefix), perseus_client.__file__
        print(perseus_client.protocol.PROTOCOL_VERSION)
        """
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    result = subprocess.run(
        [str(python), "-I", "-c", check], capture_output=True, text=True, env=environ, timeout=60
    )
    assert result.returncode == 0, result.stderr
    site_packages = {p.name for p in env.glob("lib/python*/site-packages/*")}
    assert {n for n in site_packages if not n.endswith(".dist-info")} == {"perseus_client"}


def test_perseus_client_project_matches_the_repository_distribution() -> None:
    client = _project(CLIENT_PROJECT / "pyproject.toml")
    root = _project(REPO_ROOT / "pyproject.toml")
    assert client["name"] == "perseus-client"
    assert client["dependencies"] == []
    assert client["version"] == root["version"]
    assert client["requires-python"] == root["requires-python"]


def test_each_extra_provides_the_modules_its_console_script_checks_for() -> None:
    extras: dict[str, list[str]] = _project(REPO_ROOT / "pyproject.toml")[  # type: ignore[assignment]
        "optional-dependencies"
    ]
    providers = metadata.packages_distributions()  # top-level module -> distributions
    for extra, modules in EXTRA_MODULES.items():
        wanted = {_norm(Requirement(line).name) for line in extras[extra]}
        provided = {module: {_norm(d) for d in providers.get(module, [])} for module in modules}
        for module, distributions in provided.items():
            assert distributions & wanted, f"[{extra}]: no requirement provides {module}"
        for name in wanted:
            assert any(name in d for d in provided.values()), f"[{extra}]: {name} unchecked"


def test_base_dependencies_are_only_what_every_component_imports() -> None:
    base = {
        _norm(Requirement(line).name)
        for line in _project(REPO_ROOT / "pyproject.toml")[
            "dependencies"  # type: ignore[index]
        ]
    }
    assert base == {"numpy", "pydantic"}


@pytest.mark.parametrize(
    ("script", "argv", "extra", "blocked"),
    [
        ("perseus-node-agent", ["--gpu-backend", "emulated"], "agent", "prometheus_client"),
        ("perseus-operator", [], "operator", "kopf"),
        ("perseus", ["plan", "--microbatches", "8", "--out", "o"], "cli", "matplotlib"),
        ("perseus", ["simulate"], "cli", "matplotlib"),
        # numba only speeds the solver up (perseus_planner._jit): scipy is what it needs.
        ("perseus", ["plan", "--microbatches", "8", "--out", "o", "--no-plot"], "planner", "scipy"),
    ],
)
def test_console_script_without_its_extra_names_it_and_exits_2(
    script: str, argv: list[str], extra: str, blocked: str, tmp_path: Path
) -> None:
    entry = _project(REPO_ROOT / "pyproject.toml")["scripts"][script]  # type: ignore[index]
    module, _, function = entry.partition(":")
    # A module set to None in sys.modules is one that cannot be imported (nor found).
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules[{blocked!r}] = None
        from {module} import {function} as main
        sys.exit(main({argv!r}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == EXIT_MISSING_EXTRA, result.stderr
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{script}: error: Python module {blocked} not installed")
    assert f"install {DISTRIBUTION}[{extra}]" in line
    assert not any(tmp_path.iterdir())  # it stopped before doing anything


def test_perseus_plan_no_plot_runs_without_matplotlib(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Up to the command itself (a real plan takes half a minute of numba compilation here):
    # without matplotlib, the check lets `plan --no-plot` through, and only that.
    import perseus_cli.main
    import perseus_cli.plan_command

    ran: list[bool] = []
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(perseus_cli.plan_command, "run", lambda args: ran.append(args.no_plot) or 0)
    argv = ["plan", "--microbatches", "8", "--out", str(tmp_path / "o")]
    assert perseus_cli.main.main([*argv, "--no-plot"]) == 0
    assert perseus_cli.main.main(argv) == EXIT_MISSING_EXTRA
    assert ran == [True]


BASE_MODULES = {"numpy", "pydantic"}
COMPONENT_EXTRAS = {
    "perseus_api": None,
    "perseus_planner": "planner",
    "perseus_cli": "cli",
    "perseus_operator": "operator",
    "perseus_agent": "agent",
}
ALLOWED_ELSEWHERE = {
    # perseus_api.crd writes the CRD files (`python -m perseus_api.crd`), a development tool:
    # yaml comes with the test extra (and with kubernetes, in both images).
    "perseus_api.crd": {"yaml"},
    # Called only by the operator's kube.py and the agent's kube/: [operator], [agent] bring it.
    "perseus_api.kube_client": {"kubernetes"},
}


def _imports(path: Path) -> set[str]:
    """Top-level names of every absolute import in ``path``, those inside functions too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _third_party_imports(path: Path) -> set[str]:
    ours = {*COMPONENT_EXTRAS, "perseus_client"}
    return {name for name in _imports(path) if name not in sys.stdlib_module_names | ours}


@pytest.mark.parametrize("package", sorted(COMPONENT_EXTRAS))
def test_every_import_of_a_component_comes_with_its_extra(package: str) -> None:
    # Every import in the file, those inside functions included: what an image installs (the
    # Dockerfile: [operator], [agent]) must cover what its code can import.
    extra = COMPONENT_EXTRAS[package]
    allowed = BASE_MODULES | set(EXTRA_MODULES[extra] if extra else ())
    root = next(r for r in ("operator", "node_agent") if (REPO_ROOT / r / package).is_dir())
    files = sorted((REPO_ROOT / root / package).rglob("*.py"))
    assert files
    for path in files:
        module = ".".join(path.relative_to(REPO_ROOT / root).with_suffix("").parts)
        extra_ok = ALLOWED_ELSEWHERE.get(module, set())
        stray = _third_party_imports(path) - allowed - extra_ok
        assert not stray, f"{module} imports {sorted(stray)}, not in {DISTRIBUTION}[{extra}]"


def test_the_client_imports_only_the_standard_library() -> None:
    for path in sorted((CLIENT_PROJECT / "perseus_client").rglob("*.py")):
        stray = _third_party_imports(path)
        # The adapters import their framework inside attach() (perseus-client[torch],
        # [deepspeed], [megatron]); DeepSpeed and Megatron run on torch.
        framework = {
            "torch": {"torch"},
            "deepspeed": {"torch", "deepspeed"},
            "megatron": {"torch", "megatron"},
        }.get(path.stem if path.stem != "__init__" else path.parent.name, set())
        if "torch" in path.parts:
            framework = {"torch"}
        assert stray <= framework, (path, stray)


@pytest.mark.parametrize("package", sorted(COMPONENT_EXTRAS))
def test_an_extra_covers_the_extras_of_the_components_it_imports(package: str) -> None:
    extra = COMPONENT_EXTRAS[package]
    own = set(EXTRA_MODULES[extra] if extra else ())
    root = next(r for r in ("operator", "node_agent") if (REPO_ROOT / r / package).is_dir())
    imported = set()
    for path in (REPO_ROOT / root / package).rglob("*.py"):
        imported |= _imports(path)
    for other in imported & set(COMPONENT_EXTRAS) - {package}:
        needed = set(EXTRA_MODULES[e]) if (e := COMPONENT_EXTRAS[other]) else set()
        assert needed <= own, f"{package} imports {other}: [{extra}] lacks {needed - own}"
