"""Tokenizers (all ``tokenizers.Tokenizer``: ``bpe`` trained on the train split, ``byte``, and ``mistral`` converted
from its SentencePiece ``.model``) and document encoding."""
from __future__ import annotations

import hashlib
import itertools
import struct
import time
import zipfile
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from . import sources
from .config import DataConfig, DataError, default_cache_dir
from .sources import Doc, sha256_file
from ..base.io import atomic_write_bytes

__all__ = ["EOT", "bytes_to_unicode", "byte_tokenizer", "train_bpe", "mistral_tokenizer", "build_tokenizer",
           "eot_id", "chunks", "encode_stream", "encode_documents", "tokenizer_origin", "read_spm", "spm_to_tokenizer"]

EOT = "<|endoftext|>"

# The wheel is pinned so the download is reproducible; the model file inside is also hash-checked
# (it is the original Mistral-7B-v0.1 tokenizer.model, unchanged across mistral-common releases).
MISTRAL_SPEC = "mistral-common==1.13.1"
MISTRAL_MEMBER = "mistral_common/data/tokenizer.model.v1"
MISTRAL_MODEL_SHA256 = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"

# Byte-level tokenizers see long documents in line-aligned pieces of at most this many characters:
# the BPE pre-tokenizer is local, so ids barely change, and memory stays bounded for huge files.
_CHUNK_CHARS = 1 << 16
_ENCODE_BATCH = 64          # documents (or chunks) per encode_batch call


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the alphabet of tokenizers' ByteLevel)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    others = iter(range(256, 512))          # the other bytes, in order, stand for 256, 257, ...
    return {b: chr(b) if b in keep else chr(next(others)) for b in range(256)}


def byte_tokenizer():
    """256 byte symbols (id = byte value) + end-of-text (id 256); lossless, no training."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges the pieces do not matter, and one piece per chunk is faster.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok


def chunks(text: str, limit: int = _CHUNK_CHARS) -> Iterator[str]:
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
    """Byte-level BPE trained on ``texts`` (deterministic; end-of-text is id 0), cached under
    ``<cache_dir>/tokenizers/`` by corpus hash, vocabulary and tokenizers version when both are given."""
    import tokenizers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    cached = None
    if cache_dir is not None and corpus_hash:
        cached = Path(cache_dir) / "tokenizers" / f"bpe{vocab_size}-{corpus_hash[:16]}-tk{tokenizers.__version__}.json"
        if cached.exists():
            return Tokenizer.from_file(str(cached))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((c for t in texts for c in chunks(t)), trainer=trainer)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(cached, tok.to_str().encode())
    return tok


def fetch_mistral_model(cache_dir: Path | None = None) -> Path:
    """The Mistral-7B-v0.1 ``tokenizer.model``, hash-checked: extracted in the cache, else from the cached wheel, else
    from ``pip download``."""
    cache_dir = Path(cache_dir or default_cache_dir())
    target = cache_dir / "mistral-7b-v0.1.tokenizer.model"
    if target.exists() and sha256_file(target) == MISTRAL_MODEL_SHA256:
        return target
    wheels = sorted(cache_dir.glob("mistral_common-" + MISTRAL_SPEC.split("==")[1] + "-*.whl"))
    wheel = wheels[0] if wheels else sources.pip_download([MISTRAL_SPEC], cache_dir)
    with zipfile.ZipFile(wheel) as z:          # read the file; never import mistral_common
        blob = z.read(MISTRAL_MEMBER)
    actual = hashlib.sha256(blob).hexdigest()
    if actual != MISTRAL_MODEL_SHA256:
        raise DataError(f"{wheel}!{MISTRAL_MEMBER}: sha256 mismatch: expected {MISTRAL_MODEL_SHA256}, "
                        f"got {actual}; delete the wheel and run again")
    atomic_write_bytes(target, blob)
    return target


def mistral_tokenizer(cache_dir: Path | None = None):
    """32k Mistral-7B-v0.1 SentencePiece BPE as a ``tokenizers.Tokenizer`` (end-of-text = ``</s>`` = 2)."""
    return spm_to_tokenizer(fetch_mistral_model(cache_dir).read_bytes())


def eot_id(tok) -> int:
    """Id that separates documents: ``<|endoftext|>`` for bpe/byte, ``</s>`` for Mistral."""
    i = tok.token_to_id(EOT)
    return tok.token_to_id("</s>") if i is None else i


def build_tokenizer(cfg: DataConfig, train_texts: list[str] | None, cache_dir: Path | None = None,
                    corpus_hash: str | None = None):
    if cfg.tokenizer == "byte":
        return byte_tokenizer()
    if cfg.tokenizer == "mistral":
        return mistral_tokenizer(cache_dir)
    return train_bpe(train_texts, cfg.vocab_size, cache_dir, corpus_hash)


def encode_stream(tok, items: Iterable[tuple[object, Doc]], timer: list | None = None) -> Iterator[tuple]:
    """``(tag, doc, ids + [eot])`` per ``(tag, doc)`` (the tag rides along: a resume position, or nothing)."""
    eot = eot_id(tok)
    # Text that spells "<|endoftext|>" or "</s>" stays text: only real boundaries get the eot id.
    tok.encode_special_tokens = True
    encode = tok.encode_batch_fast          # no offsets: faster
    # Byte-level tokenizers split safely at line ends; SentencePiece would add a dummy-prefix space
    # to every piece, so it gets whole documents.
    split = chunks if type(tok.pre_tokenizer).__name__ == "ByteLevel" else (lambda text: [text])
    items = iter(items)
    while True:
        batch = list(itertools.islice(items, _ENCODE_BATCH))
        if not batch:
            return
        pieces = [list(split(d.text)) for _, d in batch]
        t0 = time.perf_counter()
        encs = encode([p for ps in pieces for p in ps], add_special_tokens=False)
        if timer is not None:
            timer[0] += time.perf_counter() - t0
        k = 0
        for (tag, d), ps in zip(batch, pieces):
            ids = [i for e in encs[k:k + len(ps)] for i in e.ids]
            k += len(ps)
            ids.append(eot)
            yield tag, d, np.asarray(ids, dtype=np.int64)


def encode_documents(tok, texts: Iterable[str]) -> np.ndarray:
    """All ``texts`` encoded (in batches) and joined, each followed by the end-of-text id."""
    parts = [ids for _, _, ids in encode_stream(tok, ((None, Doc(str(i), t)) for i, t in enumerate(texts)))]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def tokenizer_origin(cfg: DataConfig) -> str:
    return {"mistral": f"{MISTRAL_SPEC} wheel: {MISTRAL_MEMBER} (sha256 {MISTRAL_MODEL_SHA256})",
            "bpe": "byte-level BPE trained on the train split",
            "byte": "256 bytes + end-of-text, untrained"}[cfg.tokenizer]


# SentencePiece ``.model`` -> ``tokenizers`` BPE, for the Mistral 32k tokenizer. Hand-written because the official
# readers (``sentencepiece`` + ``protobuf``, or ``mistral_common``) would add dependencies only to read three fields of a
# simple protobuf message. The conversion follows transformers' ``LlamaConverter`` (legacy mode) and matches
# sentencepiece 0.2.3 id for id (tests/test_data.py).
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
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire in (1, 5):                             # fixed 64 or 32 bits
            n = 8 if wire == 1 else 4
            value, i = buf[i:i + n], i + n
        else:
            raise DataError(f"unsupported protobuf wire type {wire}: not a SentencePiece .model file")
        yield field, value


# (message, field) of the ModelProto -> the spec flag it sets: TrainerSpec (2) and NormalizerSpec (3)
_SPM_FLAGS = {(2, 3): "model_type", (2, 35): "byte_fallback", (3, 3): "add_dummy_prefix", (3, 4): "remove_extra_whitespaces"}


def read_spm(blob: bytes) -> tuple[list[tuple[str, float, int]], dict]:
    """Pieces (text, score, type) and the few spec flags the conversion depends on."""
    pieces, spec = [], {"model_type": 1, "byte_fallback": False, "add_dummy_prefix": True,
                        "remove_extra_whitespaces": True}
    for field, value in _pb_fields(blob):
        if field == 1:                                   # ModelProto.pieces: piece (1), score (2), type (3)
            f = dict(_pb_fields(value))
            pieces.append((f.get(1, b"").decode("utf-8"), struct.unpack("<f", f[2])[0] if 2 in f else 0.0, f.get(3, 1)))
        elif field in (2, 3):
            for f, v in _pb_fields(value):
                key = _SPM_FLAGS.get((field, f))
                if key:
                    spec[key] = v if key == "model_type" else bool(v)
    return pieces, spec


def spm_to_tokenizer(blob: bytes):
    """A SentencePiece BPE ``.model`` (bytes) as a ``tokenizers.Tokenizer`` with identical ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    pieces, spec = read_spm(blob)
    if spec["model_type"] != 2 or spec["remove_extra_whitespaces"] or not spec["add_dummy_prefix"]:
        raise DataError(f"unsupported SentencePiece model (need BPE, dummy prefix, whitespace kept): {spec}")
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
