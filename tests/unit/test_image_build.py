"""The container images' build, read without building: the Dockerfile's layer order, pins,
ports, labels and users; the wheel cut per component; the docs-edit layer check and the
root-filesystem runner of scripts/ (scripts/build_images.sh builds and smoke-tests for real).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import re
import sys
import tomllib
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from support.helm_render import render

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "scripts"
COMPONENTS = {"operator": "operator", "node-agent": "agent"}  # target -> pins / extra


def script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions (keyword, rest), continuation lines joined."""
    text = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stages: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest.strip(), re.IGNORECASE)
            assert match, line
            current = match.group(2) or f"stage{len(stages)}"
            stages[current] = [("FROM", match.group(1))]
        else:
            stages[current].append((keyword, rest.strip()))
    return stages


def ancestry(stages: dict[str, list[tuple[str, str]]], stage: str) -> list[str]:
    """``stage`` and the stages it is built FROM, down to the base."""
    chain = [stage]
    while stages[chain[-1]][0][1] in stages:
        chain.append(stages[chain[-1]][0][1])
    return chain


PROJECT_FILES = ("pyproject.toml", "README.md", "operator", "node_agent")


INSTALL_DEPS = "/opt/tools/image_install_deps.sh"


def test_dependencies_install_from_the_pins_alone() -> None:
    """Both images' dependency stages run one script: --no-deps from the pins given, into a
    venv without pip."""
    text = (SCRIPTS / "image_install_deps.sh").read_text()
    assert '--no-deps -r "$constraints"' in text
    assert "python3 -m venv --without-pip /opt/perseus" in text
    assert (
        f"COPY scripts/image_install_deps.sh {INSTALL_DEPS.rsplit('/', 1)[0]}/"
        in (REPO_ROOT / "Dockerfile").read_text()
    )


def test_no_syntax_line_so_no_frontend_image_is_pulled() -> None:
    first = (REPO_ROOT / "Dockerfile").read_text().splitlines()
    assert not any(re.match(r"#\s*syntax\s*=", line, re.IGNORECASE) for line in first)


def test_dependencies_are_installed_before_any_project_file_is_copied() -> None:
    stages = dockerfile_stages()
    for target in COMPONENTS:
        deps = ancestry(stages, f"{target}-deps")
        for stage in deps:
            copies = [rest for kw, rest in stages[stage] if kw in ("COPY", "ADD")]
            assert not any(f in c.split() for c in copies for f in PROJECT_FILES), (stage, copies)
        runs = [rest for kw, rest in stages[f"{target}-deps"] if kw == "RUN"]
        pins = f"image-constraints-{COMPONENTS[target]}.txt"
        assert any(INSTALL_DEPS in r and pins in r for r in runs), runs
        # The project goes on top, alone, without dependencies.
        (app_run,) = [rest for kw, rest in stages[f"{target}-app"] if kw == "RUN"]
        assert "--no-deps" in app_run and "--root /out" in app_run
        copies = [rest for kw, rest in stages[target] if kw == "COPY"]
        assert copies == [
            f"--from={target}-deps /opt/perseus /opt/perseus",
            f"--from={target}-app /out/ /",
        ]


def test_final_images_run_their_program_as_the_chart_does() -> None:
    stages = dockerfile_stages()
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    programs = {"operator": "perseus-operator", "node-agent": "perseus-node-agent"}
    rendered = render()
    for target, program in programs.items():
        assert ancestry(stages, target)[-1] == "runtime"
        assert stages["runtime"][0] == ("FROM", "${PYTHON_IMAGE}")  # no build tools
        assert ("ENTRYPOINT", f'["{program}"]') in stages[target]
        assert program in scripts
        env = " ".join(rest for kw, rest in stages[target] if kw == "ENV")
        assert "MPLCONFIGDIR" not in env  # no matplotlib in either image
    users = [rest for kw, rest in stages["operator"] if kw == "USER"]
    uid = rendered.one("Deployment")["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert users == [f"{uid}:{uid}"]
    assert [rest for kw, rest in stages["node-agent"] if kw == "USER"] == ["0:0"]


def test_exposed_ports_are_the_charts() -> None:
    stages = dockerfile_stages()
    values = yaml.safe_load((REPO_ROOT / "helm" / "perseus" / "values.yaml").read_text())
    exposed = {
        t: {p for kw, rest in stages[t] if kw == "EXPOSE" for p in rest.split()} for t in COMPONENTS
    }
    operator = values["operator"]
    assert exposed["operator"] == {
        str(operator["metricsPort"]),
        str(operator["healthPort"]),
        str(values["injection"]["port"]),
    }
    agent = values["agent"]
    assert exposed["node-agent"] == {str(agent["metricsPort"]), str(agent["tcp"]["port"])}


def test_images_carry_oci_labels() -> None:
    stages = dockerfile_stages()
    wanted = {"title", "description", "licenses", "version", "revision", "created", "source"}
    wanted |= {"base.name", "base.digest"}
    for target in COMPONENTS:
        labels = " ".join(rest for kw, rest in stages[target] if kw == "LABEL")
        found = set(re.findall(r"org\.opencontainers\.image\.([\w.]+)=", labels))
        assert found == wanted, target
        # Declared after every layer-making step: a new revision changes no layer.
        keywords = [kw for kw, _ in stages[target]]
        first_arg = keywords.index("ARG")
        assert not {"RUN", "COPY", "ADD"} & set(keywords[first_arg:])


def pins(name: str) -> dict[str, str]:
    found = {}
    for line in (SCRIPTS / name).read_text().splitlines():
        if line and not line.startswith("#"):
            dist, _, version = line.partition("==")
            found[re.sub(r"[-_.]+", "-", dist).lower()] = version
    return found


def test_each_image_pins_what_its_extra_requires() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    for target, extra in COMPONENTS.items():
        pinned = pins(f"image-constraints-{extra}.txt")
        for line in [*project["dependencies"], *project["optional-dependencies"][extra]]:
            req = Requirement(line)
            name = re.sub(r"[-_.]+", "-", req.name).lower()
            assert name in pinned, f"{req.name} is not pinned for the {target} image"
            assert req.specifier.contains(pinned[name], prereleases=True), (line, pinned[name])
        assert "aiohttp-retry" not in pinned  # only kubernetes.aio needs it: deleted
    agent = pins("image-constraints-agent.txt")
    assert not {"aiohttp", "kopf", "scipy", "numba", "llvmlite", "matplotlib"} & set(agent)


def test_build_tools_are_pinned_past_known_vulnerable_setuptools() -> None:
    from packaging.version import Version

    tools = pins("image-constraints-tools.txt")
    assert set(tools) == {"pip", "setuptools", "wheel", "packaging"}
    assert Version(tools["setuptools"]) >= Version("70.0")  # CVE-2024-6345
    build = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    for line in build:
        req = Requirement(line)
        assert req.specifier.contains(tools[req.name.lower()]), (line, tools[req.name.lower()])
    every = pins("image-constraints.txt")
    for name in ("tools", "operator", "agent"):
        assert pins(f"image-constraints-{name}.txt").items() <= every.items()


def test_dockerignore_keeps_the_build_context_to_what_the_dockerfile_copies() -> None:
    lines = (REPO_ROOT / ".dockerignore").read_text().split("\n")
    lines = [x.strip() for x in lines if x.strip() and not x.startswith("#")]
    assert lines[0] == "**"  # everything out, then only what the build copies
    kept = {x[1:] for x in lines if x.startswith("!")}
    assert kept == {
        "pyproject.toml", "README.md", "operator/", "node_agent/",
        "scripts/image-constraints-*.txt", "scripts/image_wheel.py",
        "scripts/image_install_deps.sh",
    }  # fmt: skip


# -- the wheel cut ----------------------------------------------------------------------------


def fake_wheel(path: Path) -> Path:
    dist = "perseus_k8s-0.1.0.dist-info"
    files = {
        f"{p}/__init__.py": f"# {p}\n".encode()
        for p in ("perseus_api", "perseus_planner", "perseus_operator", "perseus_agent",
                  "perseus_client", "perseus_cli", "perseus_emulation")
    }  # fmt: skip
    files["perseus_planner/profiles/gpt3.csv"] = b"stage,instruction\n"
    files[f"{dist}/METADATA"] = b"Name: perseus-k8s\nVersion: 0.1.0\n"
    files[f"{dist}/entry_points.txt"] = (
        b"[console_scripts]\nperseus = perseus_cli.main:main\n"
        b"perseus-node-agent = perseus_agent.main:main\n"
        b"perseus-operator = perseus_operator.main:main\n"
    )
    files[f"{dist}/top_level.txt"] = b"".join(p.split("/")[0].encode() + b"\n" for p in files)
    files[f"{dist}/RECORD"] = b""
    wheel = path / "perseus_k8s-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


@pytest.mark.parametrize(
    ("component", "packages", "program"),
    [
        ("operator", {"perseus_api", "perseus_planner", "perseus_operator"}, "perseus-operator"),
        ("agent", {"perseus_api", "perseus_agent", "perseus_client"}, "perseus-node-agent"),
    ],
)
def test_the_wheel_is_cut_to_the_components_packages_and_script(
    tmp_path: Path, component: str, packages: set[str], program: str
) -> None:
    cut = script("image_wheel").cut
    wheel = fake_wheel(tmp_path)
    first = cut(component, wheel, tmp_path / "a")
    second = cut(component, wheel, tmp_path / "b")
    assert first.read_bytes() == second.read_bytes()  # reproducible
    with zipfile.ZipFile(first) as zf:
        names = zf.namelist()
        assert {n.split("/")[0] for n in names} == packages | {
            "perseus_k8s-0.1.0.dist-info",
            "perseus_planner",  # the agent: its bundled profiles only, for emulated GPUs
        }
        planner = sorted(n for n in names if n.startswith("perseus_planner/"))
        assert planner == ["perseus_planner/__init__.py"] * (component == "operator") + [
            "perseus_planner/profiles/gpt3.csv"
        ]
        entry_points = zf.read("perseus_k8s-0.1.0.dist-info/entry_points.txt").decode()
        assert [x.split(" =")[0] for x in entry_points.splitlines()[1:] if x] == [program]
        rows = list(csv.reader(io.StringIO(zf.read("perseus_k8s-0.1.0.dist-info/RECORD").decode())))
        assert {r[0] for r in rows} == set(names)
        for name, digest, size in rows:
            if digest:
                data = zf.read(name)
                expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                assert (digest, int(size)) == (f"sha256={expected.decode()}", len(data))


# -- the docs-edit layer check ----------------------------------------------------------------


def inspect(*diff_ids: str) -> dict[str, Any]:
    made = [
        "/bin/sh",
        "/bin/sh -c if python3 -m pip",
        "COPY dir:aa in /opt/perseus ",
        "COPY dir:bb in / ",
    ]
    history = [{"created_by": c} for c in made[: len(diff_ids)]]
    history.append({"created_by": "ENTRYPOINT", "empty_layer": True})
    return {"OCIv1": {"rootfs": {"diff_ids": list(diff_ids)}, "history": history}}


def test_the_layer_check_passes_when_only_the_projects_layer_changed() -> None:
    check = script("image_layers").check
    assert check(inspect("a", "b", "c", "d"), inspect("a", "b", "c", "e")) == []


def test_the_layer_check_fails_when_a_dependency_layer_changed() -> None:
    check = script("image_layers").check
    problems = check(inspect("a", "b", "c", "d"), inspect("a", "b", "x", "e"))
    assert problems == ["layer 2 changed with a docs edit: 'COPY dir:aa in /opt/perseus '"]


def test_the_layer_check_fails_when_the_edit_reached_nothing() -> None:
    check = script("image_layers").check
    problems = check(inspect("a", "b", "c", "d"), inspect("a", "b", "c", "d"))
    assert problems == ["the project's layer did not change: the edit never reached the build"]


# -- running an image's root filesystem -------------------------------------------------------


def test_the_runner_runs_the_entrypoint_as_the_image_user_on_a_read_only_root(
    tmp_path: Path,
) -> None:
    run = script("image_run")
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "passwd").write_text(
        "perseus:x:65532:65532::/nonexistent:/usr/sbin/nologin\n"
    )
    record = {
        "image": "perseus-operator", "rootfs": str(rootfs), "entrypoint": ["perseus-operator"],
        "cmd": [], "user": "65532:65532", "env": ["PATH=/opt/perseus/bin:/usr/bin"],
        "working_dir": "/",
    }  # fmt: skip
    kubeconfig = tmp_path / "kube"
    kubeconfig.mkdir()
    argv = run.command(
        record, ["--help"], binds=[run.Bind(kubeconfig, "/k", True)], scratch=tmp_path / "s"
    )
    assert argv[1:5] == ["--mount", "--propagation", "private", "/bin/sh"]
    script_lines = argv[-1].splitlines()
    # Mount points first, then the root read-only, then the program as the image's user.
    assert script_lines[-2] == f"mount -o remount,ro {tmp_path}/s/root"
    assert (
        script_lines[-1]
        == f"exec chroot --userspec=65532:65532 {tmp_path}/s/root perseus-operator --help"
    )
    assert f"mount -o remount,bind,ro {tmp_path}/s/root/k" in script_lines
    assert any(
        line.startswith("mount -t tmpfs") and line.endswith("/root/tmp") for line in script_lines
    )
    env = run.environment(record, "65532:65532", {"X": "1"})
    assert env == {"PATH": "/opt/perseus/bin:/usr/bin", "HOME": "/nonexistent", "X": "1"}
