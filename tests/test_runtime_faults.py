"""Multi-process reliability: graceful stops end every rank and the launcher with 130 and one line per
rank, a killed launcher leaves no orphans, and a slow data preparation on rank 0 is waited for."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mapl.core.runtime.rank_checkpoints import rank_ckpt_path
from mapl.orchestration.launch import launch
from mapl.orchestration.launch import free_port

from test_pipeline import base_args

# every test here launches pipeline ranks; all are `full` (make test-all): make test stops and resumes a pipeline
# once (tests/test_pipeline.py, SIGTERM), these four add Ctrl-C, accelerate, a killed launcher and a slow rank 0
pytestmark = [pytest.mark.process, pytest.mark.full]

PROJECT = Path(__file__).resolve().parents[1]
MAPL_FRAMES = f'File "{PROJECT / "mapl"}'          # a traceback line inside our code


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", ACCELERATE_USE_CPU="true", **extra)
    return env


def test_ctrl_c_on_the_self_launched_pipeline_stops_every_rank_and_the_launcher_with_130(corpus, tmp_path):
    """`mapl pipeline` without a launcher starts its ranks itself. SIGINT to that command (as
    Ctrl-C) stops both ranks after the same step: one line per rank, exit 130 from the ranks and the
    command, no traceback, per-rank checkpoints of the same step; the same command then resumes."""
    ckpt = tmp_path / "r.pt"
    cmd = [sys.executable, "-m", "mapl.cli", "pipeline", *base_args(corpus, "mapl", 2), "--set", "train.eval_every=1",
           "--set", "train.eval_tokens=64", "--out", str(tmp_path / "r.json"), "--ckpt", str(ckpt)]
    p = subprocess.Popen(cmd, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    for line in p.stdout:
        if "step 3/20" in line:
            break
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-3000:]
    steps = [torch.load(rank_ckpt_path(ckpt, s), weights_only=True)["state"]["step"] for s in range(2)]
    assert steps[0] == steps[1] and 3 <= steps[0] < 20
    for rank in range(2):
        assert f"interrupted: rank {rank} (stage {rank}): stopped after step {steps[0]}: checkpoint written" in err
    assert "interrupted: all 2 ranks stopped after the same step" in err and "Traceback" not in err
    p = subprocess.run(cmd, cwd=PROJECT, capture_output=True, text=True, timeout=240, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"at step {steps[0]}" in p.stdout and json.loads((tmp_path / "r.json").read_text())["steps"] == 20


def test_graceful_stop_under_accelerate_is_130_with_one_line_per_rank(corpus, tmp_path):
    """Under accelerate each rank exits 130 with one line and no traceback from mapl; accelerate itself
    reports a failed child (its own exit 1), which ``launch`` reads through the ranks' status files."""
    io = ["--out", str(tmp_path / "r.json"), "--ckpt", str(tmp_path / "r.pt")]
    r = launch([*base_args(corpus, "none", 2), *io], 2, launcher="accelerate", timeout=240,
               env={"MAPL_FAULT_SIGTERM_RANK": "0", "MAPL_FAULT_SIGTERM_STEP": "2"})
    assert r.returncode == 130, (r.launcher_returncode, r.stderr[-3000:])
    assert sorted(r.statuses) == [0, 1] and all(s["status"] == "interrupted" for s in r.statuses.values())
    for rank in range(2):
        assert f"interrupted: rank {rank} (stage {rank}): stopped after step 3" in r.stderr
    assert MAPL_FRAMES not in r.stderr


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "gone"


@pytest.mark.skipif(not Path("/proc").exists(), reason="needs /proc to follow the orphaned processes")
def test_stage_processes_stop_when_their_launcher_is_killed(corpus, tmp_path):
    """SIGKILL the launcher mid-run: its stage processes get SIGTERM from the kernel (parent-death
    signal), stop gracefully after the step in flight, write their checkpoints and exit."""
    ckpt = tmp_path / "o.pt"
    args = [*base_args(corpus, "none", 2), "--steps", "2000", "--set", "train.checkpoint_every=100000",
            "--set", "train.eval_every=1", "--set", "train.eval_tokens=64", "--out", str(tmp_path / "o.json"),
            "--ckpt", str(ckpt)]
    parent = subprocess.Popen([sys.executable, "-c", (
        "import json, os, subprocess, sys\n"
        "procs = [subprocess.Popen([sys.executable, '-m', 'mapl.cli.pipeline', *sys.argv[1:]], env=dict(os.environ, "
        "RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE='2', MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ['PORT'])) "
        "for r in range(2)]\n"
        "print(json.dumps([p.pid for p in procs]), flush=True)\n"
        "[p.wait() for p in procs]\n"), *args], cwd=PROJECT, stdout=subprocess.PIPE, text=True,
        env=_env(PORT=str(free_port())))
    pids = json.loads(parent.stdout.readline())
    for line in parent.stdout:                  # rank 0's progress line: training is under way
        if "step 3/2000" in line:
            break
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 60
    while any(_state(p) not in ("gone", "Z") for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert all(_state(p) in ("gone", "Z") for p in pids), [(p, _state(p)) for p in pids]
    steps = [torch.load(rank_ckpt_path(ckpt, s), weights_only=True)["state"]["step"] for s in range(2)]
    assert steps[0] == steps[1] and 0 < steps[0] < 2000


def test_ranks_wait_for_a_slow_data_verification_without_timing_out(corpus, tmp_path):
    """Rank 0 opens (verifies) the data for longer than the training timeout: rank 1 waits (saying so)
    instead of reporting a dead peer, and the run completes."""
    io = ["--out", str(tmp_path / "w.json"), "--ckpt", str(tmp_path / "w.pt"), "--steps", "2", "--timeout", "2"]
    r = launch([*base_args(corpus, "none", 2), *io], 2, launcher="direct", timeout=240,
               env={"MAPL_FAULT_DATA_DELAY_S": "8"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[rank 1] rank 1: waiting for the other ranks to open the data" in r.stdout
    assert json.loads((tmp_path / "w.json").read_text())["steps"] == 2
