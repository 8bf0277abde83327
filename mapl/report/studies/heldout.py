"""Finished runs rescored on held-out windows: Δ% on each set, and the ledger's verdicts read again there."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from ..claims import NOT_TESTABLE, Evidence, claims, headline_contrast, study_contrast
from ..render import DASH, Table, fmt_delta, fmt_int, fmt_pct, fmt_pm
from ..rows import rescored_rows, run_key
from ..stats import summarize

__all__ = ["SET_LABELS", "NO_SCORES", "load_rescores", "heldout_table", "heldout_readings", "heldout_verdicts",
           "heldout_claims_table", "heldout_contrasts"]

SET_LABELS = {"heldout-kjv": "held-out text (KJV)", "unread-train": "unread training windows"}
NO_SCORES = ("no run group is rescored on this profile (params.yaml `rescore.<profile>` is empty; DVC stage "
             "rescore, `mapl rescore`).")


def load_rescores(root: str | Path, profile: str) -> dict[str, dict]:
    """run name -> its scores (``val_loss``, ``scores``: set -> loss, ``group``) under ``reports/<profile>/rescore/``."""
    out = {}
    for path in sorted((Path(root) / "reports" / profile / "rescore").glob("*.json")):
        doc = json.loads(path.read_text())
        for name, entry in (doc.get("runs") or {}).items():
            out[name] = {**entry, "group": doc.get("group", path.stem)}
    return out


def _sets(rescores: dict[str, dict]) -> list[str]:
    seen = {name for entry in rescores.values() for name in entry.get("scores", {})}
    return [s for s in SET_LABELS if s in seen]


def heldout_table(rows: Sequence[dict], rescores: dict[str, dict], redrawn: Sequence[dict] = ()) -> Table:
    """Each rescored configuration's Δ% on the validation split and on each held-out set (and a redraw's runs)."""
    rows = [*rows, *redrawn]
    sets = _sets(rescores)
    header = ["group", "configuration", "model", "steps", "seeds", "val Δ%", *[f"{SET_LABELS[s]} Δ%" for s in sets],
              *[f"{SET_LABELS[s]} loss" for s in sets]]
    base = rescored_rows(rows, rescores)
    by_set = {s: {run_key(x, with_seed=False): x for x in summarize(rescored_rows(rows, rescores, s))} for s in sets}
    body, moved = [], []
    for s in sorted(summarize(base), key=lambda x: (x["model"], x["steps"], x["method"] != "none", x["variant"])):
        key = run_key(s, with_seed=False)
        cells = [by_set[name].get(key) for name in sets]
        body.append([rescores[s["runs"][0]]["group"], s["variant"], s["model"], fmt_int(s["steps"]),
                     ",".join(map(str, s["seeds"])), fmt_delta(s),
                     *[fmt_delta(c) for c in cells], *[fmt_pm(c["val_loss"], c["val_loss_std"]) if c else DASH for c in cells]])
        for name, c in zip(sets, cells):
            if s["method"] != "none" and c and c["delta_pct"] is not None and s["delta_pct"] is not None:
                moved.append(f"{s['variant']} {fmt_pct(s['delta_pct'])} -> {fmt_pct(c['delta_pct'])} "
                             f"({SET_LABELS[name]})")
    caption = ("The same checkpoints scored on windows that no run trained, selected or reported on "
               "(mapl/orchestration/rescore.py): a held-out text for prose corpora (the King James Bible, one chapter "
               "in eight, in the run's tokens) and, for runs drawing by epochs under one epoch, the training windows "
               "the run never read. Δ%: mean ± sd over seeds, each seed against its own uncompressed run scored on the "
               "same windows; loss: mean ± sd over seeds. Each checkpoint reproduced its committed validation loss "
               "before it was scored.")
    takeaway = ("Δ% on the validation split -> on the held-out windows: " + "; ".join(moved) + "."
                if moved else "no compressed configuration with its uncompressed runs is rescored.")
    return Table("heldout", "Held-out rescoring: the same checkpoints on windows no choice saw", header,
                 body if sets else [], caption, takeaway if sets else NO_SCORES)


def _draws(rows: Sequence[dict], corpus_rows: Sequence[dict], redrawn: Sequence[dict]) -> list[tuple]:
    """(label, rows, corpus rows) per draw: the committed runs, then each redraw's."""
    draws = [("", rows, corpus_rows)]
    for draw in dict.fromkeys(r["draw"] for r in redrawn):
        mine = [r for r in redrawn if r["draw"] == draw]
        draws.append((draw, mine, mine))
    return draws


def _move(before: dict, after: dict) -> str:
    """``yes`` where the verdict moves, "no, its reason moves" where it stays on other grounds."""
    if after["verdict"] != before["verdict"]:
        return "yes"
    if after["grounds"] != before["grounds"]:
        return "no, its reason moves"
    return "no"


def heldout_readings(rows: Sequence[dict], corpus_rows: Sequence[dict], rescores: dict[str, dict],
                     redrawn: Sequence[dict] = (), ledger: Sequence[dict] | None = None) -> list[dict]:
    """Each claim the rescored runs can test, per set and draw: ``claim``, ``set``, ``where``, ``before`` (its
    validation ledger row), ``after`` (its row on the set), ``move``."""
    ledger = claims(rows, corpus_rows) if ledger is None else ledger
    out = []
    for draw, mine, corpus_mine in _draws(rows, corpus_rows, redrawn):
        # a redraw's held-out verdicts move from its own validation verdicts, not from another draw's
        before_ledger = {c["claim"]: c for c in (claims(mine, mine) if draw else ledger)}
        for name in _sets(rescores):
            where = SET_LABELS[name] + (f", draw {draw}" if draw else "")
            for c in claims(rescored_rows(mine, rescores, name), rescored_rows(corpus_mine, rescores, name)):
                before = before_ledger.get(c["claim"])
                if c["verdict"] != NOT_TESTABLE and before is not None:
                    out.append({"claim": c["claim"], "set": name, "where": where, "before": before, "after": c,
                                "move": _move(before, c)})
    return out


def heldout_verdicts(rows: Sequence[dict], corpus_rows: Sequence[dict], rescores: dict[str, dict],
                     redrawn: Sequence[dict] = (), ledger: Sequence[dict] | None = None) -> dict[str, dict[str, str]]:
    """The ledger's held-out columns: set label -> {claim: its verdict there} (every set the rescores have)."""
    out: dict[str, dict[str, str]] = {SET_LABELS[name]: {} for name in _sets(rescores)}
    for r in heldout_readings(rows, corpus_rows, rescores, redrawn, ledger):
        out[SET_LABELS[r["set"]]].setdefault(r["claim"], r["after"]["verdict"])
    return out


def heldout_claims_table(rows: Sequence[dict], corpus_rows: Sequence[dict], rescores: dict[str, dict],
                         redrawn: Sequence[dict] = (), ledger: Sequence[dict] | None = None) -> Table:
    """The ledger's verdicts on each held-out set beside the validation split's (a redraw: its own)."""
    header = ["paper's claim", "set", "verdict (validation)", "ours (set)", "verdict (set)", "moves"]
    body, moves = [], []
    for r in heldout_readings(rows, corpus_rows, rescores, redrawn, ledger):
        before, c, where = r["before"]["verdict"], r["after"], r["where"]
        if r["move"] == "yes":
            moves.append(f"{c['claim']}: {before} -> {c['verdict']} ({where})")
        elif r["move"] != "no":
            moves.append(f"{c['claim']}: {before} on both, its reason moves to: {c['reason']} ({where})")
        # the row's numbers are read from the held-out scores here, not from the table the ledger's row cites
        body.append([c["claim"], where, before, c["ours"], c["verdict"], r["move"]])
    caption = ("Each claim the rescored runs can test (3 or more seeds of what it reads), read again with the "
               "ledger's rules (claims.md) from their scores on the held-out windows (heldout.md), beside its "
               "verdict from the validation split: claims.md's for the committed runs; for a draw of a study made "
               "again on this machine (a redraw: its checkpoints are here), the verdict of that draw's own "
               "validation losses. The held-out ledger's families hold only its own rows, so its levels can differ "
               "from claims.md's. moves: yes where the verdict moves; \"no, its reason moves\" where it stays for "
               "another reason (an order contradicted by its size on validation and by its reversed sign here).")
    if not body:
        why = NO_SCORES if not rescores else "the rescored runs test no claim of the ledger."
        return Table("heldout-claims", "Held-out rescoring: whether the ledger's verdicts move", header, [], caption, why)
    takeaway = (f"{len(body)} verdict(s) read on held-out windows; "
                + (f"{len(moves)} move or change their reason: " + "; ".join(moves) + "." if moves else "none moves."))
    return Table("heldout-claims", "Held-out rescoring: whether the ledger's verdicts move", header, body, caption, takeaway)


def heldout_contrasts(rows: Sequence[dict], corpus_rows: Sequence[dict], rescores: dict[str, dict],
                      redrawn: Sequence[dict] = ()) -> dict[str, dict | None]:
    """set -> SSN − MAPL on its scores (the headline's, else the corpus study's; else the first redraw's)."""
    reads = (headline_contrast("ssn", "mapl"), study_contrast("corpus"))
    out: dict[str, dict | None] = {name: None for name in SET_LABELS}
    for name in SET_LABELS:
        for _, mine, corpus_mine in _draws(rows, corpus_rows, redrawn):
            ev = Evidence(rescored_rows(mine, rescores, name), rescored_rows(corpus_mine, rescores, name))
            out[name] = next((c for read in reads if (c := read(ev)) is not None), None)
            if out[name] is not None:
                break
    return out
