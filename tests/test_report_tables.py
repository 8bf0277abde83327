"""The report's tables: their writers, the main budget's, the headline's, the token and width axes, the tuning
protocol and its check, time to target and the data notebook's helpers."""
import json
import math
import statistics

import numpy as np
import pytest

from mapl import report as R
from tests.helpers.report_data import LONG, result


def test_write_table_formats(tmp_path):
    t = R.Table("demo", "Demo 50%", ["a_b", "Δ%"], [[1, "+2.0% ± 0.1"]], caption="Cap & more.", takeaway="Says x.")
    md = R.write_table(t, tmp_path / "t")
    assert md.startswith("# Demo 50%\n\nCap & more.\n\n| a_b | Δ% |") and md.endswith("Takeaway: Says x.\n")
    assert (tmp_path / "t" / "demo.csv").read_text() == "a_b,Δ%\n1,+2.0% ± 0.1\n"
    tex = (tmp_path / "t" / "demo.tex").read_text()
    assert r"a\_b & $\Delta$\% \\" in tex and r"+2.0\% $\pm$ 0.1" in tex and r"\caption{Demo 50\%. Cap \& more.}" in tex
    assert "*Takeaway:* Says x." in t.render()
    assert R.Table("e", "Empty", ["a"], [], takeaway="no runs in group x.").render() == "**Empty:** no runs in group x.\n"


def test_table1(rows):
    t = R.table1(rows)
    assert t.header[:5] == ["model", "P", "method", "proj. d/r", "wire ratio"]
    mapl8 = next(b for b in t.body if b[2] == "MAPL" and b[4] == "8×")
    assert mapl8[6] == "74.0" and mapl8[8] == 2 and mapl8[9].startswith("4.1000 ± ") and mapl8[11] == "1B, P=4, 8×"
    vq = next(b for b in t.body if b[2] == "MAPL+VQ" and b[3] == "4×")
    assert vq[4] == "8×" and vq[11] == "150M, P=4, 8×"
    assert "4× +1.00% vs +10.00%" in t.takeaway and "MAPL ahead at 2 of 2" in t.takeaway
    assert "P=" not in t.takeaway                                    # one model and P: entries need no name
    # a second model (blocks' mini): every entry names its model and P, the main model's first
    mini = [{**r, "model": "mini", "run": "mini-" + r["run"], "steps": 1000} for r in rows
            if r["method"] in ("none", "ssn", "mapl") and r["projection_ratio"] in (1, 8)]
    both = R.table1(rows + mini).takeaway
    assert both.startswith("MAPL vs SSN Δ% at equal wire ratio: tiny P=4 4× +1.00% vs +10.00%")
    assert "; mini P=4 8× " in both and "MAPL ahead at 3 of 3" in both


def test_ablation_ordering_claims(rows):
    anchor = R.ablation_table(rows, "anchor")
    assert [b[0].split(":")[0] for b in anchor.body] == ["none", "static", "full", "factorized"]
    assert "no anchor +6.25% < static +6.50%: the same order as the paper's." in anchor.takeaway
    swapped = [dict(r, val_loss=4.30) if r["run"] == "abl-anchor-none" else r for r in rows]
    assert "the orders differ" in R.ablation_table(swapped, "anchor").takeaway     # the paper: no anchor ahead
    proj = R.ablation_table(rows, "projector")
    # the fixed projector has seeds 0-1, the unconstrained one seed 0: the setting's rows are read on seed 0 alone
    assert proj.body[0][5] == 1 and proj.body[0][9] == "+1.19%" and proj.body[0][10] == "CONFIRMED-secondary"
    unconstrained = [r for r in rows if r["projector"] == "unconstrained"]
    assert R.ablation_table([r for r in rows if r not in unconstrained], "projector").body[0][5] == 2
    names = {"a": "A", "b": "B"}
    assert "the same order as the paper's" in R.order_sentence({"a": 1, "b": 2}, {"a": 0.5, "b": 3}, names)
    assert "the orders differ" in R.order_sentence({"a": 2, "b": 1}, {"a": 0.5, "b": 3}, names)
    empty = R.ablation_table([r for r in rows if r["group"] != "ablations"], "anchor")
    assert empty.body == [] and "no runs in group ablations" in empty.render()


def test_seed_rvq_and_tuning_tables(rows, rows_all):
    seeds = R.seed_table(rows)
    assert {b[5] for b in seeds.body} == {"0,1", "0,1,2"}
    sync = R.rvq_sync_table(rows)
    assert [b[0] for b in sync.body] == ["stream", "full", "mirrored"]
    assert sync.body[1][8] == "122.0" and sync.body[0][6] == "0.50"
    tune = R.tuning_table(rows_all)
    assert [b[-1] for b in tune.body] == ["★", "★", ""]
    assert "MAPL 8× μ 0.02, emb 0.03 (4.400, best of 2 cells)" in tune.takeaway
    assert "use each tuned method's best cell" in tune.takeaway
    mapl_cells = sorted((r for r in rows_all if r["group"] in ("tune", "tune2") and r["variant"] == "mapl"),
                        key=lambda r: r["val_loss"])
    flipped = [{**r, "val_loss": r["val_loss"] - 1} if r is mapl_cells[1] else r for r in rows_all]
    tune = R.tuning_table(flipped)                  # the main runs' cell is now second: said, with the margin
    assert "The main runs of MAPL 8× (their cell μ 0.02, emb 0.03 scored 4.4000," in tune.takeaway
    assert "behind the best) do not use their best cell." in tune.takeaway
    assert R.tuning_table(rows).body == []                           # the report slice has no tuning runs


def test_diagnostics_table():
    r = R.row_from_result(result("mapl", 8))
    r["boundary_diagnostics"] = [
        {"boundary": 0, "rank": 16, "captured_energy": 0.8, "pca_energy": 0.9, "angles_to_pca_deg": {"mean": 30},
         "angles_to_next_deg": {"mean": 50}, "ortho_err": 1e-6},
        {"boundary": 1, "rank": 16, "captured_energy": 0.6, "pca_energy": 0.7, "angles_to_pca_deg": {"mean": 40},
         "ortho_err": 2e-6}]
    t = R.diagnostics_table([r])
    assert t.body == [[r["run"], "MAPL 8×", 300, 16, "0.700", "0.800", "50.0", "35.0", "2.0e-06"]]
    assert "captures 0.70" in t.takeaway and "0.80 learned vs 0.36 fixed" in t.takeaway


def test_diagnostics_takeaway_states_every_ratio_trained_with_a_fixed_projector_at_the_longest_budget():
    def run(method, ratio, energy, steps=3000, projector=None):
        r = R.row_from_result(result(method, ratio, steps=steps, projector=projector))
        r["boundary_diagnostics"] = [{"boundary": 0, "rank": 64 // ratio, "captured_energy": energy, "pca_energy": 0.99,
                                      "angles_to_pca_deg": {"mean": 30}, "ortho_err": 1e-6}]
        return r
    rows = [run("mapl", 4, 0.88), run("mapl", 4, 0.72, projector="fixed"), run("mapl", 8, 0.89),
            run("mapl", 8, 0.63, projector="fixed"), run("mapl", 16, 0.5), run("mapl", 8, 0.1, steps=300)]
    for order in (rows, rows[::-1]):
        t = R.diagnostics_table(order)
        assert t.takeaway.startswith("MAPL 4× at 3,000 steps captures 0.88 of the boundary energy (fixed projector 0.72)")
        assert "; MAPL 8× at 3,000 steps captures 0.89 of the boundary energy (fixed projector 0.63)" in t.takeaway
        assert "16×" not in t.takeaway and "0.10" not in t.takeaway
    # another model's run of the same method, ratio and budget (blocks' mini) is a row, never the takeaway's number
    mini = {**run("mapl", 8, 0.30), "model": "mini", "run": "mini-P4-mapl-8x-3000steps-s0"}
    for order in (rows + [mini], [mini] + rows):
        t = R.diagnostics_table(order)
        assert "mini-P4-mapl-8x-3000steps-s0" in [b[0] for b in t.body]
        assert "8× at 3,000 steps captures 0.89" in t.takeaway and "0.30" not in t.takeaway


def test_headline_and_paired_tables(rows):
    none, ssn, mapl = LONG["none"], LONG["ssn"], LONG["mapl"]
    diffs = [100 * (ssn[s] - mapl[s]) / none[s] for s in range(3)]
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = 4.302653 * sd / math.sqrt(3)
    t = R.paired_table(rows)
    assert [b[0] for b in t.body] == ["SSN 8× − MAPL 8×", "MAPL, fixed projector 8× − MAPL 8×",
                                      "MAPL+VQ 16× (proj. 8×) − MAPL 8×"]
    first = t.body[0]
    assert first[1] == "primary" and t.body[1][1].startswith("exploratory (Holm p ")
    assert first[3] == "0,1,2" and first[4] == ", ".join(f"{d:+.2f}" for d in diffs)
    assert first[5] == f"{mean:.2f} ± {sd:.2f}" and first[6] == f"[{mean - half:+.2f}, {mean + half:+.2f}] (95.0%)"
    assert first[-1] == "MAPL 8× ahead"                                     # the interval excludes 0
    assert first[8] == "0.250" and first[9] == "0.250"      # exact Wilcoxon and sign tests: 3 seeds reach 0.25 at best
    assert f"MAPL 8× is {mean:.2f} ± {sd:.2f} points ahead of SSN 8× at 3,000 steps (3 seeds, 95% CI" in t.takeaway
    h = R.headline_table(rows)
    assert [b[0] for b in h.body] == ["Uncompressed", "SSN", "MAPL", "MAPL, fixed projector", "MAPL+VQ"]
    assert h.body[1][6] == "0,1,2" and "+13.93% (Table 1, 1B, P=4, 8×)" == h.body[1][10]
    assert "+1.19% (App. C" in h.body[3][10]
    assert h.takeaway.startswith(f"MAPL 8× is {mean:.2f}")


def test_token_and_width_axes(rows):
    t = R.token_table(rows)
    assert [b[0] for b in t.body] == ["300", "1,000", "3,000"]
    assert "(300 steps) → " in t.takeaway and "(3,000 steps)" in t.takeaway and "95% CI" in t.takeaway
    w = R.width_table(rows)
    assert [b[0] for b in w.body] == [64, 128] and w.body[0][1] == "8"
    gap64 = 100 * (4.8 - 4.7) / 4.5
    assert w.body[0][-3] == f"{gap64:.2f}" and f"{gap64:+.2f} (d = 64)" in w.takeaway
    assert R.width_table([r for r in rows if r["group"] != "width"]).body == []   # one width: no axis


def test_best_validation_view_takes_out_an_overfitting_reference(rows):
    """Early stopping: each run is scored at its lowest validation loss; when the uncompressed run of
    the longest budget was better mid-way, its Δ% reference drops and the takeaway says it overfits."""
    longest = max(r["steps"] for r in rows if r["method"] == "none")
    none = next(r for r in rows if r["method"] == "none" and r["steps"] == longest)
    early = none["val_loss"] - 0.2
    changed = [{**r, "val_loss_curve": [[longest // 2, early], [longest, r["val_loss"]]]} if r is none else r
               for r in rows]
    best = {r["run"]: r for r in R.at_best_validation(changed)}
    assert best[none["run"]]["val_loss"] == early and best[none["run"]]["best_step"] == longest // 2
    assert best[none["run"]]["final_val_loss"] == none["val_loss"]
    final, early_stopped = R.token_table(changed, train_tokens=10_000), R.token_table(changed, best=True)
    assert final.name == "tokens" and early_stopped.name == "tokens-best"
    assert final.header[2] == "epochs" and final.body[0][2] == R.fmt(int(final.body[0][1].replace(",", "")) / 10_000, 1)
    assert "epochs" not in early_stopped.header
    assert early_stopped.body[-1][2] != final.body[-1][3]          # the reference (none val loss) moved
    assert f"best at step {longest // 2:,}" in early_stopped.takeaway and "overfits" in early_stopped.takeaway
    assert "overfits" not in R.token_table(rows, best=True).takeaway     # best = final: nothing to say


def test_runs_table_shows_a_run_that_blew_up(rows):
    longest = max(r["steps"] for r in rows if r["method"] == "mapl")
    mapl = next(r for r in rows if r["method"] == "mapl" and r["steps"] == longest)
    calm = [{**r, "boundary_diagnostics": [{"activation_rms": 3.0}]} for r in rows]
    t = R.runs_table(calm)
    assert t.name == "runs-long" and t.body and all(b[1] in (0, 1, 2) for b in t.body)
    assert t.takeaway == "median of the largest boundary RMS over runs 3.0."      # no run singled out
    blown = [{**r, "boundary_diagnostics": [{"activation_rms": 9000.0}], "val_loss": r["val_loss"] + 1,
              "val_loss_curve": [[longest // 2, r["val_loss"]], [longest, r["val_loss"] + 1]]} if r is mapl else r
             for r in [{**r, "boundary_diagnostics": [{"activation_rms": 3.0}]} if r is not mapl else r for r in rows]]
    t = R.runs_table(blown)
    # a study at another ratio and the same budget (learned_fixed_4x) is not a run of the headline
    other = {**mapl, "projection_ratio": 4, "run": "other-ratio", "group": "learned_fixed_4x"}
    assert R.runs_table(blown + [other]).body == t.body and "projection ratio (8×)" in t.caption
    line = next(b for b in t.body if b[0] == "MAPL" and b[1] == mapl["seed"])
    assert line[2] == R.fmt(mapl["val_loss"] + 1) and line[3] == R.fmt(mapl["val_loss"]) and line[5] == "9000.0"
    assert f"MAPL seed {mapl['seed']}: RMS 9000" in t.takeaway and f"at step {longest // 2:,}" in t.takeaway


def test_lr_check_has_one_row_per_checked_cell_paired_with_the_tuned_headline_run():
    def run(group, seed, loss, lr_muon, lr_embed, name):
        r = R.row_from_result(result("ssn", 8, seed=seed, steps=3000, loss=loss, lr_muon=lr_muon, lr_embed=lr_embed,
                                     name=name), group)
        return {**r, "select_loss": loss}
    rows = [run("long", s, 3.60 + 0.01 * s, 0.04, 0.1, f"long-s{s}") for s in range(3)]
    rows += [run("lr_check", s, 3.61 + 0.01 * s + 0.001 * s, 0.02, 0.1, f"mu-s{s}") for s in range(3)]
    rows += [run("lr_check", s, 3.58 + 0.01 * s, 0.04, 0.3, f"emb-s{s}") for s in range(3)]
    table = R.lr_check_table(rows)
    assert [(b[1], b[2]) for b in table.body] == [("0.02, 0.1", "0.04, 0.1"), ("0.04, 0.3", "0.04, 0.1")]
    assert table.body[1][5].startswith("-0.0200") and table.body[1][7] == "check cell better: retune at this budget"
    assert "μ 0.04, emb 0.3: check cell better" in table.takeaway


def test_lr_check_keys_a_learned_projector_cell_on_its_spel_step():
    def run(group, seed, loss, step, name):
        r = R.row_from_result(result("mapl", 8, seed=seed, steps=3000, loss=loss, name=name), group)
        return {**r, "select_loss": loss, "proj_lr_mult": step}
    rows = [run("long", s, 3.70 + 0.01 * s, 0.1, f"long-s{s}") for s in range(3)]
    rows += [run("lr_check", s, 3.75 + 0.01 * s + 0.002 * s, 0.03, f"p003-s{s}") for s in range(3)]
    rows += [run("lr_check", s, 3.69 + 0.01 * s, 0.3, f"p03-s{s}") for s in range(3)]
    table = R.lr_check_table(rows)
    # the Muon and embedding LRs are the tuned ones in both checks: only SPEL's step tells the two cells apart
    assert [(b[1], b[2]) for b in table.body] == [("0.02, 0.03, SPEL ×0.03", "0.02, 0.03, SPEL ×0.1"),
                                                   ("0.02, 0.03, SPEL ×0.3", "0.02, 0.03, SPEL ×0.1")]
    assert table.body[0][7] == "tuned cell better" and table.body[1][5].startswith("-0.0100")
    assert "SPEL ×0.3: check cell better" in table.takeaway


def test_lr_check_pairs_a_16x_check_with_the_frontier_run_of_its_ratio_not_the_8x_headline():
    def run(group, ratio, seed, loss, lr_muon, name):
        r = R.row_from_result(result("mapl", ratio, seed=seed, steps=3000, loss=loss, lr_muon=lr_muon, name=name),
                              group)
        return {**r, "select_loss": loss}
    rows = [run("long", 8, s, 3.50, 0.02, f"long-s{s}") for s in range(3)]
    rows += [run("frontier", 16, s, 3.80 + 0.01 * s, 0.02, f"front-s{s}") for s in range(3)]
    rows += [run("lr_check", 16, s, 3.83 + 0.01 * s + 0.001 * s, 0.04, f"mu004-s{s}") for s in range(3)]
    table = R.lr_check_table(rows)
    (row,) = table.body
    assert row[0] == "MAPL 16×" and row[4] == "0,1,2"
    assert row[5].startswith("0.0310") and row[7] == "tuned cell better"      # against 3.80, not the 8x run's 3.50


def test_lr_check_pairs_with_the_reported_run_of_its_configuration_whichever_study_holds_it():
    """A 4x check is paired with the learned-vs-fixed study's MAPL 4x run (no study is named by hand), never with
    a tuning study's run of the same configuration at other learning rates."""
    def run(group, seed, loss, lr_muon, name):
        r = R.row_from_result(result("mapl", 4, seed=seed, steps=3000, loss=loss, lr_muon=lr_muon, name=name), group)
        return {**r, "select_loss": loss}
    rows = [run("learned_fixed_4x", s, 3.60 + 0.01 * s, 0.02, f"lf-s{s}") for s in range(3)]
    rows += [run("tune", s, 3.40, 0.01, f"tune-s{s}") for s in range(3)]
    rows += [run("lr_check", s, 3.62 + 0.01 * s + 0.001 * s, 0.04, f"mu004-s{s}") for s in range(3)]
    (row,) = R.lr_check_table(rows).body
    assert row[2] == "0.02, 0.03" and row[4] == "0,1,2" and row[5].startswith("0.0210")


def test_time_to_target(rows, tmp_path):
    from mapl.core.link import StepMeasurement
    assert R.load_bench(tmp_path / "missing.json") == []

    def meas(nbytes):
        return StepMeasurement.uniform("gpipe", 4, 2, 0.01, 0.02, [nbytes] * 3, [nbytes] * 3).to_dict()
    bench = {"profile": "cpu", "methods": [
        {"method": "none", "ratio": 1.0, "timing": meas(1e6)}, {"method": "mapl", "ratio": 8.0, "timing": meas(1.25e5)},
        {"method": "ssn", "ratio": 8.0, "timing": meas(1.25e5)}, {"method": "mapl-rvq", "ratio": 32.0, "timing": meas(3e4)},
        {"bogus": 1}]}
    (tmp_path / "pipeline.json").write_text(json.dumps(bench))
    assert R.load_bench(tmp_path / "pipeline.json", profile="micro") == []          # another profile's benchmark
    b = R.load_bench(tmp_path / "pipeline.json", profile="cpu")
    assert [x["method"] for x in b] == ["none", "mapl", "ssn", "mapl-rvq"]
    ttt = R.time_to_target_rows(rows, b, [1e7, 1e9], target_pct=2.0, latencies_s=[0.0, 0.05])
    by = {(t["method"], t["bandwidth_bps"], t["latency_s"]): t for t in ttt}
    assert len(ttt) == 4 * 2 * 2
    assert by[("none", 1e7, 0.0)]["target"] == pytest.approx(statistics.fmean(LONG["none"]) * 1.02)
    assert by[("ssn", 1e7, 0.0)]["time_s"] is None and by[("ssn", 1e7, 0.0)]["budget"] == 3000   # kept, marked
    assert by[("mapl-rvq", 1e7, 0.0)]["budget"] is None                  # no run at 32x: listed as such
    assert by[("mapl", 1e7, 0.0)]["time_s"] < by[("none", 1e7, 0.0)]["time_s"]   # fewer bytes on a slow link
    assert by[("none", 1e7, 0.05)]["step_s"] > by[("none", 1e7, 0.0)]["step_s"]
    t = R.time_to_target_table(ttt)
    assert len(t.body) == 8 and t.body[0][:2] == ["Uncompressed", "0"]
    ssn_row = next(b for b in t.body if b[0] == "SSN 8×")
    assert ssn_row[3] == "never in 3,000 steps" and ssn_row[4] == "never"
    assert "Never within their runs" in t.takeaway and "ProtocolNanoGPT" in t.takeaway
    plot = R.time_to_target_plot(ttt)
    assert plot.save(tmp_path).exists() and not plot.empty
    assert R.time_to_target_plot([]).empty


def test_data_helpers():
    from mapl.data import byte_tokenizer
    tok = byte_tokenizer()
    lengths = R.token_byte_lengths(tok)
    assert len(lengths) == 257 and lengths[256] == 0 and set(lengths[:256]) == {1}
    assert R.token_length_histogram(np.array([65, 66, 256, 256]), lengths) == {0: 2, 1: 2}
    manifest = {"splits": {"train": {"tokens": 1000, "documents": 3, "works": ["a", "b", "c"]},
                           "val": {"tokens": 100, "documents": 1, "unigram_entropy": 3.25}}}
    assert R.data_summary_table(manifest)[1] == [["train", "1,000", 3, 3, "—"], ["val", "100", 1, "—", "3.2500"]]
