"""`mapl pipeline`: one process per stage (x R replicas); this process starts the ranks, or is one (docs/pipeline.md)."""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

# No torch at import (as mapl.cli.train): the flags and the config are checked before the runtime loads.
from ..base.cli import debug_requested, report
from ..core.config import PROJECT_ROOT, SCHEDULES
from ..core.link import PROFILES
from . import Parser, command_parser
from . import train as mtrain

__all__ = ["main", "PROG", "DEFAULT_RENDEZVOUS_S"]

PROG = "mapl pipeline"
DEFAULT_RENDEZVOUS_S = 300.0        # ranks of a several-machine launch are often started by hand, minutes apart


def _extra_parser() -> argparse.ArgumentParser:
    ap = command_parser("pipeline", "Train one run, one process per stage; every `mapl train` flag applies too.", """
        mapl pipeline --profile micro --method mapl --ratio 4 --stages 2 --replicas 2
        torchrun --standalone --nproc_per_node 2 -m mapl.cli.pipeline --stages 2
        mapl pipeline --stages 4 --link-delay 500Mbps@20ms --blocking-transport""")
    ap.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (train.schedule)")
    ap.add_argument("--replicas", type=int, default=1, metavar="R",
                    help="data-parallel replicas (P x R processes)")
    ap.add_argument("--timeout", default=os.environ.get("MAPL_PG_TIMEOUT"), metavar="S",
                    help="limit of any wait in training (env MAPL_PG_TIMEOUT)")
    ap.add_argument("--rendezvous-timeout", type=float, metavar="S",
                    help=f"rendezvous limit (env MAPL_RENDEZVOUS_TIMEOUT; default {DEFAULT_RENDEZVOUS_S:g})")
    ap.add_argument("--blocking-transport", action="store_true",
                    help="every send waits for its receive, as on NCCL")
    ap.add_argument("--link-delay", metavar="LINK",
                    help=f"emulate this link: {', '.join(PROFILES)} or e.g. 500Mbps@20ms")
    ap.add_argument("--link-latency-ms", type=float, metavar="MS", help="override the link's one-way latency")
    ap.add_argument("--launcher", default="direct", choices=["direct", "accelerate", "torchrun"],
                    help="how this command starts the ranks")
    return ap


def _parse(argv: list[str]):
    """(this command's own flags, the `mapl train` flags, the arguments every rank gets)."""
    extra, rest = _extra_parser().parse_known_args(argv)
    if extra.rendezvous_timeout is None:
        extra.rendezvous_timeout = _env_number("MAPL_RENDEZVOUS_TIMEOUT", float, DEFAULT_RENDEZVOUS_S)
    value = extra.rendezvous_timeout         # --timeout is checked as the config field below
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"--rendezvous-timeout {value:g} is invalid: must be a finite number of seconds > 0")
    run_flags = Parser(prog=PROG, add_help=False)
    mtrain.add_run_arguments(run_flags)
    args = run_flags.parse_args(rest)
    if extra.schedule:
        args.set = list(args.set) + [f"train.schedule={extra.schedule}"]
    if extra.timeout is not None:        # checked as the config field (one line naming it)
        args.set = list(args.set) + [f"train.comm_timeout_s={extra.timeout}"]
    return extra, args, argv


def _paths(args, cfg) -> tuple[Path, Path]:
    out = args.out or PROJECT_ROOT / "reports" / "results" / f"{cfg.name()}-mp.json"
    ckpt = args.ckpt or PROJECT_ROOT / "checkpoints" / f"{cfg.name()}-mp.pt"
    return out, ckpt


def _launch(extra, args, argv: list[str]) -> int:
    """No launcher around this process: start the ranks here."""
    cfg = mtrain.config_from_args(args)
    out, ckpt = _paths(args, cfg)
    from ..orchestration.pipeline_launch import launch_pipeline     # torch: once the flags and config are read
    return launch_pipeline(argv, cfg, out, ckpt, replicas=extra.replicas, launcher=extra.launcher,
                           replace_results=args.replace_results, resume_with_changes=args.resume_with_changes)


def _rank(extra, args, debug: bool) -> int:
    """This process is one rank of a launch."""
    from ..core.runtime.rank_process import RankOptions, run_rank_process

    def resolve():
        cfg = mtrain.config_from_args(args)
        _check_process_count(int(os.environ["WORLD_SIZE"]), cfg.stages)
        return (cfg, *_paths(args, cfg))
    options = RankOptions(rendezvous_timeout_s=extra.rendezvous_timeout, link_delay=extra.link_delay,
                          link_latency_ms=extra.link_latency_ms, blocking_transport=extra.blocking_transport,
                          fresh=args.fresh, resume_with_changes=args.resume_with_changes,
                          replace_results=args.replace_results, progress=not args.no_progress)
    return run_rank_process(resolve, options, debug)


def _env_number(name: str, kind: type, default):
    """The number in environment variable ``name`` (``default`` when unset), or a ValueError naming the variable."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"environment variable {name}={text!r} is invalid: must be {what}") from None


def check_launch_env() -> None:
    """A launcher's RANK and WORLD_SIZE, checked before the rendezvous: afterwards a mistake here reads as a peer
    failure (gloo's own text, exit 3)."""
    world, rank = _env_number("WORLD_SIZE", int, 1), _env_number("RANK", int, 0)
    if world < 1:
        raise ValueError(f"environment variable WORLD_SIZE={world} is invalid: must be >= 1")
    if not 0 <= rank < world:
        raise ValueError(f"environment variable RANK={rank} is invalid: must be in [0, WORLD_SIZE={world}) (ranks "
                         "are numbered from 0)")


def _check_process_count(world: int, stages: int) -> None:
    """Refuse a WORLD_SIZE that is no multiple of P before the rendezvous (after it, peers would end "peer died")."""
    if world % stages:
        raise ValueError(f"{world} process(es) cannot be split into pipelines of stages={stages}: the process count "
                         f"must be a multiple of the stage count (P x replicas). Launch {stages} x R processes "
                         f"(torchrun --nproc_per_node, accelerate launch --multi_gpu --num_processes), or let "
                         f"`mapl pipeline ... --stages {stages}` start them")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    try:
        extra, args, argv = _parse(argv)
        if "WORLD_SIZE" not in os.environ:          # no launcher around us: start the ranks here
            return _launch(extra, args, argv)
        check_launch_env()
    except (ValueError, FileNotFoundError) as e:
        return report(e, prog=PROG, debug=debug)
    return _rank(extra, args, debug)


if __name__ == "__main__":          # launchers start a module: `torchrun ... -m mapl.cli.pipeline ...`
    sys.exit(main())
