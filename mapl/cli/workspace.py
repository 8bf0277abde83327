"""`mapl workspace`: smoke, verify or repro a profile in a copy of the checkout (mapl.orchestration.workspace)."""
from __future__ import annotations

from pathlib import Path

from . import add_profile, command_parser

__all__ = ["main", "build_parser"]


def build_parser():
    ap = command_parser("workspace", "Run the DVC pipeline on a profile in a copy of this checkout.", """
        mapl workspace smoke                    # micro up to the report and plan (make smoke)
        mapl workspace verify                   # re-execute the report; fail on a difference
        mapl workspace repro --profile paper --dir ../mapl-paper --copy-back""")
    sub = ap.add_subparsers(dest="command", required=True)
    smoke = command_parser("smoke", "Reproduce micro up to the report; a second repro must do nothing.", """
        mapl workspace smoke
        mapl workspace smoke --keep            # keep the copy for a look (its path is printed)""", sub)
    repro = command_parser("repro", "Run dvc repro on a profile in a copy.", """
        mapl workspace repro --profile paper-smoke --copy-back
        mapl workspace repro --profile paper --dir ../mapl-paper train@150M-P4-mapl   # rerun to resume""", sub)
    add_profile(repro, required=True)
    repro.add_argument("--copy-back", action="store_true", help="then copy reports/<profile>/ back here")
    repro.add_argument("--dir", type=Path, help="a lasting workspace (kept; a rerun resumes)")
    repro.add_argument("targets", nargs="*", metavar="STAGE", help="DVC stages, e.g. train@tiny-P4-none-s0 (default: all)")
    verify = command_parser("verify", "Re-execute the report from committed results; fail on a difference.", """
        mapl workspace verify                   # the default profile (make verify)
        mapl workspace verify --profile cpu --keep""", sub)
    add_profile(verify)
    for p in (smoke, repro, verify):
        p.add_argument("--keep", action="store_true", help="keep the temporary copy (its path is printed)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ..orchestration.workspace import run_command
    return run_command(args.command, getattr(args, "profile", ""), copy_back=getattr(args, "copy_back", False),
                       keep=args.keep, into=getattr(args, "dir", None), targets=getattr(args, "targets", None))
