"""``perseus-operator``: run the kopf operator with the Perseus handlers.

Settings are ``PERSEUS_OPERATOR_*`` environment variables (see
:class:`perseus_operator.config.OperatorConfig`); the command line chooses what to watch and
the liveness endpoint.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from perseus_operator.config import ConfigError, OperatorConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="perseus-operator",
        description="Kubernetes operator that removes energy bloat from large-model training.",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="manage PerseusJobs (and apply PerseusPolicies) in this namespace only "
        "(repeatable; default: all namespaces)",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8081/healthz",
        help="liveness endpoint (default: %(default)s); '' disables it",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level != "debug":
        # kopf logs every handler run per object at INFO: a line per job per timer tick.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    try:
        OperatorConfig.from_env()  # fail fast, before connecting anywhere
    except ConfigError as exc:
        print(f"perseus-operator: error: {exc}", file=sys.stderr)
        return 2
    import kopf

    import perseus_operator.handlers  # registers the handlers

    perseus_operator.handlers.watch_namespaces(args.namespace)
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
