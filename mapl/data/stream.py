"""Streamed, resumable preparation (``val_tokens > 0``): the first documents worth ``val_tokens`` go to val, the rest
to train until ``max_train_tokens``. ``progress.json``, replaced after each fsynced chunk, is the commit point a
restart resumes from, byte for byte as an uninterrupted run (docs/data.md).
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

from .config import DataConfig, effective_token_config, token_config
from .downloads import sha256_file
from .shards import ShardWriter, dtype_for
from .sources import DocChain, iter_records
from .tokenizers import encode_stream
from ..base.io import atomic_write_json

__all__ = ["write_streamed", "Progress", "PROGRESS"]

log = logging.getLogger("mapl.data")

PROGRESS = "progress.json"
CHUNK_SECONDS = 30.0        # a chunk also ends after this long, so a slow source loses at most this much


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
