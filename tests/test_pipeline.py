"""The multi-process pipeline (mapl pipeline, mapl/core/runtime) and the link emulator (mapl.core.link).

Multi-process tests launch real processes on CPU/gloo (micro profile, a small text corpus written
here, so nothing is downloaded) and compare per-step losses with the single-process loop
(``mapl.core.run.run``) run in this process with the same seed: they must be bit-identical, for every
method, schedule and transport mode (the blocking transport makes every send wait for its receive,
as NCCL's do, so a schedule that would deadlock on GPUs deadlocks here).

The ``mapl`` reference is exact because both runtimes add the receiver-side gradient of a learned
projector once per step (``ProjectionCompressor.fold_receiver_grad``): the same fp32 sums in the
same order, so Muon/SPEL see bit-identical gradients.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

import mapl.cli.train as mtrain
from mapl.core.run import run
from mapl.core.link import (IDEAL, PROFILES, LinkProfile, StepMeasurement, estimate, floor_time, get_profile, simulate,
                       step_time, steps_to_target, time_to_target)
from mapl.core.runtime.rank_checkpoints import rank_ckpt_path
from mapl.orchestration.launch import launch

PROJECT = Path(__file__).resolve().parents[1]


# ---- helpers (the `corpus` fixture is in conftest.py: test_runtime_* share it) --------------------
def base_args(corpus, method, stages, schedule="gpipe", micro_batches=None, ratio=4):
    args = ["--profile", "micro", "--method", method, "--stages", str(stages), "--set", f"train.schedule={schedule}",
            "--set", "data.source=text", "--set", f"data.paths={json.dumps([corpus['glob']])}",
            "--set", "data.tokenizer=byte", "--set", f"data_dir={corpus['data_dir']}",
            "--set", "train.threads=1", "--no-progress"]
    if method != "none":
        args += ["--ratio", str(ratio)]
    if micro_batches:
        args += ["--set", f"train.micro_batches={micro_batches}", "--set", f"train.batch_size={2 * micro_batches}"]
    return args


def reference(args) -> dict:
    threads = torch.get_num_threads()
    try:
        cfg = mtrain.config_from_args(mtrain.parse_args(args))
        return run(cfg, progress=False, log=lambda *a, **k: None)
    finally:
        torch.set_num_threads(threads)


def run_mp(args, nprocs, tmp_path, launcher, name="mp", env=None, extra=()):
    out, ckpt = tmp_path / f"{name}.json", tmp_path / f"{name}.pt"
    r = launch([*args, "--out", str(out), "--ckpt", str(ckpt), *extra], nprocs, launcher=launcher, env=env, timeout=240)
    assert r.returncode == 0, f"{launcher} launch failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(out.read_text())


def assert_parity(res, ref, nprocs, launcher, tol=0.0):
    a = [loss for _, loss in ref["train_loss_curve"]]
    b = [loss for _, loss in res["train_loss_curve"]]
    assert len(a) == len(b) >= 20
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    assert worst <= tol, f"per-step losses differ by {worst:.3g} relative (> {tol})"
    for (s1, v1), (s2, v2) in zip(ref["val_loss_curve"], res["val_loss_curve"]):
        assert s1 == s2 and abs(v1 - v2) <= tol * abs(v1)
    # the early warning reads the same messages in both engines (gathered from each boundary's sender)
    health = [[[r["step"], [b["train_max"] for b in r["boundaries"]]] for r in x["boundary_health"]["readings"]]
              for x in (ref, res)]
    assert len(health[0]) == len(health[1]) > 0
    if tol == 0:
        assert health[0] == health[1]
    # bytes: measured == declared, and the same as the single-process meter
    w = res["wire"]
    assert w["measured"] == w["declared"], (w["measured"], w["declared"])
    assert w["measured"] == ref["wire"]["measured"]
    pipe = res["pipeline"]
    for b_name, dirs in pipe["bytes_per_step"].items():
        decl = pipe["declared_bytes_per_step"][b_name]
        assert dirs["fwd"]["data"] == decl["fwd"] and dirs["bwd"]["data"] == decl["bwd"]
        assert dirs["fwd"].get("ids", 0) == decl["ids"]
        assert dirs["fwd"].get("state", 0) + dirs["bwd"].get("state", 0) == decl["state"]
    # P real processes, started by the launcher we asked for
    assert res["runtime"] == "multiprocess" and pipe["processes"] == nprocs and pipe["replicas"] == 1
    assert len(set(pipe["pids"])) == nprocs
    assert pipe["launcher"] == launcher
    assert all(pipe["state_checksum_match"])
    assert len(pipe["stage_compute_s_per_step"]) == nprocs and all(t > 0 for t in pipe["stage_compute_s_per_step"])
    assert pipe["peak_memory_kind"] == "process_peak_rss" and len(pipe["stage_peak_memory_bytes"]) == nprocs
    assert all(b > 50 * 2**20 for b in pipe["stage_peak_memory_bytes"])     # a process running torch: > 50 MiB
    # sends are released one batch later: a stage holds its batch's send and the one before (+ the dtype
    # handshake at the first batch), never a step's worth (2M on a middle stage) or an evaluation's
    held = pipe["stage_peak_held_sends"]
    assert len(held) == nprocs and max(held) <= (0 if pipe["transport"] == "blocking" else 3), held
    return worst


# ---- parity (multi-process vs single-process) -------------------------------------------------
# `make test` runs three tests here: MAPL P = 2 1F1B under accelerate on the blocking transport, MAPL+RVQ P = 4
# 1F1B under torchrun (losses bit-identical to one process, measured bytes == declared), and MAPL's SIGTERM stop
# and exact resume. Every other launch is marked `full` (`make test-all`): each starts 2-8 rank processes that
# import torch (the first launch of this file: 19 CPU-s) and repeats a launcher, P, schedule or stop path that
# those three already run.
@pytest.mark.process
@pytest.mark.full          # link-delay timing; accelerate, P = 2 and parity are in make test (MAPL below)
def test_parity_none_p2_gpipe_accelerate_with_real_link_delay(corpus, tmp_path):
    """accelerate launch form; real-delay mode on (it changes timing, never numbers): the wall
    clock per step must agree with the virtual clock fed with the run's own measurements."""
    args = base_args(corpus, "none", 2, "gpipe")
    ref = reference(args)
    res = run_mp(args, 2, tmp_path, "accelerate", extra=["--link-delay", "80Mbps@30ms"])
    assert assert_parity(res, ref, 2, "accelerate") == 0.0           # bit-identical in practice
    ld = res["pipeline"]["link_delay"]
    assert ld["latency_s"] == 0.03
    # measured wall includes Python overhead outside the timed compute: allow 30% + 20 ms
    assert abs(ld["measured_step_s"] - ld["model_step_s"]) <= 0.3 * ld["model_step_s"] + 0.02, ld
    assert ld["model_step_s"] > 4 * 0.03           # critical path: 1 fwd + 1 bwd latency + 2 for the all-reduce


@pytest.mark.process
@pytest.mark.full          # link-delay timing: several seconds of emulated link
def test_step_end_compute_excludes_the_wait_for_receiver_gradients(corpus, tmp_path):
    """MAPL P = 2 on a 64 kbit/s real-delay link: stage 0 waits about half a second a step for the receiver-side
    gradient (4 KB), which the link model adds itself (state, bwd). The runtime's step-end compute (``opt``,
    the model's ``opt_s``) must not hold that wait, or the model counts it twice; fed with the run's own
    measurement, the model then predicts the measured step."""
    args = base_args(corpus, "mapl", 2, "1f1b") + ["--set", "train.steps=5", "--set", "train.eval_every=1000"]
    res = run_mp(args, 2, tmp_path, "torchrun", extra=["--link-delay", "64kbps@1ms"])
    pipe = res["pipeline"]
    rgrad_s = pipe["timing"]["state_bwd_bytes"][0] * 8 / 64e3
    assert rgrad_s > 0.4, pipe["timing"]
    assert max(pipe["stage_opt_s_per_step"]) < 0.25 * rgrad_s, pipe["stage_opt_s_per_step"]
    ld = pipe["link_delay"]
    assert abs(ld["model_step_s"] - ld["measured_step_s"]) <= 0.1 * ld["measured_step_s"], ld


@pytest.mark.process
@pytest.mark.full          # P = 4, 1F1B and torchrun are in make test (the MAPL+RVQ parity)
def test_parity_none_p4_1f1b_torchrun(corpus, tmp_path):
    args = base_args(corpus, "none", 4, "1f1b", micro_batches=4)
    ref = reference(args)
    res = run_mp(args, 4, tmp_path, "torchrun")
    assert assert_parity(res, ref, 4, "torchrun") == 0.0


@pytest.mark.process
def test_parity_mapl_p2_1f1b_accelerate_blocking_transport(corpus, tmp_path):
    """... and evaluation in pieces of 3 of each batch's 4 sequences (``schedule.eval_program``: two uneven pieces
    per batch, each weighted by its share of the batch's tokens) gives the single process's validation curve."""
    args = [*base_args(corpus, "mapl", 2, "1f1b"), "--set", "train.eval_micro_batch_size=3"]
    ref = reference(args)
    res = run_mp(args, 2, tmp_path, "accelerate", extra=["--blocking-transport", "--timeout", "30"])
    assert res["pipeline"]["transport"] == "blocking"
    assert_parity(res, ref, 2, "accelerate")
    w = res["wire"]
    assert w["measured"]["ids"] > 0 and w["measured"]["state"] > 0      # anchors need ids; A synced + A.grad back
    assert res["ortho_max_err"] is not None and res["ortho_max_err"] < 1e-4


@pytest.mark.process
@pytest.mark.full          # 8 rank processes; make test stops and resumes a pipeline by SIGTERM (below)
def test_parity_mapl_p4_gpipe_survives_a_killed_rank_and_resumes(corpus, tmp_path):
    """Kill stage 1 of 4 in the middle of step 3: every process exits non-zero within 45 s of it (the dead
    one with 1, the others with a message naming the failed operation, peer and step). The rerun
    resumes from the per-rank checkpoints of step 2 and ends on the uninterrupted losses."""
    args = base_args(corpus, "mapl", 4, "gpipe", micro_batches=4) + ["--set", "train.checkpoint_every=2"]
    out, ckpt = tmp_path / "kill.json", tmp_path / "kill.pt"
    io = ["--out", str(out), "--ckpt", str(ckpt)]
    r = launch([*args, *io, "--timeout", "30"], 4, launcher="direct", timeout=120,
               env={"MAPL_FAULT_KILL_RANK": "1", "MAPL_FAULT_KILL_STEP": "3"})
    assert all(rc != 0 for rc in r.rank_returncodes), (r.rank_returncodes, r.stderr[-3000:])
    assert r.rank_returncodes[1] == 1
    # survivors exit within the 30 s timeout (+ margin) of the killed rank's death, whatever start-up took on a
    # loaded machine (a CI clone beside a retrain needed ~60 s to reach step 3)
    assert max(r.rank_exit_s) - r.rank_exit_s[1] < 45, r.rank_exit_s
    assert "MAPL_FAULT: rank 1" in r.stderr
    for rank in (0, 2):
        assert f"error: rank {rank} (stage {rank}):" in r.stderr and "from stage 1 failed during step 3" in r.stderr
    assert "error: rank 3 (stage 3):" in r.stderr
    assert not out.exists()
    for rank in range(4):
        ck = torch.load(rank_ckpt_path(ckpt, rank), weights_only=True)
        assert ck["state"]["step"] == 2
    ref = reference(args)
    r2 = launch([*args, *io], 4, launcher="direct", timeout=240)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "resumed 4 per-rank checkpoints" in r2.stdout and "at step 2" in r2.stdout
    res = json.loads(out.read_text())
    assert_parity(res, ref, 4, "env")


@pytest.mark.process
@pytest.mark.full          # make test's parity runs check the checksums match; this injects a mismatch
def test_diverged_projector_copy_is_detected_by_its_checksum(corpus, tmp_path):
    """The receiver's copy of A_0 is corrupted on arrival (fault injection): the checksum exchange
    after each evaluation reports the boundary, and the results JSON records the mismatch."""
    args = base_args(corpus, "mapl", 2, "gpipe") + ["--out", str(tmp_path / "d.json"), "--ckpt", str(tmp_path / "d.pt")]
    r = launch(args, 2, launcher="direct", timeout=240, env={"MAPL_FAULT_CORRUPT_SYNC": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "shared state differs between sender and receiver at boundaries [0]" in r.stderr
    res = json.loads((tmp_path / "d.json").read_text())
    assert res["pipeline"]["state_checksum_match"] == [False]


@pytest.mark.process
@pytest.mark.parametrize("method", [pytest.param("none", marks=pytest.mark.full), "mapl"])   # MAPL in make test
def test_sigterm_on_one_rank_stops_all_after_the_same_step_and_resume_is_exact(corpus, tmp_path, method):
    """A real SIGTERM on rank 1 in the middle of step 3: the stop request rides on that step's
    all-reduce, every rank finishes step 3, writes its checkpoint atomically and exits 130; the
    rerun resumes at step 4 and ends on the uninterrupted losses, bit for bit."""
    args = base_args(corpus, method, 2, "gpipe")
    out, ckpt = tmp_path / "s.json", tmp_path / "s.pt"
    io = ["--out", str(out), "--ckpt", str(ckpt)]
    r = launch([*args, *io], 2, launcher="direct", timeout=120,
               env={"MAPL_FAULT_SIGTERM_RANK": "1", "MAPL_FAULT_SIGTERM_STEP": "3"})
    assert r.rank_returncodes == [130, 130], (r.rank_returncodes, r.stderr[-3000:])
    assert r.returncode == 130 and [s["status"] for s in r.statuses.values()] == ["interrupted"] * 2
    for rank in range(2):                  # one line per rank, no traceback
        assert f"[rank {rank}] interrupted: rank {rank} (stage {rank}): stopped after step 4" in r.stderr
    assert "Traceback" not in r.stderr
    for rank in range(2):
        assert torch.load(rank_ckpt_path(ckpt, rank), weights_only=True)["state"]["step"] == 4
    assert not out.exists()
    ref = reference(args)
    r2 = launch([*args, *io], 2, launcher="direct", timeout=240)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert assert_parity(json.loads(out.read_text()), ref, 2, "env") == 0.0


@pytest.mark.process
@pytest.mark.full          # a dead rank: the fault table's pipeline rows and the P = 4 kill above, all `full`
def test_killed_rank_under_accelerate_fails_the_launch_fast(corpus, tmp_path):
    args = base_args(corpus, "none", 2) + ["--out", str(tmp_path / "x.json"), "--ckpt", str(tmp_path / "x.pt")]
    r = launch(args, 2, launcher="accelerate", timeout=120,
               env={"MAPL_FAULT_KILL_RANK": "1", "MAPL_FAULT_KILL_STEP": "2"})
    assert r.returncode != 0
    assert r.wall_s < 60
    assert "MAPL_FAULT: rank 1" in r.stderr


@pytest.mark.process
@pytest.mark.parametrize("nprocs,schedule,launcher,blocking", [
    pytest.param(2, "gpipe", "accelerate", False, marks=pytest.mark.full),      # P = 4 (token scale) in make test
    (4, "1f1b", "torchrun", True)])
def test_mapl_rvq_parity(corpus, tmp_path, nprocs, schedule, launcher, blocking, load_benchmark):
    """... and the pipeline benchmark's steady step carries the compressors' steady-state declarations: the
    whole codebook sent once after the k-means init is metered, declared once and taken out of the mean."""
    from mapl.planning.costmodel import boundary_bytes
    args = base_args(corpus, "mapl-rvq", nprocs, schedule, micro_batches=4 if nprocs == 4 else None)
    if nprocs == 4:                  # RVQ's per-token scale on the wire of a real pipeline
        args += ["--set", "compressor.rvq.scale=token"]
    ref = reference(args)
    res = run_mp(args, nprocs, tmp_path, launcher, extra=["--blocking-transport", "--timeout", "30"] * blocking)
    assert_parity(res, ref, nprocs, launcher)
    bench = load_benchmark("pipeline")
    once = bench.once_bytes(res)
    assert len(once) == nprocs - 1 and all(b > 0 for b in once)
    metered = StepMeasurement.from_results(res).fwd_bytes
    steady = bench.steady_measurement(res).fwd_bytes
    cfg = mtrain.config_from_args(mtrain.parse_args(args))
    declared = [b.fwd for b in boundary_bytes(cfg, cfg.data.vocab_size)]
    assert steady == pytest.approx(declared, rel=1e-12) and all(m > d for m, d in zip(metered, declared))


@pytest.mark.process
@pytest.mark.parametrize("blocking", [True, pytest.param(False, marks=pytest.mark.full)])
def test_deep_1f1b_for_slow_links_is_bit_identical(corpus, tmp_path, blocking):
    """1f1b-x3 (3x 1F1B's warm-up, each gradient's receive posted with its forward's send) runs on the
    blocking transport, where a send waits for its receive as on NCCL, and gives the single-process loop's
    losses bit for bit: the same as 1F1B's (backwards stay in micro-batch order)."""
    args = base_args(corpus, "mapl", 4, "1f1b-x3", micro_batches=8)
    ref = reference(args)
    res = run_mp(args, 4, tmp_path, "direct", extra=["--blocking-transport", "--timeout", "30"] * blocking)
    assert_parity(res, ref, 4, "env")
    assert res["pipeline"]["schedule"] == "1f1b-x3"


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.full          # 10 launches; make test runs MAPL (P = 2) and MAPL+RVQ (P = 4) on the blocking transport
@pytest.mark.parametrize("method", ["none", "int8", "ssn", "mapl", "mapl-rvq"])
@pytest.mark.parametrize("nprocs,schedule", [(2, "gpipe"), (4, "1f1b")])
def test_blocking_transport_parity_every_method(corpus, tmp_path, method, nprocs, schedule):
    """The blocking transport (every send waits for its receive, as on NCCL) runs every method
    bit-identically to the single-process loop (the full P x schedule x method grid is in
    reports/bench/pipeline-blocking-parity.json, from benchmarks/pipeline.py --parity)."""
    args = base_args(corpus, method, nprocs, schedule, micro_batches=4 if nprocs == 4 else None)
    ref = reference(args)
    res = run_mp(args, nprocs, tmp_path, "direct", extra=["--blocking-transport", "--timeout", "30"])
    assert_parity(res, ref, nprocs, "env")


def test_a_process_count_that_is_no_multiple_of_the_stages_is_refused_before_the_rendezvous(monkeypatch, tmp_path,
                                                                                            capsys):
    """Each rank refuses from the launcher's WORLD_SIZE without joining the process group: a rank that refused
    after joining closed its sockets while its peers still connected, and they ended "peer died" (exit 3)."""
    from mapl.cli import pipeline
    from mapl.core.runtime import rank_process

    def joined():
        raise AssertionError("joined the process group")

    def out(rank, code, message=""):
        raise SystemExit(code)

    monkeypatch.setattr(rank_process, "init_distributed", joined)
    monkeypatch.setattr(rank_process, "_exit", out)
    monkeypatch.setattr(rank_process, "exit_with_parent", lambda: None)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as e:
        pipeline.main(["--profile", "micro", "--stages", "2", "--out", str(tmp_path / "r.json"),
                       "--ckpt", str(tmp_path / "r.pt")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err
    assert err.startswith("error: rank 1: 3 process(es) cannot be split into pipelines of stages=2")
    assert not list(tmp_path.iterdir())


@pytest.mark.process
@pytest.mark.full          # 3 ranks importing torch for a one-line error; the fault rows in make test check such lines
def test_a_process_count_that_is_no_multiple_of_the_stages_is_refused(corpus, tmp_path):
    r = launch([*base_args(corpus, "none", 2), "--out", str(tmp_path / "x.json"), "--ckpt", str(tmp_path / "x.pt")],
               3, launcher="direct", timeout=120)
    assert r.rank_returncodes == [2, 2, 2], r.stderr[-2000:]
    assert "3 process(es) cannot be split into pipelines of stages=2" in r.stderr and "--multi_gpu" in r.stderr
    assert "Traceback" not in r.stderr


# ---- the virtual clock ------------------------------------------------------------------------
# 1000 bytes/s links make "bytes" read as milliseconds x 1000: 500 bytes = 0.5 s on the wire.
KB_LINK = LinkProfile("1kB/s", 8e3, 0.1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_virtual_clock_two_stages_two_micro_batches(schedule):
    """f = 1 s, b = 2 s on both stages; every message 0.5 s + 0.1 s latency.
    GPipe: s0 F0 [0,1] F1 [1,2]; arrivals 1.6, 2.6; s1 F0 [1.6,2.6] F1 [2.6,3.6] B0 [3.6,5.6]
    B1 [5.6,7.6]; gradients arrive 6.2, 8.2; s0 B0 [6.2,8.2] B1 [8.2,10.2] -> 10.2.
    1F1B: s1 F0 [1.6,2.6] B0 [2.6,4.6] F1 [4.6,5.6] B1 [5.6,7.6]; s0 B0 [5.2,7.2] B1 [8.2,10.2] -> 10.2."""
    meas = StepMeasurement.uniform(schedule, 2, 2, 1.0, 2.0, [500], [500], collective=False)
    sim = simulate(meas, KB_LINK)
    assert sim.step_time == pytest.approx(10.2, abs=1e-12)
    ev = {(s, k, m): (a, b) for s, k, m, a, b in sim.events}
    if schedule == "gpipe":
        assert ev[(1, "B", 0)] == pytest.approx((3.6, 5.6))
    else:
        assert ev[(1, "B", 0)] == pytest.approx((2.6, 4.6))
        assert ev[(0, "B", 0)] == pytest.approx((5.2, 7.2))
    assert sim.floor == pytest.approx(1.0)          # 2 x 500 bytes per direction at 1000 bytes/s


def test_virtual_clock_step_end_state_messages_and_all_reduce():
    """P = 2, M = 1, f = b = 1, messages 0.5 s + 0.1 s; receiver grad 250 B back, sync 250 B forward;
    optimizer 0.2 s / 0.3 s. s0 F [0,1]; s1 F [1.6,2.6] B [2.6,3.6]; s0 B [4.2,5.2]. The receiver
    grad queues behind the gradient message (channel free at 4.1): arrives 4.1 + 0.25 + 0.1 = 4.45.
    All-reduce at max(5.2, 4.45) + 2 x 0.1 = 5.4; optimizers end 5.6 / 5.7; sync leaves s0 at 5.6 and
    arrives 5.95 -> the first step 5.95.
    Back to back, s0 starts step 2 at 5.6 while the sync is on the wire: F [5.6,6.6], its message queues
    behind the sync (channel free at 5.85) and arrives 7.2; s1 F [7.2,8.2] B [8.2,9.2]; gradient arrives
    9.8; s0 B [9.8,10.8]; all-reduce 11.0; s0's optimizer ends 11.2 -> period 5.6 (and so on)."""
    meas = StepMeasurement("gpipe", [[1.0], [1.0]], [[1.0], [1.0]], [500], [500], opt_s=[0.2, 0.3],
                           state_fwd_bytes=[250], state_bwd_bytes=[250])
    sim = simulate(meas, KB_LINK)
    assert sim.first_step_time == pytest.approx(5.95, abs=1e-12)
    assert sim.step_time == pytest.approx(5.6, abs=1e-12)
    assert simulate(meas, KB_LINK, steps=2).step_time == pytest.approx(5.6, abs=1e-12)
    assert simulate(meas, KB_LINK, steps=1).step_time == pytest.approx(5.95, abs=1e-12)
    assert floor_time(meas, KB_LINK) == pytest.approx(0.75)
    meas.collective = False            # no all-reduce: the first step ends 5.75, s0's period is 5.4
    assert simulate(meas, KB_LINK).first_step_time == pytest.approx(5.75, abs=1e-12)
    assert step_time(meas, KB_LINK) == pytest.approx(5.4, abs=1e-12)


def test_virtual_clock_without_step_end_state_period_is_stage0s_cycle():
    """No state at the step's end: every channel is idle at the all-reduce, so each step repeats the first
    except for where it starts. P = 2, M = 1, f = b = 1, 0.6 s per message (as above); optimizer 0.2 / 0.3 s.
    s0's last backward ends at 5.2, the all-reduce at 5.4 (2 x 0.1 s latency); the first step ends at 5.7 (s1's
    optimizer, the one-step makespan). s0 starts its next step at 5.6 and nothing it waits on depends on
    s1's later start, so its period is 5.6."""
    meas = StepMeasurement("gpipe", [[1.0], [1.0]], [[1.0], [1.0]], [500], [500], opt_s=[0.2, 0.3])
    sim = simulate(meas, KB_LINK)
    assert sim.first_step_time == pytest.approx(5.7, abs=1e-12)
    assert sim.step_time == pytest.approx(5.6, abs=1e-12)
    assert simulate(meas, KB_LINK, steps=1).step_time == sim.first_step_time
    meas.opt_s = [0.3, 0.3]                           # equal optimizer steps: every step the same
    assert simulate(meas, KB_LINK).step_time == pytest.approx(simulate(meas, KB_LINK, steps=1).step_time, abs=1e-12)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        simulate(meas, KB_LINK, steps=0)


def test_virtual_clock_channel_is_fifo():
    """Three 1 s messages produced 0.1 s apart queue on the link: they arrive at 1.1, 2.1, 3.1 (+lat)."""
    meas = StepMeasurement.uniform("gpipe", 2, 3, 0.1, 0.0, [1000], [0], collective=False)
    sim = simulate(meas, LinkProfile("x", 8e3, 0.05))
    arrivals = sorted(a for b, d, m, s, a in sim.messages if d == "fwd")
    assert arrivals == pytest.approx([1.15, 2.15, 3.15])
    assert sim.step_time == pytest.approx(3.15 + 0.1 + 0.05, abs=1e-9)   # last F, zero-cost B, then a 0-byte grad msg


def test_faster_link_is_never_slower_and_floor_is_a_bound():
    rng = random.Random(1)
    for _ in range(40):
        P, M = rng.randint(2, 5), rng.randint(1, 6)
        sched = rng.choice(["gpipe", "1f1b"]) if M >= P else "gpipe"
        meas = StepMeasurement(sched, [[rng.uniform(0.01, 0.2) for _ in range(M)] for _ in range(P)],
                               [[rng.uniform(0.01, 0.4) for _ in range(M)] for _ in range(P)],
                               [rng.uniform(1e3, 1e7) for _ in range(P - 1)], [rng.uniform(1e3, 1e7) for _ in range(P - 1)],
                               [rng.uniform(0, 0.1) for _ in range(P)], [rng.uniform(0, 1e5) for _ in range(P - 1)],
                               [rng.uniform(0, 1e5) for _ in range(P - 1)])
        compute = step_time(meas, IDEAL)
        prev = math.inf
        for bw in (1e6, 8e6, 80e6, 200e6, 1e9, 1e10, 1e12):
            for lat in (0.1, 0.05, 0.0):
                t = step_time(meas, LinkProfile("x", bw, lat))
                assert t >= compute - 1e-12
                assert t >= floor_time(meas, LinkProfile("x", bw, lat)) - 1e-12
            t = step_time(meas, LinkProfile("x", bw, 0.05))
            assert t <= prev + 1e-12
            prev = t
        # per-boundary links: slowing one boundary never speeds the step up
        fast = [PROFILES["10Gbps"]] * (P - 1)
        slow = list(fast)
        slow[rng.randrange(P - 1)] = PROFILES["80Mbps"]
        assert step_time(meas, slow) >= step_time(meas, fast) - 1e-12


def test_profiles_and_parsing():
    assert set(PROFILES) >= {"80Mbps", "200Mbps", "1Gbps", "10Gbps"}
    p = get_profile("80Mbps")
    assert p.bandwidth_bps == 80e6 and p.latency_s == 0.05
    assert get_profile("80Mbps", latency_ms=5).latency_s == 0.005
    q = get_profile("500Mbps@20ms")
    assert q.bandwidth_bps == 500e6 and q.latency_s == pytest.approx(0.02)
    assert get_profile("2.5Gbps").bandwidth_bps == 2.5e9
    assert get_profile("ideal").transfer_s(1e12) == 0.0
    assert p.message_s(1e6) == pytest.approx(1e6 * 8 / 80e6 + 0.05)
    for bad in ("fast", "10 parsecs", "80Mbps@", "-1Mbps"):
        with pytest.raises(ValueError, match="link profile"):
            get_profile(bad)
    with pytest.raises(ValueError, match="bandwidth"):
        LinkProfile("x", 0.0, 0.0)


def test_time_to_target():
    curve = [[10, 3.0], [20, 2.0], [30, 1.5]]
    assert steps_to_target(curve, 3.5) == 10.0
    assert steps_to_target(curve, 2.5) == pytest.approx(15.0)
    assert steps_to_target(curve, 1.5) == 30.0
    assert steps_to_target(curve, 1.0) is None
    assert time_to_target(curve, 2.0, 0.5) == pytest.approx(10.0)
    assert time_to_target(curve, 1.0, 0.5) is None


def test_estimate_orders_profiles():
    meas = StepMeasurement.uniform("1f1b", 4, 4, 0.02, 0.04, [2e5] * 3, [2e5] * 3, opt_s=[0.01] * 4,
                                   state_fwd_bytes=[8192] * 3, state_bwd_bytes=[8192] * 3)
    est = estimate(meas)
    order = [est[k]["step_s"] for k in ("80Mbps", "200Mbps", "1Gbps", "10Gbps")]
    assert order == sorted(order, reverse=True)
    assert all(v["floor_s"] <= v["step_s"] and v["compute_s"] <= v["step_s"] for v in est.values())
    assert StepMeasurement.from_results({"pipeline": {"schedule": "1f1b", "timing": meas.to_dict()}}).to_dict() == meas.to_dict()


@pytest.mark.process
@pytest.mark.full          # one 4-rank launch; the int8 backward leg's bytes and rounding are unit-tested in make test
def test_an_int8_backward_message_runs_bit_identically_on_the_runtime(corpus, tmp_path):
    """compressor.grad_wire=int8 on 4 gloo ranks: the receiver allocates the int8 payload from the declared
    spec, the bytes metered are the bytes declared, and the losses are the single-process loop's."""
    args = [*base_args(corpus, "mapl-rvq", 4, "1f1b", micro_batches=4), "--set", "compressor.grad_wire=int8"]
    ref = reference(args)
    res = run_mp(args, 4, tmp_path, "direct", extra=["--blocking-transport", "--timeout", "30"])
    assert_parity(res, ref, 4, "env")
    tokens = 2 * 32                  # one micro-batch: 2 sequences of the micro profile's 32 tokens
    for decl in res["pipeline"]["declared_bytes_per_step"].values():
        assert decl["bwd"] == 4 * tokens * (16 + 2)        # M = 4 messages of r = 64 / 4 int8 codes + a scale
