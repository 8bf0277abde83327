"""``mapl``: the artifact's one command. ``mapl --help`` lists the subcommands, ``mapl <command> --help``
documents one.

    mapl data --profile cpu                                   # prepare the corpus and tokenizer
    mapl train --profile cpu --method mapl --ratio 8          # one run in this process
    mapl pipeline --profile micro --method mapl --ratio 4 --stages 2
    mapl sweep --profile cpu --group main                     # a run group of params.yaml

Each subcommand is a module of this package with its own parser, ``main(argv) -> exit code``. The
dispatcher reads only the first argument and imports only the module it names, so ``mapl --help`` and a
mistyped command cost no torch import, and everything after the command's name reaches its parser
untouched. Exit codes and one-line errors are the subcommands' own (``mapl.base.cli``: 0 done, 1 a bug,
2 a user error, 3 a peer failed, 4 non-finite values, 130 interrupted).

This package is the commands layer (``tests/test_layers.py``): it may import every layer, none imports it.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

__all__ = ["COMMANDS", "main", "build_parser", "command_table"]

# command -> (module of this package, the one line `mapl --help` shows); the order is the help's
COMMANDS: dict[str, tuple[str, str]] = {
    "data": ("data", "prepare, verify or rebuild a tokenized dataset (DVC stage prepare)"),
    "train": ("train", "train one run in this process, every pipeline stage in order"),
    "pipeline": ("pipeline", "train one run, one process per stage (x replicas): gloo on CPU, NCCL on GPU"),
    "sweep": ("sweep", "train a group's runs through DVC, estimate them, or validate params.yaml"),
    "frozen-trunk": ("frozen_trunk", "the frozen-trunk study of a profile (DVC stage frozen_trunk)"),
    "rescore": ("rescore", "score finished runs on held-out windows no choice saw (DVC stage rescore)"),
    "workspace": ("workspace", "smoke, verify or repro a profile in a copy of the checkout"),
    "plan": ("plan", "when compression pays: each method's steps to target against uncompressed"),
    "costmodel": ("costmodel", "GPU-hour estimate of a profile's run groups"),
    "memory": ("memory", "the memory plan per pipeline stage; refuses one that exceeds --device-gib"),
    "peer": ("peer", "the peer systems' published cost on this artifact's link model"),
    "docs": ("docs", "write the documents' generated blocks from their sources; --check compares only"),
}


def command_table() -> str:
    """``mapl --help``'s list: one line per command, its name and its summary."""
    width = max(map(len, COMMANDS)) + 2
    return "commands:\n" + "\n".join(f"  {name:<{width}}{summary}" for name, (_, summary) in COMMANDS.items())


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: ``--help``, ``--version`` and the command's name (its flags are its own)."""
    from .. import __version__
    ap = argparse.ArgumentParser(prog="mapl", usage="mapl [-h] [--version] <command> [flags ...]",
                                 description=__doc__.split("\n\n")[0].replace("``", "`"),
                                 epilog=command_table() + "\n\n`mapl <command> --help` documents a command's flags; "
                                        "exit codes are those of mapl/base/cli.py.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"mapl {__version__}")
    ap.add_argument("command", metavar="<command>", choices=COMMANDS, help=argparse.SUPPRESS)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``mapl <command> [flags]``: the command's exit code (argparse's 2 for an unknown command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        # exits: --help and --version with 0, anything else (no command, an unknown one) with argparse's usage
        # line and one error line, exit 2
        build_parser().parse_args(argv[:1])
    module, _ = COMMANDS[argv[0]]
    return importlib.import_module(f"{__name__}.{module}").main(argv[1:])
