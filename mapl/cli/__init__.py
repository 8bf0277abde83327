"""The artifact's one command, `mapl`: `mapl <command> --help` documents each command.

    mapl data --profile cpu                                   # prepare the corpus and tokenizer
    mapl train --profile cpu --method mapl --ratio 8          # one run in this process
    mapl pipeline --profile micro --method mapl --ratio 4 --stages 2
    mapl sweep --profile cpu --group main                     # a run group of params.yaml
    mapl rerun --group long --seeds 0,1                       # a reviewer's rerun, judged against the committed

Each subcommand is a module of this package, `main(argv) -> exit code`, its parser from `command_parser` and
`add_profile`. The dispatcher imports only the module it names (no torch for `mapl --help`).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import sys
import textwrap
from typing import Sequence

__all__ = ["COMMANDS", "main", "build_parser", "command_parser", "add_profile", "profile_names", "Parser"]

# command -> (module of this package, the one line `mapl --help` shows); the order is the help's
COMMANDS: dict[str, tuple[str, str]] = {
    "data": ("data", "prepare, verify or rebuild a tokenized dataset (DVC stage prepare)"),
    "train": ("train", "train one run in this process, every pipeline stage in order"),
    "pipeline": ("pipeline", "train one run, one process per stage (x replicas): gloo on CPU, NCCL on GPU"),
    "sweep": ("sweep", "train a group's runs through DVC, estimate them, or validate params.yaml"),
    "frozen-trunk": ("frozen_trunk", "the frozen-trunk study of a profile (DVC stage frozen_trunk)"),
    "rescore": ("rescore", "score finished runs on held-out windows no choice saw (DVC stage rescore)"),
    "rerun": ("rerun", "train k seeds of a committed group again and judge them (exit 6: not consistent)"),
    "eval": ("eval", "score a finished run on lm-eval tasks with its compressors on the wire"),
    "workspace": ("workspace", "smoke, verify or repro a profile in a copy of the checkout"),
    "plan": ("plan", "when compression pays: each method's steps to target against uncompressed"),
    "costmodel": ("costmodel", "GPU-hour estimate of a profile's run groups"),
    "memory": ("memory", "the memory plan per pipeline stage; refuses one that exceeds --device-gib"),
    "docs": ("docs", "write the documents' generated blocks from their sources; --check compares only"),
    "notebook": ("notebook", "execute a notebook with papermill (dvc.yaml's stages); one line on a user error"),
}


class Parser(argparse.ArgumentParser):
    """argparse, except that ``--flag=--`` is a usage error: argparse drops a value of ``--`` and hands the command
    an empty list, unchecked against the flag's choices or type (found by tests/test_fuzz.py)."""

    def _get_values(self, action, arg_strings):
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            self.error(f"argument {'/'.join(action.option_strings)}: expected one argument")
        return super()._get_values(action, arg_strings)


def command_parser(name: str, summary: str, examples: str, subcommands=None) -> argparse.ArgumentParser:
    """A command's parser: usage, the one-sentence ``summary``, the flags, then ``examples`` (``subcommands``: the
    parent's ``add_subparsers()``)."""
    # the examples' line breaks kept; a help column wide enough for a long flag
    kw = dict(description=summary, epilog="examples:\n" + textwrap.indent(textwrap.dedent(examples).strip(), "  "),
              formatter_class=functools.partial(argparse.RawDescriptionHelpFormatter, max_help_position=26))
    if subcommands is not None:
        return subcommands.add_parser(name, help=summary.rstrip("."), **kw)
    return Parser(prog=f"mapl {name}", **kw)


def profile_names(params: dict | None = None) -> list[str]:
    """The profiles params.yaml defines: every ``--profile`` takes exactly these."""
    from ..core.config import load_params
    return sorted((params or load_params())["profiles"])


def add_profile(parser: argparse.ArgumentParser, default: str | None = "", help: str = "params.yaml profile",
                required: bool = False) -> None:
    """``--profile`` with params.yaml's profiles as its choices (``default`` "": params.yaml's ``profile:``)."""
    from ..core.config import load_params
    params = load_params()
    default = None if required else params["profile"] if default == "" else default
    parser.add_argument("--profile", choices=profile_names(params), default=default, required=required,
                        help=help if default is None else f"{help} (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: ``--help``, ``--version`` and the command's name (its flags are its own)."""
    from .. import __version__
    width = max(map(len, COMMANDS)) + 2
    table = "\n".join(f"  {name:<{width}}{summary}" for name, (_, summary) in COMMANDS.items())
    ap = argparse.ArgumentParser(prog="mapl", usage="mapl [-h] [--version] <command> [flags ...]",
                                 description=__doc__.split("\n\n")[0],
                                 epilog=f"commands:\n{table}\n\n`mapl <command> --help` documents a command's flags; "
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
