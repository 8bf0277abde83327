"""``mapl sweep``: train a run group of params.yaml, estimate it, or validate params.yaml.

The command only; what it runs is :mod:`mapl.orchestration.sweep` (its docstring is ``--help``). The
GPU-hours estimate of a profile launched on GPUs comes from the planning layer (:mod:`mapl.planning.costmodel`),
which orchestration does not import.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..base.cli import run_cli
from ..core.config import load_params
from ..orchestration import sweep, validate

__all__ = ["main", "estimate"]


def estimate(profile: str, params: dict) -> str:
    """``--estimate``: GPU-hours for a profile launched on GPUs, wall time on this machine for the rest."""
    launcher = sweep.launcher_config(profile, params)
    if launcher.kind != "pool" and launcher.gpus:
        from ..planning.costmodel import format_gpu_hours, gpu_hours
        return format_gpu_hours(gpu_hours(profile, n_gpus=(launcher.gpus,), params=params))
    return sweep.estimate_text(profile, params)


def _seed_list(text: str) -> list[int]:
    """``--seeds 0,1`` -> [0, 1], ``--seeds 4-7`` -> [4, 5, 6, 7]; anything else is argparse's one-line error."""
    seeds = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not (low.isdigit() and (not dash or (high.isdigit() and int(high) >= int(low)))):
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: seeds >= 0 and ranges, e.g. 1, 0,1 or 4-7")
        seeds += range(int(low), int(high or low) + 1)
    return seeds


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mapl sweep", description=sweep.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="params.yaml profile (default: its `profile:`)")
    ap.add_argument("--group", help="run group in profiles.<profile>.groups")
    ap.add_argument("--seeds", type=_seed_list,
                    help="with --group: only its runs of these seeds, e.g. 1, 0,1 or 4-7 (a group's seeds split across machines)")
    ap.add_argument("--estimate", action="store_true", help="print runs and estimated wall time per group; train nothing")
    ap.add_argument("--check", action="store_true", help="validate every profile and run of params.yaml; train nothing")
    ap.add_argument("--stamp", type=Path, help="with --check: then write this file (DVC's validate stage output)")
    ap.add_argument("--jobs", type=int, default=0, help="runs side by side (default: the profile's launcher.jobs)")
    ap.add_argument("--out-dir", type=Path, help="default reports/<profile>/results/<group>")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(argv)
    try:
        params = load_params()
        if args.check:
            summary = validate.check_params(params)
            if args.stamp:
                validate.write_stamp(args.stamp)
            print(summary, flush=True)
            return 0
        profile = args.profile or params["profile"]
        if args.estimate:
            sweep.check_names(profile, params)
            print(estimate(profile, params), flush=True)
            return 0
        if not args.group:
            ap.error("--group is required (or --estimate)")
        if args.jobs < 0:                           # was: a pool of -2 processes, a traceback when a run was due
            raise ValueError(f"--jobs {args.jobs} is invalid: must be >= 0 (0: the profile's launcher.jobs)")
        specs = sweep.group_specs(profile, args.group, params)
        if args.seeds:
            specs = sweep.runs_of_seeds(profile, specs, args.seeds, params)
        sweep.run_many(profile, specs, args.out_dir or sweep.results_dir(profile, args.group), args.jobs, group=args.group,
                 progress_every=0 if args.quiet else 5.0)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    """The command; a user error is one line, Ctrl-C or SIGTERM exit 130 (:func:`mapl.base.cli.run_cli`)."""
    return run_cli(_main, argv, prog="mapl sweep")
