"""The tuning protocol (groups tune, tune2) and the budget-matched check of the tuned cells (group lr_check)."""
from __future__ import annotations

import statistics
from typing import Sequence

from ..render import DASH, Table, fmt, fmt_ci, fmt_int, fmt_pm
from ..rows import sort_key, study_role
from ..stats import t_interval
from ..style import label
from .main_budget import NO_RUNS

__all__ = ["tuning_score", "tuning_table", "lr_check_table"]


def tuning_score(r: dict) -> float:
    """A tuning cell's score: its selection-set loss (older results: its loss on the tuning slice)."""
    return r["select_loss"] if r.get("select_loss") is not None else r["val_loss"]


def _tuning_takeaway(tune: Sequence[dict], rows: Sequence[dict]) -> str:
    parts, unmatched = [], []
    for variant in dict.fromkeys(r["variant"] for r in tune):
        runs = [r for r in tune if r["variant"] == variant]
        best = min(runs, key=tuning_score)
        fields = ("lr_muon", "lr_embed", "lr_head") + (("proj_lr_mult",) if best["projector"] else ())

        def _cell(r: dict) -> tuple:
            return tuple(r.get(f) for f in fields)
        parts.append(f"{label(variant, best['wire_ratio'])} μ {best['lr_muon']:g}, emb {best['lr_embed']:g} "
                     f"({tuning_score(best):.3f}, best of {len(runs)} cells)")
        main = [r for r in rows if r["group"] == "main" and r["variant"] == variant
                and r["wire_ratio"] == best["wire_ratio"]]
        if main and any(_cell(m) != _cell(best) for m in main):
            used = next((r for r in runs if _cell(r) == _cell(main[0])), None)
            gap = tuning_score(used) - tuning_score(best) if used else 0.0
            unmatched.append(label(variant, best["wire_ratio"]) + (
                f" (their cell μ {used['lr_muon']:g}, emb {used['lr_embed']:g} scored {tuning_score(used):.4f}, "
                f"{gap:+.4f} = {100 * gap / tuning_score(best):+.2f}% behind the best)" if used else ""))
    tail = (f" The main runs of {'; '.join(unmatched)} do not use their best cell." if unmatched
            else " The main runs use each tuned method's best cell.")
    return "Best on the selection tokens: " + "; ".join(parts) + "." + tail


def _scored_on(tune: Sequence[dict]) -> str:
    if tune and all(r.get("select_loss") is not None for r in tune):
        return "the selection set (every second 128-token window of the whole validation split)"
    offset = next((r["eval_offset"] for r in tune if r["eval_offset"]), None)
    return f"validation tokens from {fmt_int(offset)} on (the old tuning slice)" if offset else "the validation split"


def tuning_table(rows_all: Sequence[dict]) -> Table:
    """Every tuning cell's learning rates and score, the best per method marked."""
    tune = sorted([r for r in rows_all if r["group"] in ("tune", "tune2")],
                  key=lambda r: (sort_key(r)[:5], tuning_score(r)))
    best = {v: min((r for r in tune if r["variant"] == v), key=tuning_score)["run"]
            for v in {r["variant"] for r in tune}}
    header = ["method", "stage", "lr muon", "lr embed", "lr head", "proj. lr mult", "steps", "loss (selection)",
              "best"]
    body = [[label(r["variant"], r["wire_ratio"]), r["group"], r["lr_muon"], r["lr_embed"], r["lr_head"],
             r["proj_lr_mult"] if r["projector"] else DASH, r["steps"], fmt(tuning_score(r)),
             "★" if best[r["variant"]] == r["run"] else ""] for r in tune]
    caption = (f"Stage 1 (``tune``): the same 2 × 2 grid over the Muon and embedding learning rates for every "
               f"method family; stage 2 (``tune2``): one step past the best cell along each knob where it sat on "
               f"the grid's edge, plus one run on a third knob. Judged on {_scored_on(tune)}, which no reported "
               f"number uses.")
    reported = [r for r in rows_all if not r["eval_offset"] and study_role(r["group"]) != "tuning"]
    return Table("tuning", "Tuning protocol", header, body, caption,
                 _tuning_takeaway(tune, reported) if tune else NO_RUNS.format("tune"))


def _spel_step(r: dict) -> float | None:
    """SPEL's projector step multiplier of a run with a learned projector."""
    return r.get("proj_lr_mult") if r["projector"] == "spel" else None


def _cell_text(r: dict, named: bool = False) -> str:
    """A tuning cell as ``μ, emb[, SPEL ×m]``; ``named``: each value after its name."""
    step = _spel_step(r)
    mu, emb = (f"μ {r['lr_muon']:g}", f"emb {r['lr_embed']:g}") if named else (f"{r['lr_muon']:g}", f"{r['lr_embed']:g}")
    return f"{mu}, {emb}" + (f", SPEL ×{step:g}" if step is not None else "")


def lr_check_table(rows_all: Sequence[dict]) -> Table:
    """Each check cell (group ``lr_check``) against the tuned run of its seed: check − tuned on the selection set."""
    checks = [r for r in rows_all if r["group"] == "lr_check"]
    header = ["method", "check cell (μ, emb[, SPEL])", "tuned cell", "steps", "seeds", "check − tuned (selection)",
              "95% CI", "reading"]
    body, sentences = [], []
    def cell_of(r: dict) -> tuple:          # one row per checked cell: a method may be checked at several
        return r["variant"], r["wire_ratio"], r["lr_muon"], r["lr_embed"], _spel_step(r)

    def configuration(r: dict) -> tuple:
        return r["variant"], r["model"], r["stages"], r["wire_ratio"], r["steps"]
    for cell in dict.fromkeys(map(cell_of, checks)):
        variant = cell[0]
        mine = [r for r in checks if cell_of(r) == cell]
        # seed -> the reported run of the check's configuration (reported studies train at the tuned cells)
        tuned = {r["seed"]: r for r in rows_all if study_role(r["group"]) == "reported" and not r["eval_offset"]
                 and configuration(r) == configuration(mine[0])}
        pairs = [(r, tuned[r["seed"]]) for r in mine if r["seed"] in tuned]
        diffs = [tuning_score(a) - tuning_score(b) for a, b in pairs]
        ci = t_interval(diffs)
        worse = ci is not None and ci[0] > 0
        better = ci is not None and ci[1] < 0
        reading = ("tuned cell better" if worse else "check cell better: retune at this budget" if better
                   else "not resolved" if ci else DASH)
        name = label(variant, mine[0]["wire_ratio"])
        t0 = pairs[0][1] if pairs else None
        body.append([name, _cell_text(mine[0]), _cell_text(t0) if t0 else DASH, fmt_int(mine[0]["steps"]),
                     ",".join(str(a["seed"]) for a, _ in pairs),
                     fmt_pm(statistics.fmean(diffs), statistics.stdev(diffs) if len(diffs) > 1 else None, 4)
                     if diffs else DASH, fmt_ci(ci, 4) if ci else DASH, reading])
        if diffs:
            sentences.append(f"{name} at {_cell_text(mine[0], named=True)}: {reading} ({len(diffs)} seeds)")
    caption = ("Each method at another cell (the other method's winning knob; SSN also at the step past its "
               "300-step winner; MAPL also at SPEL's projector step multiplier on each side of its tuned one; at "
               "16×, SSN and MAPL at half and twice the Muon LR tuned at 8×), at the headline budget, against its "
               "tuned run of the same ratio and seed (group long; at 4× and 16× group frontier); losses on the "
               "selection set at the last step.")
    return Table("lr-check", "Budget-matched learning-rate check", header, body, caption,
                 "; ".join(sentences) + "." if sentences else NO_RUNS.format("lr_check"))
