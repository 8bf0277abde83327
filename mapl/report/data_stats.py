"""Corpus and tokenizer statistics for notebooks/data.ipynb (not part of the results report)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from .figures import new_figure
from .render import DASH, fmt, save_figure
from .style import NEUTRAL

__all__ = ["data_summary_table", "token_byte_lengths", "token_length_histogram", "token_length_figure"]


def data_summary_table(manifest: dict) -> tuple[list, list]:
    """Split sizes, documents, works and unigram entropy from a data manifest: ``(header, body)``."""
    header = ["split", "tokens", "documents", "works", "unigram entropy (nats)"]
    body = []
    for split in ("train", "val"):
        s = manifest["splits"][split]
        works = s.get("works") or []
        body.append([split, f"{s['tokens']:,}", s["documents"], len(works) if works else DASH,
                     fmt(s.get("unigram_entropy"))])
    return header, body


def token_byte_lengths(tok) -> np.ndarray:
    """Bytes of UTF-8 text per token id of a ``tokenizers.Tokenizer`` (special tokens: 0)."""
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = set(ByteLevel.alphabet())
    vocab = tok.get_vocab(with_added_tokens=True)
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    lengths = np.zeros(tok.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for piece, i in vocab.items():
        if piece in special:
            continue
        if all(c in alphabet for c in piece):
            lengths[i] = len(piece)
        elif piece.startswith("<0x") and piece.endswith(">"):
            lengths[i] = 1
        else:
            lengths[i] = len(piece.replace("\u2581", " ").encode())
    return lengths


def token_length_histogram(tokens: np.ndarray, lengths: np.ndarray) -> dict[int, int]:
    """Occurrences in ``tokens`` by token length in bytes: ``{bytes: count}``."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=len(lengths))
    by_len = np.bincount(lengths, weights=counts[:len(lengths)])
    return {int(k): int(v) for k, v in enumerate(by_len) if v}


def token_length_figure(hist: dict[int, int], path: str | Path | None = None) -> Figure:
    """Bar chart of :func:`token_length_histogram` (share of tokens per length)."""
    fig, (ax,) = new_figure(1, 5.0, 3.0)
    total = sum(hist.values()) or 1
    ax.bar(list(hist), [100 * v / total for v in hist.values()], color=NEUTRAL["bar"])
    ax.set(xlabel="token length (bytes of text)", ylabel="share of validation tokens (%)",
           title="Validation tokens by length")
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, path)
