"""The `hyla` command: one entry point, one subcommand per room that faces users.

    hyla serve ...   OpenAI-compatible HTTP server          (hyla/server/cli.py)
    hyla sim ...     trace-driven prefix-cache simulator    (hyla/sim/cli.py)
    hyla bench ...   serving benchmark client               (hyla/bench/cli.py)
    hyla route ...   router over data-parallel servers       (hyla/router/cli.py)

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``; they are imported
lazily so that `hyla sim` never pays for importing the server, and vice versa.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

SUBCOMMANDS = {
    "serve": ("hyla.server.cli", "Start the OpenAI-compatible HTTP server."),
    "sim": ("hyla.sim.cli", "Replay a request trace through the prefix cache in accounting mode."),
    "bench": ("hyla.bench.cli", "Benchmark a running OpenAI-compatible server."),
    "route": ("hyla.router.cli", "Route requests over data-parallel servers, each to where its prefix is cached."),
}


def check_output_path(path: str, option: str) -> None:
    """``ValueError`` unless ``path`` can be written: its directory exists and is writable, and it is
    not a directory (the subcommands check their output files before a run, so that a long run is
    not lost to a typo)."""
    target = Path(path)
    parent = target.parent
    if target.is_dir():
        raise ValueError(f"{option} {path}: is a directory")
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{option} {path}: not writable")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="hyla", description="Serving engine for hybrid LLMs.")
    sub = parser.add_subparsers(dest="command")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in SUBCOMMANDS:  # argparse's error and status 2: "invalid choice: 'foo'", an unknown option
        parser.parse_args(argv)
        parser.error(f"the first argument must be a subcommand, got {argv[0]!r}")  # (a guard: argparse refused it)
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    # (no abbreviations: `hyla serve --dp 2` would reach each worker, whose flags are matched by their full names)
    sub_parser = argparse.ArgumentParser(prog=f"hyla {name}", description=SUBCOMMANDS[name][1], allow_abbrev=False)
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(rest)
    args.given_argv = rest  # the subcommand's own arguments as given (`hyla serve --dp-size` passes them on)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
