"""Boundary health: what the message z of a boundary looks like over training, and an early warning.

Why this exists: a MAPL+RVQ run (``tiny-P4-mapl-rvq-8x-3000steps-s1``) blew up late in training, and
the cause was visible ~1,000 steps before the loss moved: single tokens with |z| hundreds of times the
typical value, absorbed into the EMA codebooks. A loss curve shows none of that, so every boundary
keeps cheap running statistics of what it sends, and the loop reads them every ``train.health_every``
steps (one host read of a few scalars per boundary) and at every evaluation.

    >>> h = BoundaryHealth()
    >>> h.observe(z, training=True)        # every forward message (device tensors: no host sync)
    >>> h.read()                           # {"train_max": ..., "train_rms": ..., "eval_max": ..., ...}; resets
    >>> alarm = OutlierAlarm(factor=5.0)
    >>> alarm.check(boundary=1, value=h_max)   # True when value > factor x the median of earlier readings

Everything here observes; nothing changes a number the model computes.
"""
from __future__ import annotations

import math
import statistics

import torch

__all__ = ["BoundaryHealth", "OutlierAlarm"]


class BoundaryHealth:
    """Running max |z| and RMS of z over a window, kept apart for training and evaluation messages.

    ``observe`` keeps device tensors (no host read per micro-batch); ``read`` turns the window into
    floats (one host read) and starts a new window. A window with no message reads as None.
    """

    WINDOWS = ("train", "eval")

    def __init__(self):
        self._win = {k: None for k in self.WINDOWS}

    @torch.no_grad()
    def observe(self, z: torch.Tensor, training: bool) -> None:
        # reductions accumulate in fp32 without an fp32 copy of z (this runs on every message)
        z = z.detach()
        absmax = z.abs().amax().float()
        sumsq = torch.linalg.vector_norm(z, dtype=torch.promote_types(z.dtype, torch.float32)).square().float()
        key = "train" if training else "eval"
        w = self._win[key]
        if w is None:
            self._win[key] = [absmax, sumsq, z.numel()]
        else:
            w[0], w[1], w[2] = torch.maximum(w[0], absmax), w[1] + sumsq, w[2] + z.numel()

    def read(self) -> dict:
        out = {}
        for key in self.WINDOWS:
            w = self._win[key]
            out[f"{key}_max"] = None if w is None else float(w[0])
            out[f"{key}_rms"] = None if w is None else math.sqrt(float(w[1]) / max(1, w[2]))
            self._win[key] = None
        return out


class OutlierAlarm:
    """Fires when a boundary's max |z| exceeds ``factor`` x the median of its earlier readings (the last
    ``window`` of them; None: all).

    The median (not the mean) so that the outliers being warned about do not raise the bar; over every
    earlier reading by default, since a rolling window follows a slow outlier up (measured on seed 1 of
    the cpu profile: boundary 1's max |z| grows 42 -> 1,197 over 700 steps, never 8x its last 10
    readings' median but 11x the median of all readings after the warmups); at least
    ``min_history`` readings before it can fire (the loop feeds it only readings after the learning-rate
    warmup, when activations grow by an order of magnitude in a few hundred steps); and it fires
    again for a boundary only once the value has grown tenfold since its last warning, so a growing
    outlier prints one line per decade, not one per reading.
    """

    def __init__(self, factor: float = 5.0, min_history: int = 5, window: int | None = None, after_step: int = 0):
        if not factor >= 1:
            raise ValueError(f"factor={factor!r} is invalid; allowed: a number >= 1")
        self.factor, self.min_history, self.window = float(factor), int(min_history), window
        self.after_step = int(after_step)        # readings at or before this step are not judged (the caller's rule)
        self.history: dict[int, list[float]] = {}
        self._last_warned: dict[int, float] = {}

    def median(self, boundary: int) -> float | None:
        h = self.history.get(boundary, [])
        h = h[-self.window:] if self.window else h
        return statistics.median(h) if len(h) >= self.min_history else None

    def check(self, boundary: int, value: float | None) -> bool:
        """Record ``value`` (a window's max |z|) and say whether it warrants a warning."""
        if value is None or not math.isfinite(value):
            return False
        med = self.median(boundary)
        self.history.setdefault(boundary, []).append(value)
        fire = med is not None and value > self.factor * med and value > 10 * self._last_warned.get(boundary, 0.0)
        if fire:
            self._last_warned[boundary] = value
        return fire
