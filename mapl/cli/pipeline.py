"""``mapl pipeline``: the multi-process pipeline: one process per stage (x R data-parallel replicas), gloo
on CPU, NCCL on GPU.

One machine (the command starts its P x R ranks itself; Ctrl-C stops every rank after the same step,
writes per-rank checkpoints and exits 130; rerun the command to resume)::

    mapl pipeline --profile micro --method mapl --ratio 4 --stages 2 [--replicas 2]

Under a launcher (the same command as the module ``mapl.cli.pipeline``; the process count is P x R)::

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \\
        --mixed_precision no --dynamo_backend no --main_process_port 29555 \\
        -m mapl.cli.pipeline --profile micro --method mapl --ratio 4 --stages 2
    torchrun --standalone --nproc_per_node 2 -m mapl.cli.pipeline --profile micro --stages 2

Several machines: accelerate's ``--num_processes`` is the TOTAL over machines; one-GPU nodes still need
``--multi_gpu``; each machine runs the same command with its ``--machine_rank`` (``--num_machines N
--main_process_ip HOST --main_process_port PORT``). torchrun: ``--nnodes N --node_rank K
--nproc_per_node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT``. (``accelerate launch --cpu``
silently starts ONE process; ``--multi_gpu`` + ``ACCELERATE_USE_CPU=true`` is the CPU form.)

Why hand-written stages over ``torch.distributed.pipelining``: a ``PipelineStage`` sends a stage's
output tensors forward and exactly their gradients back. A compressed boundary is asymmetric (e.g.
integer RVQ codes plus a streamed codebook slice forward, an r-wide float gradient back), and an
integer output carries no gradient, so the library could only train upstream if the float
activation also crossed the wire: it cannot put *only* the compressed bytes on the wire. Its shape
inference also runs stages on uninitialised buffers, which would corrupt stateful compressors (torch
2.13 skips it when every stage's input and output metadata is given). Where the library can carry the
message (none; MAPL: bf16 Z with a gradient of Z's shape, the token ids as an integer output without
gradient) it trains our stages to bit-identical losses: benchmarks/peer_pipelining.py.
The runtime lives in ``mapl/core/runtime/`` (schedule, transport, worker, boundary_sync, faults, and
``rank_process``: what each rank does); starting the ranks from this command is
``mapl.orchestration.pipeline_launch``. This module is the command only: flags, output defaults, and which
of the two this process is.

Exit codes (``mapl.base.cli``; every rank, and this command when it starts the ranks): 0 done, 2 invalid
settings or files (one line per rank), 3 a peer died or timed out (the message names the operation, peer
and step), 4 non-finite values (the last good checkpoints are kept), 130 interrupted (checkpoints written).
``train.comm_timeout_s`` (``--timeout``, env ``MAPL_PG_TIMEOUT``; 60 s by default, 10 minutes in the paper
profile) bounds every wait during
training; the wait for rank 0 to prepare data has none. On NCCL the same value is the process groups'
timeout, so a wait past it is ended by NCCL's watchdog (see ``mapl/core/runtime/transport.py``). Right
after the process group is up, the ranks compare their resolved config, shared options, data and
training code (``mapl.core.runtime.same_run``): ranks started for different runs all exit 2, naming the
fields, before anything is written.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

# No torch at import (as mapl.cli.train): the flags and the config are checked before the runtime loads.
from ..base.cli import add_debug_flag, debug_requested, report
from ..core.config import PROJECT_ROOT, SCHEDULES, TrainConfig
from ..core.link import PROFILES
from . import train as mtrain

__all__ = ["main", "PROG", "DEFAULT_TIMEOUT_S", "DEFAULT_RENDEZVOUS_S"]

PROG = "mapl pipeline"
DEFAULT_TIMEOUT_S = TrainConfig.comm_timeout_s        # train.comm_timeout_s unless a profile sets it
DEFAULT_RENDEZVOUS_S = 300.0        # ranks of a several-machine launch are often started by hand, minutes apart


def _extra_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, add_help=False,
                                 description="Multi-process pipeline options (all `mapl train` flags apply too):")
    ap.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (= --set train.schedule=...)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="data-parallel replicas when this command starts the ranks itself (P x R processes)")
    ap.add_argument("--timeout", default=os.environ.get("MAPL_PG_TIMEOUT"),
                    help="seconds any training-time wait may last: a dead stage makes the others fail after at "
                         "most this long (= --set train.comm_timeout_s=...; default: the profile's, else "
                         f"{DEFAULT_TIMEOUT_S:g}; env MAPL_PG_TIMEOUT)")
    ap.add_argument("--rendezvous-timeout", type=float,
                    default=float(os.environ.get("MAPL_RENDEZVOUS_TIMEOUT", DEFAULT_RENDEZVOUS_S)),
                    help="seconds a rank waits for every rank to join the process group (a rank that was never "
                         "started or failed first, or MASTER_PORT held by another program) (default %(default)s, "
                         "env MAPL_RENDEZVOUS_TIMEOUT)")
    ap.add_argument("--blocking-transport", action="store_true",
                    help="every send waits for its receive (as NCCL's do): tests deadlock-freedom on gloo")
    ap.add_argument("--link-delay", metavar="PROFILE",
                    help=f"real-delay mode: delay every message as over this link ({', '.join(PROFILES)}, or "
                         "e.g. 500Mbps@20ms)")
    ap.add_argument("--link-latency-ms", type=float, help="override the link profile's one-way latency")
    ap.add_argument("--launcher", default="direct", choices=["direct", "accelerate", "torchrun"],
                    help="how this command starts the ranks when it is not itself run by a launcher")
    return add_debug_flag(ap)


def _parse(argv: list[str]):
    """(this command's own flags, the `mapl train` flags, the arguments every rank gets)."""
    ap = _extra_parser()
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        ap.print_help()
        print("\nEvery `mapl train` flag (below) applies; outputs default to reports/results/<run>-mp.json and "
              "checkpoints/<run>-mp.rank<s>.pt.\n")
        mtrain.parse_args(["--help"])
    extra, rest = ap.parse_known_args(argv)
    value = extra.rendezvous_timeout         # --timeout is checked as the config field below
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"--rendezvous-timeout {value:g} is invalid: must be a finite number of seconds > 0")
    args = mtrain.parse_args(rest)
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
    """No launcher around this process: start the ranks here (mapl.orchestration.pipeline_launch)."""
    cfg = mtrain.config_from_args(args)
    out, ckpt = _paths(args, cfg)
    from ..orchestration.pipeline_launch import launch_pipeline     # torch: once the flags and config are read
    return launch_pipeline(argv, cfg, out, ckpt, replicas=extra.replicas, launcher=extra.launcher,
                           replace_results=args.replace_results, resume_with_changes=args.resume_with_changes)


def _rank(extra, args, debug: bool) -> int:
    """This process is one rank of a launch (mapl.core.runtime.rank_process)."""
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


def _check_process_count(world: int, stages: int) -> None:
    """Each rank refuses a launch that cannot be split into pipelines, from the launcher's WORLD_SIZE and
    before the rendezvous (the process group would check it too, but only after joining: the first rank to
    refuse closes its sockets while its peers still connect, and they end "peer died" instead of with this
    line). Checked here, not in mapl.core.runtime: that package is part of the training fingerprint."""
    if world % stages:
        raise ValueError(f"{world} process(es) cannot be split into pipelines of stages={stages}: the process count "
                         f"must be a multiple of the stage count (P x replicas). Launch {stages} x R processes "
                         f"(torchrun --nproc_per_node, accelerate launch --multi_gpu --num_processes), or let "
                         f"`mapl pipeline ... --stages {stages}` start them")


def main(argv=None) -> int:
    """The command; exit codes and one-line errors as ``mapl.base.cli`` documents (every rank, and this
    process when it starts them)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    try:
        extra, args, argv = _parse(argv)
        if "WORLD_SIZE" not in os.environ:          # no launcher around us: start the ranks here
            return _launch(extra, args, argv)
    except (ValueError, FileNotFoundError) as e:
        return report(e, prog=PROG, debug=debug)
    return _rank(extra, args, debug)


if __name__ == "__main__":          # launchers start a module: `torchrun ... -m mapl.cli.pipeline ...`
    sys.exit(main())
