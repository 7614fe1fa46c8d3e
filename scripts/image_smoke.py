"""Smoke tests of the built images, from their root filesystems (run by build_images.sh).

Each check runs the image's own Python, packages, user and environment on a read-only root
with a tmpfs ``/tmp`` (scripts/image_run.py), as the chart's pods run them:

- operator: ``perseus-operator --help`` as the image's user (65532); every module of its
  packages imports, and nothing else of the project, no pip/setuptools, no ``kubernetes.aio``
  is there; the planner's numba kernels compile (cache in ``/tmp``) and give a frontier;
- node agent: every module imports, no planner code/scipy/numba/kopf/aiohttp; standalone on
  emulated GPUs (the bundled profile, as the chart's emulated backend) it serves ``/healthz``
  and metrics, locks the plan's clocks, and resets them on SIGTERM; with the NVML backend and
  no driver it exits 1 saying to mount the host library.

Usage: ``.venv/bin/python scripts/image_smoke.py OPERATOR.json NODE_AGENT.json`` (the records
build_images.sh writes); exits non-zero on the first failure, with the program's output.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

import image_run  # noqa: E402
from image_run import Bind  # noqa: E402

TIMEOUT_S = 180.0


class SmokeError(Exception):
    pass


def _scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="perseus-smoke-"))


def run(
    rec: dict[str, Any],
    args: Sequence[str] | None = None,
    *,
    entrypoint: Sequence[str] | None = None,
    user: str | None = None,
    binds: Sequence[Bind] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    scratch = _scratch()
    try:
        argv = image_run.command(
            rec, args, binds=binds, scratch=scratch, user=user, entrypoint=entrypoint
        )
        return subprocess.run(
            argv,
            env=image_run.environment(rec, user or rec["user"], env or {}),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    finally:
        scratch.rmdir()


def python(rec: dict[str, Any], code: str) -> str:
    done = run(rec, ["-c", textwrap.dedent(code)], entrypoint=["python3"])
    if done.returncode != 0:
        raise SmokeError(f"{rec['image']}: python3 -c exited {done.returncode}:\n{done.stderr}")
    return done.stdout


IMPORTS = """
    import importlib, importlib.util, os, pkgutil, sys
    wanted, absent = {wanted!r}, {absent!r}
    count = 0
    for name in wanted:
        package = importlib.import_module(name)
        for module in pkgutil.walk_packages(package.__path__, name + "."):
            importlib.import_module(module.name)
            count += 1
    def there(name):
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            return False
    present = [name for name in absent if there(name)]
    assert not present, f"should not be in the image: {{present}}"
    # No pip, setuptools or wheel anywhere (the venv's or the base's Python).
    dists = [os.path.join(d, f) for d, _, files in os.walk("/usr") for f in files
             if f == "METADATA" and os.path.basename(d).split("-")[0] in
             ("pip", "setuptools", "wheel")]
    dists += [f for f in os.listdir("/opt/perseus/lib/python3.11/site-packages")
              if f.split("-")[0] in ("pip", "setuptools", "wheel")]
    assert not dists, f"pip/setuptools/wheel in the image: {{dists}}"
    from importlib.metadata import distribution
    scripts = sorted(e.name for e in distribution("perseus-k8s").entry_points
                     if e.group == "console_scripts")
    missing = [s for s in scripts if not os.access(f"/opt/perseus/bin/{{s}}", os.X_OK)]
    assert not missing, f"console scripts not installed: {{missing}}"
    print(count, scripts)
"""

NUMBA = """
    import os
    from perseus_planner import DEFAULT_PROFILE, bundled_profile, compute_frontier, prepare_problem
    bundled = bundled_profile(DEFAULT_PROFILE)
    problem = prepare_problem(bundled.load(), "1f1b", 8, 8, bundled.unit_time_s,
                              bundled.blocking_power_w)
    frontier = compute_frontier(problem)
    cache = os.environ["NUMBA_CACHE_DIR"]
    cached = sum(len(files) for _, _, files in os.walk(cache))
    print(len(frontier.times_s), cache, cached)
"""


def check_operator(rec: dict[str, Any]) -> None:
    if rec["user"] != "65532:65532":
        raise SmokeError(f"{rec['image']}: runs as {rec['user']}, not 65532:65532")
    done = run(rec, ["--help"])
    if done.returncode != 0 or "usage: perseus-operator" not in done.stdout:
        raise SmokeError(f"perseus-operator --help exited {done.returncode}:\n{done.stderr}")
    print(f"  operator: --help as {rec['user']}: ok")

    wanted = ("perseus_api", "perseus_planner", "perseus_operator")
    absent = (
        "perseus_agent", "perseus_client", "perseus_cli", "perseus_emulation",
        "kubernetes.aio", "aiohttp_retry", "matplotlib", "pip", "setuptools", "wheel",
    )  # fmt: skip
    count, scripts = python(rec, IMPORTS.format(wanted=wanted, absent=absent)).split(" ", 1)
    if scripts.strip() != "['perseus-operator']":
        raise SmokeError(f"operator image's console scripts: {scripts}")
    print(f"  operator: {count} modules import; console scripts {scripts.strip()}")

    points, cache, cached = python(rec, NUMBA).split()
    if int(points) < 2 or int(cached) == 0:
        raise SmokeError(f"numba: {points} frontier points, {cached} files cached in {cache}")
    print(f"  operator: numba compiled, read-only root: {points} frontier points, "
          f"{cached} files cached in {cache} (tmpfs)")  # fmt: skip


def _wait(what: str, proc: subprocess.Popen[str], log: Path, check: Any) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise SmokeError(f"waiting for {what}; agent output:\n{log.read_text()[-5000:]}")


def check_agent(rec: dict[str, Any]) -> None:
    from support.agent_process import locked_clocks, plan_document

    wanted = ("perseus_api", "perseus_agent", "perseus_client")
    absent = (
        "perseus_planner.solver", "perseus_operator", "perseus_cli", "perseus_emulation", "scipy",
        "numba", "kopf", "aiohttp", "kubernetes.aio", "matplotlib", "pip", "setuptools",
        "wheel",
    )  # fmt: skip
    count, scripts = python(rec, IMPORTS.format(wanted=wanted, absent=absent)).split(" ", 1)
    if scripts.strip() != "['perseus-node-agent']":
        raise SmokeError(f"agent image's console scripts: {scripts}")
    print(f"  node agent: {count} modules import; console scripts {scripts.strip()}")

    work = Path(tempfile.mkdtemp(prefix="perseus-smoke-agent-"))
    scratch = _scratch()
    try:
        plan = plan_document()
        (work / "plan.json").write_text(json.dumps(plan))
        base_args = [
            "--standalone", "--plan-file=/work/plan.json", "--node-name=n1",
            "--metrics-address=127.0.0.1", "--metrics-port=0", "--socket-dir=/work/sock",
            "--state-dir=/work/state",
        ]  # fmt: skip
        # As the chart's emulated backend: the profile bundled in the image.
        emulated = [
            "--gpu-backend=emulated", "--emulated-gpus=2", "--emulated-state-file=/work/gpus.json",
        ]  # fmt: skip
        binds = [Bind(work, "/work")]
        log = work / "agent.log"
        argv = image_run.command(rec, [*base_args, *emulated], binds=binds, scratch=scratch)
        with log.open("w") as out:
            proc = subprocess.Popen(
                argv,
                env=image_run.environment(rec, rec["user"], {}),
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
            )
        try:
            pattern = re.compile(r"serving metrics on http://127\.0\.0\.1:(\d+)/metrics")

            def port() -> int:
                match = pattern.search(log.read_text())
                return int(match.group(1)) if match else 0

            metrics_port = _wait("its metrics port", proc, log, port)

            def get(path: str) -> str:
                url = f"http://127.0.0.1:{metrics_port}{path}"
                with urllib.request.urlopen(url, timeout=5) as response:
                    return str(response.read().decode())

            def healthy() -> bool:
                try:
                    return get("/healthz") == "ok\n"
                except OSError:  # 503 while starting
                    return False

            _wait("/healthz to say ok", proc, log, healthy)
            want = [1200, 1005]  # plan_document's stage clocks, GPU i runs stage i
            state = work / "gpus.json"
            _wait("the plan's clocks", proc, log, lambda: locked_clocks(state) == want)
            metrics = get("/metrics")
            if "perseus_gpu_sm_clock_hertz{" not in metrics:
                raise SmokeError(f"no perseus_gpu_sm_clock_hertz in /metrics:\n{metrics[:2000]}")
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=TIMEOUT_S)
            if code != 0 or locked_clocks(state) != [None, None]:
                raise SmokeError(
                    f"after SIGTERM: exit {code}, clocks {locked_clocks(state)}:\n{log.read_text()}"
                )
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        print(f"  node agent: standalone, emulated GPUs: /healthz ok, metrics, plan applied "
              f"(clocks {want}), reset on SIGTERM (exit 0)")  # fmt: skip

        done = run(rec, [*base_args, "--gpu-backend=nvml"], binds=binds)
        if done.returncode != 1 or "must be mounted from the host" not in done.stderr:
            raise SmokeError(
                f"NVML without a driver: exit {done.returncode}:\n{done.stdout}{done.stderr}"
            )
        message = next(x for x in done.stderr.splitlines() if "mounted from the host" in x)
        print(f"  node agent: NVML without a driver: exit 1, {message.strip()[:100]}...")
    finally:
        scratch.rmdir()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    operator, agent = (image_run.load(Path(a)) for a in argv)
    try:
        check_operator(operator)
        check_agent(agent)
    except (SmokeError, subprocess.TimeoutExpired) as exc:
        print(f"smoke test FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
