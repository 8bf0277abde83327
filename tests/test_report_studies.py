"""The control studies (decomposition, learned against fixed, frontier, corpus, blocks), the frozen trunk and the
held-out rescoring's table: each read from the right runs, at the right ratio and seeds."""
import json
import statistics

import pytest

from mapl import report as R
from tests.helpers.report_data import frozen_run, rescored, scaled_rvq_row, study_row, study_rows


def test_decomposition_isolates_each_ingredient_against_the_headlines_own_runs():
    rows = [r for r in study_rows() if r["data_source"] == ""]
    table = R.decomposition_table(rows)
    assert [b[0] for b in table.body] == ["Uncompressed", "Uncompressed + anchors", "SSN", "SSN + anchors",
                                          "SSN + anchors, parameter-matched", "MAPL, one shared fixed subspace", "MAPL"]
    # every Δ% is against the plain uncompressed run of the seed, never "uncompressed + anchors"
    wide = next(b for b in table.body if b[0] == "SSN + anchors, parameter-matched")
    assert wide[1] == "tiny[ffn_hidden=724]" and wide[9] != "—"
    comps = {(c[0]): c for c in R.decomposition_paired_table(rows).body}
    assert len(comps) == 7
    # SSN - (SSN + anchors): the anchors are 0.02 of loss better on every seed
    diffs = [100 * (0.10 + 0.001 * s) / n - 100 * (0.08 + 0.002 * s) / n for s, n in enumerate([3.50, 3.52, 3.48])]
    assert comps["SSN − SSN + anchors"][3] == ", ".join(f"{d:+.2f}" for d in diffs)
    # one exploratory family: seven Holm levels, the strictest 1 - 0.05/7
    levels = sorted(float(c[5].split("(")[1].rstrip("%)")) for c in comps.values())
    assert levels[-1] == pytest.approx(100 * (1 - 0.05 / 7), abs=0.05)
    # before decompose_capacity lands (no "+ anchors" uncompressed, no widened SSN) the family is still seven
    partial = [r for r in rows if r["variant"] != "none-anchor-factorized" and not r["model"].endswith("]")]
    partial_levels = [float(c[5].split("(")[1].rstrip("%)")) for c in R.decomposition_paired_table(partial).body]
    assert len(partial_levels) == 5 and max(partial_levels) == pytest.approx(100 * (1 - 0.05 / 7), abs=0.05)
    # MAPL at 4x at the same budget (learned_fixed_4x) is not the decomposition's MAPL (8x), whatever the row order
    for order in (rows, rows[::-1]):
        assert next(b for b in R.decomposition_table(order).body if b[0] == "MAPL")[3] == "8×"
        assert all(c[0] != "MAPL" for c in R.decomposition_paired_table(order).body)
    before = R.decomposition_paired_table(rows).body
    assert R.decomposition_paired_table(rows[::-1]).body == before
    ledger = {c["claim"]: c for c in R.claims(rows)}
    row = ledger["MAPL's lead over SSN is more than its anchors (SSN given MAPL's anchors still trails)"]
    assert row["verdict"] in ("reproduced", "inconclusive") and row["ours"].startswith("SSN + anchors − MAPL: +")


def test_capacity_control_on_more_seeds_pairs_with_the_headlines_mapl_of_those_seeds():
    rows = [r for r in study_rows() if r["data_source"] == ""]
    for s in range(3, 8):                  # seeds the decomposition never ran: the headline's and the control's only
        none = 3.50 + 0.005 * s
        rows += [study_row("long", "none", seed=s, loss=none), study_row("long", "ssn", 8, seed=s, loss=none + 0.1),
                 study_row("long", "mapl", 8, seed=s, loss=none + 0.05),
                 study_row("decompose_capacity", "ssn", 8, seed=s, loss=none + 0.06, anchor="factorized",
                            overrides={"ffn_hidden": 724}, name=f"wide-s{s}")]
    comps = {c[0]: c for c in R.decomposition_paired_table(rows).body}
    assert comps["SSN + anchors, parameter-matched − MAPL"][2] == "0,1,2,3,4,5,6,7"
    assert comps["SSN + anchors − MAPL"][2] == "0,1,2"          # the unwidened control has seeds 0-2 only
    c = R.study_comparison(rows, "decompose_capacity")
    assert c["n"] == 8 and c["a"]["name"] == "ssn+anchors, matched"
    ledger = {c["claim"]: c for c in R.claims(rows)}
    row = next(v for k, v in ledger.items() if k.startswith("MAPL's lead over SSN is more than its parameters"))
    anchors = ledger["MAPL's lead over SSN is more than its anchors (SSN given MAPL's anchors still trails)"]
    # one paper claim, two rows: one family, read at Holm's levels
    assert row["family"] == anchors["family"] and "n = 8" in row["ours"]


def test_frontier_reads_every_ratio_on_the_groups_seeds_only(tmp_path):
    rows = [r for r in study_rows() if r["data_source"] == ""]      # long's 8x and learned_fixed_4x's MAPL 4x
    for s in range(5, 8):                  # seeds the frontier never trained: never on its points
        rows += [study_row("long", "none", seed=s, loss=3.5), study_row("long", "mapl", 8, seed=s, loss=9.0)]
    for s, none in enumerate([3.50, 3.52, 3.48]):
        rows += [study_row("frontier", "ssn", 4, seed=s, loss=none + 0.07 + 0.001 * s),
                 scaled_rvq_row("frontier", 4, s, none + 0.04),
                 study_row("frontier", "ssn", 16, seed=s, loss=none + 0.20 + 0.002 * s),
                 study_row("frontier", "mapl", 16, seed=s, loss=none + 0.09),
                 scaled_rvq_row("frontier", 16, s, none + 0.15)]
    for r in rows:                         # MAPL 16x keeps 0.85 of the boundary energy on every seed
        if r["group"] == "frontier" and r["variant"] == "mapl":
            r["boundary_diagnostics"] = [{"captured_energy": 0.9}, {"captured_energy": 0.8}]
    table = R.frontier_table(rows)
    assert table.header[-1] == "captured" and [b[-1] for b in table.body if b[-1] != "—"] == ["0.850"]
    names = [(b[0], b[1]) for b in table.body]
    assert names == [("Uncompressed", "—"), ("SSN", "4×"), ("MAPL", "4×"), ("MAPL+VQ, per-token scale", "4×"),
                     ("SSN", "8×"), ("MAPL", "8×"), ("SSN", "16×"), ("MAPL", "16×"), ("MAPL+VQ, per-token scale", "16×")]
    assert all(b[7] == "0,1,2" for b in table.body)                    # every point on the group's seeds
    # SSN − MAPL and MAPL+VQ − MAPL at each ratio (8x has no MAPL+VQ): one Holm family of the declared six
    assert table.takeaway.count("points ahead of") == 5
    assert "MAPL 16× is" in table.takeaway and "MAPL+VQ, per-token scale 32× (proj. 16×)" in table.takeaway
    mapl16 = statistics.fmean(100 * 0.09 / n for n in [3.50, 3.52, 3.48])
    assert next(b for b in table.body if b[:2] == ["MAPL", "16×"])[9].startswith(f"{mapl16:+.2f}%")
    plot = R.frontier_plot(rows)
    assert plot.name == "pareto-frontier" and not plot.empty and "SSN 4× +" in plot.takeaway
    assert plot.save(tmp_path).exists()
    # before the group has runs: nothing is drawn, and the table says so
    before = [r for r in rows if r["group"] != "frontier"]
    assert R.frontier_table(before).body == [] and R.frontier_plot(before).empty


def test_learned_fixed_at_4x_reads_the_ablation_ratio_only():
    rows = [r for r in study_rows() if r["data_source"] == ""]
    table = R.learned_fixed_table(rows)
    assert [b[0] for b in table.body] == ["Uncompressed", "MAPL, fixed projector", "MAPL"]
    assert all(b[3] in ("—", "4×") for b in table.body)
    c = R.study_comparison(rows, "learned_fixed_4x")
    assert c["n"] == 3 and c["mean"] > 0
    row = next(c for c in R.claims(rows) if "ablation's 4×" in c["claim"])
    assert row["table"] == "learned-fixed-4x.md" and row["verdict"] in R.VERDICTS[:3]


def test_the_corpus_table_splits_the_validation_penalty_from_the_training_streams_on_unread_windows():
    """Drawn by epochs under one epoch, the train loss is on windows never read; the checkpoints scored on unread
    training windows (stage rescore) put the documents' share of the gap between the two penalties in numbers."""
    rows = [{**r, "data_sampling": "epochs", "train_split_tokens": 10 * r["tokens"]} for r in study_rows()
            if r["group"] == "corpus"]
    plain = R.corpus_table(rows)
    assert "unread Δ%" not in plain.header and "no window is read twice" in plain.caption and "0.10 epochs" in plain.caption
    assert "Unread" not in plain.caption and "training stream" not in plain.takeaway
    offset = {"none": 0.00, "ssn": 0.03, "mapl": 0.01}                         # unread: SSN +3 %, MAPL +1 % of 1.0x
    scores = {r["run"]: {"val_loss": r["val_loss"], "group": "corpus",
                         "scores": {"unread-train": 1.00 + 0.01 * r["seed"] + offset[r["method"]]}} for r in rows}
    table = R.corpus_table(rows, scores)
    assert table.header[-1] == "unread Δ%" and table.body[0][-1] == "—"
    mapl = [100 * 0.01 / (1.00 + 0.01 * s) for s in range(3)]
    assert table.body[2][-1] == f"{statistics.fmean(mapl):+.2f}% ± {statistics.stdev(mapl):.2f}"
    val = statistics.fmean(100 * 0.03 / (1.20 + 0.01 * s) for s in range(3))
    tail = statistics.fmean(1.0 - i / 3000 for i in range(2700, 3000))
    stream = statistics.fmean(100 * 0.03 / (1.20 + 0.01 * s + tail) for s in range(3))
    u = statistics.fmean(mapl)
    assert (f"MAPL costs {val:+.2f}% on the validation split, {u:+.2f}% on unread training windows (the same "
            f"checkpoints) and {stream:+.2f}% on the training stream: the documents scored") in table.takeaway
    assert f"account for {u - val:+.2f} of the {stream - val:+.2f} points" in table.takeaway
    # a score of another draw (its validation loss differs from the row's) is never read
    stale = {k: {**v, "val_loss": v["val_loss"] + 1e-6} for k, v in scores.items()}
    assert R.corpus_table(rows, stale).header == plain.header
    # drawn with replacement: the caption says the stream mixes windows read before
    assert "mixes windows read before" in R.corpus_table(study_rows()).caption


def test_corpus_study_reads_its_own_corpus_and_never_leaks_into_the_headline():
    rows_all = study_rows()
    main_rows = [r for r in rows_all if r["data_source"] == ""]
    table = R.corpus_table(rows_all)
    assert [b[0] for b in table.body] == ["Uncompressed", "SSN", "MAPL"]
    tail = statistics.fmean(1.0 - i / 3000 for i in range(2700, 3000))         # the last 10 % of steps of result()'s curve
    assert table.body[0][-2] == f"{1.21 + tail:.4f}"                           # mean over seeds 1.20, 1.21, 1.22
    train_ssn = [100 * 0.06 / (1.20 + 0.01 * s + tail) for s in range(3)]     # each seed against its own none's
    assert table.body[0][-1] == "—" and table.body[1][-1] == (f"{statistics.fmean(train_ssn):+.2f}% ± "
                                                               f"{statistics.stdev(train_ssn):.2f}")
    ssn = statistics.fmean(100 * 0.06 / (1.20 + 0.01 * s) for s in range(3))    # Δ% against the code corpus's own
    assert table.body[1][9].startswith(f"{ssn:+.2f}%")
    c = R.study_comparison(rows_all, "corpus")
    assert c["n"] == 3 and c["mean"] > 0
    # the report's selection leaves the code corpus out, and its runs are nobody else's reference
    assert R.select(rows_all) == R.select(main_rows)
    assert all(R.reference_loss(rows_all, r) == R.reference_loss(main_rows, r) for r in main_rows)
    row = next(c for c in R.claims(main_rows, rows_all) if "corpus" in c["claim"])
    assert row["verdict"] in ("reproduced", "contradicted") and "sign: the paired 95% interval excludes 0" in row["reason"]
    assert next(c for c in R.claims(main_rows) if "corpus" in c["claim"])["reason"].startswith("not run")
    # the paper's two ranges again on this corpus, from its own summaries (SSN ~+4.9 %, MAPL ~+2.5 %, tight)
    ranges = {c["claim"]: c for c in R.claims(main_rows, rows_all) if c["claim"].endswith("(on a corpus seen at most once)")}
    ssn_row, mapl_row = ranges["SSN loses 8-15 % (on a corpus seen at most once)"], ranges[
        "MAPL costs at most ~2 % (on a corpus seen at most once)"]
    assert ssn_row["table"] == mapl_row["table"] == "corpus.md"
    assert ssn_row["ours"].startswith(f"SSN: {ssn:+.2f}%") and ssn_row["verdict"] == "contradicted"
    assert "wholly below" in ssn_row["reason"]
    assert mapl_row["verdict"] == "contradicted" and "wholly above" in mapl_row["reason"]
    assert all(c["reason"].startswith("not run") for c in R.claims(main_rows)
               if c["claim"].endswith("(on a corpus seen at most once)"))
    # a range met by an interval that reaches outside it is inconclusive (a wide interval is no confirmation)
    from mapl.report.claims import range_verdict
    assert range_verdict((1.9, 10.4), 8.37, 15.05) == ("inconclusive", "our 95% interval straddles the claimed "
                                                       "range's lower bound: neither inside nor outside it",
                                                       ("straddles", "lower bound"))
    assert range_verdict((0.8, 1.7), None, 2.0) == ("reproduced", "our 95% interval lies inside the claimed range",
                                                     ("inside",))
    # the report notebook's three views, each selected from the loaded rows: the corpus reaches its own view
    tuning = study_row("tune", "ssn", 8, seed=0, loss=3.6, name="tune-x")
    every, reported, with_corpus = R.report_selections(rows_all + [tuning], "cpu")
    assert {r["group"] for r in every} >= {"corpus", "tune", "long"}
    assert not {r["group"] for r in reported} & {"corpus", "tune"}
    assert {r["group"] for r in with_corpus} >= {"corpus"} and "tune" not in {r["group"] for r in with_corpus}
    assert len(R.corpus_table(with_corpus).body) == 3
    # its in-run figure: its own file (never the headline's gap-curves.png), against the code corpus's own reference
    plot = R.gap_curves_plot(rows_all, group="corpus")
    assert plot.name == "gap-curves-corpus" and not plot.empty and "Group corpus" in plot.caption
    assert plot.takeaway.startswith(f"At step 3,000 MAPL leads SSN by {c['mean']:+.2f} points")
    assert R.gap_curves_plot(rows_all).name == "gap-curves"


def test_blocks_study_pairs_at_each_p_and_two_seeds_give_no_verdict():
    rows = [r for r in study_rows() if r["data_source"] == ""]
    table = R.blocks_table(rows)
    assert [(b[0], b[2]) for b in table.body] == [("Uncompressed", 4), ("SSN", 4), ("MAPL", 4), ("SSN", 8), ("MAPL", 8)]
    p8 = next(b for b in table.body if b[0] == "SSN" and b[2] == 8)
    assert p8[9].startswith(f"{100 * (4.1 - 3.9) / 3.9:+.2f}")               # P = 8 against the P = 4 reference
    assert "P = 4:" in table.takeaway and "P = 8:" in table.takeaway
    row = next(c for c in R.claims(rows) if "several blocks" in c["claim"])
    assert row["verdict"] == "not testable here" and "fewer than 3" in row["reason"]


def test_frozen_trunk_tables_pair_by_seed_and_feed_the_ledger(tmp_path):
    runs = [frozen_run(s, p, 3.95 + d + 0.003 * s + (0.001 * s if p == "fixed" else 0))
            for s in range(3) for p, d in (("spel", 0.0), ("fixed", 0.05), ("unconstrained", 0.01))]
    folder = tmp_path / "reports" / "cpu" / "frozen-trunk"
    folder.mkdir(parents=True)
    for r in reversed(runs):
        (folder / f"{r['run']}.json").write_text(json.dumps(r))
    (folder / "trunks").mkdir()
    loaded = R.load_frozen(tmp_path, "cpu")
    assert [(r["seed"], r["projector"]) for r in loaded] == [(r["seed"], r["projector"]) for r in runs]
    table = R.frozen_table(loaded)
    assert [b[0] for b in table.body] == ["SPEL (learned)", "fixed random basis", "unconstrained (learned)"]
    assert table.body[0][9].startswith(f"{statistics.fmean(100 * (0.05 + 0.003 * s) / 3.9 for s in range(3)):+.2f}")
    assert [b[1] for b in table.body] == ["lr_mult 0.3", "spec", "spec"]
    paired_table = R.frozen_paired_table(loaded)
    assert [b[0] for b in paired_table.body] == ["fixed random basis − SPEL (learned)",
                                                 "unconstrained (learned) − SPEL (learned)"]
    c = R.frozen_comparison(loaded)
    assert c["n"] == 3 and c["diffs"] == pytest.approx([100 * (0.05 + 0.001 * s) / 3.9 for s in range(3)])
    assert c["level"] == pytest.approx(1 - 0.05 / 2) or c["level"] == pytest.approx(0.95)      # Holm over the two
    # the frozen trunk is a mechanism study: the ledger's rules, its own family, outside the ledger
    assert not any("frozen trunk" in x["claim"] for x in R.claims(study_rows(), frozen_rows=loaded))
    found = R.mechanisms(study_rows(), frozen_rows=loaded)
    row = next(x for x in found if "a learned subspace" in x["claim"])
    assert row["verdict"] == "reproduced" and row["table"] == "frozen-trunk-paired.md"
    stiefel = next(x for x in found if "Stiefel" in x["claim"])
    assert stiefel["ours"].startswith("unconstrained − SPEL, frozen trunk: ") and "claimed lead of 1.72" in stiefel["reason"]
    assert {x["family_size"] for x in found} == {2}
    assert R.mechanisms(study_rows())[0]["reason"].startswith("not run")
    assert [b[0] for b in R.mechanisms_table(study_rows(), frozen_rows=loaded).body] == [x["claim"] for x in found]
    assert R.frozen_plot(loaded).empty is False and R.frozen_plot([]).empty is True
    assert R.load_frozen(tmp_path, "micro") == [] and R.frozen_table([]).body == []
    mixed = loaded + [{**loaded[0], "seed": 9, "override": {}}]
    with pytest.raises(ValueError, match=r"spel runs with different settings \['lr_mult 0.3', 'spec'\]"):
        R.frozen_summaries(mixed)


def test_frozen_tuning_table_marks_the_candidate_chosen_on_the_selection_split(tmp_path):
    assert R.load_frozen_tuning(tmp_path, "cpu") == {} and R.frozen_tuning_table({}).body == []
    lr = "compressor.projector.lr_mult"
    tuning = {"spel": {"seed": 0, "chosen": {lr: 1.0}, "candidates": [
        {"override": {}, "run": "a", "select_loss": 4.2, "val_loss": 4.25},
        {"override": {lr: 1.0}, "run": "b", "select_loss": 4.0, "val_loss": 4.1}]}}
    folder = tmp_path / "reports" / "cpu" / "frozen-trunk"
    folder.mkdir(parents=True)
    (folder / "tuning.json").write_text(json.dumps(tuning))
    table = R.frozen_tuning_table(R.load_frozen_tuning(tmp_path, "cpu"))
    assert [(b[1], b[3], b[5]) for b in table.body] == [("spec", "4.2000", ""), ("lr_mult 1", "4.0000", "✓")]
    assert table.takeaway == "SPEL (learned): lr_mult 1 chosen of 2."


def test_heldout_deltas_are_each_seeds_own_uncompressed_run_on_the_same_windows():
    rows = [r for r in study_rows() if r["data_source"] == ""]
    # every run 1.0 higher on the held-out text, SSN another 0.2: Δ% against the none run's held-out loss
    table = R.heldout_table(rows, rescored(rows, lambda r: 1.0 + (0.2 if r["method"] == "ssn" else 0.0)))
    assert table.header[5:] == ["val Δ%", "held-out text (KJV) Δ%", "held-out text (KJV) loss"]
    cells = {b[1]: b for b in table.body}
    assert set(cells) == {"none", "ssn", "mapl"}          # only the rescored runs (group long), not decompose's
    nones = [3.50, 3.52, 3.48]
    ssn = [100 * (0.30 + 0.001 * s) / (n + 1.0) for s, n in enumerate(nones)]
    assert cells["ssn"][6] == R.fmt_pm(statistics.fmean(ssn), statistics.stdev(ssn), nd=2, pct=True)
    assert cells["none"][7] == R.fmt_pm(statistics.fmean(n + 1.0 for n in nones), statistics.stdev(nones))
    assert f"ssn +2.89% -> {R.fmt_pct(statistics.fmean(ssn))} (held-out text (KJV))" in table.takeaway
    # a score of another draw (its validation loss not the row's) is left out
    stale = {k: {**v, "val_loss": v["val_loss"] + 1e-9} for k, v in rescored(rows, lambda r: 1.0).items()}
    assert R.heldout_table(rows, stale).body == [] and R.heldout_table(rows, {}).takeaway == R.NO_SCORES


def _anchor_rank_row(group, ratio, seed, loss, rank=0):
    from tests.helpers.report_data import result
    res = result("mapl", ratio, seed=seed, steps=3000, loss=loss, name=f"mapl-{ratio}x-ar{rank}-s{seed}")
    if rank:
        res["config"]["compressor"]["anchor"] = {"rank": rank}
    return {**R.row_from_result(res, group), "data_source": ""}


def test_the_frontier_with_the_anchor_rank_held_is_its_own_arm_and_says_what_the_rank_does():
    rows = []
    for s, none in enumerate([3.50, 3.52, 3.48]):
        rows += [study_row("long", "none", seed=s, loss=none), study_row("frontier", "ssn", 16, seed=s, loss=none + 0.10),
                 _anchor_rank_row("frontier", 16, s, none + 0.10 + 0.001 * s),                  # tied with SSN
                 _anchor_rank_row("frontier_anchor", 16, s, none + 0.05 + 0.002 * s, rank=16)]  # the lead returns
    assert {r["variant"] for r in rows if r["group"] == "frontier_anchor"} == {"mapl-ar16"}
    # the frontier's own MAPL 16x point is the default anchor rank's, never pooled with the set rank's
    frontier_mapl = next(s for s in R.frontier_study(rows)[0] if s["variant"] == "mapl")
    assert frontier_mapl["runs"] == [f"mapl-16x-ar0-s{s}" for s in range(3)]
    table = R.frontier_anchor_table(rows)
    assert [(b[0], b[2]) for b in table.body] == [("SSN", "—"), ("MAPL", 8), ("MAPL, anchor rank 16", 16)]
    assert table.takeaway.startswith("16×: SSN − MAPL ") and "with MAPL, anchor rank 16; the set rank moves MAPL by -1." \
        in table.takeaway and "(resolved, 3 seeds)" in table.takeaway
    without = R.frontier_anchor_table([r for r in rows if r["group"] != "frontier_anchor"])
    assert without.body == [] and without.takeaway.startswith("no runs of group frontier_anchor")
