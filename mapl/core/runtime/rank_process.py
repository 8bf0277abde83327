"""One rank process of ``mapl pipeline``, from its parsed command line to its exit: the process group, the check
that every rank runs the same run, the output locks, ``run_rank``, and how it ends. Every way out writes a status
for the launcher (``rank_status``) and leaves by ``os._exit`` (normal teardown can block on a dead peer's socket).
Exit codes (``mapl.base.cli``): 0 done, 2 invalid settings or files, 3 a peer died or the group did not form,
4 non-finite values, 130 interrupted (checkpoints written).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from ...base.cli import EXIT_INTERRUPTED, EXIT_PEER_FAILED, EXIT_USER_ERROR, report
from ...base.io import OutputLock
from ..config import RunConfig
from ..link import get_profile
from ..run import check_output_paths, check_results_file
from .faults import FaultPlan, exit_with_parent
from .rank import run_rank
from .rank_checkpoints import all_stage_files, stage_slot
from .rank_status import write_status
from .same_run import check_same_run, run_fingerprint
from .topology import Topology, check_local_gpus, detect_launcher, init_distributed

__all__ = ["RankOptions", "run_rank_process", "leave"]

PROG = "mapl pipeline"


@dataclass(frozen=True)
class RankOptions:
    """What a rank's command line sets beside its config (``mapl pipeline``'s flags)."""
    rendezvous_timeout_s: float                 # the process group must form within this
    link_delay: str | None = None               # real-delay mode: a link profile name or e.g. 500Mbps@20ms
    link_latency_ms: float | None = None
    blocking_transport: bool = False
    fresh: bool = False
    resume_with_changes: bool = False
    replace_results: bool = False
    progress: bool = True

    def shared(self) -> dict:
        """The options every rank must share (not the output paths or the timeouts)."""
        return {"fresh": self.fresh, "resume_with_changes": self.resume_with_changes,
                "blocking_transport": self.blocking_transport, "link_delay": self.link_delay,
                "link_latency_ms": self.link_latency_ms}


def leave(rank: int, code: int, message: str) -> int:
    """One line, the status file for the launcher, and out at once (teardown can block on a dead peer)."""
    if message:
        sys.stderr.write(message + "\n")        # one write: the ranks share stderr
    _exit(rank, code, message)


def _exit(rank: int, code: int, message: str = "") -> int:
    write_status(rank, "interrupted" if code == EXIT_INTERRUPTED else "error", code, message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_rank_process(resolve: Callable[[], tuple[RunConfig, Path, Path]], options: RankOptions, debug: bool) -> int:
    """This rank, start to end. ``resolve()`` builds its config and results and checkpoint paths (a ValueError:
    exit 2)."""
    exit_with_parent()                  # a killed launcher must not leave this rank training as an orphan
    rank = int(os.environ.get("RANK", 0))
    started = time.time()
    try:
        cfg, out, ckpt = resolve()
        link = get_profile(options.link_delay, options.link_latency_ms) if options.link_delay else None
        faults = FaultPlan.from_env()
        cfg.validate()
        check_local_gpus()                  # under a launcher: before NCCL would fail on a shared GPU
    except ValueError as e:
        return leave(rank, EXIT_USER_ERROR, f"error: rank {rank}: {e}")
    try:
        with _deadline(options.rendezvous_timeout_s, rank):
            rank, world, device, backend = init_distributed()
        topo = Topology(rank, world, cfg.stages, device, backend, detect_launcher())
    except ValueError as e:
        return leave(rank, EXIT_USER_ERROR, f"error: rank {rank}: {e}" + _launch_hint(cfg.stages))
    except Exception as e:              # noqa: BLE001 -- the rendezvous failed
        return leave(rank, EXIT_PEER_FAILED, f"error: rank {rank}: process-group setup failed: "
                                             f"{type(e).__name__}: {e}")
    lock, refusal = _lock_outputs(out, ckpt, topo)
    try:                                # before anything is opened or written: one run on every rank, and its files
        check_same_run(run_fingerprint(cfg, options.shared()),
                       "; ".join(filter(None, (_results_refusal(rank, out, cfg, options), refusal))) or None)
    except ValueError as e:             # every rank ends with the same line: none is left waiting on a peer
        lock.release()
        return leave(rank, EXIT_USER_ERROR, f"error: rank {rank}: {e}")
    if cfg.stages < 2:
        lock.release()
        return leave(rank, EXIT_USER_ERROR, f"error: rank {rank}: mapl pipeline needs stages >= 2; for one "
                                            "stage use mapl train")
    try:
        try:                            # the lock is held since before the agreement above
            if rank == 0:
                check_output_paths(out, ckpt, all_stage_files(ckpt, cfg.stages))
            res = run_rank(cfg, topo, out=out, ckpt=ckpt, fresh=options.fresh, progress=options.progress,
                           timeout_s=cfg.train.comm_timeout_s, link=link, blocking=options.blocking_transport,
                           resume_with_changes=options.resume_with_changes, faults=faults, started=started)
        finally:
            lock.release()
    except BaseException as e:          # noqa: BLE001 -- one line per rank (a bug: its traceback), then out
        _exit(rank, report(e, prog=PROG, label=f"rank {rank} (stage {topo.stage})", debug=debug), str(e))
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


def _lock_outputs(out: Path, ckpt: Path, topo: Topology) -> tuple[OutputLock, str | None]:
    """This rank's output locks, taken before the ranks agree to start (a second run on the same files is refused by
    every rank, not only by the one whose file is held); the lock and why it could not be taken, or None."""
    lock = OutputLock()
    try:
        lock = OutputLock(*_rank_files(out, ckpt, topo))
        lock.__enter__()
    except ValueError as e:
        return lock, str(e)
    return lock, None


def _rank_files(out: Path, ckpt: Path, topo: Topology) -> list[Path]:
    mine = [out] if topo.rank == 0 else []
    return mine + (stage_slot(ckpt, topo.stage).files() if topo.replica == 0 else [])


def _results_refusal(rank: int, out: Path, cfg: RunConfig, options: RankOptions) -> str | None:
    """Rank 0's results guard as a message every rank acts on."""
    if rank != 0:
        return None
    try:
        check_results_file(out, cfg, options.replace_results, options.resume_with_changes)
    except ValueError as e:
        return str(e)
    return None


@contextlib.contextmanager
def _deadline(seconds: float, rank: int):
    """The process group must form within ``seconds``, else exit 3 (its own timeout is days: data preparation)."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    timer = threading.Timer(seconds, lambda: leave(rank, EXIT_PEER_FAILED, (
        f"error: rank {rank}: the process group did not form within {seconds:g} s (--rendezvous-timeout; "
        f"rendezvous at {where}, {os.environ.get('WORLD_SIZE', '?')} ranks): a rank was not started or failed "
        "before joining, or another program holds that port; start every rank, or choose a free port")))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _launch_hint(stages: int) -> str:
    return (f". Launch P x R processes: `mapl pipeline ... --stages {stages}` starts them itself; or "
            f"`torchrun --standalone --nproc_per_node {stages} -m mapl.cli.pipeline ...`, or `ACCELERATE_USE_CPU=true "
            f"accelerate launch --multi_gpu --num_processes {stages} --num_machines 1 --mixed_precision no "
            f"--dynamo_backend no -m mapl.cli.pipeline ...` (`accelerate launch --cpu` silently starts ONE process)")
