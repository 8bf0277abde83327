"""The multi-process pipeline: one process per stage (x R data-parallel replicas), gloo on CPU, NCCL on GPU.

One machine (the command starts its P x R ranks itself; Ctrl-C stops every rank after the same step,
writes per-rank checkpoints and exits 130; rerun the command to resume)::

    python -m mapl.pipeline --profile micro --method mapl --ratio 4 --stages 2 [--replicas 2]

Under a launcher (the same entry point; the process count is P x R)::

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \\
        --mixed_precision no --dynamo_backend no --main_process_port 29555 \\
        -m mapl.pipeline --profile micro --method mapl --ratio 4 --stages 2
    torchrun --standalone --nproc_per_node 2 -m mapl.pipeline --profile micro --stages 2

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
The runtime lives in ``mapl/core/runtime/`` (schedule, transport, worker, boundary_sync, faults, launch).

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
import contextlib
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from . import train as mtrain
from .base.cli import EXIT_INTERRUPTED, EXIT_PEER_FAILED, EXIT_USER_ERROR, add_debug_flag, debug_requested, report
from .core.config import PROJECT_ROOT, TrainConfig
from .base.io import OutputLock
from .core.link import PROFILES, get_profile
from .core.runtime.faults import FaultPlan, exit_with_parent
from .orchestration.launch import launch, write_status
from .core.runtime.rank import run_rank
from .core.runtime.rank_checkpoints import rank_ckpt_path, stage_slot
from .core.run import check_output_paths, check_results_file
from .core.runtime.same_run import check_same_run, run_fingerprint
from .core.runtime.topology import Topology, check_local_gpus, detect_launcher, init_distributed
from .core.runtime.transport import CommError

__all__ = ["main", "launch", "rank_ckpt_path", "CommError", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = TrainConfig.comm_timeout_s        # train.comm_timeout_s unless a profile sets it
DEFAULT_RENDEZVOUS_S = 300.0        # ranks of a several-machine launch are often started by hand, minutes apart
LAUNCH_GRACE_S = 30.0               # beyond --timeout: how long the self-launcher waits for the others once a rank ended


def _extra_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mapl.pipeline", add_help=False,
                                 description="Multi-process pipeline options (all mapl.train flags apply too):")
    ap.add_argument("--schedule", choices=["gpipe", "1f1b"], help="pipeline schedule (= --set train.schedule=...)")
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


def _parse(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = _extra_parser()
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        ap.print_help()
        print("\nEvery mapl.train flag (below) applies; outputs default to reports/results/<run>-mp.json and "
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


def _leave(rank: int, code: int, message: str) -> int:
    """One line, the status file for the launcher, and out at once (teardown can block on a dead peer)."""
    if message:
        sys.stderr.write(message + "\n")        # one write: the ranks share stderr
    _exit(rank, code, message)


def _exit(rank: int, code: int, message: str = "") -> int:
    write_status(rank, "interrupted" if code == EXIT_INTERRUPTED else "error", code, message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _checkpoint_files(ckpt: Path, stages: int) -> list[Path]:
    return [p for s in range(stages) for p in stage_slot(ckpt, s).files()]


def _rank_files(out: Path, ckpt: Path, topo: Topology) -> list[Path]:
    """The outputs this rank writes: rank 0 the results; replica 0 of each stage its checkpoints."""
    mine = [out] if topo.rank == 0 else []
    return mine + (stage_slot(ckpt, topo.stage).files() if topo.replica == 0 else [])


def _self_launch(extra, args, argv) -> int:
    """No launcher around us: start the P x R ranks here (direct), or under the launcher asked for."""
    cfg = mtrain.config_from_args(args)
    out, ckpt = _paths(args, cfg)
    check_output_paths(out, ckpt, _checkpoint_files(ckpt, cfg.stages))
    check_results_file(out, cfg, args.replace_results, args.resume_with_changes)
    if extra.replicas < 1:
        raise ValueError(f"--replicas {extra.replicas} is invalid: must be >= 1")
    check_local_gpus(cfg.stages * extra.replicas)       # before any rank starts
    path = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    grace = cfg.train.comm_timeout_s + LAUNCH_GRACE_S
    res = launch(argv, cfg.stages * extra.replicas, launcher=extra.launcher, stream=True, cwd=Path.cwd(),
                 env={"PYTHONPATH": path}, grace_s=grace)
    for r in res.stopped:
        first = min((t, k) for k, t in enumerate(res.rank_exit_s) if k not in res.stopped)[1]
        print(f"error: rank {r} was still running {grace:g} s (--timeout + {LAUNCH_GRACE_S:g} s) after rank {first} "
              f"ended (exit {res.rank_returncodes[first]}): stopped it (a stopped or hung process)", file=sys.stderr)
    if res.returncode == EXIT_INTERRUPTED:
        print(f"interrupted: all {cfg.stages * extra.replicas} ranks stopped after the same step and wrote their "
              f"checkpoints ({rank_ckpt_path(ckpt, 0).name.replace('rank0', 'rank*')}); rerun the same command to "
              "resume", file=sys.stderr)
    elif res.returncode:
        codes = res.rank_returncodes or [res.launcher_returncode]
        print(f"error: the pipeline failed (exit codes per rank: {codes})", file=sys.stderr)
    return res.returncode


def _rank_main(extra, args, debug: bool) -> int:
    exit_with_parent()                  # a killed launcher must not leave this rank training as an orphan
    rank = int(os.environ.get("RANK", 0))
    started = time.time()
    try:
        cfg = mtrain.config_from_args(args)
        link = get_profile(extra.link_delay, extra.link_latency_ms) if extra.link_delay else None
        faults = FaultPlan.from_env()
        out, ckpt = _paths(args, cfg)
        cfg.validate()
        check_local_gpus()                  # under a launcher: before NCCL would fail on a shared GPU
    except ValueError as e:
        return _leave(rank, EXIT_USER_ERROR, f"error: rank {rank}: {e}")
    try:
        with _deadline(extra.rendezvous_timeout, rank):
            rank, world, device, backend = init_distributed()
        topo = Topology(rank, world, cfg.stages, device, backend, detect_launcher())
    except ValueError as e:
        return _leave(rank, EXIT_USER_ERROR, f"error: rank {rank}: {e}" + _launch_hint(cfg.stages))
    except Exception as e:              # noqa: BLE001 -- the rendezvous failed
        return _leave(rank, EXIT_PEER_FAILED, f"error: rank {rank}: process-group setup failed: "
                                              f"{type(e).__name__}: {e}")
    try:                                # before anything is opened, locked or written: one run on every rank
        check_same_run(run_fingerprint(cfg, _shared_options(extra, args)), _results_refusal(rank, out, cfg, args))
    except ValueError as e:
        return _leave(rank, EXIT_USER_ERROR, f"error: rank {rank}: {e}")
    if cfg.stages < 2:
        return _leave(rank, EXIT_USER_ERROR, f"error: rank {rank}: mapl.pipeline needs stages >= 2; for one "
                                             "stage use python -m mapl.train")
    try:
        with OutputLock(*_rank_files(out, ckpt, topo)):     # a second run on the same files is refused
            if rank == 0:
                check_output_paths(out, ckpt, _checkpoint_files(ckpt, cfg.stages))
            res = run_rank(cfg, topo, out=out, ckpt=ckpt, fresh=args.fresh, progress=not args.no_progress,
                           timeout_s=cfg.train.comm_timeout_s, link=link, blocking=extra.blocking_transport,
                           resume_with_changes=args.resume_with_changes, faults=faults, started=started)
    except BaseException as e:          # noqa: BLE001 -- one line per rank (a bug: its traceback), then out
        _exit(rank, report(e, prog="python -m mapl.pipeline", label=f"rank {rank} (stage {topo.stage})",
                           debug=debug), str(e))
    if res is not None:
        print(json.dumps({k: res[k] for k in ("run", "val_loss", "tokens", "tokens_per_s", "ratio", "runtime",
                                              "schedule")}))
    write_status(rank, "done", 0)
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:                   # noqa: BLE001 -- results are written; teardown is best effort
        pass
    return 0


def _results_refusal(rank: int, out: Path, cfg, args) -> str | None:
    """Rank 0's results guard (``mapl.core.run.check_results_file``), as a message all ranks act on."""
    if rank != 0:
        return None
    try:
        check_results_file(out, cfg, args.replace_results, args.resume_with_changes)
    except ValueError as e:
        return str(e)
    return None


@contextlib.contextmanager
def _deadline(seconds: float, rank: int):
    """The process group must form within ``seconds``, else one line and exit 3 (the rendezvous itself
    would wait for days: the default group's timeout also covers rank 0 preparing data)."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    timer = threading.Timer(seconds, lambda: _leave(rank, EXIT_PEER_FAILED, (
        f"error: rank {rank}: the process group did not form within {seconds:g} s (--rendezvous-timeout; "
        f"rendezvous at {where}, {os.environ.get('WORLD_SIZE', '?')} ranks): a rank was not started or failed "
        "before joining, or another program holds that port; start every rank, or choose a free port")))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _shared_options(extra, args) -> dict:
    """The command-line options every rank must share (mapl.core.runtime.same_run); not the output paths,
    which may differ per machine, nor --timeout, which changes no number."""
    return {"fresh": args.fresh, "resume_with_changes": args.resume_with_changes,
            "blocking_transport": extra.blocking_transport, "link_delay": extra.link_delay,
            "link_latency_ms": extra.link_latency_ms}


def _launch_hint(stages: int) -> str:
    return (f". Launch P x R processes: `python -m mapl.pipeline ... --stages {stages}` starts them itself; or "
            f"`torchrun --standalone --nproc_per_node {stages} -m mapl.pipeline ...`, or `ACCELERATE_USE_CPU=true "
            f"accelerate launch --multi_gpu --num_processes {stages} --num_machines 1 --mixed_precision no "
            f"--dynamo_backend no -m mapl.pipeline ...` (`accelerate launch --cpu` silently starts ONE process)")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    try:
        extra, args, argv = _parse(argv)
        if "WORLD_SIZE" not in os.environ:          # no launcher around us: start the ranks here
            return _self_launch(extra, args, argv)
    except (ValueError, FileNotFoundError) as e:
        return report(e, prog="python -m mapl.pipeline", debug=debug)
    return _rank_main(extra, args, debug)


if __name__ == "__main__":
    sys.exit(main())
