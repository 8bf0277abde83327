"""``mapl pipeline`` with no launcher around it: start its P x R ranks here and say in one line how they ended."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

from ..core.config import PROJECT_ROOT, RunConfig
from ..core.run import check_output_paths, check_results_file
from ..core.runtime.rank_checkpoints import all_stage_files, rank_ckpt_path
from ..core.runtime.topology import check_local_gpus
from .launch import INTERRUPTED, launch

__all__ = ["launch_pipeline", "LAUNCH_GRACE_S"]

LAUNCH_GRACE_S = 30.0       # beyond the run's comm timeout: how long the others may run on once a rank ended


def launch_pipeline(argv: Sequence[str], cfg: RunConfig, out: Path, ckpt: Path, *, replicas: int = 1,
                    launcher: str = "direct", replace_results: bool = False, resume_with_changes: bool = False) -> int:
    """Start ``cfg.stages x replicas`` ranks of ``mapl pipeline <argv>`` after every check; the run's exit code."""
    check_output_paths(out, ckpt, all_stage_files(ckpt, cfg.stages))
    check_results_file(out, cfg, replace_results, resume_with_changes)
    if replicas < 1:
        raise ValueError(f"--replicas {replicas} is invalid: must be >= 1")
    nprocs = cfg.stages * replicas
    check_local_gpus(nprocs)       # before any rank starts
    path = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    grace = cfg.train.comm_timeout_s + LAUNCH_GRACE_S
    res = launch(list(argv), nprocs, launcher=launcher, stream=True, cwd=Path.cwd(), env={"PYTHONPATH": path},
                 grace_s=grace)
    for r in res.stopped:
        first = min((t, k) for k, t in enumerate(res.rank_exit_s) if k not in res.stopped)[1]
        print(f"error: rank {r} was still running {grace:g} s (--timeout + {LAUNCH_GRACE_S:g} s) after rank {first} "
              f"ended (exit {res.rank_returncodes[first]}): stopped it (a stopped or hung process)", file=sys.stderr)
    if res.returncode == INTERRUPTED:
        print(f"interrupted: all {nprocs} ranks stopped after the same step and wrote their checkpoints "
              f"({rank_ckpt_path(ckpt, 0).name.replace('rank0', 'rank*')}); rerun the same command to resume",
              file=sys.stderr)
    elif res.returncode:
        codes = res.rank_returncodes or [res.launcher_returncode]
        print(f"error: the pipeline failed (exit codes per rank: {codes})", file=sys.stderr)
    return res.returncode
