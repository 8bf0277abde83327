"""mapl.orchestration.frozen_trunk on micro: a trained uncompressed trunk, boundaries inserted, only A_p and the
anchors train, for SPEL, the fixed projector and the unconstrained one; a study writes its folder whole."""
import copy
import json

import pytest
import torch

from mapl.core.config import ConfigError, load_params
from mapl.orchestration import frozen_trunk as ft
from mapl.orchestration import groups, sweep
from mapl.report.studies.frozen import load_frozen


def _params(tiny_corpus, **study):
    data = {"data.source": "text", "data.paths": [str(tiny_corpus.parent / "doc*.txt")], "data.tokenizer": "byte",
            "data_dir": str(tiny_corpus)}
    params = copy.deepcopy(load_params())
    params["frozen_trunk"]["micro"] = {
        "seeds": [0], "trunk": {"method": "none", "train.steps": 8, **data},
        "boundaries": {"method": "mapl", "ratio": 4, "train.steps": 4, "train.warmup_steps": 1, "train.eval_every": 2, **data},
        **study}
    return params


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """Checkpoints and the study's folder under tmp_path, not in this checkout."""
    monkeypatch.setattr(sweep, "PROJECT_ROOT", tmp_path)
    for module in (sweep, groups):        # the sweep and the groups it reads: neither may read params.yaml itself
        monkeypatch.setattr(module, "load_params", lambda: pytest.fail("the study passes its params"))
    return tmp_path


@pytest.mark.process          # the study's spawn pool
def test_frozen_trunk_trains_only_the_boundaries_and_anchors(tiny_corpus, sandbox, monkeypatch):
    params = _params(tiny_corpus)
    monkeypatch.setattr(sweep, "load_params", lambda: params)
    logs = []
    status = ft.run_study("micro", params, root=sandbox, log=logs.append)
    assert len(status) == 3 and not any("error" in s for s in status)
    rows = load_frozen(sandbox, "micro")
    assert [r["projector"] for r in rows] == ["spel", "fixed", "unconstrained"]
    trunk = json.loads(next((sandbox / "reports/micro/frozen-trunk/trunks").glob("*.json")).read_text())
    assert (sandbox / "checkpoints/micro" / f"{trunk['run']}.pt").exists()
    # micro: V = 257, d = 64, P = 2, r = 16: one A_p (64 x 16) and two anchors (257 x 16)
    anchors, a_p = 2 * 257 * 16, 64 * 16
    assert {r["projector"]: r["trainable_params"] for r in rows} == {"spel": anchors + a_p, "fixed": anchors,
                                                                     "unconstrained": anchors + a_p}
    for r in rows:
        assert r["trunk"]["val_loss"] == trunk["val_loss"] and r["trunk"]["run"] == trunk["run"]
        assert len(r["train_loss_curve"]) == 4 and r["val_loss_curve"][-1][0] == 4 and len(r["select_loss_curve"]) == 2
        assert r["delta_pct"] == pytest.approx(100 * (r["val_loss"] - trunk["val_loss"]) / trunk["val_loss"])
        assert torch.isfinite(torch.tensor([r["val_before"], r["val_loss"]])).all()
    # a second study (its trunk restored from the checkpoint) gives the same numbers
    ft.run_study("micro", params, root=sandbox, log=logs.append)
    assert [r["val_loss"] for r in load_frozen(sandbox, "micro")] == [r["val_loss"] for r in rows]
    assert "frozen trunk: 3 boundary run(s), 3 to train" in logs


@pytest.mark.parametrize("study, match", [
    ({"projectors": ["learned"]}, r"frozen_trunk.micro.projectors = \['learned'\] is invalid: a non-empty list of"),
    ({"seeds": [-1]}, r"frozen_trunk.micro.seeds = \[-1\] is invalid: must be a list of integers >= 0"),
    ({"trunk": {"method": "ssn"}}, r"frozen_trunk.micro.trunk.method = 'ssn' is invalid: must be 'none'"),
    ({"boundaries": {"train.seed": 3}}, r"frozen_trunk.micro.boundaries.train.seed is invalid: the study sets it"),
    ({"boundaries": {"method": "mapl", "ratio": 4, "model.d_model": 32}},
     r"frozen_trunk.micro.boundaries: model, stages and data"),
    ({"boundaries": {"method": "mapl"}}, r"frozen_trunk.micro.boundaries \(.*\): compressor.ratio=1.0 is invalid"),
    ({"epochs": 3}, r"frozen_trunk.micro: \['epochs'\] is invalid: allowed keys"),
])
def test_a_bad_study_setting_is_one_line_naming_its_field(tiny_corpus, study, match):
    params = _params(tiny_corpus, **study)
    with pytest.raises(ConfigError, match=match):
        ft.settings("micro", params)


def test_every_profile_of_params_yaml_has_a_valid_study():
    params = load_params()
    assert set(params["frozen_trunk"]) == set(params["profiles"])        # dvc.yaml reads frozen_trunk.${profile}
    cpu = ft.settings("cpu", params)
    assert cpu.seeds == (0, 1, 2) and cpu.projectors == ft.STUDIED
    assert set(cpu.tune) == set(ft.STUDIED)                  # each projector gets its own step size
    assert ft.settings("paper", params).seeds == ()


@pytest.mark.process          # the study's spawn pool
def test_a_tuned_projector_runs_its_winner_on_every_seed(tiny_corpus, sandbox, monkeypatch):
    """tune.spel: the boundary spec and two step sizes on seed 0 (under tune/); the lowest selection loss wins
    (tuning.json), seed 0's final run is that candidate's file, seed 1 runs the winner; fixed is not tuned."""
    overs = [{"compressor.projector.lr_mult": 1.0}, {"compressor.projector.lr_mult": 3.0}]
    params = _params(tiny_corpus, seeds=[0, 1], projectors=["spel", "fixed"], tune={"spel": overs})
    monkeypatch.setattr(sweep, "load_params", lambda: params)
    logs = []
    ft.run_study("micro", params, root=sandbox, log=logs.append)
    study = sandbox / "reports/micro/frozen-trunk"
    assert "frozen trunk: 6 boundary run(s) (3 tuning candidates on seed 0), 5 to train first" in logs
    tuning = json.loads((study / "tuning.json").read_text())["spel"]
    cands = tuning["candidates"]
    assert [c["override"] for c in cands] == [{}, *overs] and tuning["seed"] == 0
    winner = min(cands, key=lambda c: c["select_loss"])
    assert tuning["chosen"] == winner["override"]
    assert sorted(p.name for p in (study / "tune").glob("*.json")) == sorted(f"{c['run']}.json" for c in cands)
    base = "frozen-micro-P2-mapl-4x-4steps"          # micro trains 20 steps: the budget is in the name
    assert [c["run"] for c in cands] == [f"{base}-s0", f"{base}-lr_mult1-s0", f"{base}-lr_mult3-s0"]
    finals = sorted(p.name for p in study.glob("frozen-*.json"))
    spel_s1 = winner["run"].removesuffix("-s0") + "-s1"
    assert finals == sorted([f"{winner['run']}.json", f"{spel_s1}.json", "frozen-micro-P2-mapl-4x-proj-fixed-4steps-s0.json",
                             "frozen-micro-P2-mapl-4x-proj-fixed-4steps-s1.json"])
    assert (study / f"{winner['run']}.json").read_bytes() == (study / "tune" / f"{winner['run']}.json").read_bytes()
    s1 = json.loads((study / f"{spel_s1}.json").read_text())
    assert s1["override"] == winner["override"] and s1["seed"] == 1
    assert [r["projector"] for r in load_frozen(sandbox, "micro")] == ["spel", "fixed", "spel", "fixed"]
    # without the tuning, the folder holds only the new study's runs
    plain = _params(tiny_corpus, seeds=[0, 1], projectors=["spel", "fixed"])
    monkeypatch.setattr(sweep, "load_params", lambda: plain)
    logs.clear()
    ft.run_study("micro", plain, root=sandbox, log=logs.append)
    names = {p.name for p in study.glob("frozen-*.json")}
    assert f"{base}-s0.json" in names and f"{base}-s1.json" in names and len(names) == 4
    assert not list((study / "tune").glob("*.json"))


def test_choose_takes_the_lowest_finite_selection_loss_and_the_spec_itself_on_a_tie():
    assert ft.choose([{"select_loss": 4.0}, {"select_loss": 3.5}, {"select_loss": 3.9}]) == 1
    assert ft.choose([{"select_loss": 3.5}, {"select_loss": 3.5}]) == 0
    assert ft.choose([None, {"select_loss": float("nan")}, {"select_loss": 5.0}, {"select_loss": None}]) == 2
    with pytest.raises(RuntimeError, match="no tuning candidate has a finite selection loss"):
        ft.choose([None, {"select_loss": None}])


@pytest.mark.parametrize("tune, match", [
    ({"learned": [{"compressor.projector.lr_mult": 1.0}]}, r"frozen_trunk.micro.tune: \['learned'\] is invalid"),
    ({"spel": []}, r"frozen_trunk.micro.tune.spel = \[\] is invalid: a non-empty list of non-empty mappings"),
    ({"spel": [{"train.seed": 1}]}, r"frozen_trunk.micro.tune.spel: train.seed is invalid in an override"),
    ({"spel": [{"compressor.projector.lr_mult": -1.0}]},
     r"frozen_trunk.micro.tune.spel\[0\] \(\{'compressor.projector.lr_mult': -1.0\}\): .*lr_mult"),
])
def test_a_bad_tuning_setting_is_one_line_naming_its_field(tiny_corpus, tune, match):
    with pytest.raises(ConfigError, match=match):
        ft.settings("micro", _params(tiny_corpus, tune=tune))
