"""The frozen-trunk study: only A_p and the anchors train on a frozen uncompressed model; Δ% against its trunk."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Sequence

from ..figures import empty_note, new_figure
from ..render import DASH, Plot, Table, fmt, fmt_ci, fmt_int, fmt_pm
from ..stats import spread, t_interval
from ..style import NEUTRAL, PROJECTOR_LABELS, PROJECTOR_VARIANTS, bars_handle, bars_text, style
from .controls import PAIRED_HEADER, paired_body, study_comparisons
from .headline import reading, tested_comparisons

__all__ = ["FROZEN_PROJECTORS", "FROZEN_COMPARISONS", "load_frozen", "load_frozen_tuning", "setting_label",
           "frozen_summaries", "frozen_comparison", "frozen_table", "frozen_tuning_table", "frozen_paired_table",
           "frozen_plot"]

FROZEN_PROJECTORS = ("spel", "fixed", "unconstrained")
# (A, B, what the difference isolates), read A − B (positive: B ahead)
FROZEN_COMPARISONS = (("fixed", "spel", "learning the subspace, without co-adaptation"),
                      ("unconstrained", "spel", "the Stiefel constraint, without co-adaptation"))
NO_RUNS = "the frozen-trunk study has not run for this profile (DVC stage frozen_trunk)."


def load_frozen(root: str | Path, profile: str) -> list[dict]:
    """Every boundary run of the profile's study, by seed and projector; empty when it has not run."""
    folder = Path(root) / "reports" / profile / "frozen-trunk"
    rows = [json.loads(path.read_text()) for path in folder.glob("frozen-*.json")]
    order = {p: i for i, p in enumerate(FROZEN_PROJECTORS)}
    return sorted(rows, key=lambda r: (r["seed"], order.get(r["projector"], 99), r["run"]))


def load_frozen_tuning(root: str | Path, profile: str) -> dict[str, dict]:
    """projector -> its tuning (``seed``, ``candidates``, ``chosen``) from ``tuning.json``; empty without one."""
    path = Path(root) / "reports" / profile / "frozen-trunk" / "tuning.json"
    return json.loads(path.read_text()) if path.exists() else {}


def setting_label(override: dict | None) -> str:
    """A candidate's override as the tables name it: ``lr_mult 0.3`` (none: ``spec``)."""
    if not override:
        return "spec"
    return ", ".join(f"{key.rsplit('.', 1)[-1]} {value:g}" if isinstance(value, float) else f"{key.rsplit('.', 1)[-1]} {value}"
                     for key, value in sorted(override.items()))


def frozen_summaries(runs: Sequence[dict]) -> dict[str, dict]:
    """projector -> its summary: Δ% against its trunk per seed, mean and std, losses before and after."""
    out = {}
    for proj in FROZEN_PROJECTORS:
        mine = [r for r in runs if r["projector"] == proj]
        if not mine:
            continue
        deltas = {r["seed"]: r["delta_pct"] for r in mine}
        settings = {setting_label(r.get("override")) for r in mine}
        if len(settings) > 1:
            raise ValueError(f"frozen trunk: {proj} runs with different settings {sorted(settings)} (one study per folder)")
        out[proj] = {"variant": f"frozen-{proj}", "name": proj, "steps": mine[0]["steps"], "ratio": mine[0]["ratio"],
                     "setting": settings.pop(),
                     "seeds": sorted(deltas), "deltas": deltas, "n": len(deltas),
                     "delta_pct": statistics.fmean(deltas.values()), "delta_std": spread(list(deltas.values())),
                     "val_before": statistics.fmean(r["val_before"] for r in mine),
                     "val_loss": statistics.fmean(r["val_loss"] for r in mine),
                     "val_loss_std": spread([r["val_loss"] for r in mine]),
                     "trunk_loss": statistics.fmean(r["trunk"]["val_loss"] for r in mine),
                     "trunk_steps": mine[0]["trunk"].get("steps"), "trunk": mine[0]["trunk"]["run"],
                     "trainable_params": mine[0]["trainable_params"]}
    return out


def _comparisons(runs: Sequence[dict]) -> list[dict]:
    return tested_comparisons(study_comparisons(frozen_summaries(runs), FROZEN_COMPARISONS), None)


def frozen_comparison(runs: Sequence[dict], projector: str = "fixed") -> dict | None:
    """``projector`` − SPEL at the study's Holm level (the ledger re-reads it at its family's); None without runs."""
    return next((c for c in _comparisons(runs) if c["a"]["name"] == projector), None)


def frozen_table(runs: Sequence[dict]) -> Table:
    """One row per projector: what trains, the losses before and after, Δ% against the trunk."""
    sums = frozen_summaries(runs)
    header = ["projector", "setting", "ratio", "trainable params", "steps", "seeds", "trunk val loss", "val loss before",
              "val loss after", "Δ% vs trunk", "Δ% 95% CI"]
    body = [[PROJECTOR_LABELS[p], s["setting"], f"{s['ratio']:g}×", fmt_int(s["trainable_params"]), fmt_int(s["steps"]),
             ",".join(map(str, s["seeds"])), fmt(s["trunk_loss"], 4), fmt(s["val_before"], 4),
             fmt_pm(s["val_loss"], s["val_loss_std"]), fmt_pm(s["delta_pct"], s["delta_std"], 2, pct=True),
             fmt_ci(t_interval(list(s["deltas"].values())))] for p, s in sums.items()]
    trunk = next(iter(sums.values()), None)
    caption = ("A trained uncompressed model (the trunk, one per seed: "
               f"{trunk['trunk'] if trunk else DASH} and its seeds) frozen; MAPL's boundaries inserted and only the "
               "projectors A_p and the anchors trained (the fixed basis: the anchors only). Setting: the boundary spec's "
               "(spec) or the override chosen on the first seed's selection split (frozen-trunk-tuning.md). Δ% against "
               "the trunk's own validation loss; val loss before: the inserted boundaries untrained.")
    takeaway = ("; ".join(f"{PROJECTOR_LABELS[p]} {fmt_pm(s['delta_pct'], s['delta_std'], 2, pct=True)} (n = {s['n']})"
                          for p, s in sums.items()) + "." if body else NO_RUNS)
    return Table("frozen-trunk", "When does learning the subspace pay? Boundaries on a frozen trunk", header, body,
                 caption, takeaway)


def frozen_tuning_table(tuning: dict[str, dict]) -> Table:
    """Every candidate of every tuned projector on the first seed: its selection loss (what chose) and val loss."""
    header = ["projector", "setting", "seed", "selection loss", "val loss", "chosen"]
    body = [[PROJECTOR_LABELS.get(proj, proj), setting_label(c["override"]), str(t["seed"]), fmt(c["select_loss"], 4),
             fmt(c["val_loss"], 4), "✓" if c["override"] == t["chosen"] else ""]
            for proj, t in tuning.items() for c in t["candidates"]]
    caption = ("Each projector's learning rate on the frozen trunk (the fixed basis has none: its anchors' LR): the "
               "boundary spec (spec: the profile's settings, tuned for joint training) and each override of "
               "frozen_trunk.<profile>.tune, trained on the first seed; the lowest selection loss is run on every seed, "
               "the validation loss is shown and never used to choose.")
    takeaway = ("; ".join(f"{PROJECTOR_LABELS.get(proj, proj)}: {setting_label(t['chosen'])} chosen of "
                          f"{len(t['candidates'])}" for proj, t in tuning.items()) + "." if tuning
                else "no projector was tuned (frozen_trunk.<profile>.tune is empty, or the study has not run).")
    return Table("frozen-trunk-tuning", "Frozen trunk: each projector's learning rate, tuned on the first seed", header,
                 body, caption, takeaway)


def frozen_paired_table(runs: Sequence[dict]) -> Table:
    """fixed − SPEL and unconstrained − SPEL on the same seed and trunk, one exploratory family (Holm)."""
    comps = _comparisons(runs)
    caption = ("Differences of Δ% on the same seed and trunk (positive: B ahead); the two are one exploratory "
               "family, each interval at its Holm-adjusted level.")
    takeaway = ("; ".join(f"{_name(c['a'])} − {_name(c['b'])}: {c['mean']:+.2f} points "
                          f"{fmt_ci(c['ci'])}, {reading(c, _name)}" for c in comps) + "." if comps else NO_RUNS)
    return Table("frozen-trunk-paired", "Frozen trunk: paired comparisons", PAIRED_HEADER, paired_body(comps, _name),
                 caption, takeaway)


def _name(s: dict) -> str:
    return PROJECTOR_LABELS[s["name"]]


def frozen_plot(runs: Sequence[dict]) -> Plot:
    """Validation loss against boundary-training step, a line per projector (mean over seeds); the trunk's dotted."""
    fig, (ax,) = new_figure(1, width=6.0, height=3.8)
    caption = ("Validation loss while only the boundaries train on the frozen trunk (mean over seeds, bars ±1 sd; "
               "step 0: boundaries inserted, untrained); dotted: the trunk itself, uncompressed.")
    sums = frozen_summaries(runs)
    if not sums:
        empty_note(ax, "the frozen-trunk study has not run")
        return Plot("frozen-trunk", caption, NO_RUNS, fig, empty=True)
    for i, proj in enumerate(sums):
        mine = [r for r in runs if r["projector"] == proj]
        steps = [0] + [s for s, _ in mine[0]["val_loss_curve"]]
        curves = [[r["val_before"]] + [v for _, v in r["val_loss_curve"]] for r in mine]
        sd = [statistics.stdev(vals) if len(vals) > 1 else 0.0 for vals in zip(*curves)]
        shift = 0.012 * steps[-1] * (i - (len(sums) - 1) / 2)    # side by side, so the bars do not hide each other
        ax.errorbar([x + shift for x in steps], [statistics.fmean(vals) for vals in zip(*curves)],
                    yerr=sd if len(mine) > 1 else None, capsize=3, ms=5, lw=1.2,
                    label=f"{PROJECTOR_LABELS[proj]} ({len(mine)} seeds)", **style(PROJECTOR_VARIANTS[proj]))
    ax.axhline(next(iter(sums.values()))["trunk_loss"], color=NEUTRAL["guide"], linestyle=":", linewidth=1,
               label="trunk (uncompressed)")
    ax.set_xlabel("boundary-training step")
    ax.set_ylabel("validation loss (nats / token)")
    ax.set_title("Boundaries trained on a frozen trunk")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles + [bars_handle()], labels + [bars_text("sd")], fontsize=8)
    best = min(sums.values(), key=lambda s: s["delta_pct"])
    takeaway = f"lowest mean Δ% after {fmt_int(best['steps'])} steps: {_name(best)} ({best['delta_pct']:+.2f} %)."
    return Plot("frozen-trunk", caption, takeaway, fig)
