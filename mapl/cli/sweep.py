"""``mapl sweep``: train a group's runs side by side through DVC, estimate a profile's runs, or validate params.yaml."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..base.cli import EXIT_STEP_FAILED, run_cli
from ..core.config import ConfigError, load_params
from ..orchestration import sweep, validate
from ..orchestration.groups import group_specs, runs_of_seeds, write_configs
from . import add_profile, command_parser

__all__ = ["main", "estimate", "seed_list"]

EXAMPLES = """
    mapl sweep --group long               # its stale runs two at a time: dvc repro -s train@<run> each
    mapl sweep --group blocks --seeds 1   # only its seed-1 runs
    mapl sweep --estimate                 # runs and estimated wall time per group"""


def estimate(profile: str, params: dict) -> str:
    """``--estimate``: GPU-hours for a profile launched on GPUs, wall time on this machine for the rest."""
    launcher = sweep.launcher_config(profile, params)
    if launcher.kind != "pool" and launcher.gpus:
        from ..planning.costmodel import format_gpu_hours, gpu_hours
        return format_gpu_hours(gpu_hours(profile, n_gpus=(launcher.gpus,), params=params))
    return sweep.estimate_text(profile, params)


def seed_list(text: str) -> list[int]:
    """``--seeds 0,1`` -> [0, 1], ``--seeds 4-7`` -> [4, 5, 6, 7]; anything else is argparse's one-line error."""
    seeds = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not (low.isdigit() and (not dash or (high.isdigit() and int(high) >= int(low)))):
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: seeds >= 0 and ranges, e.g. 1, 0,1 or 4-7")
        seeds += range(int(low), int(high or low) + 1)
    return seeds


def _main(argv=None) -> int:
    params = load_params()
    ap = command_parser("sweep", "Train a group's runs through DVC, estimate a profile's runs, or validate "
                                 "params.yaml.", EXAMPLES)
    add_profile(ap)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--group", help="train this group's runs (through DVC: only the stale ones train)")
    what.add_argument("--estimate", action="store_true", help="print runs and estimated wall time per group")
    what.add_argument("--check", action="store_true", help="validate every profile and run of params.yaml")
    ap.add_argument("--seeds", type=seed_list, help="with --group: only its runs of these seeds, e.g. 1, 0,1 or 4-7")
    ap.add_argument("--stamp", type=Path, help="with --check: write each run's resolved config, then this file")
    ap.add_argument("--jobs", type=int, default=0, help="runs side by side (default: the profile's launcher.jobs)")
    args = ap.parse_args(argv)
    if args.seeds and not args.group:
        raise ConfigError("--seeds is invalid without --group: the seeds of which group's runs?")
    if args.stamp and not args.check:
        raise ConfigError("--stamp is invalid without --check: the stamp says params.yaml passed the check")
    if args.jobs < 0:
        raise ConfigError(f"--jobs {args.jobs} is invalid: must be >= 0 (0: the profile's launcher.jobs)")
    if args.check:
        summary = validate.check_params(params)
        if args.stamp:
            write_configs(params["profile"], params)
            validate.write_stamp(args.stamp)
        print(summary, flush=True)
        return 0
    if args.estimate:
        print(estimate(args.profile, params), flush=True)
        return 0
    if args.profile != params["profile"]:
        raise ConfigError(f"--profile {args.profile!r} is invalid here: DVC trains this checkout's profile "
                          f"({params['profile']!r}); run `mapl workspace repro --profile {args.profile}` instead")
    specs = group_specs(args.profile, args.group, params)
    if args.seeds:
        specs = runs_of_seeds(args.profile, specs, args.seeds, params)
    failed = sweep.sweep(args.profile, [s["name"] for s in specs], args.jobs)
    if failed:
        print(f"error: {len(failed)} of {len(specs)} run(s) failed: {', '.join(failed)} (their output is above)",
              file=sys.stderr)
        return EXIT_STEP_FAILED
    return 0


def main(argv=None) -> int:
    return run_cli(_main, argv, prog="mapl sweep")
