"""Progress lines of runs (one ``write`` to fd 2 each: runs side by side never interleave), and how long runs take."""
from __future__ import annotations

import contextvars
import json
import os
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

from ..core.config import RunConfig
from ..core.model_config import count_params

__all__ = ["CORE_S_PER_TOKEN_PARAM", "STEP_S", "RVQ_SLOWDOWN", "RUN_OVERHEAD_S", "LAUNCH_OVERHEAD_S", "UNPREPARED_EVAL_TOKENS",
           "estimate_core_seconds", "eval_tokens", "eval_split_guessed",
           "committed_data_only", "estimate_group", "hms", "emit", "StepProgress",
           "named_warnings"]

# A run's seconds = RUN_OVERHEAD_S + STEP_S per step + CORE_S_PER_TOKEN_PARAM per (token x parameter), an
# evaluation token a third of a training one: a relative least-squares fit to the train_wall_s of the cpu
# profile's committed runs, two side by side on 2 cores (tests/test_sweep.py holds the main groups to it). The
# per-step term is the step's fixed cost (the optimizer over many small matrices), which no parameter count sees.
STEP_S = 0.18
CORE_S_PER_TOKEN_PARAM = 7.4e-11
RVQ_SLOWDOWN = 1.5                  # codebook search and EMA updates (the 16 committed MAPL+RVQ runs: 1.03x it)
RUN_OVERHEAD_S = 5.0                # process start, data load, diagnostics
LAUNCH_OVERHEAD_S = 40.0            # a multi-process launch on CPU: P interpreters, each building the model


# ---- wall-time estimates -------------------------------------------------------------------------
def estimate_core_seconds(cfg: RunConfig, from_step: int = 0) -> float:
    """Seconds to train ``cfg`` from ``from_step`` on this machine, two runs side by side (fitted, see above)."""
    t = cfg.train
    n_params = count_params(cfg.model_config(cfg.data.vocab_size or None))
    steps = max(0, t.steps - from_step)
    evals = steps // t.eval_every + 1
    tokens = steps * t.batch_size * t.seq_len + evals * eval_tokens(cfg) / 3
    slow = RVQ_SLOWDOWN if cfg.compressor.method == "mapl-rvq" else 1.0
    return RUN_OVERHEAD_S + steps * STEP_S + tokens * n_params * CORE_S_PER_TOKEN_PARAM * slow


UNPREPARED_EVAL_TOKENS = 65_536   # the price of one whole-split evaluation whose split's size nothing here gives


def eval_tokens(cfg: RunConfig) -> int:
    """Validation tokens one evaluation reads: ``train.eval_tokens``, else the split's size as far as it is known."""
    if cfg.train.eval_tokens:
        return cfg.train.eval_tokens
    prepared = _prepared_val_tokens(cfg)
    return prepared - cfg.train.eval_offset if prepared is not None else cfg.data.val_tokens or UNPREPARED_EVAL_TOKENS


def eval_split_guessed(cfg: RunConfig) -> bool:
    """True when :func:`eval_tokens` had to guess the whole split's size (not prepared here, no ``data.val_tokens``)."""
    return not cfg.train.eval_tokens and not cfg.data.val_tokens and _prepared_val_tokens(cfg) is None


# set by committed_data_only(): price from committed stamps alone, as a fresh clone does
_COMMITTED_ONLY = contextvars.ContextVar("committed_data_only", default=False)


@contextmanager
def committed_data_only():
    """Within the block, split sizes come from committed stamps only: an estimate that reads the same everywhere."""
    token = _COMMITTED_ONLY.set(True)
    try:
        yield
    finally:
        _COMMITTED_ONLY.reset(token)


def _prepared_val_tokens(cfg: RunConfig) -> int | None:
    """The validation split's size from its prepared manifest, else from a committed ``data/<profile>.manifest.json``."""
    from ..data import default_data_dir, read_manifest      # the estimate runs before torch is needed
    folder = default_data_dir(cfg.data)
    if not _COMMITTED_ONLY.get():
        try:
            return int(read_manifest(folder)["splits"]["val"]["tokens"])
        except (OSError, ValueError, KeyError):
            pass
    for stamp in sorted(folder.parent.glob("*.manifest.json")):
        try:
            manifest = json.loads(stamp.read_text())
            if Path(manifest["data_dir"]).name == folder.name:
                return int(manifest["splits"]["val"]["tokens"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def estimate_group(seconds: list[float], workers: int) -> float:
    """Wall seconds of runs taking ``seconds`` each, in list order on the first free of ``workers``."""
    loads = [0.0] * max(1, workers)
    for s in seconds:
        loads[loads.index(min(loads))] += s
    return max(loads)


def hms(s: float) -> str:
    """m:ss, or h:mm:ss from an hour on."""
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


# ---- progress lines -------------------------------------------------------------------------------
def emit(line: str) -> None:
    """One progress line on fd 2, written at once (lines of runs side by side do not interleave)."""
    os.write(2, (line.rstrip("\n") + "\n").encode())


class StepProgress:
    """``on_step`` callback of one run: a line every ``every_s`` seconds of work, and at the end."""

    def __init__(self, name: str, every_s: float):
        self.name, self.every_s = name, every_s
        self.t0 = self.step0 = self.last = self.step = None

    def __call__(self, step: int, steps: int, loss: float) -> None:
        self.step = step
        now = time.monotonic()
        if self.t0 is None:
            self.t0, self.step0, self.last = now, step, now
        if now - self.last < self.every_s and step < steps:
            return
        self.last = now
        rate = (step - self.step0) / (now - self.t0) if now > self.t0 and step > self.step0 else 0.0
        eta = hms((steps - step) / rate) if rate else "?"
        emit(f"{self.name} step {step}/{steps} loss {loss:.3f} ETA {eta}")


@contextmanager
def named_warnings(run: str, progress: StepProgress | None = None):
    """Each Python warning in the block becomes one progress line naming the run and its last step."""
    def show(message, category, filename, lineno, file=None, line=None):
        step = f" step {progress.step}" if progress is not None and progress.step is not None else ""
        emit(f"warning: {run}{step}: {category.__name__}: {message} ({Path(filename).name}:{lineno})")

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
