"""`mapl reuse refresh`: after a proven-equivalent change of the training code, a train stage whose
runs are all current is re-executed and `dvc commit`ted instead of `dvc repro`, which would delete its results
and retrain them."""
import json
import shutil

import pytest
import yaml

from mapl.core.config import PROJECT_ROOT, config_hash, load_params
from mapl.orchestration import refresh as R
from mapl.orchestration import reuse
from mapl.orchestration.sweep import group_specs, spec_config

GROUP = "main"


def _root(tmp_path, profile="micro"):
    params = load_params()
    params["profile"] = profile
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copy(PROJECT_ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    return params


def _write_results(tmp_path, params, specs, fingerprint="f00d"):
    out = tmp_path / "reports" / "micro" / "results" / GROUP
    out.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        cfg = spec_config("micro", spec, params).validate()
        (out / f"{cfg.name()}.json").write_text(json.dumps(
            {"steps": cfg.train.steps, "provenance": {"config_hash": config_hash(cfg), "code_fingerprint": fingerprint}}))


def test_refresh_runs_the_stage_then_commits_it_and_refuses_a_group_not_current_before_running_anything(
        tmp_path, monkeypatch):
    monkeypatch.setattr(R, "code_fingerprint", lambda root: "f00d")
    params = _root(tmp_path)
    specs = group_specs("micro", GROUP, params)
    assert len(specs) >= 2
    calls = []
    _write_results(tmp_path, params, specs[:-1])
    with pytest.raises(ValueError, match=rf"group {GROUP}: 1 run\(s\) not current under training code f00d.*nothing was run"):
        R.refresh("micro", [GROUP], root=tmp_path, run=calls.append, log=lambda m: None)
    assert calls == []
    _write_results(tmp_path, params, specs[-1:], fingerprint="another")      # other code, no proof: not current
    with pytest.raises(ValueError, match="not current"):
        R.refresh("micro", [GROUP], root=tmp_path, run=calls.append, log=lambda m: None)
    _write_results(tmp_path, params, specs[-1:])
    assert R.refresh("micro", [], root=tmp_path, run=calls.append, log=lambda m: None) == [GROUP]
    assert calls == [R.stage_command(GROUP, "micro", tmp_path), f"dvc commit -f train@{GROUP}"]
    assert calls[0] == (f"mkdir -p reports/micro/notebooks && papermill notebooks/train.ipynb "
                        f"reports/micro/notebooks/train-{GROUP}.ipynb -p profile micro -p group {GROUP} --no-progress-bar")


def test_refresh_refuses_another_profile_and_an_unknown_group(tmp_path, capsys):
    _root(tmp_path, profile="cpu")
    with pytest.raises(ValueError, match="dvc.yaml's stages run params.yaml's profile 'cpu'"):
        R.refresh("micro", [], root=tmp_path, run=lambda c: None)
    with pytest.raises(ValueError, match="group\\(s\\) nosuch not in profile cpu: allowed first, main"):
        R.refresh("cpu", ["nosuch"], root=tmp_path, run=lambda c: None)
    with pytest.raises(ValueError, match="group 'nosuch' has no train stage in dvc.yaml"):
        R.stage_command("nosuch", "cpu", tmp_path)
    assert reuse.main(["refresh", "paper"]) == 2                     # the checkout's params.yaml runs cpu
    err = capsys.readouterr().err
    assert err.startswith("error: profile 'paper'") and err.count("\n") == 1 and "Traceback" not in err


def test_the_frozen_trunk_stage_is_refreshed_only_with_current_runs_and_every_trunk_here(tmp_path, monkeypatch):
    from mapl.orchestration import frozen_trunk
    assert R._frozen_stamp(PROJECT_ROOT) == frozen_trunk.study_fingerprint()     # one stamp, computed in two places
    monkeypatch.setattr(R, "code_fingerprint", lambda root: "f00d")
    _root(tmp_path)
    folder = tmp_path / "reports" / "micro" / "frozen-trunk"
    (tmp_path / "mapl" / "orchestration").mkdir(parents=True)
    (tmp_path / "mapl" / "orchestration" / "frozen_trunk.py").write_text("# the study\n")
    stamp = R._frozen_stamp(tmp_path)
    calls = []
    with pytest.raises(ValueError, match="frozen_trunk: no boundary run in reports/micro/frozen-trunk"):
        R.refresh("micro", ["frozen_trunk"], root=tmp_path, run=calls.append, log=lambda m: None)
    folder.mkdir(parents=True)
    (folder / "frozen-a-s0.json").write_text(json.dumps({"provenance": {"code_fingerprint": stamp},
                                                         "trunk": {"run": "trunk-s0"}}))
    with pytest.raises(ValueError, match=r"the checkpoint of trunk trunk-s0 is not here.*nothing was run"):
        R.refresh("micro", ["frozen_trunk"], root=tmp_path, run=calls.append, log=lambda m: None)
    (tmp_path / "checkpoints" / "micro").mkdir(parents=True)
    (tmp_path / "checkpoints" / "micro" / "trunk-s0.pt").write_bytes(b"")
    (folder / "frozen-b-s0.json").write_text(json.dumps({"provenance": {"code_fingerprint": "f00d+other"},
                                                         "trunk": {"run": "trunk-s0"}}))
    with pytest.raises(ValueError, match=r"frozen-b-s0.json was trained by code not proven equivalent"):
        R.refresh("micro", ["frozen_trunk"], root=tmp_path, run=calls.append, log=lambda m: None)
    assert calls == []
    (folder / "frozen-b-s0.json").unlink()
    assert R.refresh("micro", ["frozen_trunk"], root=tmp_path, run=calls.append, log=lambda m: None) == ["frozen_trunk"]
    assert calls == ["mkdir -p reports/micro/notebooks && papermill notebooks/frozen_trunk.ipynb "
                     "reports/micro/notebooks/frozen_trunk.ipynb -p profile micro --no-progress-bar",
                     "dvc commit -f frozen_trunk"]
