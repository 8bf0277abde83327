"""Boundary health: running statistics of what each boundary sends, and an early warning.

A MAPL+RVQ run (``tiny-P4-mapl-rvq-8x-3000steps-s1``) blew up late; the cause showed ~1,000 steps earlier as
single tokens with |z| hundreds of times the typical value, absorbed into the EMA codebooks, invisible in the
loss. Everything here observes; nothing changes a number the model computes.
"""
from __future__ import annotations

import math
import statistics

import torch

__all__ = ["BoundaryHealth", "OutlierAlarm"]


class BoundaryHealth:
    """Running max |z| and RMS of z per window, training and evaluation apart. ``observe`` keeps device tensors
    (no host read per message); ``read`` returns floats (None for an empty window) and starts a new window."""

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
    """Fires when a boundary's max |z| exceeds ``factor`` x the median of all its earlier readings, after
    ``min_history`` readings, and again only once the value grew tenfold.

    The median, so the outliers warned about do not raise the bar; over all readings, since a rolling window
    follows a slow outlier up (cpu profile seed 1: boundary 1's max |z| grew 42 -> 1,197 over 700 steps, never
    8x its last 10 readings' median but 11x the median of all).
    """

    def __init__(self, factor: float = 5.0, min_history: int = 5, after_step: int = 0):
        if not factor >= 1:
            raise ValueError(f"factor={factor!r} is invalid; allowed: a number >= 1")
        self.factor, self.min_history = float(factor), int(min_history)
        self.after_step = int(after_step)        # readings at or before this step are not judged (the caller's rule)
        self.history: dict[int, list[float]] = {}
        self._last_warned: dict[int, float] = {}

    def median(self, boundary: int) -> float | None:
        h = self.history.get(boundary, [])
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
