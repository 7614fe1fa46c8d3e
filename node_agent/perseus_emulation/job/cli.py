"""The emulated job's command line: ``python -m perseus_emulation.job`` (see the package
docstring for its arguments and output)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import signal
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TextIO

import perseus_emulation.job
from perseus_api.profile import load_profile
from perseus_api.schedule import Schedule
from perseus_client.client import DEFAULT_RETRY_INTERVAL_S
from perseus_emulation.job.clients import default_client
from perseus_emulation.job.job import EmulatedJob
from perseus_emulation.job.records import EmulatedJobError, IterationRecord, NodeSpec

__all__ = ["main"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


_NODE_KEYS = ("name", "gpus", "socket", "state")


@dataclass
class _NodeArg:
    """A ``--node`` value before node ranks (default names) are known."""

    gpus: int
    name: str | None = None
    socket: Path | None = None
    state: Path | None = None


def _node_arg(text: str) -> _NodeArg:
    fields: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not value:
            raise argparse.ArgumentTypeError(
                f"expected KEY=VALUE items separated by commas, got {item!r} in {text!r}"
            )
        if key not in _NODE_KEYS:
            raise argparse.ArgumentTypeError(
                f"unknown key {key!r} in {text!r}; expected {', '.join(_NODE_KEYS)}"
            )
        if key in fields:
            raise argparse.ArgumentTypeError(f"{key!r} given twice in {text!r}")
        fields[key] = value
    if "gpus" not in fields:
        raise argparse.ArgumentTypeError(f"gpus=N is required, missing in {text!r}")
    return _NodeArg(
        gpus=_positive_int(fields["gpus"]),
        name=fields.get("name"),
        socket=Path(fields["socket"]) if "socket" in fields else None,
        state=Path(fields["state"]) if "state" in fields else None,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="perseus-emulated-job",
        description=perseus_emulation.job.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--profile", type=Path, required=True, help="profile CSV")
    parser.add_argument(
        "--blocking-power", type=_positive_float, required=True, help="watts of an idle GPU"
    )
    parser.add_argument("--stages", type=_positive_int, required=True)
    parser.add_argument("--replicas", type=_positive_int, default=1, help="data-parallel")
    parser.add_argument("--microbatches", type=_positive_int, required=True)
    parser.add_argument("--schedule", default=Schedule.ONE_F_ONE_B.value, help="1f1b or gpipe")
    parser.add_argument(
        "--time-scale", type=_positive_float, default=1.0, help="factor on profiled times"
    )
    parser.add_argument(
        "--steps", type=_positive_int, default=None, help="iterations (default: until signalled)"
    )
    parser.add_argument("--log", type=Path, default=None, help="append JSON records here")
    parser.add_argument(
        "--client-retry-s",
        type=_positive_float,
        default=DEFAULT_RETRY_INTERVAL_S,
        help="least time between a rank's attempts to reach its node agent again "
        f"(default: {DEFAULT_RETRY_INTERVAL_S:g})",
    )
    parser.add_argument(
        "--node",
        type=_node_arg,
        action="append",
        required=True,
        metavar="gpus=N[,name=NAME][,socket=PATH][,state=PATH]",
        help="one emulated node, repeated in node-rank order",
    )
    return parser


@contextlib.contextmanager
def _stop_on_signals(job: EmulatedJob) -> Iterator[None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        job.stop()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    nodes = [
        NodeSpec(
            name=n.name if n.name is not None else f"node-{k}",
            gpus=n.gpus,
            socket=n.socket,
            state_file=n.state,
        )
        for k, n in enumerate(args.node)
    ]
    log: TextIO | None = None
    try:
        profile = load_profile(args.profile)
        if args.log is not None:
            log = args.log.open("a", encoding="utf-8")
    except (OSError, ValueError) as exc:
        parser.error(str(exc))

    def write(record: IterationRecord) -> None:
        if log is not None:
            log.write(json.dumps(record.to_json()) + "\n")
            log.flush()

    try:
        try:
            job = EmulatedJob(
                profile,
                nodes,
                blocking_power_w=args.blocking_power,
                stages=args.stages,
                replicas=args.replicas,
                microbatches=args.microbatches,
                schedule=args.schedule,
                time_scale=args.time_scale,
                client_factory=functools.partial(
                    default_client, retry_interval_s=args.client_retry_s
                ),
                on_iteration=write,
            )
        except ValueError as exc:
            parser.error(str(exc))
        with _stop_on_signals(job):
            try:
                result = job.run(args.steps)
            except EmulatedJobError as exc:
                print(f"perseus-emulated-job: error: {exc}", file=sys.stderr)
                print(json.dumps({**exc.result.summary(), "error": str(exc)}), flush=True)
                return 1
    finally:
        if log is not None:
            log.close()
    print(json.dumps(result.summary()), flush=True)
    return 0
