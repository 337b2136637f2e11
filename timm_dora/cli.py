"""The ``timm-dora`` command: ``eval``, ``bench``, ``viz``, ``partition``, ``distill`` and ``calibrate`` subcommands.

Each subcommand lives in its own module, which provides ``add_parser(subparsers)`` registering its
arguments and setting ``func`` (called with the parsed arguments, returning an exit code). Modules
are imported lazily so that optional dependencies (matplotlib for ``viz``) are only needed by the
command that uses them. Training has its own command, ``timm-dora-train`` (:mod:`timm_dora.train`).
An error is printed as one line (:mod:`timm_dora.command`).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

from .command import one_line_errors
from .version import __version__

COMMANDS = {
    "eval": ("timm_dora.evaluate.cli", "top-1, GFLOPs and policy statistics of native and wrapped models"),
    "bench": ("timm_dora.evaluate.bench", "throughput with the paper's App. E.5 timing protocol"),
    "viz": ("timm_dora.viz.cli", "pictures: pruning trajectories, policy statistics, training dynamics"),
    "partition": ("timm_dora.partition", "re-partition a labels CSV (test stays), or draw splits from an image folder"),
    "distill": ("timm_dora.train.distill", "a narrower actor that makes a trained actor's decisions (ours)"),
    "calibrate": ("timm_dora.evaluate.calibrate", "move an actor's operating point to a GFLOPs reduction, without labels (ours)"),
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        print("timm-dora: training is its own command: timm-dora-train --help (or python -m timm_dora.train)",
              file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(prog="timm-dora", description="DORA token pruning for timm ViTs "
                                 "(training: timm-dora-train)")
    ap.add_argument("--version", action="version", version=f"timm-dora {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if argv[:1] == [name]:  # import only the module of the command being run
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_text)
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 2
    return one_line_errors(f"timm-dora {args.command}", lambda: int(args.func(args) or 0))


if __name__ == "__main__":
    sys.exit(main())
