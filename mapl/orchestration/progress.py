"""Progress lines of runs, and how long runs will take.

Lines go to fd 2 in one ``write`` each, so lines of runs side by side never interleave and they reach
the terminal even from the worker processes of a notebook's kernel (ipykernel echoes fd 2 output)::

    tiny-P4-ssn-8x-s0 step 120/300 loss 4.512 ETA 0:42

The estimate is fitted to what this machine's committed runs took, trained two side by side as ``dvc repro``
trains them (see ``STEP_S`` and ``CORE_S_PER_TOKEN_PARAM``); ``mapl sweep --estimate`` prints it per group.
"""
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
# evaluation token a third of a training one. The two rates are a relative least-squares fit to the train_wall_s
# of the cpu profile's committed runs (224 runs of 21 groups, d = 64-256, 300-3,000 steps, two side by side on
# this 2-core machine, sometimes beside other work): each group's median measured / estimated (per model size)
# lies within 0.74-1.36 but long_gradwire's (1.97); tests/test_sweep.py holds the main groups to it. A rate per
# token and parameter alone (fitted on one quiet `tiny` run before) priced the small models at half what they
# took: the step's fixed cost (the optimizer over many small matrices, Python per micro-batch) does not grow
# with the parameters.
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
    """Validation tokens one evaluation reads: ``train.eval_tokens``, or for 0 (the whole split) the split's
    size from :func:`_prepared_val_tokens` (its manifest, or a committed stamp of it), else ``data.val_tokens``,
    else :data:`UNPREPARED_EVAL_TOKENS` (:func:`eval_split_guessed` says when)."""
    if cfg.train.eval_tokens:
        return cfg.train.eval_tokens
    prepared = _prepared_val_tokens(cfg)
    return prepared - cfg.train.eval_offset if prepared is not None else cfg.data.val_tokens or UNPREPARED_EVAL_TOKENS


def eval_split_guessed(cfg: RunConfig) -> bool:
    """True when :func:`eval_tokens` had to guess: the run reads the whole split, the split is not prepared on
    this machine and ``data.val_tokens`` does not give its size (the estimate then differs between a machine
    that has prepared the data and one that has not, so the estimate says which it is)."""
    return not cfg.train.eval_tokens and not cfg.data.val_tokens and _prepared_val_tokens(cfg) is None


# set by committed_data_only(): price from committed stamps alone, as a fresh clone does
_COMMITTED_ONLY = contextvars.ContextVar("committed_data_only", default=False)


@contextmanager
def committed_data_only():
    """Within the block, split sizes come from committed stamps only, never from a folder prepared on this
    machine: an estimate that must read the same everywhere (the one the documents print, held by a test)
    then does not depend on which corpora this machine happens to have prepared."""
    token = _COMMITTED_ONLY.set(True)
    try:
        yield
    finally:
        _COMMITTED_ONLY.reset(token)


def _prepared_val_tokens(cfg: RunConfig) -> int | None:
    """The validation split's size from its prepared folder's manifest, else from a committed profile stamp of
    the same folder (``data/<profile>.manifest.json``, a copy of that manifest: a fresh clone then prices the
    profile's own corpus as a machine that has prepared it does); None when neither is here. Within
    :func:`committed_data_only` the prepared folder is not read."""
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
    """Wall seconds of runs taking ``seconds`` each on ``workers`` side by side, each starting in
    list order on the first free worker (as the pool hands them out)."""
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
    """In one run's worker process: each Python warning becomes one line naming the run and its last step.
    Runs side by side share the terminal, and a warning from the numerical core (e.g. ``thin_svd`` retrying
    a non-convergent float32 SVD in float64) does not know which run it is in; the default format would not
    say, and could interleave with the progress lines."""
    def show(message, category, filename, lineno, file=None, line=None):
        step = f" step {progress.step}" if progress is not None and progress.step is not None else ""
        emit(f"warning: {run}{step}: {category.__name__}: {message} ({Path(filename).name}:{lineno})")

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
