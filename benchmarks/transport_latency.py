"""Hook round trip over the agent's TCP listener beside today's Unix socket (issue 17, item 1).

One server process runs the agent's two listeners,
:class:`perseus_agent.serving.local_server.LocalServer` (Unix socket) and
:class:`perseus_agent.serving.tcp_server.TcpServer` (127.0.0.1, the peer mapped to a pod through the
real :class:`~perseus_agent.ownership.node_pods.NodePods` over a fixed pod list, each request
checking that the address is still the pod's), with one
handler for both that answers at once (no GPU work: the transport is what differs). This process
drives a ``perseus_client.PerseusClient`` per transport, in alternating blocks of calls (so a load
spike on a shared machine hits both alike): ``on_step_begin``, then
``on_instruction_begin``/``on_instruction_end`` pairs, ``on_step_end``, each timed around the client
method (what a training loop pays). Reported: p50, p99, p99.9 per transport and the TCP/Unix ratios.

Loopback TCP is what a pod's connection to its node's address costs minus the veth hop (a
pod's packets to the node cross its veth pair; a few µs more, not measured here).

Run from the repository root::

    python benchmarks/transport_latency.py               # 20 blocks x 2000 calls per transport
    python benchmarks/transport_latency.py --blocks 4 --calls 500
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _root, _package in zip(
    (REPO / "operator", REPO / "node_agent"), ("perseus_api", "perseus_agent"), strict=True
):
    if importlib.util.find_spec(_package) is None:
        sys.path.insert(0, str(_root))

from perseus_client import PerseusClient  # noqa: E402

SERVER = r"""
import json, sys
from pathlib import Path
from perseus_agent.serving.local_server import LocalServer
from perseus_agent.serving.tcp_server import CLIENT_LABEL, TcpServer
try:
    from perseus_agent.ownership.node_pods import NodePods
except ImportError:  # before issue 30: the address book listed on demand
    NodePods = None
    from perseus_agent.serving.tcp_server import PodAddressBook

class Handler:
    def hello(self, session, msg, t): return {"managed": True}
    def step_begin(self, session, msg, t): return None
    def step_end(self, session, msg, t): return None
    def instruction_begin(self, session, msg, t): return {"sm_clock_mhz": 1410}
    def instruction_end(self, session, msg, t): return None
    def disconnected(self, session): pass

pod = {"metadata": {"name": "bench-0", "namespace": "bench", "uid": "u-0",
                    "labels": {CLIENT_LABEL: "true"}},
       "spec": {}, "status": {"phase": "Running", "podIP": "127.0.0.1"}}
handler = Handler()
unix = LocalServer(Path(sys.argv[1]), handler)
if NodePods is not None:
    book = NodePods("bench-node")
    book.listed([pod])
    tcp = TcpServer("127.0.0.1", 0, handler, book.resolve, book.holds)
else:
    tcp = TcpServer("127.0.0.1", 0, handler, PodAddressBook("bench-node", lambda: [pod]).resolve)
unix.start(); tcp.start()
print(json.dumps({"tcp_port": tcp.port}), flush=True)
sys.stdin.read()
tcp.stop(); unix.stop()
"""


def _percentile(ordered: Sequence[int], q: float) -> float:
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index] / 1000.0


def _drive(client: PerseusClient, calls: int, out: list[int], step: int) -> None:
    clock = time.perf_counter_ns
    t0 = clock()
    client.on_step_begin(step)
    out.append(clock() - t0)
    for i in range((calls - 2) // 2):
        name = "forward" if i % 2 == 0 else "backward"
        t0 = clock()
        client.on_instruction_begin(name, i)
        t1 = clock()
        client.on_instruction_end(name)
        t2 = clock()
        out += (t1 - t0, t2 - t1)
    t0 = clock()
    client.on_step_end(step)
    out.append(clock() - t0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--calls", type=int, default=2000, help="hook calls per block")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="ptl-") as tmp:
        sock_path = Path(tmp) / "agent.sock"
        server = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(sock_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert server.stdout is not None and server.stdin is not None
            port = json.loads(server.stdout.readline())["tcp_port"]
            # A generous reply timeout: a client that gave up would make every later hook a
            # no-op of a few µs, which is no round trip (checked after each block).
            options = {"rank": 0, "local_rank": 0, "gpu_uuids": [], "reply_timeout_s": 30.0}
            clients = {
                "unix": PerseusClient(str(sock_path), **options),
                "tcp": PerseusClient(f"tcp://127.0.0.1:{port}", **options),
            }
            samples: dict[str, list[int]] = {name: [] for name in clients}
            for name, client in clients.items():  # warm-up (connect, hello)
                _drive(client, 200, [], 0)
                if not client.connected:
                    print(f"{name}: the client could not reach the server", file=sys.stderr)
                    return 2
            for block in range(args.blocks):
                order = list(clients) if block % 2 == 0 else list(reversed(clients))
                for name in order:
                    _drive(clients[name], args.calls, samples[name], block + 1)
                    if not clients[name].connected:
                        print(f"{name}: a hook failed (see the log)", file=sys.stderr)
                        return 2
            for client in clients.values():
                client.close()
        finally:
            if server.stdin is not None:
                server.stdin.close()
            server.wait(timeout=10)
    results = {}
    for name, values in samples.items():
        ordered = sorted(values)
        results[name] = {
            "calls": len(ordered),
            "p50_us": _percentile(ordered, 0.50),
            "p99_us": _percentile(ordered, 0.99),
            "p999_us": _percentile(ordered, 0.999),
        }
    print(f"{'transport':<10}{'calls':>8}{'p50 µs':>10}{'p99 µs':>10}{'p99.9 µs':>10}")
    for name, r in results.items():
        print(
            f"{name:<10}{r['calls']:>8}{r['p50_us']:>10.1f}{r['p99_us']:>10.1f}{r['p999_us']:>10.1f}"
        )
    ratios = {k: results["tcp"][k] / results["unix"][k] for k in ("p50_us", "p99_us", "p999_us")}
    print(
        "tcp/unix  "
        + "".join(f"{ratios[k]:>10.2f}" for k in ("p50_us", "p99_us", "p999_us")).rjust(38)
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
