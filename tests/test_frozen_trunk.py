"""benchmarks/frozen_trunk.py on micro: a trained uncompressed trunk, boundaries inserted, only A_p and the
anchors train (issue 26), for SPEL, the fixed projector and the unconstrained one."""
import json

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("frozen_trunk")


def _base(tiny_corpus):
    return {"data.source": "text", "data.paths": [str(tiny_corpus.parent / "doc*.txt")], "data.tokenizer": "byte",
            "data_dir": str(tiny_corpus)}


def test_frozen_trunk_trains_only_the_boundaries_and_anchors(bench, tiny_corpus, tmp_path):
    res = bench.study("micro", seeds=(0,), trunk_steps=8, steps=4, ratio=4, base=_base(tiny_corpus),
                      ckpt_dir=tmp_path, log=lambda *a: None)
    row = res["seeds"]["0"]
    assert (tmp_path / "frozen-trunk" / f"{row['trunk']['run']}.pt").exists()
    ref = row["trunk"]["val_loss"]
    assert set(row["projectors"]) == {"spel", "fixed", "unconstrained"}
    # micro: V = 257, d = 64, P = 2, r = 16: one A_p (64 x 16) and two anchors (257 x 16)
    anchors, a_p = 2 * 257 * 16, 64 * 16
    counts = {p: r["trainable_params"] for p, r in row["projectors"].items()}
    assert counts == {"spel": anchors + a_p, "fixed": anchors, "unconstrained": anchors + a_p}
    for r in row["projectors"].values():
        assert len(r["train_loss_curve"]) == 4 and r["val_loss_curve"][-1][0] == 4
        assert r["delta_pct"] == pytest.approx(100 * (r["val_loss"] - ref) / ref)
        assert torch.isfinite(torch.tensor([r["val_before"], r["val_loss"]])).all()
    # a second study reads the trunk it trained instead of training it again
    again = bench.study("micro", seeds=(0,), trunk_steps=8, steps=4, ratio=4, projectors=("fixed",),
                        base=_base(tiny_corpus), ckpt_dir=tmp_path, log=lambda *a: None)
    assert again["seeds"]["0"]["trunk"]["val_loss"] == ref
    assert again["seeds"]["0"]["projectors"]["fixed"]["val_loss"] == row["projectors"]["fixed"]["val_loss"]
    json.dumps(res)


def test_bad_projector_is_one_line(bench, tiny_corpus, tmp_path):
    with pytest.raises(ValueError, match=r"--projectors \['learned'\] is invalid: allowed"):
        bench.study("micro", projectors=("learned",), base=_base(tiny_corpus), ckpt_dir=tmp_path)
