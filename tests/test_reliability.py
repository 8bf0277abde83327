"""Round 3 of the reliability work (issue 24), the in-process checks behind rows of tests/test_faults.py:
ranks that agree on what they train, validation loss independent of how it is batched, the report's
refusal of broken results, the results-file guard, params.yaml checked before DVC, workspace folders."""
from __future__ import annotations

import pytest

from mapl.runtime import same_run


# ---- ranks started for the same run (mapl.runtime.same_run) -----------------------------------------------
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
    return engine.evaluate(0)


def test_validation_loss_does_not_depend_on_the_eval_batch_size(micro_cfg):
    """32 windows in batches of 4 (even), 5 and 7 (a smaller last batch): the same weights give the same
    loss to float tolerance (was 5.0867 / 5.0777 / 5.0714 for the same weights: a mean of batch means)."""
    import torch

    from mapl.engine import LocalEngine
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

    from mapl.engine import LocalEngine, batch_weight
    cfg = micro_cfg()
    engine = LocalEngine.build(cfg)
    batches = engine.data.val_batches
    assert [batch_weight(y, batches) for _, y in batches] == [1.0] * len(batches)
    with torch.no_grad():
        engine.sm.eval()
        total = torch.zeros((), dtype=torch.float64)
        for x, y in batches:
            total += engine.sm(x, y)
    assert engine.evaluate(0) == float(total) / len(batches)


@pytest.mark.slow
def test_pipeline_validation_loss_is_the_same_for_every_eval_batch_size_and_replica_count(tmp_path, tiny_corpus):
    """The multi-process runtime weighs each replica's batches by their tokens too: R = 2 with batches of 5
    (3 + 4 batches, one of 2 windows) gives R = 2 with batches of 4's losses to float tolerance."""
    import json

    from mapl.runtime.launch import launch
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
