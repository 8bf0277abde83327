"""``prepare``, the only code that creates a prepared folder (shards, ``tokenizer.json``, ``manifest.json``). A
folder with a manifest is never rebuilt or deleted implicitly; files are written in ``<out>/.partial/`` and moved
into place, the manifest last and atomically; two processes preparing one folder take turns (a lock).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np

from .batches import unigram_entropy
from .config import DataConfig, token_config
from .dataset import default_data_dir
from ..base.io import atomic_write_bytes, atomic_write_json, waiting_lock
from .shards import ShardWriter, dtype_for
from .sources import code_inventory, describe_source, doc_hash, load_documents, split_documents
from .stream import write_streamed
from .tokenizers import build_tokenizer, encode_stream, eot_id, tokenizer_origin
from .verify import FORMAT_VERSION, MANIFEST, TOKENIZER_FILE, verified_manifest

__all__ = ["prepare", "WORK_DIR"]

log = logging.getLogger("mapl.data")

WORK_DIR = ".partial"


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
    with waiting_lock(out / ".prepare", f"preparing {out}"):
        if not rebuild and (out / MANIFEST).exists():        # finished by another process while we waited
            return _existing(out, cfg, profile, full_verify)
        return _build(cfg, out, cache_dir, progress_every_s, chunk_tokens)


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
