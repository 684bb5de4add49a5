"""``python -m graphscale demo``, ``build`` and ``env``: the command line.

The only place in graphscale that prints (with ``graphscale/_native/build.py``'s
``main``, which ``build`` runs, and the background build too); the library
itself logs.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphscale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo",
        help="run the graph shapes where DeepSpeed's GAS scaling goes wrong, with DeepSpeed alone and with "
        "graphscale, on small CPU engines, and print the gradient errors against a plain-PyTorch oracle",
    )
    sub.add_parser(
        "build",
        help="build the native walker into graphscale's cache now (or report the cached build) and print "
        "where and how long; for Dockerfiles and CI, so that no run starts on the Python walker",
        add_help=False,
    )
    env = sub.add_parser(
        "env",
        help="print what graphscale sees (Python, torch and CUDA, DeepSpeed and its drift checks, transformers, "
        "accelerate, peft, the compiler, the native walker and its build log, the route, the native route's "
        "self-test) as a block to paste into a bug report; exit status 1 when something a backward needs is "
        "missing or refused",
    )
    env.add_argument("--wait", type=float, default=600.0, metavar="SECONDS",
                     help="wait this long for a native walker build under way (default 600)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "build":
        from ._native import build_main

        return build_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "env":
        from ._tools.env import report

        text, ok = report(args.wait)
        print(text)
        return 0 if ok else 1
    if args.command == "demo":
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            print("graphscale: the demo needs deepspeed: pip install deepspeed", file=sys.stderr)
            return 2
        import os

        # The demo's graphs are tiny and both walkers make the same plan: skip the
        # first-use C++ build of the native walker so a fresh machine finishes in
        # under a minute.  GRAPHSCALE_WALKER=native python -m graphscale demo overrides.
        os.environ.setdefault("GRAPHSCALE_WALKER", "python")
        from ._tools.demo import EXACT, format_report, run_demo

        rows, header = run_demo()
        print(format_report(rows, header))
        # The demo checks itself: graphscale must be exact in every row.
        return 0 if all(r.graphscale <= EXACT for r in rows) else 1
    return 2  # pragma: no cover - argparse rejects other commands


if __name__ == "__main__":
    sys.exit(main())
