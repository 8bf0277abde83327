"""The in-process checks behind rows of tests/test_faults.py:
ranks that agree on what they train, validation loss independent of how it is batched, the report's
refusal of broken results, the results-file guard, params.yaml checked before DVC, workspace folders."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mapl.core.runtime import same_run

ROOT = Path(__file__).resolve().parents[1]


# ---- ranks started for the same run (mapl.core.runtime.same_run) -----------------------------------------------
def _fp(cfg, **options):
    return same_run.run_fingerprint(cfg, {"fresh": False, **options})


def test_identical_ranks_agree_and_local_fields_may_differ(micro_cfg):
    from dataclasses import replace
    cfg = micro_cfg("mapl", 4)
    other = replace(cfg, data_dir=cfg.data_dir + "/", train=replace(cfg.train, threads=7))
    assert same_run.differences([_fp(cfg), _fp(cfg), _fp(other)]) == {}


def test_every_kind_of_difference_is_named_per_rank(micro_cfg):
    from dataclasses import replace
    cfg = micro_cfg("mapl", 4)
    seed = replace(cfg, train=replace(cfg.train, seed=1))
    fps = [_fp(cfg), _fp(seed), _fp(cfg, fresh=True), {**_fp(cfg), "data": "0" * 16}, {**_fp(cfg), "code": "1" * 16}]
    diffs = same_run.differences(fps)
    assert diffs == {1: ["config.train.seed"], 2: ["run.fresh"], 3: ["data"], 4: ["code"]}
    msg = same_run.mismatch_message(fps, diffs)
    assert "\n" not in msg
    assert "(settings, options, prepared data, training code differ)" in msg
    assert "rank 1 differs from rank 0 in train.seed (0 vs 1)" in msg
    assert f"rank 3 differs from rank 0 in data ({fps[0]['data']} vs {'0' * 16})" in msg


def test_a_rank_without_a_readable_manifest_is_not_called_different_data(micro_cfg, tmp_path):
    from dataclasses import replace
    cfg = micro_cfg()
    assert same_run.data_fingerprint(cfg) is not None
    missing = replace(cfg, data_dir=str(tmp_path / "nothing"))
    assert same_run.data_fingerprint(missing) is None
    assert same_run.differences([_fp(cfg), _fp(missing)]) == {}      # opening the data names that problem


def test_many_differences_are_cut_short(micro_cfg):
    fps = [{f"config.k{i}": "0" for i in range(10)}, {f"config.k{i}": "1" for i in range(10)}]
    assert same_run.mismatch_message(fps, same_run.differences(fps)).count(" vs ") == 6
    assert " and 4 more" in same_run.mismatch_message(fps, same_run.differences(fps))


# ---- validation loss: the mean over tokens, however it is batched ---------------------------------------
def _evaluate_with(engine, cfg, eval_batch_size: int) -> float:
    t = cfg.train
    engine.data.val_batches = engine.data.dataset.eval_batches(eval_batch_size, t.seq_len, t.eval_tokens)
    return engine.evaluate(0).val


def test_validation_loss_does_not_depend_on_the_eval_batch_size(micro_cfg):
    """32 windows in batches of 4 (even), 5 and 7 (a smaller last batch): the same weights give the same
    loss to float tolerance (was 5.0867 / 5.0777 / 5.0714 for the same weights: a mean of batch means)."""
    import torch

    from mapl.core.engine import LocalEngine
    torch.manual_seed(0)
    cfg = micro_cfg("mapl", 4)
    engine = LocalEngine.build(cfg)
    for step in range(3):
        engine.train_step(step, 1.0)
    assert cfg.train.eval_tokens // cfg.train.seq_len == 32
    losses = {b: _evaluate_with(engine, cfg, b) for b in (4, 5, 7, 32)}
    assert max(losses.values()) - min(losses.values()) < 1e-5 * losses[4], losses
    # the old mean of batch means is measurably different with a small last batch: the test can fail
    t = cfg.train
    batches = engine.data.dataset.eval_batches(7, t.seq_len, t.eval_tokens)
    with torch.no_grad():
        engine.sm.eval()
        plain = sum(float(engine.sm(x, y)) for x, y in batches) / len(batches)
    assert abs(plain - losses[4]) > 1e-4


def test_full_batches_keep_the_plain_mean_bit_for_bit(micro_cfg):
    """Where the windows fill every batch (every committed profile), the weights are exactly 1.0: the
    committed numbers stay those of the mean over batches."""
    import torch

    from mapl.core.engine import LocalEngine, batch_weight
    cfg = micro_cfg()
    engine = LocalEngine.build(cfg)
    batches = engine.data.val_batches
    assert [batch_weight(y, batches) for _, y in batches] == [1.0] * len(batches)
    with torch.no_grad():
        engine.sm.eval()
        total = torch.zeros((), dtype=torch.float64)
        for x, y in batches:
            total += engine.sm(x, y)
    assert engine.evaluate(0).val == float(total) / len(batches)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.full          # two 4-process launches; the in-process tests above hold the same weighting
def test_pipeline_validation_loss_is_the_same_for_every_eval_batch_size_and_replica_count(tmp_path, tiny_corpus):
    """The multi-process runtime weighs each replica's batches by their tokens too: R = 2 with batches of 5
    (3 + 4 batches, one of 2 windows) gives R = 2 with batches of 4's losses to float tolerance."""
    import json

    from mapl.orchestration.launch import launch
    args = ["--profile", "micro", "--set", "data.source=text", "--set",
            f"data.paths={json.dumps([str(tiny_corpus.parent / 'doc*.txt')])}", "--set", "data.tokenizer=byte",
            "--set", f"data_dir={tiny_corpus}", "--set", "train.threads=1", "--no-progress", "--steps", "10",
            "--replicas", "2"]
    curves = {}
    for b in (4, 5):
        out = tmp_path / f"eb{b}.json"
        r = launch([*args, "--set", f"train.eval_batch_size={b}", "--out", str(out), "--ckpt", str(tmp_path / f"eb{b}.pt")],
                   4, launcher="direct", timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        curves[b] = json.loads(out.read_text())["val_loss_curve"]
    assert [s for s, _ in curves[4]] == [s for s, _ in curves[5]] == [10]
    assert abs(curves[4][0][1] - curves[5][0][1]) < 1e-5 * curves[4][0][1], curves


# ---- the launcher never waits without limit (mapl.orchestration.launch) ------------------------------------------
@pytest.mark.process
def test_a_stopped_rank_is_stopped_by_the_launcher_once_another_ended():
    """Rank 0 ends (exit 3, as after a peer timeout); rank 1 is SIGSTOPped (it can act on no signal but
    SIGKILL): the launcher stops it ``grace_s`` later instead of waiting forever."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from mapl.orchestration.launch import _wait_all
    procs = [subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(0.5); sys.exit(3)"]),
             subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])]
    os.kill(procs[1].pid, signal.SIGSTOP)
    t0 = time.time()
    try:
        exit_s, stopped = _wait_all(procs, None, t0, grace_s=1.0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert stopped == [1] and procs[0].returncode == 3 and procs[1].returncode == -signal.SIGKILL
    assert time.time() - t0 < 1.0 + 5.0 + 3.0 and exit_s[0] < exit_s[1]


@pytest.mark.process
def test_without_grace_every_rank_is_waited_for():
    import subprocess
    import sys
    import time

    from mapl.orchestration.launch import _wait_all
    procs = [subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({t})"]) for t in (0.1, 1.5)]
    exit_s, stopped = _wait_all(procs, None, time.time())
    assert stopped == [] and [p.returncode for p in procs] == [0, 0] and exit_s[1] >= 1.4


@pytest.mark.parametrize("codes,expected", [([0, 0], 0), ([-9, 3], 3), ([0, -15], 3), ([4, 3], 4), ([2, 2], 2)])
def test_a_rank_killed_by_a_signal_ends_the_launch_as_a_peer_failure(codes, expected):
    # was: rank 0's -9 became the launcher's exit status 247, a code no table documents
    from mapl.orchestration.launch import _outcome
    assert _outcome(codes, {}, len(codes), None) == expected


def test_status_folders_of_dead_launchers_are_removed(tmp_path, monkeypatch):
    # a SIGKILLed launcher cannot remove its status folder: the next launch does
    import tempfile

    from mapl.base.io import owned_temp_folder
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / "mapl-status-999999999-abc"           # above Linux's PID limit: never a live process
    live = tmp_path / f"mapl-status-{os.getppid()}-def"
    for folder in (dead, live):
        folder.mkdir()
        (folder / "rank0.json").write_text("{}")
    new = owned_temp_folder("mapl-status")
    assert not dead.exists() and live.exists() and Path(new).name.startswith(f"mapl-status-{os.getpid()}-")


# ---- a finished run's results are never replaced by another config's (mapl.core.run.check_results_file) -----
def _results_of(cfg) -> dict:
    from mapl.core.config import config_hash
    v = cfg.validate()
    return {"config": v.to_dict(), "provenance": {"config_hash": config_hash(v)}, "val_loss": 4.0, "method": "none"}


def test_results_guard(micro_cfg, tmp_path):
    import json
    from dataclasses import replace

    from mapl.base.io import OutputError
    from mapl.core.run import check_results_file
    cfg = micro_cfg("mapl", 4)
    out = tmp_path / "r.json"
    check_results_file(out, cfg)                                    # nothing there
    out.write_text(json.dumps(_results_of(cfg)))
    check_results_file(out, cfg)                                    # the same config: the same numbers
    check_results_file(out, replace(cfg, train=replace(cfg.train, threads=3, checkpoint_every=7)))   # execution only
    seed = replace(cfg, train=replace(cfg.train, seed=1))
    with pytest.raises(OutputError, match=r"holds the results of another config \(train\.seed 0 -> 1\)"):
        check_results_file(out, seed)
    check_results_file(out, seed, replace=True)
    lr = replace(cfg, train=replace(cfg.train, lr_muon=0.5, steps=40))
    with pytest.raises(OutputError, match=r"train\.lr_muon 0\.02 -> 0\.5, train\.steps 20 -> 40"):
        check_results_file(out, lr)
    check_results_file(out, lr, resume_with_changes=True)          # a continuation of resumable fields
    with pytest.raises(OutputError, match=r"train\.seed"):
        check_results_file(out, replace(seed, train=replace(seed.train, lr_muon=0.5)), resume_with_changes=True)
    out.write_text("not json")
    with pytest.raises(OutputError, match=r"exists and is not a mapl results JSON"):
        check_results_file(out, cfg)


# ---- workspaces: a --dir is never overwritten, a stopped workspace leaves nothing running ----------------
def test_workspace_dir_must_be_new_empty_or_a_workspace(tmp_path):
    from mapl.orchestration.workspace import MARKER, PROJECT_ROOT, check_dir
    check_dir(tmp_path / "new")                                             # created later
    (tmp_path / "empty").mkdir()
    check_dir(tmp_path / "empty")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("my notes")
    with pytest.raises(ValueError, match=r"exists, is not empty and is no mapl workspace"):
        check_dir(mine)
    (mine / MARKER).parent.mkdir()
    (mine / MARKER).write_text("/somewhere\n")                              # made by make_copy: refreshed
    check_dir(mine)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match=r"is a file, not a folder"):
        check_dir(tmp_path / "afile")
    for where in (PROJECT_ROOT, PROJECT_ROOT.parent, PROJECT_ROOT / "."):
        with pytest.raises(ValueError, match=r"is this checkout or a folder above it"):
            check_dir(where)
    with pytest.raises(ValueError, match=r"is inside this checkout"):
        check_dir(PROJECT_ROOT / "reports" / "ws")


def test_a_failed_step_in_the_copy_is_exit_5_and_names_it(monkeypatch, capsys):
    """A step in the copy that fails (or outputs that differ) is neither a bug here (1) nor the user's input (2):
    exit 5, the step named on stderr; the stage names are dvc.yaml's, a run's training stage train@<run> (of the
    profile the copy runs)."""
    from mapl.base.cli import EXIT_STEP_FAILED
    from mapl.cli import workspace as cli_workspace
    from mapl.orchestration import workspace

    def failing(*a, **k):
        raise workspace.WorkspaceError("`dvc repro train@x` failed in /tmp/x (exit 255)\nERROR: failed to reproduce")
    monkeypatch.setattr(workspace, "repro", failing)
    assert cli_workspace.main(["repro", "--profile", "micro", "train@micro-P2-none-s0"]) == EXIT_STEP_FAILED
    assert capsys.readouterr().err.startswith("error: `dvc repro train@x` failed in /tmp/x (exit 255)")
    names = workspace.stage_names()
    assert {"validate", "prepare", "train", "train@tiny-P4-none-s0", "report", "plan"} <= set(names)
    assert "train@micro-P2-none-s0" in workspace.stage_names(profile="micro")
    assert not any(n.startswith("frozen_trunk@") for n in names)       # a stage without foreach has no items


@pytest.mark.process
def test_stopping_a_command_stops_every_process_below_it(tmp_path):
    """What SIGTERM to `mapl.orchestration.workspace` does to DVC and its children: the whole tree goes, even a child
    that ignores SIGTERM (SIGKILL after the grace)."""
    import subprocess
    import sys
    import time

    import psutil

    from mapl.orchestration.workspace import _stop_tree
    code = ("import signal, subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, "
            "signal.SIG_IGN); time.sleep(600)'])\n"
            "time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.time() + 30
    while not psutil.Process(proc.pid).children() and time.time() < deadline:
        time.sleep(0.1)
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert len(tree) == 2
    _stop_tree(proc, grace_s=1.0)
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.process
def test_a_run_in_a_folder_with_spaces_and_non_ascii_letters_and_no_home(tmp_path):
    """Environment class: a checkout or output folder named with spaces and non-ASCII letters, and ``HOME`` unset
    (a service account, a container): the corpus is prepared, a run trains, resumes as current, and reports."""
    where = tmp_path / "my runs é ü"
    (where / "text").mkdir(parents=True)
    for i in range(6):
        (where / "text" / f"doc {i} é.txt").write_text(f"Document {i}. " + "the quick brown fox. " * 400)
    env = {k: v for k, v in os.environ.items() if k != "HOME"}
    env.update(PYTHONPATH=str(ROOT), MAPL_DEBUG="0", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    data = ["--source", "text", "--paths", str(where / "text" / "*.txt"), "--tokenizer", "byte"]
    run = [sys.executable, "-m", "mapl.cli", "train", "--profile", "micro", "--set", "data.source=text",
           "--set", f"data.paths={json.dumps([str(where / 'text' / '*.txt')])}", "--set", "data.tokenizer=byte",
           "--set", f"data_dir={where / 'prepared data'}", "--set", "train.threads=1", "--steps", "2", "--no-progress",
           "--out", str(where / "résultat 1.json"), "--ckpt", str(where / "point de reprise.pt")]
    prep = subprocess.run([sys.executable, "-m", "mapl.cli", "data", "--out", str(where / "prepared data"), *data],
                          cwd=where, env=env, text=True, capture_output=True, timeout=600)
    assert prep.returncode == 0, prep.stderr[-2000:]
    for _ in range(2):                          # the second finds the run finished and current
        p = subprocess.run(run, cwd=where, env=env, text=True, capture_output=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((where / "résultat 1.json").read_text())["steps"] == 2
