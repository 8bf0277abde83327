"""Training runs end to end: determinism, resume, bytes as declared, clear errors."""
import json
import os
import signal

import pytest
import torch

from mapl.train import main, run


def _losses(res):
    return [l for _, l in res["train_loss_curve"]]


@pytest.mark.parametrize("method,ratio", [("none", 1), ("int8", 1), ("ssn", 4), ("mapl", 4), ("mapl-rvq", 4)])
def test_measured_bytes_equal_declared(micro_cfg, method, ratio, tmp_path):
    res = run(micro_cfg(method, ratio), out=tmp_path / "r.json", progress=False, log=lambda *a: None)
    w = res["wire"]
    assert w["measured"] == w["declared"]
    assert w["measured_bytes_total"] == w["declared_bytes_total"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["val_loss"] == res["val_loss"]
    if method in ("ssn", "mapl"):
        assert res["ratio"] == ratio
    if method == "mapl-rvq":
        assert res["ratio"] == 2 * ratio          # RVQ halves the projection's bytes
        assert w["id_bytes_per_token"] == 2


def test_same_seed_same_losses(micro_cfg):
    a = run(micro_cfg("mapl", 4), progress=False, log=lambda *a: None)
    b = run(micro_cfg("mapl", 4), progress=False, log=lambda *a: None)
    assert _losses(a) == _losses(b)


@pytest.mark.parametrize("method,ratio", [("none", 1), ("mapl", 4), ("mapl-rvq", 4)])
def test_sigint_checkpoints_and_resume_equals_uninterrupted(micro_cfg, tmp_path, monkeypatch, method, ratio):
    cfg = micro_cfg(method, ratio)
    full = run(cfg, progress=False, log=lambda *a: None)
    ck = tmp_path / "ck.pt"
    import mapl.train as T
    real_get_batch = T.mdata.get_batch
    fired = []

    def get_batch(tokens, B, T_, seed, step):
        if step == 7 and not fired:            # a real SIGINT in the middle of a step
            fired.append(step)
            os.kill(os.getpid(), signal.SIGINT)
        return real_get_batch(tokens, B, T_, seed, step)
    monkeypatch.setattr(T.mdata, "get_batch", get_batch)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, ckpt=ck, progress=False, log=lambda *a: None)
    assert ck.exists()
    assert torch.load(ck, weights_only=True)["state"]["step"] == 8     # the step in flight completed
    logs = []
    resumed = run(cfg, ckpt=ck, progress=False, log=logs.append)
    assert any("resumed" in m and "step 8" in m for m in logs)
    assert len(_losses(resumed)) == len(_losses(full))
    for x, y in zip(_losses(resumed), _losses(full)):
        assert abs(x - y) <= 1e-6 * abs(y)
    assert resumed["val_loss"] == pytest.approx(full["val_loss"], rel=1e-6)
    assert resumed["wire"]["measured"] == full["wire"]["measured"]


def test_cli_bad_method_exits_nonzero_with_allowed_values(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--profile", "micro", "--method", "zip"])
    assert e.value.code != 0
    assert "invalid choice" in capsys.readouterr().err


def test_cli_bad_ratio_names_the_field(capsys, tiny_corpus, tmp_path):
    code = main(["--profile", "micro", "--method", "mapl", "--ratio", "3", "--set", f"data_dir={tiny_corpus}",
                 "--set", "data.source=text", "--set", f"data.paths=[\"{tiny_corpus.parent}/doc*.txt\"]",
                 "--set", "data.tokenizer=byte", "--out", str(tmp_path / "x.json"), "--ckpt", str(tmp_path / "x.pt")])
    assert code == 2
    assert "ratio" in capsys.readouterr().err


def test_checkpoint_from_another_config_is_refused(micro_cfg, tmp_path):
    ck = tmp_path / "ck.pt"
    run(micro_cfg("none"), ckpt=ck, progress=False, log=lambda *a: None)
    with pytest.raises(ValueError, match="another config"):
        run(micro_cfg("mapl", 4), ckpt=ck, progress=False, log=lambda *a: None)


def test_truncated_checkpoint_is_refused(micro_cfg, tmp_path):
    ck = tmp_path / "ck.pt"
    ck.write_bytes(b"PK\x03\x04 not really a checkpoint")
    with pytest.raises(ValueError, match="cannot be loaded safely"):
        run(micro_cfg("none"), ckpt=ck, progress=False, log=lambda *a: None)


def test_default_recipe_learns_far_below_the_unigram_entropy(micro_cfg, tiny_corpus):
    res = run(micro_cfg("none", **{"train.steps": 40}), progress=False, log=lambda *a: None)
    assert res["unigram_entropy"] > 2.5
    assert res["val_loss"] < res["unigram_entropy"] - 1.0


def test_nan_in_a_boundary_names_the_step_and_stage(micro_cfg, monkeypatch, tmp_path):
    cfg = micro_cfg("mapl", 4, **{"stages": 4})
    import mapl.compress.projection as P
    real = P.ProjectionCompressor.encode
    calls = []

    def encode(self, x):
        z = real(self, x)
        calls.append(1)
        if len(calls) > 12 and self is stage1[0]:
            z = z * float("nan")
        return z
    stage1 = []
    import mapl.stages as S
    real_build = S.build_staged_model

    def build(cfg_, vocab):
        sm = real_build(cfg_, vocab)
        stage1.append(sm.boundaries["1"])
        return sm
    monkeypatch.setattr(P.ProjectionCompressor, "encode", encode)
    import mapl.train as T
    monkeypatch.setattr(T, "build_staged_model", build)
    with pytest.raises(FloatingPointError, match=r"step \d+.*stage 1 output \(boundary 1"):
        run(cfg, ckpt=tmp_path / "c.pt", progress=False, log=lambda *a: None)


def test_nan_in_the_projector_names_the_boundary(micro_cfg, monkeypatch):
    import mapl.optim as O
    real_step = O.SPEL.step
    n = []

    def step(self, closure=None):
        out = real_step(self, closure)
        n.append(1)
        if len(n) == 3:
            for g in self.param_groups:
                g["params"][0].data[0, 0] = float("inf")
        return out
    monkeypatch.setattr(O.SPEL, "step", step)
    with pytest.raises(FloatingPointError, match=r"projector A of boundary 0 .* step 2"):
        run(micro_cfg("mapl", 4), progress=False, log=lambda *a: None)
