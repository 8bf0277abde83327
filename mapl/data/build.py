"""``prepare``, the only code that creates a prepared folder (shards, ``tokenizer.json``, ``manifest.json``). A
folder with a manifest is never rebuilt or deleted implicitly; files are written in ``<out>/.partial/`` and moved
into place, the manifest last and atomically; two processes preparing one folder take turns (a lock).

With ``val_tokens > 0`` the preparation is streamed and resumable: the first documents worth ``val_tokens`` go to val,
the rest to train until ``max_train_tokens``; ``progress.json``, replaced after each fsynced chunk, is the commit point
a restart resumes from, byte for byte as an uninterrupted run (docs/data.md).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np

from .batches import unigram_entropy
from .config import DataConfig, DataError, effective_token_config, token_config
from .dataset import FORMAT_VERSION, MANIFEST, TOKENIZER_FILE, default_data_dir, verified_manifest
from .sources import (DocChain, code_inventory, describe_source, doc_hash, iter_records, load_documents, sha256_file,
                      split_documents)
from .tokenizers import build_tokenizer, encode_stream, eot_id, tokenizer_origin
from ..base.io import atomic_write_bytes, atomic_write_json, waiting_lock

__all__ = ["prepare", "write_streamed", "ShardWriter", "dtype_for", "Progress", "WORK_DIR", "PROGRESS"]

log = logging.getLogger("mapl.data")

WORK_DIR = ".partial"
PROGRESS = "progress.json"
CHUNK_SECONDS = 30.0        # a streamed chunk also ends after this long, so a slow source loses at most this much
_MAX_NAMES = 1000          # list document names in the manifest for small corpora only (works, files)


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


class ShardWriter:
    """Appends whole documents to one shard file, hashing as it goes. ``resume`` (a :meth:`sync` state) continues
    a file: the bytes it vouches for are kept and re-hashed, anything after them (an interrupted chunk) cut off."""

    def __init__(self, path: Path, dtype: np.dtype, resume: dict | None = None):
        self.path, self.dtype = Path(path), np.dtype(dtype)
        self.h = hashlib.sha256()
        self.tokens = self.docs = 0
        self.names: list[str] = []
        if resume:
            self.f = open(self.path, "r+b")
            self.f.truncate(resume["tokens"] * self.dtype.itemsize)      # its length was checked (stream._resumable)
            self.h = hashlib.file_digest(self.f, "sha256")          # reads to the end: writes append
            self.tokens, self.docs, self.names = resume["tokens"], resume["documents"], list(resume["names"])
        else:
            self.f = open(self.path, "wb")

    def write(self, name: str, ids: np.ndarray, cap: int = 0) -> bool:
        """Append one document; with ``cap`` > 0 the one that reaches it is cut so the shard holds exactly ``cap``
        tokens. True when the cap is reached."""
        full = cap > 0 and self.tokens + len(ids) >= cap
        if full:
            ids = ids[: cap - self.tokens]
        b = np.ascontiguousarray(ids, dtype=self.dtype).tobytes()
        self.f.write(b)
        self.h.update(b)
        self.tokens += len(ids)
        self.docs += 1
        if len(self.names) <= _MAX_NAMES:
            self.names.append(name)
        return full

    def sync(self) -> dict:
        """Flush to disk; the returned state resumes exactly here."""
        self.f.flush()
        os.fsync(self.f.fileno())
        return {"tokens": self.tokens, "documents": self.docs, "names": list(self.names)}

    def finish(self) -> dict:
        """Close the file; its manifest entry (the file stays where it is)."""
        self.sync()
        self.f.close()
        if self.tokens == 0:
            raise DataError(f"{self.path.name} would be empty: the source has too little text for this split")
        return {"file": self.path.name, "sha256": self.h.hexdigest(), "tokens": self.tokens,
                "documents": self.docs, "works": self.names if len(self.names) <= _MAX_NAMES else None}

    def close(self) -> None:
        self.f.close()


def prepare(cfg: DataConfig, out_dir: str | os.PathLike | None = None, cache_dir: Path | None = None, *,
            rebuild: bool = False, profile: str | None = None, full_verify: bool = False,
            progress_every_s: float = 10.0, chunk_tokens: int = 1 << 24) -> dict:
    """Tokenize ``cfg``'s corpus into ``out_dir`` (default ``data/<dataset_dir_name>``); returns the manifest.
    ``full_verify`` re-hashes an existing folder instead of trusting this host's stamps; ``profile`` makes the
    commands in error messages exact."""
    cfg.validate()
    out = Path(out_dir) if out_dir else default_data_dir(cfg)
    if not rebuild and (out / MANIFEST).exists():
        return _existing(out, cfg, profile, full_verify)
    created = [p for p in (out, *out.parents) if not p.exists()]      # deepest first
    try:
        with waiting_lock(out / ".prepare", f"preparing {out}"):
            if not rebuild and (out / MANIFEST).exists():        # finished by another process while we waited
                return _existing(out, cfg, profile, full_verify)
            return _build(cfg, out, cache_dir, progress_every_s, chunk_tokens)
    except BaseException:
        for folder in created:     # a failed first build leaves no empty folder (a resumable work folder stays)
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def _existing(out: Path, cfg: DataConfig, profile: str | None, full_verify: bool) -> dict:
    m = verified_manifest(out, cfg, profile, full=full_verify)
    log.info("%s is up to date (checked against its manifest); nothing to do", out)
    return m


def _write_split(cfg: DataConfig, work: Path, cache_dir: Path | None, timer: list) -> tuple:
    """Finite source: split by document, train the tokenizer on train, then write both shards."""
    docs = list(load_documents(cfg, cache_dir))
    train_docs, val_docs = split_documents(docs, cfg.val_fraction, cfg.seed)
    t0 = time.perf_counter()
    tok = build_tokenizer(cfg, [d.text for d in train_docs], cache_dir, doc_hash(train_docs))
    log.info("tokenizer %s ready in %.1f s", cfg.tokenizer, time.perf_counter() - t0)
    splits = {}
    for name, part, cap in (("val", val_docs, 0), ("train", train_docs, cfg.max_train_tokens)):
        writer = ShardWriter(work / f"{name}.bin", dtype_for(tok.get_vocab_size()))
        try:
            for _, doc, ids in encode_stream(tok, ((None, d) for d in part), timer):
                if writer.write(doc.name, ids, cap):
                    break
            splits[name] = writer.finish()
        finally:
            writer.close()
    # the code corpus's manifest names what each pinned sdist contributes
    inventory = code_inventory(docs) if cfg.source == "python-code" else None
    return tok, splits, doc_hash(docs), inventory


class Progress:
    """A log line every ``every_s`` seconds: train tokens, source record, rate and ETA (to the cap), measured from the
    first document written in this session (not counting the tokenizer, the val split or a resume)."""

    def __init__(self, label: str, cap: int, every_s: float):
        self.label, self.cap, self.every_s = label, cap, every_s
        self.start = time.monotonic()
        self.base: tuple[float, int] | None = None         # (time, tokens) at the first document

    def update(self, tokens: int, position: int, final: bool = False) -> None:
        now = time.monotonic()
        if self.base is None:
            self.base, self.last = (now, tokens), now
        if not final and now - self.last < self.every_s:
            return
        (t0, tokens0), self.last = self.base, now
        rate = (tokens - tokens0) / max(now - t0, 1e-9)
        eta = _hms((self.cap - tokens) / rate) if self.cap and rate > 0 else "?"
        log.info("%s: train %s tokens%s, source record %s, %.2f M tokens/s, %s", self.label, f"{tokens:,}",
                 f" of {self.cap:,}" if self.cap else "", f"{position:,}", rate / 1e6,
                 f"took {_hms(now - self.start)}" if final else f"ETA {eta}")


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _resumable(work: Path, cfg: DataConfig, tok_sha: str) -> dict | None:
    """The progress record if it belongs to this config and tokenizer and its files are intact (else None, logged)."""
    try:
        state = json.loads((work / PROGRESS).read_text())
    except (OSError, ValueError):
        return None
    val, train = work / "val.bin", work / "train.bin"
    if effective_token_config(state.get("config", {})) != effective_token_config(token_config(cfg)):
        why = "it is for other settings"
    elif state.get("tokenizer_sha256") != tok_sha:
        why = "it is for another tokenizer"
    elif not val.exists() or sha256_file(val) != state["val"]["sha256"]:
        why = "val.bin does not match it"
    elif state["train"]["tokens"] and (not train.exists() or train.stat().st_size < state["train"]["tokens"] * state["itemsize"]):
        why = "train.bin is shorter than it says"
    else:
        return state
    log.warning("%s: starting over (%s)", work / PROGRESS, why)
    return None


def _write_val(cfg: DataConfig, work: Path, tok, tok_sha: str, cache_dir, timer) -> dict:
    dtype = dtype_for(tok.get_vocab_size())
    writer, chain, position = ShardWriter(work / "val.bin", dtype), DocChain(), 0
    try:
        for position, doc, ids in encode_stream(tok, iter_records(cfg, cache_dir), timer):  # noqa: B007 -- saved below
            writer.write(doc.name, ids)
            chain.add(doc)
            if writer.tokens >= cfg.val_tokens:
                break
        entry = writer.finish()
    finally:
        writer.close()
    state = {"config": token_config(cfg), "tokenizer_sha256": tok_sha, "itemsize": dtype.itemsize, "val": entry,
             "position": position, "chain": chain.state, "train": {"tokens": 0, "documents": 0, "names": []},
             "train_entry": None}
    atomic_write_json(work / PROGRESS, state)
    return state


def _save(work: Path, state: dict, train: dict, position: int, chain: DocChain) -> None:
    state.update(train=train, position=position, chain=chain.state)
    atomic_write_json(work / PROGRESS, state)


def _write_train(cfg: DataConfig, work: Path, tok, state: dict, cache_dir, timer, progress: Progress,
                 chunk_tokens: int) -> None:
    resume = state["train"] if state["train"]["tokens"] else None
    writer = ShardWriter(work / "train.bin", dtype_for(tok.get_vocab_size()), resume)
    chain, position, last, last_t = DocChain(state["chain"]), state["position"], writer.tokens, time.monotonic()
    try:
        # start= reads the resume position once, before the loop rebinds the name to the stream's current one
        for position, doc, ids in encode_stream(tok, iter_records(cfg, cache_dir, start=position), timer):  # noqa: B020 -- as said above
            full = writer.write(doc.name, ids, cfg.max_train_tokens)
            chain.add(doc)
            progress.update(writer.tokens, position)
            if full:
                break
            if writer.tokens - last >= chunk_tokens or time.monotonic() - last_t >= CHUNK_SECONDS:
                _save(work, state, writer.sync(), position, chain)      # data on disk first, then the record
                last, last_t = writer.tokens, time.monotonic()
        train = writer.sync()
        state["train_entry"] = writer.finish()
        _save(work, state, train, position, chain)
    finally:
        writer.close()
    progress.update(writer.tokens, position, final=True)


def write_streamed(cfg: DataConfig, work: Path, tok, cache_dir=None, *, timer: list | None = None,
                   every_s: float = 10.0, chunk_tokens: int = 1 << 24, label: str = "prepare") -> tuple[dict, str]:
    """Write (or finish) ``val.bin`` and ``train.bin`` in ``work``; their manifest entries and the corpus hash."""
    tok_sha = hashlib.sha256(tok.to_str().encode()).hexdigest()
    state = _resumable(work, cfg, tok_sha)
    if state is None:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        state = _write_val(cfg, work, tok, tok_sha, cache_dir, timer)
    else:
        log.info("%s: resuming at source record %s (train: %s tokens already written)", label,
                 f"{state['position']:,}", f"{state['train']['tokens']:,}")
    if state["train_entry"] is None:
        progress = Progress(label, cfg.max_train_tokens, every_s)
        _write_train(cfg, work, tok, state, cache_dir, timer, progress, chunk_tokens)
    return {"val": state["val"], "train": state["train_entry"]}, state["chain"]


def _build(cfg: DataConfig, out: Path, cache_dir: Path | None, every_s: float, chunk_tokens: int) -> dict:
    work, timer, t0, inventory = out / WORK_DIR, [0.0], time.perf_counter(), None
    if cfg.val_tokens > 0:
        tok = build_tokenizer(cfg, None, cache_dir)
        splits, corpus_hash = write_streamed(cfg, work, tok, cache_dir, timer=timer, every_s=every_s,
                                             chunk_tokens=chunk_tokens, label=f"prepare {out.name}")
    else:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            tok, splits, corpus_hash, inventory = _write_split(cfg, work, cache_dir, timer)
        except BaseException:           # nothing here resumes (unlike the streamed build): leave no work folder
            shutil.rmtree(work, ignore_errors=True)
            raise
    total = splits["train"]["tokens"] + splits["val"]["tokens"]
    log.info("encoded %d tokens in %.2f s of encode_batch (%.0f tokens/s); %.1f s in all",
             total, timer[0], total / max(timer[0], 1e-9), time.perf_counter() - t0)
    tok_json = tok.to_str().encode()
    atomic_write_bytes(work / TOKENIZER_FILE, tok_json)
    import tokenizers                   # lazily (a slow import): its version goes into the manifest
    vocab = tok.get_vocab_size()
    splits["val"]["unigram_entropy"] = unigram_entropy(np.fromfile(work / "val.bin", dtype=dtype_for(vocab)), vocab)
    manifest = {
        "format": FORMAT_VERSION,
        "config": token_config(cfg),
        "source": describe_source(cfg),
        "corpus_hash": corpus_hash,
        "tokenizer": {"kind": cfg.tokenizer, "file": TOKENIZER_FILE, "vocab_size": vocab, "eot_id": eot_id(tok),
                      "sha256": hashlib.sha256(tok_json).hexdigest(), "tokenizers_version": tokenizers.__version__,
                      "origin": tokenizer_origin(cfg)},
        "vocab_size": vocab,
        "eot_id": eot_id(tok),
        "dtype": dtype_for(vocab).name,
        "splits": splits,
        **({"sources": inventory} if inventory is not None else {}),
    }
    for name in ("val.bin", "train.bin", TOKENIZER_FILE):
        os.replace(work / name, out / name)
    atomic_write_json(out / MANIFEST, manifest)
    shutil.rmtree(work, ignore_errors=True)
    return manifest
