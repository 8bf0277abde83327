"""Training runs (mapl.orchestration.sweep, mapl.orchestration.progress, mapl.cli.train's run flags): DVC's train
stages rebuild their runs' configs, launches, the pool, `mapl sweep` through DVC, estimates and progress lines;
fast: nothing here trains."""
import json
import shlex
import threading
import time
import warnings
from pathlib import Path

import pytest
import yaml

import mapl.cli.sweep
import mapl.cli.train
from mapl.base.declared_groups import declaration
from mapl.cli.train import config_from_args, parse_args
from mapl.core.config import ConfigError, config_hash, load_params
from mapl.orchestration import groups as G
from mapl.orchestration import sweep
from mapl.orchestration.progress import StepProgress, estimate_core_seconds, estimate_group, named_warnings

PARAMS = load_params()
ROOT = Path(__file__).resolve().parents[1]
GROUPS = list(declaration(PARAMS).names())


def cfgs(group, profile="cpu"):
    return [G.spec_config(profile, s, PARAMS) for s in G.group_specs(profile, group, PARAMS)]


def dvc_command(name: str, spec: dict, profile: str = "cpu") -> list[str]:
    """The train stage's command as DVC writes it (dvc.yaml: `mapl train --profile ${profile} --name ${key} ${item}`,
    a dict unpacked as `--key value` pairs, in its order)."""
    cmd = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]["do"]["cmd"]
    assert cmd == "mapl train --profile ${profile} --name ${key} ${item}"
    return ["--profile", profile, "--name", name, *[x for k, v in spec.items() for x in (f"--{k}", str(v))]]


@pytest.mark.parametrize("profile", ["micro", "cpu", "paper-smoke", "paper"])
def test_each_train_stage_command_builds_its_runs_config(profile):
    """The command DVC runs for a run builds the very config its params.yaml spec resolves to (same hash and
    name): `--anchor none` must stay the ablation, not the method's default."""
    runs = G.profile_runs(profile, PARAMS)
    for name, spec in list(runs.items())[::7 if profile == "cpu" else 1]:
        cfg = G.spec_config(profile, {"name": name, **spec}, PARAMS).validate()
        args = parse_args(dvc_command(name, spec, profile))
        again = config_from_args(args).validate()
        assert (again.name(), config_hash(again), args.group) == (name, config_hash(cfg), spec["group"])


def test_dvc_renders_the_train_command_as_the_test_assumes():
    """One run through DVC's own renderer (slow with every run: DVC parses params.yaml per stage; one is enough)."""
    from dvc.repo import Repo
    stage = next(s for s in Repo(str(ROOT)).index.stages if s.addressing == "train@tiny-P4-mapl-8x-anchor-none-s1")
    spec = G.profile_runs("cpu", PARAMS)["tiny-P4-mapl-8x-anchor-none-s1"]
    assert shlex.split(stage.cmd) == ["mapl", "train", *dvc_command("tiny-P4-mapl-8x-anchor-none-s1", spec)]
    assert [str(o) for o in stage.outs] == ["reports/cpu/results/seeds/tiny-P4-mapl-8x-anchor-none-s1.json"]


@pytest.mark.parametrize("argv,says", [
    (["--train.seed"], None),
    (["--bogus", "1"], "unrecognized arguments: --bogus"),
    (["stray"], "unrecognized arguments: stray"),
])
def test_setting_flags_are_dotted_pairs(argv, says, capsys):
    if says is None:
        assert parse_args(["--profile", "micro", *argv]).set == ["train.seed=true"]   # a boolean as DVC writes one
        return
    with pytest.raises(SystemExit) as stop:
        parse_args(["--profile", "micro", *argv])
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_a_run_of_params_yaml_with_other_flags_is_refused(tmp_path, monkeypatch, capsys):
    """`mapl train --group` writes where DVC records the run: flags that build another config than the run's
    recorded one (reports/<profile>/configs/<run>.json) are refused before anything trains."""
    monkeypatch.setattr(G, "PROJECT_ROOT", tmp_path)
    monkeypatch.setattr(mapl.cli.train, "PROJECT_ROOT", tmp_path)
    G.write_configs("micro", PARAMS, tmp_path)
    monkeypatch.setattr(G, "config_path", lambda profile, name, root=tmp_path: tmp_path / "reports" / profile /
                        "configs" / f"{name}.json")
    monkeypatch.setattr(sweep, "train_one", lambda *a, **k: pytest.fail("trained"))
    code = mapl.cli.train.main(["--profile", "micro", "--name", "micro-P2-ssn-4x-s0", "--group", "main",
                                "--method", "ssn", "--ratio", "8"])
    assert code == 2 and "these flags build another config than reports/micro/configs/micro-P2-ssn-4x-s0.json" in \
        capsys.readouterr().err
    assert mapl.cli.train.main(["--profile", "micro", "--name", "x", "--group", "nope"]) == 2
    assert "--group 'nope' is invalid: allowed the groups params.yaml declares" in capsys.readouterr().err


def test_run_name_shows_only_what_differs():
    base = G.spec_config("cpu", {"method": "mapl", "ratio": 8}, PARAMS)
    assert base.name() == "tiny-P4-mapl-8x-s0"
    named = G.spec_config("cpu", {"method": "mapl-rvq", "ratio": 8, "compressor.rvq.sync": "full",
                                  "anchor": "static", "train.steps": 1000, "train.seed": 1,
                                  "model.d_model": 256, "model.ffn_hidden": 704}, PARAMS)
    assert named.name() == "tiny-d256-P4-mapl-rvq-8x-anchor-static-sync-full-1000steps-s1"
    assert G.spec_config("cpu", {"name": "x", "method": "none"}, PARAMS).name() == "x"


def test_launcher_config():
    assert sweep.launcher_config("cpu", PARAMS) == sweep.LauncherConfig("pool", jobs=2)
    paper = sweep.launcher_config("paper", PARAMS)
    assert paper.kind == "accelerate" and paper.gpus == 8
    assert sweep.launcher_config("paper-smoke", PARAMS).gpus == 0
    with pytest.raises(ConfigError, match=r"profiles.x.launcher.kind='mpirun' is invalid: allowed"):
        sweep.launcher_config("x", {"profiles": {"x": {"launcher": {"kind": "mpirun"}}}})
    with pytest.raises(ConfigError, match="unknown key"):
        sweep.launcher_config("x", {"profiles": {"x": {"launcher": {"gpu": 8}}}})


def test_paper_profiles_use_the_pipeline_shapes():
    for profile in ("paper", "paper-smoke"):
        for c in cfgs("main", profile):
            assert c.train.schedule == "1f1b" and c.stages in (4, 8)
    smoke = cfgs("main", "paper-smoke")
    assert {c.compressor.method for c in smoke} == {"none", "int8", "ssn", "mapl", "mapl-rvq"}
    assert all(c.model == "150M" and c.compressor.rank(1024) in (256, 1024) and c.data.tokenizer == "mistral"
               for c in smoke)


def test_a_launched_run_rebuilds_its_config_in_the_pipeline(tmp_path, monkeypatch):
    """A profile launched on GPUs starts `mapl pipeline` with the run's spec as --set values: the same config."""
    import mapl.orchestration.launch as launch
    seen = {}

    def fake_launch(args, nprocs, launcher, stream):
        seen.update(args=args, nprocs=nprocs, launcher=launcher)
        return launch.LaunchResult(args, 0, "", "", 1.0)
    monkeypatch.setattr(launch, "launch", fake_launch)
    monkeypatch.setattr(sweep, "prepare_data", lambda cfgs: None)
    spec = G.group_specs("paper-smoke", "main", PARAMS)[3]
    cfg = G.spec_config("paper-smoke", spec, PARAMS).validate()
    assert sweep.train_one("paper-smoke", cfg, spec, tmp_path / "r.json", tmp_path / "r.pt") is None
    args = seen["args"]
    i = args.index("--out")
    assert args[i:i + 4] == ["--out", str(tmp_path / "r.json"), "--ckpt", str(tmp_path / "r.pt")]
    again = config_from_args(parse_args(args[:i])).validate()
    assert (again.name(), config_hash(again), seen["nprocs"], seen["launcher"]) == (
        cfg.name(), config_hash(cfg), 4, "accelerate")
    monkeypatch.setattr(launch, "launch", lambda *a, **k: launch.LaunchResult([], 3, "", "", 1.0))
    with pytest.raises(RuntimeError, match=r"run 150M-P4-mapl-4x-s0 failed \(exit 3; its ranks' output is above\)"):
        sweep.train_one("paper-smoke", cfg, spec, tmp_path / "r.json", tmp_path / "r.pt")


def test_a_sweep_runs_each_stage_through_dvc_side_by_side(monkeypatch):
    """`mapl sweep` prepares, then runs `dvc repro -s train@<run>` per run, two at a time on the cpu profile; on a
    GPU machine each run starts when its P GPUs are free, with CUDA_VISIBLE_DEVICES set to them."""
    calls, active, seen, lock = [], [], [], threading.Lock()

    class Done:
        def __init__(self, code):
            self.returncode = code

    def fake_run(cmd, cwd=None, env=None):
        calls.append(cmd[3:])
        if cmd[-1] == "prepare":
            return Done(0)
        with lock:
            active.append(cmd[-1])
            seen.append((cmd[-1], (env or {}).get("CUDA_VISIBLE_DEVICES"), len(active)))
        time.sleep(0.1)
        with lock:
            active.remove(cmd[-1])
        return Done(1 if cmd[-1].endswith("s1") else 0)

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    monkeypatch.setattr(sweep, "check_disk_space", lambda cfgs, folder: None)   # the paper's checkpoints need TBs
    names = [s["name"] for s in G.group_specs("micro", "main", PARAMS)] + ["micro-P2-none-s1"]
    assert sweep.sweep("micro", names) == ["micro-P2-none-s1"]                 # the one that failed
    assert calls[0] == ["repro", "prepare"] and sorted(c[-1] for c in calls[1:]) == sorted(f"train@{n}" for n in names)
    assert all(c[:2] == ["repro", "--single-item"] for c in calls[1:]) and max(k for _, _, k in seen) == 2
    seen.clear()
    paper = [s["name"] for s in G.group_specs("paper", "main", PARAMS)][3:6]    # P = 4, 8, 8 on 8 GPUs
    sweep.sweep("paper", paper)
    gpus = {name.removeprefix("train@"): ids for name, ids, _ in seen}
    assert sorted(len(v.split(",")) for v in gpus.values()) == [4, 8, 8]
    with pytest.raises(ConfigError, match=r"needs 8 GPUs \(one per stage\) but profiles.paper.launcher.gpus=4"):
        monkeypatch.setattr(sweep, "launcher_config", lambda p, params=None: sweep.LauncherConfig("accelerate", gpus=4))
        sweep.sweep("paper", paper)


def test_a_group_whose_checkpoints_do_not_fit_the_disk_is_refused_before_its_first_run(monkeypatch, tmp_path):
    import shutil
    from collections import namedtuple

    from mapl.base.io import OutputError
    monkeypatch.setattr(sweep.subprocess, "run", lambda *a, **k: pytest.fail("a run started"))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**5, 10**5))    # 0.1 MB free
    names = [s["name"] for s in G.group_specs("micro", "main", PARAMS)]
    with pytest.raises(OutputError, match=r"cannot write the checkpoints of 4 run\(s\) under .*checkpoints/micro: no "
                                          r"space left on the device \(0 MB free, about [\d,.]+ MB needed\); free space"):
        sweep.sweep("micro", names)
    cfgs = [G.spec_config("micro", s, PARAMS) for s in G.group_specs("micro", "main", PARAMS)]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 10**12))
    sweep.check_disk_space(cfgs, tmp_path / "checkpoints" / "micro")          # fits


def test_the_sweep_command_refuses_another_profile_and_reports_failures(monkeypatch, capsys):
    assert mapl.cli.sweep.main(["--profile", "micro", "--group", "main"]) == 2
    assert "--profile 'micro' is invalid here: DVC trains this checkout's profile ('cpu')" in capsys.readouterr().err
    monkeypatch.setattr(sweep, "sweep", lambda profile, names, jobs: names[:1])
    assert mapl.cli.sweep.main(["--group", "rvq_sync"]) == 5
    assert capsys.readouterr().err.startswith("error: 1 of 2 run(s) failed: tiny-P4-mapl-rvq-8x-sync-full-s0")
    for argv, says in ((["--seeds", "1", "--estimate"], "error: --seeds is invalid without --group"),
                       (["--stamp", "s.txt", "--estimate"], "error: --stamp is invalid without --check"),
                       (["--group", "main", "--jobs", "-1"], "error: --jobs -1 is invalid: must be >= 0")):
        assert mapl.cli.sweep.main(argv) == 2 and says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mapl.cli.sweep.main(["--group", "main", "--check"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_estimates():
    from mapl.orchestration.progress import RUN_OVERHEAD_S, RVQ_SLOWDOWN, STEP_S
    tiny = G.spec_config("cpu", {"method": "none"}, PARAMS)
    fixed = RUN_OVERHEAD_S + tiny.train.steps * STEP_S                 # what does not grow with the parameters
    rvq = G.spec_config("cpu", {"method": "mapl-rvq", "ratio": 8}, PARAMS)
    assert estimate_core_seconds(rvq) - fixed == pytest.approx(
        RVQ_SLOWDOWN * (estimate_core_seconds(tiny) - fixed), rel=0.02)   # RVQ's parameters: a codebook more
    wide = cfgs("width")[-1]
    assert 1.8 < estimate_core_seconds(wide) / estimate_core_seconds(tiny) < 3       # d = 256: ~2.2x
    assert estimate_group([3, 1, 1, 1], 2) == 3 and estimate_group([1, 1, 1, 3], 2) == 4 and estimate_group([5], 4) == 5
    main = estimate_group([estimate_core_seconds(c) for c in cfgs("main")], 2)
    assert main < 45 * 60                                                # the first table in under 45 minutes
    text = sweep.estimate_text("micro", PARAMS)
    assert "main" in text and "ladder_tune" in text and "total about" in text and "tune2" not in text   # empty groups


def test_the_estimate_is_what_the_committed_runs_took():
    """The fit's promise, on the committed results of the main groups (each model size apart): the median of
    measured / estimated train_wall_s lies within 0.7-1.45."""
    import statistics
    checked = 0
    for group in ("main", "seeds", "long", "blocks"):
        by_size = {}
        for cfg in cfgs(group):
            res = json.loads((G.results_dir("cpu", group) / f"{cfg.name()}.json").read_text())
            by_size.setdefault(cfg.model_config(cfg.data.vocab_size or None).d_model, []).append(
                res["train_wall_s"] / estimate_core_seconds(cfg))
        for d, ratios in by_size.items():
            assert 0.7 < statistics.median(ratios) < 1.45, (group, d, statistics.median(ratios))
            checked += 1
    assert checked == 4


def test_the_estimate_says_when_it_priced_a_split_it_has_not_seen(monkeypatch):
    """A whole-split run whose validation split is not prepared here is priced at UNPREPARED_EVAL_TOKENS per
    evaluation, and its group's line says so; a prepared split, or ``data.val_tokens``, is its true size."""
    import copy
    from mapl.orchestration import progress
    params = copy.deepcopy(PARAMS)
    spec = {"group": "corpus", "method": "none", "data.source": "sympy-code", "data.val_fraction": 0.02}
    params["profiles"]["cpu"]["runs"] = {"r": spec}
    whole = G.spec_config("cpu", spec, params)
    monkeypatch.setattr(progress, "_prepared_val_tokens", lambda cfg: None)
    assert progress.eval_split_guessed(whole) and progress.eval_tokens(whole) == progress.UNPREPARED_EVAL_TOKENS
    line = next(ln for ln in sweep.estimate_text("cpu", params).splitlines() if ln.strip().startswith("corpus"))
    assert "1 run(s) read a validation split not prepared here: each evaluation priced at 65,536 tokens" in line
    sized = G.spec_config("cpu", {**spec, "data.val_tokens": 200_000}, params)
    assert not progress.eval_split_guessed(sized) and progress.eval_tokens(sized) == 200_000
    monkeypatch.setattr(progress, "_prepared_val_tokens", lambda cfg: 187_000)
    assert not progress.eval_split_guessed(whole) and progress.eval_tokens(whole) == 187_000 - whole.train.eval_offset
    assert "not prepared" not in sweep.estimate_text("cpu", params)


def test_the_estimate_reads_a_committed_profile_stamp_where_the_split_is_not_prepared(monkeypatch, tmp_path):
    """A fresh clone has data/<profile>.manifest.json (committed) but not the folder it copies: the split's size
    comes from the stamp of the same folder; a stamp of another folder is not read."""
    import mapl.data
    from mapl.orchestration import progress
    cfg = G.spec_config("cpu", {"method": "none"}, PARAMS)
    folder = tmp_path / "data" / "some-corpus"
    monkeypatch.setattr(mapl.data, "default_data_dir", lambda data: folder)
    folder.parent.mkdir()
    assert progress._prepared_val_tokens(cfg) is None and progress.eval_split_guessed(cfg)
    stamp = {"data_dir": "data/other-corpus", "splits": {"val": {"tokens": 999}}}
    (folder.parent / "micro.manifest.json").write_text(json.dumps(stamp))
    assert progress._prepared_val_tokens(cfg) is None
    (folder.parent / "cpu.manifest.json").write_text(json.dumps({**stamp, "data_dir": "data/some-corpus"}))
    (folder.parent / "broken.manifest.json").write_text("{")
    assert progress._prepared_val_tokens(cfg) == 999 and not progress.eval_split_guessed(cfg)


def test_the_estimate_shows_what_committed_runs_measured(tmp_path):
    runs = cfgs("main")[:3]
    for cfg, wall, same in ((runs[0], 100.0, True), (runs[1], 300.0, True), (runs[2], 9999.0, False)):
        h = config_hash(cfg.validate()) if same else "another-protocol"
        (tmp_path / f"{cfg.name()}.json").write_text(json.dumps({"train_wall_s": wall, "provenance": {"config_hash": h}}))
    assert sweep._measured_text(runs, tmp_path) == "measured 2 of 3 runs: 3:20 per run (median train_wall_s)"
    assert sweep._measured_text(runs, tmp_path / "none") == ""


def test_a_warning_inside_a_run_names_the_run_and_its_step(capfd, monkeypatch):
    # thin_svd's float64 retry (SPEL's retraction) warns from the numerical core, which does not know its run
    import torch
    from mapl.core.optim import thin_svd
    real = torch.linalg.svd

    def fails_in_float32(A, full_matrices=True):
        if A.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        return real(A, full_matrices=full_matrices)

    monkeypatch.setattr(torch.linalg, "svd", fails_in_float32)
    progress = StepProgress("tiny-P4-mapl-4x-3000steps-s4", every_s=3600)
    progress(2145, 3000, 3.1)
    with named_warnings("tiny-P4-mapl-4x-3000steps-s4", progress):
        thin_svd(torch.randn(16, 4))
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        "warning: tiny-P4-mapl-4x-3000steps-s4 step 2145: RuntimeWarning: thin_svd: float32 LAPACK SVD of a (16, 4) "
        "matrix did not converge; retried in float64 (mapl.core.optim.thin_svd) (")
    with named_warnings("r"):                                            # no progress: no step
        warnings.warn("w", UserWarning, stacklevel=1)
    assert capfd.readouterr().err.startswith("warning: r: UserWarning: w (test_sweep.py:")
    with pytest.warns(UserWarning):                                      # outside: the default handling again
        warnings.warn("after", UserWarning, stacklevel=1)


def test_progress_lines(capfd):
    p = StepProgress("tiny-P4-ssn-8x-s0", every_s=0.0)
    p(1, 300, 5.0)
    time.sleep(0.01)
    p(2, 300, 4.5123)
    assert capfd.readouterr().err.splitlines()[-1].startswith("tiny-P4-ssn-8x-s0 step 2/300 loss 4.512 ETA ")
    quiet = StepProgress("r", every_s=3600)
    quiet(1, 10, 1.0)
    quiet(5, 10, 1.0)
    quiet(10, 10, 1.0)                                                   # the last step always prints
    assert capfd.readouterr().err.splitlines() == ["r step 10/10 loss 1.000 ETA 0:00"]


def test_a_stop_signal_in_the_pool_stops_it_instead_of_starting_the_next_run(monkeypatch, tmp_path):
    """A run's Interrupted is reported by its worker, nothing new starts, and the pool raises Interrupted naming the
    run (the CLI exits 130 with one line)."""
    import mapl.core.run
    from mapl.core.loop import Interrupted

    def stopped(*args, **kwargs):
        raise Interrupted("stopped after step 7: checkpoint written; rerun the same command to resume")
    monkeypatch.setattr(mapl.core.run, "run", stopped)
    cfg = G.spec_config("micro", {"method": "none"}, PARAMS)
    st = sweep._pool_worker((cfg, tmp_path / "r.json", tmp_path / "r.pt", 0))
    assert st == {"run": cfg.name(), "interrupted": "stopped after step 7: checkpoint written; rerun the same "
                                                    "command to resume"}
