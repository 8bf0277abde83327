"""The paper path: data parallelism across replicas (P x R processes) and a two-machine launch rehearsed
on one host (loopback)."""
from __future__ import annotations

import json

import pytest

from mapl.orchestration.launch import launch
from mapl.orchestration.launch import launch_machines

from test_pipeline import base_args, reference

# every test here launches pipeline ranks (4 processes, or 2 "machines"); all are `full` (make test-all): make test
# runs the single-replica pipeline (tests/test_pipeline.py), replicas and machines are what these add
pytestmark = [pytest.mark.process, pytest.mark.full]


def _losses(res):
    return [loss for _, loss in res["train_loss_curve"]]


@pytest.mark.parametrize("method", [pytest.param("none", marks=pytest.mark.slow), "mapl"])
def test_two_replicas_of_a_two_stage_pipeline_train_like_one(corpus, tmp_path, method):
    """P = 2 stages x R = 2 replicas on 4 processes, the global batch split between the replicas and the
    gradients summed per stage: the losses are those of one pipeline with the same global batch and
    micro-batches of the same size, up to the order of the floating-point sums. The first step is the
    same to 1e-7 and the second (after one update) to 1e-6; then the curves drift apart as any
    reordering of the sums makes them drift: at R = 1, 2 vs 4 micro-batches (the same maths) differ by
    up to 2e-4 over these 20 steps, so the whole curve is held to 2e-3."""
    common = base_args(corpus, method, 2, "1f1b") + ["--set", "train.batch_size=8"]
    ref = reference(common + ["--set", "train.micro_batches=4"])
    out = tmp_path / "dp.json"
    r = launch([*common, "--set", "train.micro_batches=2", "--out", str(out), "--ckpt", str(tmp_path / "dp.pt")], 4,
               launcher="direct", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    pipe = res["pipeline"]
    assert (pipe["stages"], pipe["replicas"], pipe["processes"]) == (2, 2, 4)
    rel = [abs(a - b) / abs(a) for a, b in zip(_losses(ref), _losses(res))]
    assert len(_losses(res)) == len(_losses(ref)) == 20
    assert rel[0] <= 1e-7 and rel[1] <= 1e-6 and max(rel) <= 2e-3, rel
    assert abs(res["val_loss"] - ref["val_loss"]) <= 2e-3 * ref["val_loss"]
    assert res["tokens"] == ref["tokens"]
    assert res["wire"]["measured"] == res["wire"]["declared"]
    assert all(pipe["state_checksum_match"])


def test_data_parallel_mapl_rvq_is_refused_in_one_line(corpus, tmp_path):
    r = launch([*base_args(corpus, "mapl-rvq", 2, "gpipe"), "--out", str(tmp_path / "x.json"), "--ckpt",
                str(tmp_path / "x.pt")], 4, launcher="direct", timeout=240)
    assert set(r.rank_returncodes) == {2}, r.stderr[-2000:]
    assert "cannot run with data-parallel replicas" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_two_machine_launch_on_loopback(corpus, tmp_path):
    """Two `accelerate launch --multi_gpu --num_machines 2 --machine_rank 0/1 --num_processes 2` on
    127.0.0.1 (one process per "machine"): one 2-stage pipeline across both, bit-identical to one process."""
    args = base_args(corpus, "mapl", 2, "1f1b")
    ref = reference(args)
    out = tmp_path / "mm.json"
    r = launch_machines([*args, "--out", str(out), "--ckpt", str(tmp_path / "mm.pt")], nprocs=2, machines=2,
                        launcher="accelerate", timeout=300)
    assert r.returncode == 0, (r.launcher_returncode, r.stderr[-3000:])
    res = json.loads(out.read_text())
    assert res["pipeline"]["processes"] == 2 and res["pipeline"]["launcher"] == "accelerate"
    assert _losses(res) == _losses(ref)
