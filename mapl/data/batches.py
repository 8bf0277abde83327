"""The token-matched batch order: the windows of the train shard a run reads at each step, which depend only on
``(seed, step)`` and the shard (``uniform`` or ``epochs`` sampling: docs/data.md). Windows cross document
boundaries (the end-of-text id separates them), as in GPT-style training.
"""
from __future__ import annotations

import functools

import numpy as np

__all__ = ["window_starts", "take_windows", "get_batch", "eval_batches", "unigram_entropy"]


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n_windows: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch, n_windows]).permutation(n_windows)
    order.flags.writeable = False
    return order


def window_starts(n_tokens: int, batch_size: int, seq_len: int, seed: int, step: int,
                  sampling: str = "uniform") -> np.ndarray:
    """Token offsets of the ``batch_size`` windows (``seq_len + 1`` tokens each) of ``step``."""
    if n_tokens < seq_len + 1:
        raise ValueError(f"split has {n_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    if sampling == "uniform":
        return np.random.default_rng([seed, step]).integers(0, n_tokens - seq_len, size=batch_size)
    if sampling != "epochs":
        raise ValueError(f"data.sampling={sampling!r} is invalid: allowed: ['uniform', 'epochs']")
    n_windows = (n_tokens - 1) // seq_len
    epoch, index = np.divmod(step * batch_size + np.arange(batch_size, dtype=np.int64), n_windows)
    starts = np.empty(batch_size, dtype=np.int64)
    for e in np.unique(epoch):                  # a batch may straddle two epochs
        rows = epoch == e
        starts[rows] = _epoch_order(seed, int(e), n_windows)[index[rows]] * seq_len
    return starts


def take_windows(tokens, starts: np.ndarray, length: int) -> np.ndarray:
    """``tokens[s : s + length]`` for each ``s`` in ``starts``, as int64 rows."""
    if hasattr(tokens, "windows"):             # a TokenShard: one pread per window
        return tokens.windows(starts, length).astype(np.int64)
    return np.asarray(tokens[np.asarray(starts)[:, None] + np.arange(length)], dtype=np.int64)


def _split_xy(w: np.ndarray):
    import torch                       # lazy: preparing data does not need torch
    return torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy())


def get_batch(tokens, batch_size: int, seq_len: int, seed: int, step: int, sampling: str = "uniform"):
    """``(x, y)`` int64 tensors of shape ``batch_size x seq_len``; ``y`` is ``x`` shifted by one."""
    starts = window_starts(len(tokens), batch_size, seq_len, seed, step, sampling)
    return _split_xy(take_windows(tokens, starts, seq_len + 1))


def eval_batches(tokens, batch_size: int, seq_len: int, max_tokens: int, select_every: int = 0,
                 part: str = "report") -> list:
    """Fixed, non-overlapping windows from the start of ``tokens`` (at most ``max_tokens`` input tokens; <= 0 = all)
    in batches of ``batch_size``. ``select_every = n > 0``: windows n-1, 2n-1, ... are the ``part="select"`` set (best
    step, tuning winners), the rest the ``"report"`` set; 0: every window reports and the select set is empty."""
    if part not in ("report", "select"):
        raise ValueError(f"part={part!r} is invalid; allowed: report, select")
    n_windows = (len(tokens) - 1) // seq_len
    if max_tokens > 0:
        n_windows = min(n_windows, max_tokens // seq_len)
    if n_windows < 1:
        raise ValueError(f"split has {len(tokens)} tokens; need at least seq_len + 1 = {seq_len + 1} "
                         f"(and max_tokens >= seq_len)")
    windows = np.arange(n_windows)
    if select_every > 0:
        chosen = windows % select_every == select_every - 1
        windows = windows[chosen if part == "select" else ~chosen]
    elif part == "select":
        return []
    return [_split_xy(take_windows(tokens, windows[start:start + batch_size] * seq_len, seq_len + 1))
            for start in range(0, len(windows), batch_size)]


def unigram_entropy(tokens, vocab_size: int) -> float:
    """Entropy (nats) of the token frequencies: the loss of the best context-free predictor."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(tokens), 1 << 24):          # chunks: shards of any size
        c = np.bincount(np.asarray(tokens[start:start + (1 << 24)]), minlength=vocab_size)
        if len(c) > vocab_size:
            raise ValueError(f"token id {len(c) - 1} >= vocab_size={vocab_size}")
        counts += c
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
