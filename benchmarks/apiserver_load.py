"""The API server's side of the node agents' reports: status writes per second, kube-apiserver
and etcd CPU, etcd database growth and the watch traffic to the operator, per 1,000 simulated
nodes at the production cadence, with every report written (as agents did) and with the
agent's dead-band and heartbeat (:mod:`perseus_agent.kube.report_cadence`).

It runs the real etcd and kube-apiserver of the end-to-end tests
(:class:`support.control_plane.ControlPlane`, binaries from
``scripts/build_test_control_plane.sh``), installs the PerseusNodePlan CRD, and creates one
node plan per simulated node. The plans are the operator's own: ``operator_scale.py``'s
simulation runs its jobs (one of each layout) until their plans are applied, and those objects
are copied to ``--jobs`` jobs of ``--nodes-per-job`` nodes, renamed. Then each node's agent,
one task per node on a random phase, makes a report every ``--report-interval-s`` (10 s, as in
production) and patches its plan's ``status`` subresource (a JSON merge patch, as the agent's
:class:`~perseus_agent.kube.report_writer.ReportWriter`), for each cadence in turn:

* ``every``: every report is written (``reportedAt`` changes with each);
* ``dead-band``: a report is written when :func:`~perseus_agent.kube.report_cadence.write_due`
  says so (a rank's mean out of the 1 % band, anything else changed, or the 30 s heartbeat).

Each replica reports its plan's expected iteration time with +-0.5 % noise; during each
window ``--stragglers`` jobs have one replica slowed 1.2x for a third of the window. One watch
on all node plans (what the operator's kopf watch receives) counts events and bytes.

Measured per cadence over ``--window-s`` (after one report interval of warm-up, in which
every agent writes its first report): PATCHes per second and their latency, the CPU seconds
per second of kube-apiserver and etcd (``/proc/<pid>/stat``), etcd's revision count and
database size (its ``/metrics``: ``etcd_mvcc_db_total_size_in_use_in_bytes``; no compaction
runs within the window: the apiserver compacts every 5 minutes), and the watch events and
bytes per second. The simulated agents run in this process (their CPU is not the server's).

Run from the repository root, with the control plane's binaries built::

    eval "$(scripts/build_test_control_plane.sh --env --only '')"
    python benchmarks/apiserver_load.py                 # about 5 minutes

Exit status: 0 when measured; 2 when it could not run (no binaries, the API server failed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import random
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

REPO = Path(__file__).resolve().parents[1]
for root, package in (("operator", "perseus_operator"), ("node_agent", "perseus_agent")):
    if importlib.util.find_spec(package) is None:
        sys.path.insert(0, str(REPO / root))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import aiohttp  # noqa: E402

import operator_scale as scale  # noqa: E402
from perseus_agent.kube.report_cadence import ReportCadence, write_due  # noqa: E402
from perseus_api import resources  # noqa: E402
from support.control_plane import ControlPlane, binaries  # noqa: E402

CRD: Final = REPO / "crds" / "perseus.energy_perseusnodeplans.yaml"
NAMESPACES: Final = 4
SLOWDOWN: Final = 1.2
CLOCK_TICK_S: Final = 1.0 / os.sysconf("SC_CLK_TCK")


class LoadError(RuntimeError):
    """The benchmark could not run."""


class BareControlPlane(ControlPlane):
    """etcd and kube-apiserver only (nothing else acts on node plans here), not niced: the
    end-to-end tests nice them to keep them off the tests' timings; here they are what is
    measured, and a starved apiserver would throttle the agents' writes."""

    def _start_garbage_collector(self) -> None:
        return

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with (self.workdir / f"{name}.log").open("wb") as log:
            self._procs.append(
                subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
            )


# --------------------------------------------------------------------------- the node plans


def template_plans() -> list[list[dict[str, Any]]]:
    """One job of each of ``operator_scale``'s layouts, planned by the operator's own code:
    per job, its node plan objects (metadata and spec, as the operator writes them)."""
    layouts = scale.layouts_for(5)
    settings = scale.Settings(
        jobs=len(layouts),
        nodes_per_job=5,
        report_s=0.5,
        reconcile_s=0.2,
        duration_s=13.0,
        stragglers=1,
        slowdown=SLOWDOWN,
        jitter=0.005,
        planner="inline",
        seed=1,
        cadence="every",
    )

    async def run() -> list[list[dict[str, Any]]]:
        sim = scale.Simulation(settings)
        sim.populate()
        tasks = [asyncio.create_task(sim.timer(job)) for job in sim.jobs]
        tasks += [asyncio.create_task(sim.agent(n)) for job in sim.jobs for n in job.nodes]
        try:
            deadline = time.monotonic() + 300
            while not sim.all_applied():
                if sim.errors or time.monotonic() > deadline:
                    raise LoadError(f"the template jobs did not run: {sim.errors[:1]}")
                await asyncio.sleep(0.1)
        finally:
            sim.stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            sim.planner.close()
        jobs = []
        for job in sim.jobs:
            stored = sim.cluster.plans[(job.namespace, resources.label_value(job.name))]
            objects = []
            for plan in stored.values():
                metadata = json.loads(plan.metadata_json)
                objects.append(
                    {
                        "apiVersion": resources.API_VERSION,
                        "kind": resources.NODE_PLAN_KIND,
                        "metadata": {
                            k: metadata[k] for k in ("name", "namespace", "labels") if k in metadata
                        },
                        "spec": json.loads(plan.spec_json),
                    }
                )
            jobs.append(objects)
        return jobs

    return asyncio.run(run())


@dataclass
class Node:
    """One simulated node: its plan object and what its agent wrote last."""

    namespace: str
    name: str
    job: int
    obj: dict[str, Any]
    pace_s: dict[str, float]
    written: dict[str, Any] | None = None
    written_at: float = -math.inf
    iterations: int = 0


def nodes_for(templates: list[list[dict[str, Any]]], jobs: int) -> list[Node]:
    nodes = []
    for j in range(jobs):
        namespace, job = f"team-{j % NAMESPACES}", f"train-{j:04d}"
        for template in templates[j % len(templates)]:
            node = f"gpu-node-{len(nodes):05d}"
            spec = {**template["spec"], "node": node, "job": job, "namespace": namespace}
            estimate = scale.ESTIMATES[str(spec["granularity"])]
            name = resources.node_plan_name(job, node)
            obj = {
                **template,
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "labels": {
                        resources.NODE_LABEL: resources.label_value(node),
                        resources.JOB_LABEL: resources.label_value(job),
                    },
                },
                "spec": spec,
            }
            pace = {p: float(v[estimate]["iterationTimeSeconds"]) for p, v in spec["plans"].items()}
            nodes.append(Node(namespace, name, j, obj, pace))
    return nodes


def status_of(node: Node, slow_dp: int | None, jitter: float, rng: random.Random) -> dict[str, Any]:
    """The status the agent would write now (camelCase, as :mod:`perseus_api.node_report`)."""
    spec = node.obj["spec"]
    revision = int(spec["revision"])
    node.iterations += 5
    gpus, ranks = [], []
    for a in spec["assignments"]:
        factor = (1.0 + rng.uniform(-jitter, jitter)) * (SLOWDOWN if a["dpRank"] == slow_dp else 1)
        gpus.append(
            {
                "uuid": f"GPU-{node.name}-{a['gpuIndex']}",
                "index": a["gpuIndex"],
                "plan": a["plan"],
                "stage": a["stage"],
                "dpRank": a["dpRank"],
                "rank": a["rank"],
                "targetMHz": 1410,
                "appliedMHz": 1410,
                "status": "Applied",
                "message": "",
            }
        )
        mean_s = node.pace_s[a["plan"]] * factor
        ranks.append(
            {
                "rank": a["rank"],
                "dpRank": a["dpRank"],
                "ppRank": a["stage"],
                "iterations": node.iterations,
                "lastIterationSeconds": mean_s,
                "meanIterationSeconds": mean_s,
                "revision": revision,
            }
        )
    return {
        "observedRevision": revision,
        "reportedAt": datetime.now(tz=UTC).isoformat(timespec="milliseconds"),
        "conditions": [
            {
                "type": "Applied",
                "status": "True",
                "reason": "Applied",
                "message": f"{len(gpus)} Applied",
                "lastTransitionTime": "2026-12-05T00:00:00Z",
            }
        ],
        "node": spec["node"],
        "job": spec["job"],
        "namespace": spec["namespace"],
        "revision": revision,
        "granularity": spec["granularity"],
        "gpus": gpus,
        "ranks": ranks,
        "profiling": [],
    }


# --------------------------------------------------------------------------- the server side


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S


def etcd_metrics(text: str) -> dict[str, float]:
    wanted = (
        "etcd_mvcc_db_total_size_in_bytes",
        "etcd_mvcc_db_total_size_in_use_in_bytes",
        "etcd_debugging_mvcc_current_revision",
        "etcd_mvcc_put_total",
    )
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            out[name] = float(value)
    return out


@dataclass
class Server:
    plane: BareControlPlane
    session: aiohttp.ClientSession
    etcd_url: str

    @property
    def etcd_pid(self) -> int:
        return self.plane._procs[0].pid

    @property
    def apiserver_pid(self) -> int:
        return self.plane._procs[1].pid

    def collection(self, namespace: str) -> str:
        return (
            f"{self.plane.server}/apis/{resources.GROUP}/{resources.VERSION}/namespaces/"
            f"{namespace}/{resources.NODE_PLAN_PLURAL}"
        )

    def status(self, node: Node) -> str:
        return f"{self.collection(node.namespace)}/{node.name}/status"

    async def etcd(self) -> dict[str, float]:
        async with self.session.get(f"{self.etcd_url}/metrics") as response:
            return etcd_metrics(await response.text())

    def cpu(self) -> tuple[float, float]:
        return cpu_s(self.apiserver_pid), cpu_s(self.etcd_pid)


@dataclass
class Window:
    cadence: str
    seconds: float = 0.0
    patches: list[float] = field(default_factory=list)  # latency of each, s
    failed: int = 0
    reports: int = 0
    due: int = 0
    """Reports the cadence decided to write (sent or not yet)."""
    watch_events: int = 0
    watch_bytes: int = 0
    apiserver_cpu_s: float = 0.0
    etcd_cpu_s: float = 0.0
    etcd_before: dict[str, float] = field(default_factory=dict)
    etcd_after: dict[str, float] = field(default_factory=dict)
    object_bytes: float = 0.0


class Load:
    def __init__(self, server: Server, nodes: list[Node], args: argparse.Namespace) -> None:
        self.server = server
        self.nodes = nodes
        self.args = args
        self.rng = random.Random(args.seed)
        self.window: Window | None = None
        self.measuring = False

    async def create(self) -> None:
        limit = asyncio.Semaphore(16)

        async def one(node: Node) -> None:
            url = self.server.collection(node.namespace)
            async with limit, self.server.session.post(url, json=node.obj) as response:
                if response.status not in (200, 201):
                    raise LoadError(f"cannot create {node.name}: {await response.text()}")

        await asyncio.gather(*(one(n) for n in self.nodes))

    async def watch(self, session: aiohttp.ClientSession) -> None:
        """The operator's watch: every node plan event of every namespace (on a connection
        of its own, not queued behind the agents' writes)."""
        url = (
            f"{self.server.plane.server}/apis/{resources.GROUP}/{resources.VERSION}/"
            f"{resources.NODE_PLAN_PLURAL}?watch=true&timeoutSeconds=3600"
        )
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=None)) as r:
                if r.status != 200:
                    raise LoadError(f"watch: HTTP {r.status}: {await r.text()}")
                async for chunk in r.content.iter_any():
                    window = self.window
                    if self.measuring and window is not None:
                        window.watch_events += chunk.count(b"\n")
                        window.watch_bytes += len(chunk)
        except (aiohttp.ClientError, LoadError) as exc:
            print(f"apiserver_load: the watch ended: {exc!r}", file=sys.stderr)

    async def drained(self) -> None:
        """Wait until the server has written what was sent (etcd's revision stands still
        for a second), so that one window's backlog is not measured in the next."""
        last = None
        for _ in range(120):
            revision = (await self.server.etcd()).get("etcd_debugging_mvcc_current_revision")
            if revision == last:
                return
            last = revision
            await asyncio.sleep(1.0)

    async def agent(self, node: Node, cadence: ReportCadence | None, slow: dict[int, int]) -> None:
        period = self.args.report_interval_s
        await asyncio.sleep(self.rng.uniform(0, period))
        due = time.monotonic()
        while True:
            now = time.monotonic()
            status = status_of(node, slow.get(node.job), self.args.jitter, self.rng)
            write = True
            if cadence is not None:
                status = cadence.stamp(status)
                since_s = now - node.written_at
                write = write_due(node.written, status, since_written_s=since_s, cadence=cadence)
                write = write is not None
            window = self.window if self.measuring else None
            if window is not None:
                window.reports += 1
                window.due += write
            if write:
                t0 = time.perf_counter()
                async with self.server.session.patch(
                    self.server.status(node),
                    data=json.dumps({"status": status}),
                    headers={"Content-Type": "application/merge-patch+json"},
                ) as response:
                    await response.read()
                    ok = response.status == 200
                if ok:
                    node.written, node.written_at = status, now
                if window is not None:
                    window.patches.append(time.perf_counter() - t0)
                    window.failed += not ok
            due += period
            await asyncio.sleep(max(0.0, due - time.monotonic()))

    async def run(self, name: str, cadence: ReportCadence | None) -> Window:
        await self.drained()
        for node in self.nodes:
            node.written, node.written_at = None, -math.inf
        slow: dict[int, int] = {}
        agents = [
            asyncio.create_task(self.agent(n, cadence, slow)) for n in self.nodes if name != "idle"
        ]
        try:
            await asyncio.sleep(self.args.report_interval_s * 1.5)  # every agent wrote once
            window = self.window = Window(name)
            jobs = sorted({n.job for n in self.nodes})
            stragglers = self.rng.sample(jobs, min(self.args.stragglers, len(jobs)))
            cpu0, etcd0 = self.server.cpu(), await self.server.etcd()
            self.measuring = True
            started = time.monotonic()
            third = self.args.window_s / 3
            await asyncio.sleep(third)
            slow.update(dict.fromkeys(stragglers, 0))  # replica 0 of each straggles ...
            await asyncio.sleep(third)
            slow.clear()  # ... and recovers
            await asyncio.sleep(self.args.window_s - 2 * third)
            self.measuring = False
            window.seconds = time.monotonic() - started
            cpu1, window.etcd_after = self.server.cpu(), await self.server.etcd()
            window.etcd_before = etcd0
            window.apiserver_cpu_s = cpu1[0] - cpu0[0]
            window.etcd_cpu_s = cpu1[1] - cpu0[1]
            window.object_bytes = statistics.fmean(
                len(json.dumps({**n.obj, "status": n.written})) for n in self.nodes
            )
            return window
        finally:
            for task in agents:
                task.cancel()
            await asyncio.gather(*agents, return_exceptions=True)


# --------------------------------------------------------------------------- report


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def report(windows: list[Window], nodes: int, args: argparse.Namespace) -> None:
    per_k = 1000 / nodes
    idle = [w for w in windows if w.cadence == "idle"]
    idle_cpu_s = (idle[0].apiserver_cpu_s + idle[0].etcd_cpu_s) / idle[0].seconds if idle else 0.0
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, values: list[float], fmt: str = "{:.2f}") -> None:
        rows.append((label, [fmt.format(v) for v in values]))

    def delta(w: Window, key: str) -> float:
        return w.etcd_after.get(key, math.nan) - w.etcd_before.get(key, math.nan)

    row("window, s", [w.seconds for w in windows], "{:.0f}")
    row("node reports / s", [w.reports / w.seconds for w in windows])
    row("status writes (PATCH) / s", [len(w.patches) / w.seconds for w in windows])
    row("  per 1,000 nodes", [len(w.patches) / w.seconds * per_k for w in windows])
    row("  failed", [w.failed for w in windows], "{:.0f}")
    row("PATCH latency p50, ms", [1e3 * percentile(w.patches, 0.5) for w in windows])
    row("PATCH latency p99, ms", [1e3 * percentile(w.patches, 0.99) for w in windows])
    row(
        "kube-apiserver CPU, % of a core",
        [100 * w.apiserver_cpu_s / w.seconds for w in windows],
        "{:.1f}",
    )
    row("etcd CPU, % of a core", [100 * w.etcd_cpu_s / w.seconds for w in windows], "{:.1f}")
    row(
        "  both, per 1,000 nodes",
        [100 * (w.apiserver_cpu_s + w.etcd_cpu_s) / w.seconds * per_k for w in windows],
        "{:.1f}",
    )
    row(
        "etcd revisions / s",
        [delta(w, "etcd_debugging_mvcc_current_revision") / w.seconds for w in windows],
    )
    row(
        "etcd DB in use: growth, MiB / min per 1,000 nodes",
        [
            delta(w, "etcd_mvcc_db_total_size_in_use_in_bytes") / w.seconds * 60 / 2**20 * per_k
            for w in windows
        ],
    )
    row(
        "etcd DB file: growth, MiB / min per 1,000 nodes",
        [
            delta(w, "etcd_mvcc_db_total_size_in_bytes") / w.seconds * 60 / 2**20 * per_k
            for w in windows
        ],
    )
    row(
        "apiserver + etcd CPU per status write (less idle), ms",
        [
            1e3
            * max(0.0, w.apiserver_cpu_s + w.etcd_cpu_s - idle_cpu_s * w.seconds)
            / max(1, len(w.patches))
            for w in windows
        ],
    )
    row(
        "etcd DB growth per status write, KiB",
        [
            delta(w, "etcd_mvcc_db_total_size_in_use_in_bytes") / max(1, len(w.patches)) / 1024
            for w in windows
        ],
    )
    row("node plan object (JSON), KiB", [w.object_bytes / 1024 for w in windows])
    # What 1,000 nodes cost at the production cadence, from the costs per write: this machine's
    # apiserver may not keep up with the offered rate (then the rates above are what it served).
    period = args.report_interval_s
    offered = [w.due / max(1, w.reports) * 1000 / period for w in windows]
    per_write_cpu = [
        max(0.0, w.apiserver_cpu_s + w.etcd_cpu_s - idle_cpu_s * w.seconds) / max(1, len(w.patches))
        for w in windows
    ]
    per_write_db = [
        delta(w, "etcd_mvcc_db_total_size_in_use_in_bytes") / max(1, len(w.patches))
        for w in windows
    ]
    row(
        f"1,000 nodes, a report per {period:g} s: status writes / s",
        offered,
    )
    row(
        "  apiserver + etcd CPU, cores",
        [o * c for o, c in zip(offered, per_write_cpu, strict=True)],
    )
    row(
        "  etcd DB growth, MiB / min (until compaction)",
        [o * b * 60 / 2**20 for o, b in zip(offered, per_write_db, strict=True)],
    )
    row(
        "  watch events to the operator / s",
        [
            o * (w.watch_events / max(1, len(w.patches)))
            for o, w in zip(offered, windows, strict=True)
        ],
    )
    row("watch events to the operator / s", [w.watch_events / w.seconds for w in windows])
    row("watch bytes to the operator, KiB / s", [w.watch_bytes / w.seconds / 1024 for w in windows])
    headers = ["", *(w.cadence for w in windows)]
    widths = [max(len(headers[0]), *(len(r[0]) for r in rows))]
    widths += [max(len(h), *(len(r[1][i]) for r in rows)) for i, h in enumerate(headers[1:])]
    print(
        "  ".join(
            h.ljust(widths[0]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(headers)
        )
    )
    print("  ".join("-" * w for w in widths))
    for label, values in rows:
        cells = [label.ljust(widths[0]), *(v.rjust(widths[i + 1]) for i, v in enumerate(values))]
        print("  ".join(cells))
    measured = [i for i, w in enumerate(windows) if w.cadence != "idle"]
    if len(measured) == 2 and windows[measured[1]].patches:
        cpu = [offered[i] * per_write_cpu[i] for i in measured]
        db = [offered[i] * per_write_db[i] for i in measured]
        a, b = (windows[i] for i in measured)
        offered = [offered[i] for i in measured]
        print(
            f"\n{a.cadence} / {b.cadence} at the production cadence: status writes "
            f"{offered[0] / offered[1]:.1f}x, apiserver + etcd CPU {cpu[0] / cpu[1]:.1f}x, "
            f"etcd DB growth {db[0] / db[1]:.1f}x"
        )


# --------------------------------------------------------------------------- main


async def measure(plane: BareControlPlane, nodes: list[Node], args: argparse.Namespace) -> None:
    context = ssl.create_default_context(cafile=str(plane.ca_file))
    headers = {"Authorization": f"Bearer {plane.admin_token}"}
    etcd_args = " ".join(str(a) for a in plane._procs[0].args)
    etcd_url = etcd_args.split("--listen-client-urls=", 1)[1].split()[0]
    connector = aiohttp.TCPConnector(ssl=context, limit=64)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        server = Server(plane, session, etcd_url)
        load = Load(server, nodes, args)
        await load.create()
        watch_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context, limit=1), headers=headers
        )
        watcher = asyncio.create_task(load.watch(watch_session))
        windows = []
        try:
            for name in args.cadences:
                cadence = None if name == "every" else ReportCadence.every(args.report_interval_s)
                print(f"measuring: {name} ({args.window_s:g} s) ...", flush=True)
                windows.append(await load.run(name, cadence))
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await watcher
            await watch_session.close()
    print()
    report(windows, len(nodes), args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--report-interval-s", type=float, default=10.0)
    parser.add_argument("--window-s", type=float, default=90.0)
    parser.add_argument("--stragglers", type=int, default=4)
    parser.add_argument("--jitter", type=float, default=0.005)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--cadences",
        nargs="+",
        choices=("idle", "every", "dead-band"),
        default=["idle", "every", "dead-band"],
        help="idle: no agent writes (the servers' own CPU, taken off the others' per write)",
    )
    args = parser.parse_args(argv)
    found = binaries()
    if isinstance(found, str):
        # Only etcd and kube-apiserver are used: the controller manager may be missing.
        etcd, apiserver = (
            os.environ.get("PERSEUS_ETCD_BIN"),
            os.environ.get("PERSEUS_KUBE_APISERVER_BIN"),
        )
        if not etcd or not apiserver:
            print(f"apiserver_load: {found}", file=sys.stderr)
            return 2
        found = (Path(etcd), Path(apiserver), Path("/nonexistent"))
    print("planning the template jobs (operator_scale's layouts) ...", flush=True)
    templates = template_plans()
    nodes = nodes_for(templates, args.jobs)
    print(
        f"apiserver load: {len(nodes):,} nodes ({args.jobs} jobs), a report every "
        f"{args.report_interval_s:g} s per node, windows of {args.window_s:g} s; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="perseus-apiserver-load-") as tmp:
        plane = BareControlPlane(Path(tmp), *found)
        try:
            plane.start()
            plane.kubectl("apply", "--server-side", "-f", str(CRD))
            plane.kubectl(
                "wait",
                "--for=condition=established",
                "--timeout=60s",
                f"crd/{resources.NODE_PLAN_PLURAL}.{resources.GROUP}",
            )
            for n in range(NAMESPACES):
                plane.kubectl("create", "namespace", f"team-{n}")
            asyncio.run(measure(plane, nodes, args))
        except (LoadError, RuntimeError, AssertionError) as exc:
            print(f"apiserver_load: error: {exc}", file=sys.stderr)
            return 2
        finally:
            plane.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
