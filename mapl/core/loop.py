"""THE training loop, for the single-process pipeline and for every rank of the multi-process one.

The loop owns what does not depend on where the stages run: the step budget, the LR schedule, the evaluation,
health and checkpoint cadence, the SIGINT/SIGTERM stop flag, the finite checks, progress and the results. An
*engine* (``Engine`` below) owns the rest. A checkpoint due after step s is written unconfirmed and confirmed by
step s+1's finite loss or a finite evaluation at s (``mapl.core.checkpoint``). A signal lets the step in flight
complete, writes a checkpoint and raises :class:`Interrupted` (exit 130).
"""
from __future__ import annotations

import math
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Protocol

from .compress.health import OutlierAlarm
from .config import RunConfig
from ..base.io import atomic_write_json

__all__ = ["LoopState", "Evaluation", "StepOutcome", "Engine", "Interrupted", "NonFiniteError", "StopFlag", "lr_factor",
           "run_loop", "train"]


def lr_factor(step: int, cfg: RunConfig) -> float:
    """Linear warmup, then linear decay to ``min_lr_frac`` of the peak at the last step."""
    t = cfg.train
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    frac = min(1.0, (step - t.warmup_steps) / span)
    return 1.0 - (1.0 - t.min_lr_frac) * frac


class Evaluation(NamedTuple):
    """One evaluation's token-weighted mean losses on the two window sets (``train.select_every``)."""
    val: float                    # the report set: what results report
    select: float | None          # the selection set, where a best step is chosen (None: the run has none)


@dataclass
class LoopState:
    """Everything the loop carries across steps and resumes (part of the checkpoint)."""
    step: int = 0
    train_curve: list = field(default_factory=list)      # [step, loss] per optimizer step
    val_curve: list = field(default_factory=list)        # [step, val loss] per evaluation (report set)
    select_curve: list = field(default_factory=list)     # [step, loss] per evaluation on the selection set
    train_wall: float = 0.0                              # seconds inside train_step, summed
    resumed_with_changes: list = field(default_factory=list)   # {"step", "changes"} per resume with new settings
    health: list = field(default_factory=list)           # {"step", "eval", "boundaries": [per-boundary dict]}
    health_warnings: list = field(default_factory=list)  # {"step", "boundary", "max", "median"} per warning

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LoopState":
        return cls(step=int(d["step"]), train_curve=list(d["train_curve"]), val_curve=list(d["val_curve"]),
                   train_wall=float(d["train_wall"]), resumed_with_changes=list(d.get("resumed_with_changes", [])),
                   health=list(d.get("health", [])), health_warnings=list(d.get("health_warnings", [])),
                   select_curve=list(d.get("select_curve", [])))


@dataclass(frozen=True)
class StepOutcome:
    loss: float                  # the step's training loss (mean over micro-batches), the same on every rank
    stop: bool = False           # a stop was requested on some rank: every rank stops after this step
    nonfinite_at: str = ""       # when ``loss`` is not finite: the first place holding a non-finite value


class NonFiniteError(FloatingPointError):
    """A loss or a value to be checkpointed is NaN/Inf; the message names the step and the place."""


class Interrupted(KeyboardInterrupt):
    """A stop was requested (signal); the checkpoint of the last completed step is written."""


class Engine(Protocol):
    """Where the stages run; a multi-process engine makes each call collective, with the same values on every rank."""
    cfg: RunConfig
    reporter: bool               # this process prints progress and writes the results (rank 0 or the only one)
    checkpointing: bool          # a checkpoint path was given

    def train_step(self, step: int, lr_scale: float, stop_requested: Callable[[], bool]) -> StepOutcome: ...
    # stop_requested() is read as late as possible in the step (a signal during the step still counts)

    def evaluate(self, step: int) -> Evaluation: ...                   # the global validation losses

    def health(self) -> list[dict] | None: ...                         # per boundary, since the last call
    # (Compressor.health_report of every boundary's sender; the reporter gets the list, others None)

    def save(self, state: LoopState, confirmed: bool = True) -> None: ...   # refuses (raises) non-finite state
    # confirmed=False: written beside the last good checkpoint, which it replaces only on confirm()

    def confirm(self) -> None: ...                                     # promote the unconfirmed one (if any)

    def drop_unconfirmed(self) -> None: ...                            # delete the unconfirmed one (if any)

    def results(self, state: LoopState, wall_s: float) -> dict | None: ...   # the reporter returns the dict


class StopFlag:
    """SIGINT/SIGTERM set ``stop``; the loop finishes the step, checkpoints and leaves."""

    def __init__(self):
        self.stop = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, lambda signum, frame: setattr(self, "stop", True))
            except ValueError:       # not the main thread (some notebook runners): no graceful stop there
                pass
        return self

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def run_loop(engine: Engine, state: LoopState, *, log: Callable = print, progress: bool = True,
             on_step: Callable | None = None) -> LoopState:
    """Train from ``state`` until ``cfg.train.steps``; the final state. ``on_step(step, steps, loss)`` after every
    step. Raises :class:`NonFiniteError` on a non-finite loss, :class:`Interrupted` after a graceful stop."""
    from tqdm.auto import tqdm

    cfg, t = engine.cfg, engine.cfg.train
    log = log if engine.reporter else (lambda *a, **k: None)
    bar = tqdm(total=t.steps, initial=state.step, disable=not (progress and engine.reporter), desc=cfg.name(),
               leave=False)
    alarm = outlier_alarm(state, t.health_warn_factor, ALARM_AFTER_WARMUPS * t.warmup_steps)
    try:
        with StopFlag() as flag:
            while state.step < t.steps:
                outcome = _one_step(engine, state, lambda: flag.stop)
                if engine.checkpointing:
                    engine.confirm()        # this step's loss is finite: the weights saved before it are good
                bar.update(1)
                bar.set_postfix(loss=f"{outcome.loss:.3f}")
                if on_step is not None and engine.reporter:
                    on_step(state.step, t.steps, outcome.loss)
                evaluated = state.step % t.eval_every == 0 or state.step == t.steps
                if evaluated:
                    _evaluate(engine, state, log, outcome.loss)
                if evaluated or (t.health_every and state.step % t.health_every == 0):
                    _read_health(engine, state, alarm, log, evaluated)
                if engine.checkpointing and (state.step % t.checkpoint_every == 0 or outcome.stop):
                    engine.save(state, confirmed=evaluated or outcome.stop)
                if outcome.stop:
                    raise Interrupted(f"stopped after step {state.step}: " + (
                        "checkpoint written; rerun the same command to resume" if engine.checkpointing
                        else "no checkpoint path was given, so nothing was kept"))
    except BaseException as e:
        if engine.checkpointing and not isinstance(e, Interrupted):
            engine.drop_unconfirmed()       # never confirmed: the last good checkpoint stays the one to resume
        raise
    finally:
        bar.close()
    return state


def _one_step(engine: Engine, state: LoopState, stop_requested: Callable[[], bool]) -> StepOutcome:
    step = state.step
    t0 = time.time()
    try:
        outcome = engine.train_step(step, lr_factor(step, engine.cfg), stop_requested)
    except RuntimeError as e:           # torch: "value cannot be converted to type float without overflow"
        if "overflow" not in str(e):
            raise
        raise NonFiniteError(f"the optimizer update of step {step} overflows float32 ({e}): a learning rate is far "
                             "too large. The last good checkpoint is kept; lower the learning rate and resume from it "
                             "with --resume-with-changes") from None
    if not math.isfinite(outcome.loss):
        raise NonFiniteError(f"non-finite training loss {outcome.loss} at step {step}; first non-finite value: "
                             f"{outcome.nonfinite_at or 'unknown'}. The last good checkpoint is kept; lower the "
                             "learning rate and resume from it with --resume-with-changes")
    state.step = step + 1
    state.train_wall += time.time() - t0
    state.train_curve.append([step + 1, outcome.loss])
    return outcome


def _evaluate(engine: Engine, state: LoopState, log: Callable, train_loss: float) -> None:
    ev = engine.evaluate(state.step)
    for loss in (ev.val, ev.select):
        if loss is not None and not math.isfinite(loss):
            raise NonFiniteError(f"non-finite validation loss {loss} after step {state.step} (the training loss was "
                                 f"{train_loss:.4f}); the last good checkpoint is kept")
    state.val_curve.append([state.step, ev.val])
    if ev.select is not None:
        state.select_curve.append([state.step, ev.select])
    select = "" if ev.select is None else f" select {ev.select:.4f}"
    log(f"{engine.cfg.name()} step {state.step}/{engine.cfg.train.steps} train {train_loss:.4f} val {ev.val:.4f}{select}")


# The outlier warning judges readings only after this many warmups: activation scales form during and after it
# (cpu profile, MAPL+VQ seed 1: boundary 0's max |z| grows 7 -> 244 over steps 250-700 with a 300-step warmup).
ALARM_AFTER_WARMUPS = 3


def outlier_alarm(state: LoopState, factor: float, after_step: int = 0) -> OutlierAlarm:
    """The early warning, primed with a resumed state's readings (its warnings derived again, so a resumed run
    records what an uninterrupted one would); readings up to ``after_step`` are not judged."""
    alarm = OutlierAlarm(factor, after_step=after_step)
    state.health_warnings = []
    for rec in state.health:
        _judge(alarm, state, rec["step"], rec["boundaries"])
    return alarm


def _judge(alarm: OutlierAlarm, state: LoopState, step: int, boundaries: list[dict]) -> list[dict]:
    if step <= alarm.after_step:
        return []
    raised = []
    for p, b in enumerate(boundaries):
        med = alarm.median(p)
        if alarm.check(p, b.get("train_max")):
            raised.append({"step": step, "boundary": p, "max": b["train_max"], "median": med})
    state.health_warnings.extend(raised)
    return raised


def _read_health(engine: Engine, state: LoopState, alarm: OutlierAlarm, log: Callable, evaluated: bool) -> None:
    """Every boundary's health window (collective), and a warning line for an outlier (observes only)."""
    boundaries = engine.health()
    if boundaries is None:                      # not the reporter
        return
    state.health.append({"step": state.step, "eval": evaluated, "boundaries": boundaries})
    for w in _judge(alarm, state, state.step, boundaries):
        p, b, med = w["boundary"], boundaries[w["boundary"]], w["median"]
        log(f"warning: {engine.cfg.name()} step {state.step}: boundary {p} max |z| {b['train_max']:.4g} is "
            f"{b['train_max'] / med:.1f}x its running median {med:.4g} (train.health_warn_factor="
            f"{alarm.factor:g}): an activation outlier is growing; see the README's 'Boundary health'")


def train(engine: Engine, state: LoopState | None = None, *, out: Path | None = None, log: Callable = print,
          progress: bool = True, started: float | None = None, on_step: Callable | None = None) -> dict | None:
    """Run the loop to the end, write the final checkpoint and the results (the reporter: ``out``, and the dict;
    None elsewhere). ``started``: when the run began, for ``wall_s``."""
    started = time.time() if started is None else started
    state = run_loop(engine, state or LoopState(), log=log, progress=progress, on_step=on_step)
    if engine.checkpointing:
        engine.save(state)
    results = engine.results(state, time.time() - started)
    if results is not None and out is not None:
        atomic_write_json(out, results)
    return results
