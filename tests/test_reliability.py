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
