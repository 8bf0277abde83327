"""Per-stage checkpoints of the multi-process pipeline, written and resumed in agreement: ``<stem>.rank<s>.pt``
(replica 0 writes), the previous one kept as ``.rank<s>.prev.pt``. A save is all or nothing (if any rank holds a
non-finite value, none writes), confirmed as in one process; a resume takes the newest step every stage has."""
from __future__ import annotations

import sys
from pathlib import Path

from .. import checkpoint
from ..loop import LoopState, NonFiniteError

__all__ = ["rank_ckpt_path", "stage_slot", "all_stage_files", "RankCheckpoints"]


def rank_ckpt_path(ckpt: Path, stage: int, prev: bool = False) -> Path:
    """``run.pt`` -> ``run.rank1.pt`` (the previous one: ``run.rank1.prev.pt``)."""
    ckpt = Path(ckpt)
    stem = ckpt.with_suffix("") if ckpt.suffix == ".pt" else ckpt
    return stem.with_name(f"{stem.name}.rank{stage}{'.prev' if prev else ''}.pt")


def stage_slot(ckpt: Path, stage: int, writer: bool = True) -> checkpoint.CheckpointSlot:
    return checkpoint.CheckpointSlot(rank_ckpt_path(ckpt, stage), rank_ckpt_path(ckpt, stage, prev=True), writer)


def all_stage_files(ckpt: Path, stages: int) -> list[Path]:
    """Every checkpoint file of every stage."""
    return [p for s in range(stages) for p in stage_slot(ckpt, s).files()]


class RankCheckpoints:
    def __init__(self, ckpt: Path, stage: int, stages: int, writer: bool, transport, log):
        self.ckpt, self.stage, self.stages, self.writer = Path(ckpt), stage, stages, writer
        self.transport, self.log = transport, log
        self.slot = stage_slot(ckpt, stage, writer)

    def _readable(self, allow_changes: bool, cfg) -> dict[int, tuple[Path, dict]]:
        have = {}
        for path in (self.slot.path, self.slot.previous):
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
        stale = self.slot.drop_stale()          # killed before the next step confirmed it
        if stale:
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
        self.slot.saved_step = state.step
        self.log(f"resumed {self.stages} per-rank checkpoints "
                 f"{rank_ckpt_path(self.ckpt, 0).name.replace('rank0', 'rank*')} at step {state.step}")
        return state

    def save(self, cfg, model, optimizers, meter, state: LoopState, confirmed: bool = True) -> None:
        """Every rank checks its values finite first; all write, or none does."""
        bad = checkpoint.first_nonfinite(model, optimizers)
        with self.transport.during(f"checkpoint after step {state.step}"):
            found = self.transport.gather_object(bad and f"{bad} (stage {self.stage})", "checkpoint check")
        culprits = sorted({name for name in found if name})
        if culprits:
            kept = (f"the per-rank checkpoints keep step {self.slot.saved_step}" if self.slot.saved_step is not None
                    else "no checkpoint was written")
            raise NonFiniteError(f"non-finite values in {', '.join(culprits)} after step {state.step}: {kept}; lower "
                                 "the learning rate and resume with --resume-with-changes")
        self.slot.commit(lambda path: checkpoint.save(path, cfg=cfg, model=model, optimizers=optimizers, meter=meter,
                                                      state=state), state.step, confirmed)
