"""Training runs end to end: determinism, resume, bytes as declared, clear errors."""
import json
import math
import os
import signal

import pytest
import torch

from mapl.core.run import run
from mapl.cli.train import main


def _losses(res):
    return [loss for _, loss in res["train_loss_curve"]]


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
    import mapl.data as D
    real_batch = D.Dataset.batch
    fired = []

    def batch(self, step, *a, **k):
        if step == 7 and not fired:            # a real SIGINT in the middle of a step
            fired.append(step)
            os.kill(os.getpid(), signal.SIGINT)
        return real_batch(self, step, *a, **k)
    monkeypatch.setattr(D.Dataset, "batch", batch)
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
    import mapl.core.compress.projection as P
    real = P.ProjectionCompressor.encode
    calls = []

    def encode(self, x):
        z = real(self, x)
        calls.append(1)
        if len(calls) > 12 and self is stage1[0]:
            z = z * float("nan")
        return z
    stage1 = []
    import mapl.core.stages as S
    real_build = S.build_staged_model

    def build(cfg_, vocab):
        sm = real_build(cfg_, vocab)
        stage1.append(sm.boundaries["1"])
        return sm
    monkeypatch.setattr(P.ProjectionCompressor, "encode", encode)
    import mapl.core.engine as E
    monkeypatch.setattr(E, "build_staged_model", build)
    with pytest.raises(FloatingPointError, match=r"step \d+.*stage 1 output \(boundary 1"):
        run(cfg, ckpt=tmp_path / "c.pt", progress=False, log=lambda *a: None)


def test_nan_in_the_projector_names_the_boundary(micro_cfg, monkeypatch):
    import mapl.core.optim as O
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


# ---- reliability: finite checkpoints, resume with changed settings, output paths ----------------
def test_nonfinite_weights_never_overwrite_the_last_good_checkpoint_and_resume_with_changes(micro_cfg, tmp_path,
                                                                                          monkeypatch):
    """An optimizer step that leaves inf in the embeddings (as a huge LR does): the checkpoint keeps the
    last finite step, the message names the tensor, stage and step, and changed settings resume only
    with the flag, recorded in the results."""
    from mapl.core.checkpoint import CheckpointError
    from mapl.core.loop import NonFiniteError
    ck = tmp_path / "c.pt"
    run(micro_cfg("mapl", 4, **{"train.steps": 4}), ckpt=ck, progress=False, log=lambda *a: None)
    longer = micro_cfg("mapl", 4, **{"train.steps": 8, "train.checkpoint_every": 1})
    with pytest.raises(CheckpointError, match=r"train\.steps 4 -> 8.*--resume-with-changes"):
        run(longer, ckpt=ck, progress=False, log=lambda *a: None)
    real_step, calls = torch.optim.AdamW.step, []

    def step(self, closure=None):
        out = real_step(self, closure)
        calls.append(1)
        if len(calls) == 2:             # the second step after the resume: step 5 (0-based), saved as "step 6"
            self.param_groups[0]["params"][0].data[0, 0] = float("inf")
        return out
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    with pytest.raises(NonFiniteError, match=r"model\.tok_embeddings\.weight \(stage 0\) after step 6.*keeps step 5"):
        run(longer, ckpt=ck, progress=False, log=lambda *a: None, resume_with_changes=True)
    monkeypatch.undo()
    saved = torch.load(ck, weights_only=True)
    assert saved["state"]["step"] == 5
    assert all(torch.isfinite(v).all() for v in saved["model"].values() if v.is_floating_point())
    logs = []
    res = run(longer, ckpt=ck, progress=False, log=logs.append)      # step 5 was written by this config
    assert res["steps"] == 8 and any("resumed" in m and "step 5" in m for m in logs)
    assert res["resumed_with_changes"] == [{"step": 4, "changes": {"train.steps": [4, 8]}}]
    assert res["config"]["train"]["steps"] == 8


def test_a_diverging_update_never_becomes_the_last_good_checkpoint(micro_cfg, tmp_path):
    """A x1e30 update leaves huge but *finite* weights whose next forward is NaN. With a
    checkpoint after every step, the checkpoint of those weights stays unconfirmed and is dropped, so
    the file on disk is byte for byte the last good one, and resuming it with a sane LR works."""
    from mapl.core.checkpoint import unconfirmed_path
    from mapl.core.loop import NonFiniteError
    ck = tmp_path / "c.pt"
    run(micro_cfg("mapl", 4, **{"train.steps": 2}), ckpt=ck, progress=False, log=lambda *a: None)
    good = ck.read_bytes()
    every_step = {"train.steps": 6, "train.checkpoint_every": 1}
    with pytest.raises(NonFiniteError, match=r"non-finite training loss nan at step 3.*last good checkpoint is kept"):
        run(micro_cfg("mapl", 4, **every_step, **{"train.lr_muon": 1e30}), ckpt=ck, progress=False,
            log=lambda *a: None, resume_with_changes=True)
    assert ck.read_bytes() == good and not unconfirmed_path(ck).exists()
    res = run(micro_cfg("mapl", 4, **every_step), ckpt=ck, progress=False, log=lambda *a: None,
              resume_with_changes=True)
    assert res["steps"] == 6 and math.isfinite(res["val_loss"])


def test_an_unconfirmed_checkpoint_left_by_a_kill_is_dropped_on_resume(micro_cfg, tmp_path):
    from mapl.core.checkpoint import unconfirmed_path
    cfg = micro_cfg("none", **{"train.steps": 4})
    ck = tmp_path / "c.pt"
    run(micro_cfg("none", **{"train.steps": 4, "train.checkpoint_every": 2}), ckpt=ck, progress=False,
        log=lambda *a: None)
    stale = unconfirmed_path(ck)
    stale.write_bytes(b"written by a run killed before its next step")
    logs = []
    res = run(cfg, ckpt=ck, progress=False, log=logs.append)
    assert res["steps"] == 4 and not stale.exists()
    assert any(f"dropped the unconfirmed checkpoint {stale}" in m for m in logs)


def test_resume_refuses_changes_outside_the_resumable_fields(micro_cfg, tmp_path):
    from mapl.core.checkpoint import CheckpointError
    ck = tmp_path / "c.pt"
    run(micro_cfg("mapl", 4, **{"train.steps": 2}), ckpt=ck, progress=False, log=lambda *a: None)
    with pytest.raises(CheckpointError, match=r"another config \(compressor\.ratio 4\.0 -> 8\.0"):
        run(micro_cfg("mapl", 8, **{"train.steps": 2}), ckpt=ck, progress=False, log=lambda *a: None,
            resume_with_changes=True)


@pytest.mark.parametrize("step,message", [
    (1000, r"state\.step=1000 is beyond this run's train\.steps=2: it trained further than the run asks"),
    (-1, r"state\.step=-1 is invalid: must be an integer >= 0"),
    ("3", r"state\.step='3' is invalid: must be an integer >= 0")])
def test_a_checkpoint_step_outside_the_budget_is_refused(micro_cfg, tmp_path, step, message):
    # was: a step counter of 1,000 resumed a 2-step run, whose results then claimed 1,000 steps
    from mapl.core.checkpoint import CheckpointError
    cfg, ck, out = micro_cfg("none", **{"train.steps": 2}), tmp_path / "c.pt", tmp_path / "r.json"
    run(cfg, ckpt=ck, progress=False, log=lambda *a: None)
    saved = torch.load(ck, weights_only=True)
    saved["state"]["step"] = step
    torch.save(saved, ck)
    before = ck.read_bytes()
    with pytest.raises(CheckpointError, match=message) as e:
        run(cfg, ckpt=ck, out=out, progress=False, log=lambda *a: None)
    assert "\n" not in str(e.value) and ck.read_bytes() == before and not out.exists()


def test_checkpoint_with_missing_keys_is_one_line(micro_cfg, tmp_path):
    from mapl.core.checkpoint import CheckpointError
    ck = tmp_path / "c.pt"
    run(micro_cfg("none", **{"train.steps": 2}), ckpt=ck, progress=False, log=lambda *a: None)
    saved = torch.load(ck, weights_only=True)
    del saved["meter"], saved["state"]["train_curve"]
    torch.save(saved, ck)
    with pytest.raises(CheckpointError, match=r"lacks \['meter', 'state.train_curve'\]"):
        run(micro_cfg("none", **{"train.steps": 2}), ckpt=ck, progress=False, log=lambda *a: None)
    saved = torch.load(tmp_path / "c.pt", weights_only=True)


def test_a_checkpoint_holding_nan_is_refused_on_load_naming_the_file_and_tensor(micro_cfg, tmp_path):
    from mapl.core.checkpoint import CheckpointError
    ck = tmp_path / "c.pt"
    run(micro_cfg("none", **{"train.steps": 2}), ckpt=ck, progress=False, log=lambda *a: None)
    saved = torch.load(ck, weights_only=True)
    name = next(k for k, v in saved["model"].items() if v.is_floating_point())
    saved["model"][name].view(-1)[0] = float("nan")
    torch.save(saved, ck)
    with pytest.raises(CheckpointError, match=rf"checkpoint {ck} holds non-finite values in model\.{name}"):
        run(micro_cfg("none", **{"train.steps": 4}), ckpt=ck, progress=False, log=lambda *a: None)


def test_output_paths_are_checked_before_any_work(micro_cfg, tmp_path, monkeypatch):
    import mapl.data as D
    from mapl.base.io import OutputError
    monkeypatch.setattr(D, "prepare", lambda *a, **k: pytest.fail("data touched before the output paths were checked"))
    with pytest.raises(OutputError, match="--out .* is also the checkpoint path"):
        run(micro_cfg("none"), out=tmp_path / "x.pt", ckpt=tmp_path / "x.pt", progress=False, log=lambda *a: None)
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match=r"file/r\.json"):
        run(micro_cfg("none"), out=tmp_path / "file" / "r.json", progress=False, log=lambda *a: None)
    with pytest.raises(OutputError, match="is a directory"):
        run(micro_cfg("none"), out=tmp_path, progress=False, log=lambda *a: None)


def test_a_second_run_on_the_same_outputs_is_refused_with_the_holders_pid(micro_cfg, tmp_path):
    from mapl.base.io import OutputError, OutputLock
    with OutputLock(results=tmp_path / "r.json"):
        with pytest.raises(OutputError, match=r"in use by PID \d+"):
            run(micro_cfg("none"), out=tmp_path / "r.json", ckpt=tmp_path / "r.pt", progress=False,
                log=lambda *a: None)


def test_eval_offset_beyond_the_validation_tokens_names_the_field(micro_cfg):
    with pytest.raises(ValueError, match=r"train\.eval_offset=100000000 is invalid: the validation split has \d+"):
        run(micro_cfg("none", **{"train.eval_offset": 10 ** 8}), progress=False, log=lambda *a: None)


def test_results_report_total_bytes_per_token_per_boundary(micro_cfg):
    res = run(micro_cfg("mapl", 4, **{"stages": 4}), progress=False, log=lambda *a: None)
    w = res["wire"]
    expect = w["measured_bytes_total"] / res["tokens"] / (res["stages"] - 1)
    assert w["total_bytes_per_token_per_boundary"] == pytest.approx(expect)
    assert w["total_bytes_per_token_per_boundary"] > w["fwd_bytes_per_token"] + w["bwd_bytes_per_token"]
    assert res["config"]["compressor"]["method"] == "mapl" and res["resumed_with_changes"] == []


# ---- hot path: host syncs and device-correctness ------------------------------------------------
@pytest.mark.parametrize("method,ratio", [("none", 1), ("mapl", 4)])
def test_host_syncs_per_step_do_not_grow_with_micro_batches(micro_cfg, monkeypatch, method, ratio):
    """Reads of a tensor's value on the host (item, float, bool, tolist) in one training step are
    the same for 2 and 4 micro-batches: the loss is accumulated on the device."""
    from mapl.core.engine import LocalEngine
    counts = {}
    for M in (2, 4):
        engine = LocalEngine.build(micro_cfg(method, ratio, **{"train.micro_batches": M, "train.batch_size": 8}))
        engine.train_step(0, 1.0)                 # warm-up (k-means init, lazy state)
        n = [0]
        for name in ("item", "__float__", "__bool__", "tolist", "__int__"):
            real = getattr(torch.Tensor, name)

            def counted(self, *a, _real=real, **k):
                n[0] += 1
                return _real(self, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, counted)
        engine.train_step(1, 1.0)
        monkeypatch.undo()
        counts[M] = n[0]
    assert counts[2] == counts[4], counts


@pytest.mark.parametrize("method,ratio", [("none", 1), ("int8", 1), ("ssn", 4), ("mapl", 4), ("mapl-rvq", 4)])
def test_one_step_and_diagnostics_create_no_tensor_off_device(micro_cfg, method, ratio):
    """Under torch.set_default_device("meta"), any tensor made without an explicit device lands on
    meta and mixing it with the real CPU tensors fails: the step, evaluation and diagnostics must
    make every tensor on its input's device."""
    from mapl.core.diagnostics import boundary_diagnostics
    from mapl.core.engine import LocalEngine
    from mapl.core.loop import LoopState
    engine = LocalEngine.build(micro_cfg(method, ratio))
    engine.train_step(0, 1.0)           # lazy initialisation (e.g. RVQ k-means) happens outside meta
    torch.set_default_device("meta")
    try:
        out = engine.train_step(1, 1.0)
        val = engine.evaluate(2).val
        diag = boundary_diagnostics(engine.sm, engine.data.val_batches[:1])
        res = engine.results(LoopState(step=2, val_curve=[[2, val]]), 1.0)
    finally:
        torch.set_default_device(None)
    assert out.loss > 0 and val > 0 and len(diag) == 1 and res["val_loss"] == val
