"""SentencePiece ``.model`` -> ``tokenizers`` BPE, for the Mistral 32k tokenizer.

Hand-written because the official readers (``sentencepiece`` + ``protobuf``, or ``mistral_common``) would add
dependencies only to read three fields of a simple protobuf message. The conversion follows transformers'
``LlamaConverter`` (legacy mode) and matches sentencepiece 0.2.3 id for id (tests/test_data.py).
"""
from __future__ import annotations

import struct
from typing import Iterator

from .errors import DataError

__all__ = ["read_spm", "spm_to_tokenizer"]


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
            raise DataError(f"unsupported protobuf wire type {wire}: not a SentencePiece .model file")
        yield field, value


def read_spm(blob: bytes) -> tuple[list[tuple[str, float, int]], dict]:
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
