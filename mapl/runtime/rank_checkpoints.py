"""Per-stage checkpoints of the multi-process pipeline, written and resumed in agreement.

Each stage's state goes to ``<ckpt stem>.rank<s>.pt`` (s = stage; with data parallelism replica 0
writes, every replica reads, since replicas hold identical state); the previous one is kept as
``.rank<s>.prev.pt``. A save is all-or-nothing: every rank first checks its values finite, and if any
is not, no rank writes (the files on disk stay at one common step). As in the single process
(``mapl.checkpoint``), a checkpoint the loop has not yet confirmed goes to ``.rank<s>.unconfirmed.pt``
and is promoted (current -> previous, unconfirmed -> current: renames) when the next step's loss is
finite on every rank. A resume takes the newest step that every stage has, current or previous file,
and drops unconfirmed files left by a kill.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from .. import checkpoint
from ..loop import LoopState, NonFiniteError

__all__ = ["rank_ckpt_path", "RankCheckpoints"]


def rank_ckpt_path(ckpt: Path, stage: int, prev: bool = False) -> Path:
    """``checkpoints/run.pt`` -> ``checkpoints/run.rank1.pt`` (``.rank1.prev.pt`` for the previous one;
    ``checkpoint.unconfirmed_path`` of the current one is ``.rank1.unconfirmed.pt``)."""
    ckpt = Path(ckpt)
    stem = ckpt.with_suffix("") if ckpt.suffix == ".pt" else ckpt
    return stem.with_name(f"{stem.name}.rank{stage}{'.prev' if prev else ''}.pt")


class RankCheckpoints:
    def __init__(self, ckpt: Path, stage: int, stages: int, writer: bool, transport, log):
        self.ckpt, self.stage, self.stages, self.writer = Path(ckpt), stage, stages, writer
        self.transport, self.log = transport, log
        self.saved_step: int | None = None          # the last good (confirmed) step on disk
        self.unconfirmed_step: int | None = None

    @property
    def path(self) -> Path:
        return rank_ckpt_path(self.ckpt, self.stage)

    def remove(self) -> None:
        """``--fresh``: drop this stage's files (replica 0 owns them)."""
        if self.writer:
            for prev in (False, True):
                rank_ckpt_path(self.ckpt, self.stage, prev).unlink(missing_ok=True)
            checkpoint.unconfirmed_path(self.path).unlink(missing_ok=True)

    def _readable(self, allow_changes: bool, cfg) -> dict[int, tuple[Path, dict]]:
        have = {}
        for prev in (False, True):
            path = rank_ckpt_path(self.ckpt, self.stage, prev)
            if not path.exists():
                continue
            try:
                ck = checkpoint.read(path)
            except checkpoint.CheckpointError as e:      # a torn or foreign file: the other one may be fine
                print(f"rank {self.stage}: ignoring checkpoint {path}: {e}", file=sys.stderr)
                continue
            checkpoint.resume_changes(ck, path, cfg, allow_changes)      # refuses another config here
            have.setdefault(checkpoint.checkpoint_step(ck), (path, ck))
        return have

    def resume(self, cfg, model, optimizers, meter, allow_changes: bool, agree) -> LoopState | None:
        stale = checkpoint.unconfirmed_path(self.path)
        if self.writer and stale.exists():      # killed before the next step confirmed it
            stale.unlink()
            print(f"rank {self.stage}: dropped the unconfirmed checkpoint {stale} (the step after it never completed)",
                  file=sys.stderr)
        err, have = None, {}
        try:
            have = self._readable(allow_changes, cfg)
        except ValueError as e:
            err = str(e)
        agree(err)
        steps = self.transport.gather_object(sorted(have), "checkpoint steps")
        common = set(steps[0]).intersection(*map(set, steps[1:]))
        if not common:
            if any(steps):
                agree(f"per-rank checkpoints {self.ckpt} have no step in common (steps per rank: {steps}); delete "
                      "them or rerun with --fresh")
            return None
        path, ck = have[max(common)]
        state = checkpoint.restore(ck, path, cfg, model, optimizers, meter, allow_changes)
        self.saved_step = state.step
        self.log(f"resumed {self.stages} per-rank checkpoints "
                 f"{rank_ckpt_path(self.ckpt, 0).name.replace('rank0', 'rank*')} at step {state.step}")
        return state

    def save(self, cfg, model, optimizers, meter, state: LoopState, confirmed: bool = True) -> None:
        """Every rank checks its values finite first; all write, or none does. ``confirmed=False``: to
        the unconfirmed file, promoted by :meth:`confirm` (the loop calls it on every rank alike)."""
        self.transport.context = f"checkpoint after step {state.step}"
        bad = checkpoint.first_nonfinite(model, optimizers)
        found = self.transport.gather_object(bad and f"{bad} (stage {self.stage})", "checkpoint check")
        culprits = sorted({name for name in found if name})
        if culprits:
            kept = (f"the per-rank checkpoints keep step {self.saved_step}" if self.saved_step is not None
                    else "no checkpoint was written")
            raise NonFiniteError(f"non-finite values in {', '.join(culprits)} after step {state.step}: {kept}; lower "
                                 "the learning rate and resume with --resume-with-changes")
        path, prev = self.path, rank_ckpt_path(self.ckpt, self.stage, prev=True)
        unconfirmed = checkpoint.unconfirmed_path(path)
        if not confirmed:
            if self.writer:
                checkpoint.save(unconfirmed, cfg=cfg, model=model, optimizers=optimizers, meter=meter, state=state)
            self.unconfirmed_step = state.step
            return
        if self.writer:
            if path.exists():
                os.replace(path, prev)
            checkpoint.save(path, cfg=cfg, model=model, optimizers=optimizers, meter=meter, state=state)
            unconfirmed.unlink(missing_ok=True)
        self.saved_step, self.unconfirmed_step = state.step, None

    def confirm(self) -> None:
        if self.unconfirmed_step is None:
            return
        if self.writer:
            checkpoint.confirm(self.path, previous=rank_ckpt_path(self.ckpt, self.stage, prev=True))
        self.saved_step, self.unconfirmed_step = self.unconfirmed_step, None

    def drop_unconfirmed(self) -> None:
        if self.unconfirmed_step is not None and self.writer:
            checkpoint.unconfirmed_path(self.path).unlink(missing_ok=True)
        self.unconfirmed_step = None
