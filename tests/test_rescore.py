"""mapl.orchestration.rescore: finished runs scored on a held-out text; a checkpoint must reproduce the committed
validation loss before it is scored; a missing checkpoint is one line, and --retrain-missing makes it again."""
import copy
import io
import json
import math
import tarfile

import numpy as np
import pytest
from dataclasses import replace

from mapl.data import take_windows

from mapl.base.io import read_json_object
from mapl.core.config import ConfigError, load_params
from mapl.orchestration import groups, rescore, sweep

VERSES = [("Genesis", 1, 1, "In the beginning God created the heaven and the earth."),
          ("Genesis", 1, 2, "And the earth was without form, and void."),
          ("Genesis", 2, 1, "Thus the heavens and the earth were finished."),
          ("Exodus", 1, 1, "Now these are the names of the children of Israel."),
          ("Exodus", 1, 2, "Reuben, Simeon, Levi, and Judah,"),
          ("Exodus", 2, 1, "And there went a man of the house of Levi.")]


@pytest.fixture
def kjv(tmp_path, monkeypatch):
    """A small stand-in for the pinned sdist: the same member, the same fields (tests never download)."""
    lines = "".join(json.dumps({"citation": f"{b} {c}:{v}", "text": t, "book": b, "chapter": c, "verse": v}) + "\n"
                    for b, c, v, t in VERSES * 1)
    body = (lines * 1).encode()
    path = tmp_path / rescore.HELDOUT_TARBALL
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(rescore.HELDOUT_MEMBER)
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    monkeypatch.setattr(rescore, "fetch_heldout", lambda cache_dir=None: path)
    return path


def test_heldout_documents_are_every_kth_chapter_one_verse_a_line(kjv):
    docs = rescore.heldout_documents(kjv, every=1)
    assert docs == ["In the beginning God created the heaven and the earth.\nAnd the earth was without form, and void.\n",
                    "Thus the heavens and the earth were finished.\n",
                    "Now these are the names of the children of Israel.\nReuben, Simeon, Levi, and Judah,\n",
                    "And there went a man of the house of Levi.\n"]
    assert rescore.heldout_documents(kjv, every=2) == [docs[0], docs[2]]
    with pytest.raises(ValueError, match="every=0 is invalid"):
        rescore.heldout_documents(kjv, every=0)


def test_the_pinned_text_is_the_one_declared():
    # the pin names one file: a new version or another member would be another held-out text
    assert rescore.HELDOUT_TARBALL == rescore.HELDOUT_SPEC.replace("==", "-") + ".tar.gz"
    assert rescore.HELDOUT_MEMBER.startswith(rescore.HELDOUT_TARBALL[:-len(".tar.gz")] + "/")
    assert len(rescore.HELDOUT_SHA256) == 64


def test_unread_windows_are_the_rest_of_the_first_epoch_and_none_was_read(micro_cfg):
    from mapl.core.engine import open_run_data
    from mapl.data import window_starts
    cfg = micro_cfg()
    cfg = replace(cfg, data=replace(cfg.data, sampling="epochs"), train=replace(cfg.train, steps=6))
    ds = open_run_data(cfg).dataset
    t = cfg.train
    unread = rescore.unread_windows(ds, cfg)
    n_windows = (len(ds.train) - 1) // t.seq_len
    assert len(unread) == min(n_windows - t.steps * t.batch_size, (len(ds.val) - 1) // t.seq_len)
    read = np.concatenate([window_starts(len(ds.train), t.batch_size, t.seq_len, t.seed, s, "epochs")
                           for s in range(t.steps)])
    starts = rescore.unread_starts(len(ds.train), len(ds.val), cfg)
    assert len(set(starts)) == len(starts) and not set(read) & set(starts) and unread.shape[1] == t.seq_len + 1
    assert (unread == take_windows(ds.train, starts, t.seq_len + 1)).all()
    # drawn uniformly, or a whole epoch read: no unread set
    assert rescore.unread_windows(ds, replace(cfg, data=replace(cfg.data, sampling="uniform"))) is None
    assert rescore.unread_windows(ds, replace(cfg, train=replace(t, steps=n_windows // t.batch_size + 1))) is None


def _params(tiny_corpus, seeds=(0,)):
    data = {"data.source": "text", "data.paths": [str(tiny_corpus.parent / "doc*.txt")], "data.tokenizer": "byte",
            "data_dir": str(tiny_corpus), "train.steps": 6, "train.eval_every": 3, "data.sampling": "epochs"}
    params = copy.deepcopy(load_params())
    params["groups"]["probe"] = {"study": "probe", "role": "reported"}
    params["profiles"]["micro"]["runs"] = {
        f"probe-{m}-s{s}": {"group": "probe", "method": m, **({"ratio": 4} if m != "none" else {}), "train.seed": s,
                            **data}
        for s in seeds for m in ("none", "mapl")}
    return params


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """Checkpoints, results and scores under tmp_path, not in this checkout."""
    monkeypatch.setattr(sweep, "PROJECT_ROOT", tmp_path)
    monkeypatch.setattr(groups, "PROJECT_ROOT", tmp_path)
    return tmp_path


@pytest.mark.process          # train_pool's spawn pool
def test_a_group_is_scored_once_and_only_from_the_committed_checkpoints(tiny_corpus, sandbox, kjv, monkeypatch):
    params = _params(tiny_corpus)
    monkeypatch.setattr(sweep, "load_params", lambda: params)
    monkeypatch.setattr(groups, "load_params", lambda: params)
    out = groups.results_dir("micro", "probe", sandbox)
    sweep.train_pool("micro", groups.group_specs("micro", "probe", params), out, params=params)
    logs = []
    scored = rescore.rescore_group("micro", "probe", params, root=sandbox, log=logs.append)
    runs = scored["runs"]
    assert len(runs) == 2 and len(logs) == 2
    for name, entry in runs.items():
        assert entry["val_loss"] == read_json_object(out / f"{name}.json")["val_loss"]
        assert set(entry["scores"]) == {"heldout-kjv", "unread-train"}
        assert all(math.isfinite(v) and v != entry["val_loss"] for v in entry["scores"].values())
    # nothing new: nothing scored again, the same file
    logs.clear()
    assert rescore.rescore_group("micro", "probe", params, root=sandbox, log=logs.append) == scored and not logs

    # a committed result the checkpoint does not reproduce is refused, naming the run
    name = next(iter(runs))
    res = read_json_object(out / f"{name}.json")
    (out / f"{name}.json").write_text(json.dumps({**res, "val_loss": res["val_loss"] + 1e-9}))
    with pytest.raises(rescore.RescoreError, match=f"{name}: its checkpoint gives validation loss .* the checkpoint is "
                                                   "not the committed run's"):
        rescore.rescore_group("micro", "probe", params, root=sandbox, log=logs.append)
    (out / f"{name}.json").write_text(json.dumps(res))

    # a missing checkpoint: one line naming the command; --retrain-missing makes it again, to the same numbers
    ckpt = sweep.checkpoint_path("micro", name)
    ckpt.unlink()
    (rescore.rescore_dir("micro", sandbox) / "probe.json").unlink()
    with pytest.raises(rescore.RescoreError, match="have no checkpoint here .* --retrain-missing"):
        rescore.rescore_group("micro", "probe", params, root=sandbox, log=logs.append)
    rescore.retrain_missing("micro", "probe", params, root=sandbox, log=logs.append)
    assert ckpt.exists()
    assert rescore.rescore_group("micro", "probe", params, root=sandbox, log=logs.append) == scored


def test_a_group_without_results_is_refused_in_one_line(tiny_corpus, sandbox, kjv):
    params = _params(tiny_corpus)
    with pytest.raises(rescore.RescoreError, match=r"group probe of profile micro: 2 run\(s\) have no results .*"
                                                   r"\(mapl sweep --group probe\)"):
        rescore.rescore_group("micro", "probe", params, root=sandbox)


def test_the_command_refuses_an_unknown_group_in_one_line(capsys):
    from mapl.cli import rescore as cli
    assert cli.main(["--profile", "micro", "--group", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--group 'nope' is invalid: profile micro has groups" in err[0]


def test_a_held_out_text_is_cut_and_batched_as_the_validation_split_is(micro_cfg):
    from mapl.core.engine import open_run_data
    cfg = micro_cfg()
    ds = open_run_data(cfg).dataset
    t = cfg.train
    ours = rescore._batches(rescore.cut_windows(ds.val, t.seq_len), t.eval_batch_size)
    theirs = ds.eval_batches(t.eval_batch_size, t.seq_len, 0)
    assert len(ours) == len(theirs) and all((a == c).all() and (b == d).all() for (a, b), (c, d) in zip(ours, theirs))
    with pytest.raises(rescore.RescoreError, match="has no window of seq_len 32"):
        rescore.cut_windows(np.arange(10), 32)


@pytest.mark.parametrize("section, match", [
    (["long"], r"rescore = \['long'\] is invalid: a mapping of profile -> list of its run groups"),
    ({"nope": []}, r"rescore.nope is invalid: not a profile"),
    ({"micro": ["nope"]}, r"rescore.micro = \['nope'\] is invalid: a list of distinct groups of profile micro"),
    ({"micro": ["long", "long"]}, r"rescore.micro = \['long', 'long'\] is invalid"),
])
def test_a_bad_rescore_section_is_one_line_naming_its_key(section, match):
    from mapl.orchestration.validate import check_params
    params = copy.deepcopy(load_params())
    params["rescore"] = section
    with pytest.raises(ConfigError, match=match):
        check_params(params)


def test_params_yaml_lists_groups_to_rescore_on_micro_for_the_smoke():
    params = load_params()
    assert rescore.declared_groups("micro", params) == ["long", "ladder", "long_redraw"]
    assert rescore.declared_groups("paper", params) == []
