"""Checkpoints: written atomically and only when every value is finite; read back with one-line errors.

On resume the stored config is compared with this run's: identical resumes; only ``RESUMABLE_FIELDS`` differ:
resumes with ``--resume-with-changes`` (recorded in the results); anything else: refused, naming the fields.
Finite is not enough (an update can leave huge finite weights whose next forward is NaN), so the loop writes a
checkpoint *unconfirmed* (``run.unconfirmed.pt``) and promotes it over the last good one (``confirm``, a rename)
once a forward on its weights was finite: ``run.pt`` is always a checkpoint the run has gone on from.
"""
from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Callable, Iterable

import torch

from .config import EXECUTION_FIELDS, RESUMABLE_FIELDS, RunConfig, config_diff, config_hash
from ..base.io import atomic_torch_save
from .loop import LoopState, NonFiniteError

__all__ = ["FORMAT", "CheckpointError", "CheckpointSlot", "first_nonfinite", "save", "read", "unconfirmed_path",
           "with_added_fields", "resume_changes", "restore", "checkpoint_step"]

FORMAT = "mapl-checkpoint-v2"
_REQUIRED = ("format", "config", "config_hash", "model", "optimizers", "meter", "state")
_STATE_KEYS = ("step", "train_curve", "val_curve", "train_wall")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used for this run; the message names the file and the fix."""


# ---- finite checks ----------------------------------------------------------------------------------
def _float_tensors(model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]):
    names = {id(p): n for n, p in model.named_parameters()}
    for name, t in model.state_dict().items():
        if isinstance(t, torch.Tensor):          # extra state (e.g. RVQ counters) may be plain Python
            yield name, t
    for i, opt in enumerate(optimizers):
        for p, st in opt.state.items():
            for key, t in st.items():
                if isinstance(t, torch.Tensor):
                    yield f"{type(opt).__name__} {key} of {names.get(id(p), f'optimizer {i} parameter')}", t


def first_nonfinite(model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> str | None:
    """The first parameter, buffer or optimizer state holding NaN/Inf (None if all finite), in one host sync."""
    items = [(n, t) for n, t in _float_tensors(model, optimizers) if t.is_floating_point() and t.numel()]
    if not items:
        return None
    flags = torch.stack([torch.isfinite(t).all().to(items[0][1].device) for _, t in items])
    if bool(flags.all()):
        return None
    return items[int((~flags).nonzero()[0, 0])][0]


# ---- save / read / restore --------------------------------------------------------------------------
def save(path: Path, *, cfg: RunConfig, model: torch.nn.Module, optimizers: list, meter, state: LoopState,
         where: Callable[[str], str] = lambda name: "", last_good: int | None = None) -> None:
    """Check every value finite, then write atomically. ``where(name)``: which stage holds a tensor (for the
    message); ``last_good``: the step of the checkpoint on disk."""
    bad = first_nonfinite(model, optimizers)
    if bad is not None:
        kept = f"{path} keeps step {last_good}" if last_good is not None else f"no checkpoint was written to {path}"
        raise NonFiniteError(f"non-finite values in {bad}{where(bad)} after step {state.step}: the checkpoint is not "
                             f"updated ({kept}); lower the learning rate and resume with --resume-with-changes")
    atomic_torch_save({"format": FORMAT, "config": cfg.to_dict(), "config_hash": config_hash(cfg),
                       "model": model.state_dict(), "optimizers": [o.state_dict() for o in optimizers],
                       "meter": meter.state_dict(), "state": state.to_dict()}, path)


def unconfirmed_path(path: Path) -> Path:
    """``run.pt`` -> ``run.unconfirmed.pt``."""
    path = Path(path)
    stem = path.with_suffix("") if path.suffix == ".pt" else path
    return stem.with_name(f"{stem.name}.unconfirmed.pt")


class CheckpointSlot:
    """One checkpoint's files and the confirmation protocol, for an engine or a stage: the last good file at
    ``path``, the unconfirmed one beside it, optionally the ``previous`` one. ``writer`` False: a replica that
    only follows (replica 0 writes)."""

    def __init__(self, path: Path, previous: Path | None = None, writer: bool = True):
        self.path, self.previous, self.writer = Path(path), previous, writer
        self.saved_step: int | None = None          # the last good (confirmed) checkpoint's step
        self.unconfirmed_step: int | None = None    # written, not yet confirmed

    @property
    def unconfirmed(self) -> Path:
        return unconfirmed_path(self.path)

    def files(self) -> list[Path]:
        return [self.path, *([self.previous] if self.previous else []), self.unconfirmed]

    def commit(self, write: Callable[[Path], None], step: int, confirmed: bool) -> None:
        if not confirmed:
            if self.writer:
                write(self.unconfirmed)
            self.unconfirmed_step = step
            return
        if self.writer:
            if self.previous is not None and self.path.exists():
                os.replace(self.path, self.previous)
            write(self.path)
            self.unconfirmed.unlink(missing_ok=True)
        self.saved_step, self.unconfirmed_step = step, None

    def confirm(self) -> None:
        if self.unconfirmed_step is None:
            return
        if self.writer:                  # renames only: atomic on one file system
            if self.previous is not None and self.path.exists():
                os.replace(self.path, self.previous)
            os.replace(self.unconfirmed, self.path)
        self.saved_step, self.unconfirmed_step = self.unconfirmed_step, None

    def drop_unconfirmed(self) -> None:
        if self.unconfirmed_step is not None and self.writer:
            self.unconfirmed.unlink(missing_ok=True)
        self.unconfirmed_step = None

    def drop_stale(self) -> Path | None:
        """At resume: delete the unconfirmed file a killed run left; its path."""
        if self.writer and self.unconfirmed.exists():
            self.unconfirmed.unlink()
            return self.unconfirmed
        return None

    def remove(self) -> None:
        if self.writer:
            for path in self.files():
                path.unlink(missing_ok=True)


def read(path: Path) -> dict:
    """Load a checkpoint (``weights_only``) and check its shape, or a one-line error."""
    _check_crc(path)
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:          # noqa: BLE001 -- torch raises many types for a bad file
        raise _unloadable(path, e) from None
    if not isinstance(ck, dict) or not str(ck.get("format", "")).startswith("mapl-checkpoint"):
        raise CheckpointError(f"checkpoint {path} is not a mapl checkpoint; delete it or use --fresh")
    if ck["format"] != FORMAT:
        raise CheckpointError(f"checkpoint {path} was written by an older mapl (format {ck['format']}, without its "
                              f"configuration): it cannot be resumed; delete it or use --fresh")
    missing = [k for k in _REQUIRED if k not in ck] + \
        [f"state.{k}" for k in _STATE_KEYS if not isinstance(ck.get("state"), dict) or k not in ck["state"]]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing}: it is damaged or was not written by mapl; delete "
                              "it or use --fresh")
    step = ck["state"]["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint {path}: state.step={step!r} is invalid: must be an integer >= 0 (a damaged "
                              "or edited file); delete it or use --fresh")
    bad = _first_nonfinite_saved(ck)
    if bad is not None:     # save() never writes one; a file edited or damaged on disk must not resume a run
        raise CheckpointError(f"checkpoint {path} holds non-finite values in {bad}: it was not written that way by "
                              "mapl (a damaged or edited file); delete it or use --fresh")
    return ck


def _unloadable(path: Path, e: BaseException) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} cannot be loaded safely (truncated, foreign, or needs pickled objects): "
                           f"{type(e).__name__}: {str(e)[:200]}. Delete it or use --fresh")


def _check_crc(path: Path) -> None:
    """torch.save writes a zip whose records carry CRC-32s, but torch.load does not check them: a flipped bit in a
    weight loads as another weight. Python's zipfile checks them (one read of the file, at resume only)."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except Exception as e:          # noqa: BLE001 -- a damaged archive fails in many ways (BadZipFile, OSError, ...)
        raise _unloadable(path, e) from None
    if bad is not None:
        raise CheckpointError(f"checkpoint {path}: its record {bad} fails its CRC-32 check (the file was damaged after "
                              "it was written); delete it or use --fresh")


def _first_nonfinite_saved(ck: dict) -> str | None:
    def tensors(obj, name):
        if isinstance(obj, torch.Tensor):
            yield name, obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                yield from tensors(v, f"{name}.{k}" if name else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                yield from tensors(v, f"{name}[{i}]")
    for name, t in tensors({"model": ck.get("model"), "optimizers": ck.get("optimizers")}, ""):
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            return name
    return None


def checkpoint_step(ck: dict) -> int:
    return int(ck["state"]["step"])


def with_added_fields(old: dict, defaults: dict) -> dict:
    """A checkpoint's config with the fields added since it was written at their defaults (what they kept)."""
    out = dict(old)
    for key, value in defaults.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict) and key != "model_overrides":
            out[key] = with_added_fields(out[key], value)
    return out


def resume_changes(ck: dict, path: Path, cfg: RunConfig, allow_changes: bool) -> dict[str, list]:
    """Dotted field -> [old, new] for the settings that differ, if resuming with them is allowed; else CheckpointError."""
    if ck["config_hash"] == config_hash(cfg):
        return {}
    old = with_added_fields(ck["config"], RunConfig().to_dict())
    diff = {k: [a, b] for k, (a, b) in config_diff(old, cfg.to_dict()).items() if k not in EXECUTION_FIELDS}
    fixed = sorted(k for k in diff if k not in RESUMABLE_FIELDS)
    shown = ", ".join(f"{k} {diff[k][0]!r} -> {diff[k][1]!r}" for k in (fixed or sorted(diff))[:6])
    if fixed:
        raise CheckpointError(f"checkpoint {path} was written by another config ({shown}); only "
                              f"{', '.join(sorted(RESUMABLE_FIELDS))} may change on resume (with "
                              "--resume-with-changes). Use another --ckpt path or --fresh")
    if not allow_changes:
        raise CheckpointError(f"checkpoint {path} was written with other settings ({shown}); to continue it with "
                              "these, pass --resume-with-changes (recorded in the results), or use --fresh")
    return diff


def restore(ck: dict, path: Path, cfg: RunConfig, model: torch.nn.Module, optimizers: list, meter,
            allow_changes: bool = False) -> LoopState:
    """Load ``ck`` into the model, optimizers and meter; the loop state to continue from."""
    changes = resume_changes(ck, path, cfg, allow_changes)
    try:
        model.load_state_dict(ck["model"])
    except (RuntimeError, KeyError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:300]
        raise CheckpointError(f"checkpoint {path} does not fit this model ({first}); use --fresh") from None
    if len(ck["optimizers"]) != len(optimizers):
        raise CheckpointError(f"checkpoint {path} holds {len(ck['optimizers'])} optimizer states, this run has "
                              f"{len(optimizers)}; use --fresh")
    for opt, saved in zip(optimizers, ck["optimizers"]):
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        try:
            opt.load_state_dict(saved)
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path}: optimizer state does not fit ({str(e)[:200]}); use --fresh") \
                from None
        for group, hyper in zip(opt.param_groups, fresh):      # this run's settings (a resume may change LRs)
            group.update(hyper)
    if checkpoint_step(ck) > cfg.train.steps:       # the loop would end at once and report the checkpoint's step count
        raise CheckpointError(f"checkpoint {path}: state.step={checkpoint_step(ck)} is beyond this run's "
                              f"train.steps={cfg.train.steps}: it trained further than the run asks; raise train.steps "
                              "(with --resume-with-changes), use another --ckpt path, or --fresh")
    meter.load_state_dict(ck["meter"])
    try:
        state = LoopState.from_dict(ck["state"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: its loop state is damaged ({type(e).__name__}: {str(e)[:120]}); "
                              "delete it or use --fresh") from None
    if changes:
        state.resumed_with_changes.append({"step": state.step, "changes": changes})
    return state
