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
