"""``mapl rescore``: re-score a run group's finished runs on a text that neither selection nor reporting read
(DVC stage rescore). The command only; what it runs is :mod:`mapl.orchestration.rescore` (its docstring is
``--help``). Errors are one line (:func:`mapl.base.cli.run_cli`; ``--debug`` for the traceback)."""
from __future__ import annotations

import argparse

from ..base.cli import add_debug_flag, run_cli
from ..core.config import ConfigError, load_params
from ..orchestration import rescore
from ..orchestration.groups import group_names

__all__ = ["main", "PROG"]

PROG = "mapl rescore"


def main(argv=None) -> int:
    """The command; errors are one line (``mapl.base.cli.run_cli``)."""
    return run_cli(_main, argv, prog=PROG)


def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=rescore.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="params.yaml profile (default: its `profile:`)")
    ap.add_argument("--group", action="append", required=True,
                    help="run group of the profile to score (repeatable)")
    ap.add_argument("--retrain-missing", action="store_true",
                    help="train again (same seed, same machine: same numbers) the runs whose checkpoint is gone")
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    params = load_params()
    profile = args.profile or params["profile"]
    if profile not in params["profiles"]:
        raise ConfigError(f"--profile {profile!r} is invalid: allowed {sorted(params['profiles'])} (params.yaml)")
    groups = args.group
    known = group_names(profile, params)
    for g in groups:
        if g not in known:
            raise ConfigError(f"--group {g!r} is invalid: profile {profile} has groups {', '.join(known)}")
    for g in groups:
        if args.retrain_missing:
            rescore.retrain_missing(profile, g, params)
        rescore.rescore_group(profile, g, params)
    return 0
