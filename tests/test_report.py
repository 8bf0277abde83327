"""mapl.report on synthetic results dicts: loading, Δ%, grouping, tables, figures, metrics, macros."""
import json
import math

import numpy as np
import pytest

from mapl import report as R

D = 128          # d_model of the synthetic runs: uncompressed 2d = 256 bytes per token


def result(method="none", ratio=1, seed=0, steps=300, loss=4.0, projector=None, anchor=None, stages=4,
           model="tiny", profile="cpu", eval_offset=0, name=None, overrides=None):
    defaults = {"none": (None, "none"), "int8": (None, "none"), "ssn": ("fixed-shared", "static"),
                "mapl": ("spel", "factorized"), "mapl-rvq": ("spel", "factorized")}[method]
    projector = projector or defaults[0]
    anchor = anchor or defaults[1]
    fwd = {"none": 2 * D, "int8": D + 2}.get(method, 2 * D / ratio / (4 if method == "mapl-rvq" else 1))
    run = name or f"{model}-P{stages}-{method}-{ratio}x-{projector}-{anchor}-n{steps}-s{seed}"
    cfg_hash = f"{run}-{eval_offset}-{profile}"
    return {
        "run": run, "method": method, "model": model, "stages": stages, "ratio": 2 * D / fwd,
        "nominal_ratio": ratio, "projector": projector, "anchor": anchor, "steps": steps, "tokens": steps * 2048,
        "val_loss": loss, "val_loss_curve": [[steps // 2, loss + 0.5], [steps, loss]],
        "train_loss_curve": [[i + 1, loss + 1.0 - i / steps] for i in range(steps)],
        "wire": {"fwd_bytes_per_token": fwd, "bwd_bytes_per_token": fwd, "id_bytes_per_token": 2 if projector else 0,
                 "uncompressed_bytes_per_token": 2 * D},
        "ortho_max_err": 1e-7 if projector == "spel" else None,
        "config": {"profile": profile, "model_overrides": overrides or {},
                   "train": {"seed": seed, "eval_offset": eval_offset}},
        "provenance": {"seed": seed, "config_hash": cfg_hash},
    }


def write(root, group, res):
    path = root / "reports" / "results" / group / f"{res['run']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res))


@pytest.fixture
def rows(tmp_path):
    """A cpu-profile results tree: main grid, ablations, seeds, long trio, a tune run, a micro run."""
    main = [result("none", loss=4.00), result("int8", loss=4.01), result("ssn", 4, loss=4.40),
            result("ssn", 8, loss=4.60), result("mapl", 4, loss=4.04), result("mapl", 8, loss=4.08),
            result("mapl-rvq", 4, loss=4.10)]
    abl = [result("mapl", 8, projector="fixed", loss=4.20, name="abl-fixed"),
           result("mapl", 8, projector="unconstrained", loss=4.30, name="abl-unc"),
           result("mapl", 8, anchor="none", loss=4.25, name="abl-anchor-none"),
           result("mapl", 8, anchor="static", loss=4.26, name="abl-anchor-static"),
           result("mapl", 8, anchor="full", loss=4.06, name="abl-anchor-full")]
    seeds = [result("none", seed=1, loss=4.02), result("mapl", 8, seed=1, loss=4.12),
             result("ssn", 8, seed=1, loss=4.62)]
    long = [result("none", steps=1200, loss=3.50), result("ssn", 8, steps=1200, loss=3.85),
            result("mapl", 8, steps=1200, loss=3.55)]
    for g, rs in (("main", main), ("ablations", abl), ("seeds", seeds), ("long", long)):
        for r in rs:
            write(tmp_path, g, r)
    write(tmp_path, "main", {**main[0], "run": "zz-dup"})                       # same config: dropped
    write(tmp_path, "", {**main[5], "run": "adhoc-lr", "val_loss": 9.9})        # ad hoc, same key: main wins
    write(tmp_path, "tune", result("mapl", 8, loss=3.0, eval_offset=65536, name="tune-x"))
    write(tmp_path, "scaling_tokens", result("mapl", 8, steps=3000, loss=3.3, name="t3000"))  # not the long group
    write(tmp_path, "scaling_width", result("none", loss=4.5, overrides={"d_model": 64}, name="w64"))
    write(tmp_path, "", result("mapl", 8, loss=9.0, model="micro", profile="micro", name="micro-x"))
    (tmp_path / "reports" / "results" / "main" / ".gitkeep").write_text("")
    (tmp_path / "reports" / "results" / "main" / "broken.json").write_text("{not json")
    return R.select(R.load_results(tmp_path), profile="cpu")


def test_delta_pct():
    assert R.delta_pct(3.156, 3.13) == pytest.approx(0.8307, abs=1e-4)
    assert R.delta_pct(None, 3.0) is None and R.delta_pct(3.0, None) is None


def test_load_and_select(rows, tmp_path):
    everything = R.load_results(tmp_path)
    assert {r["run"] for r in everything} >= {"tune-x", "micro-x"}
    assert not {"zz-dup", "adhoc-lr"} & {r["run"] for r in everything}
    assert {"zz-dup", "adhoc-lr"} <= {r["run"] for r in R.load_results(tmp_path, dedupe=False)}
    names = {r["run"] for r in rows}
    assert "tune-x" not in names and "micro-x" not in names          # tuning slice and other profile excluded
    assert len(rows) == 7 + 5 + 3 + 3 + 2
    assert next(r for r in rows if r["run"] == "w64")["model"] == "tiny[d_model=64]"
    r = next(r for r in rows if r["run"] == "abl-fixed")
    assert (r["group"], r["projector"], r["anchor"], r["ratio"], r["nominal_ratio"]) == ("ablations", "fixed",
                                                                                          "factorized", 8, 8)
    assert next(r for r in rows if r["method"] == "mapl-rvq")["ratio"] == 16     # effective, not nominal


def test_reference_prefers_same_seed_then_mean(rows):
    m1 = next(r for r in rows if r["method"] == "mapl" and r["seed"] == 1)
    assert R.reference_loss(rows, m1) == 4.02
    lone = {**m1, "seed": 7}
    assert R.reference_loss(rows, lone) == pytest.approx(4.01)
    assert R.reference_loss(rows, {**m1, "steps": 999}) is None


def test_summaries_and_budgets(rows):
    assert R.budgets(rows) == {"tiny": (300, 1200), "tiny[d_model=64]": (300, None)}
    main = {(s["method"], s["ratio"]): s for s in R.main_rows(rows)}
    assert len(main) == 7 and main[("int8", 1.97)]["n"] == 1 and main[("mapl-rvq", 16)]["nominal_ratio"] == 4
    m8 = main[("mapl", 8)]
    assert m8["n"] == 2 and m8["seeds"] == [0, 1]
    assert m8["val_loss"] == pytest.approx(4.10)
    assert m8["val_loss_std"] == pytest.approx(math.sqrt(2) * 0.02)
    # each seed against its own reference: 2% and (4.12 - 4.02) / 4.02
    assert m8["delta_pct"] == pytest.approx((2.0 + 100 * 0.10 / 4.02) / 2)
    long = {s["method"]: s for s in R.headline(rows)}
    assert set(long) == {"none", "ssn", "mapl"} and long["mapl"]["steps"] == 1200
    assert long["mapl"]["delta_pct"] == pytest.approx(100 * 0.05 / 3.5)


def test_paper_data_and_match():
    t1 = R.paper_table1()
    assert len(t1) == 24 and all(e["certainty"] == "CONFIRMED-secondary" for e in t1)
    mapl150 = next(e for e in R.paper_table1("mapl", 4) if e["scale"] == "150M")
    assert (mapl150["val_loss"], mapl150["delta_pct"]) == (3.156, 0.84)
    # tiny-model rows: matched by method and projection ratio; the paper's rvq reports twice the ratio
    assert R.paper_match({"method": "mapl", "nominal_ratio": 8, "model": "tiny", "stages": 4})["scale"] == "1B"
    vq = R.paper_match({"method": "mapl-rvq", "nominal_ratio": 4, "model": "tiny", "stages": 4})
    assert (vq["scale"], vq["ratio"], vq["stages"]) == ("150M", 8, 4)
    assert R.paper_match({"method": "mapl", "nominal_ratio": 6, "model": "500M", "stages": 8})["delta_pct"] == 0.0
    assert R.paper_match({"method": "mapl", "nominal_ratio": 16, "model": "tiny", "stages": 4}) is None
    assert R.paper_match({"method": "int8", "nominal_ratio": None, "model": "tiny", "stages": 4}) is None
    assert R.PAPER_PROJECTOR_ABLATION["spel"]["val_loss"] == 3.1564
    assert R.PAPER_ANCHOR_ABLATION["full"]["delta_pct"] == 0.47


def test_main_table_markdown(rows):
    header, body = R.main_table(rows)
    md = R.to_markdown(header, body)
    assert md.splitlines()[0].startswith("| model | P | method |")
    mapl8 = next(b for b in body if b[2] == "MAPL" and b[3] == "8×")
    assert mapl8[6] == 2 and mapl8[7].startswith("4.1000 ± ") and mapl8[9] == "1B, P=4, 8×"
    assert mapl8[11] == "+1.38%"
    none = next(b for b in body if b[2] == "Uncompressed")
    assert none[8] == R.DASH
    assert next(b for b in body if b[2] == "int8")[9] == R.DASH


def test_ablation_tables(rows):
    tabs = R.ablation_tables(rows)
    header, body = tabs["projector"]
    assert [b[0].split(":")[0] for b in body] == ["fixed", "unconstrained", "spel"]
    fixed = body[0]
    assert fixed[7] == f"{100 * 0.2 / 4.0:+.2f}%" and fixed[8] == "3.1673" and fixed[9] == "+1.19%"
    assert "CONFIRMED-secondary" in fixed[10]
    spel = body[2]
    assert spel[5] == 2                                    # main seed 0 + seeds seed 1
    header, body = tabs["anchor"]
    assert [b[0].split(":")[0] for b in body] == ["none", "static", "full", "factorized"]
    assert body[2][6] == "4.0600"
    empty = R.ablation_tables([r for r in rows if r["group"] != "ablations"])
    assert all(b[6] == R.DASH for b in empty["projector"][1]) and len(empty["anchor"][1]) == 4


def test_seed_table(rows):
    header, body = R.seed_table(rows)
    assert {b[2] for b in body} == {"Uncompressed", "SSN", "MAPL"}
    assert all(b[7] == "0,1" for b in body)


def test_val_loss_table_and_csv(rows):
    header, body = R.val_loss_table([r for r in rows if r["group"] == "long"])
    assert [b[1] for b in body] == ["Uncompressed", "SSN", "MAPL"]
    assert body[2][8] == f"{100 * 0.05 / 3.5:+.2f}%"
    assert R.to_csv(header, body).splitlines()[0] == ",".join(header)


def test_write_table(tmp_path):
    md = R.write_table((["a", "b"], [[1, "x"]]), tmp_path / "t" / "tab", title="# T")
    assert (tmp_path / "t" / "tab.md").read_text() == "# T\n\n" + md
    assert (tmp_path / "t" / "tab.csv").read_text() == "a,b\n1,x\n"


def test_metrics_and_macros(rows, tmp_path):
    m = R.write_metrics(rows, tmp_path / "metrics.json")
    assert json.loads((tmp_path / "metrics.json").read_text()) == m
    assert m["runs"] == len(rows)
    assert "tiny-P4-none" in m["main"]
    assert "tiny[d_model=64]-P4-none" not in m["main"]      # shape-override models belong to the scaling tables
    main = {k.removeprefix("tiny-P4-"): v for k, v in m["main"].items()}
    assert main["mapl-8x"]["seeds"] == 2 and "delta_pct" not in main["none"]
    assert set(m["long"]) == {"tiny-P4-none", "tiny-P4-ssn-8x", "tiny-P4-mapl-8x"}
    gap = m["main_ssn_minus_mapl_delta_points"]["tiny-P4-8x"]
    assert gap == pytest.approx(main["ssn-8x"]["delta_pct"] - main["mapl-8x"]["delta_pct"], abs=1e-3)
    text = R.write_macros(m, tmp_path / "macros.tex")
    assert "\\newcommand{\\resMainTinyPFourMaplEightXDelta}{+" in text
    assert "\\newcommand{\\resLongTinyPFourNoneLoss}{3.500}" in text
    assert "\\newcommand{\\resMainTinyPFourMaplRvqFourXLoss}" not in text     # key is ratio 16 (effective)
    assert "\\newcommand{\\resMainTinyPFourMaplRvqOneSixXLoss}" in text
    assert "\\newcommand{\\resMainGapTinyPFourEightX}" in text
    for line in text.splitlines()[1:]:
        name = line.split("{\\", 1)[1].split("}", 1)[0]
        assert name.isalpha(), name                                     # LaTeX command names: letters only


def test_metrics_of_nothing():
    assert R.metrics([]) == {"runs": 0}
    assert R.macros({"runs": 0}) == {"resRuns": "0"}


def test_figures_write_pngs(rows, tmp_path):
    for fn, name in ((R.pareto_figure, "pareto.png"), (R.loss_curves_figure, "curves.png")):
        fn(rows, tmp_path / name)
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        fn([], tmp_path / f"empty-{name}")                               # no results: still a figure
        assert (tmp_path / f"empty-{name}").exists()
    R.pareto_figure(rows, tmp_path / "a.png")
    R.pareto_figure(rows, tmp_path / "b.png")
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()   # deterministic bytes


def test_time_to_target(rows, tmp_path):
    from mapl.link import StepMeasurement
    assert R.load_bench(tmp_path / "missing.json") == []

    def meas(nbytes):
        return StepMeasurement.uniform("gpipe", 4, 2, 0.01, 0.02, [nbytes] * 3, [nbytes] * 3).to_dict()
    bench = {"methods": [{"method": "none", "ratio": 1.0, "timing": meas(1e6)},
                         {"method": "mapl", "ratio": 8.0, "timing": meas(1.25e5)},
                         {"method": "ssn", "ratio": 8.0, "timing": meas(1.25e5)},
                         {"method": "mapl-rvq", "ratio": 8.0, "timing": meas(6e4)},    # effective 8x: no such run
                         {"bogus": 1}]}
    (tmp_path / "pipeline.json").write_text(json.dumps(bench))
    b = R.load_bench(tmp_path / "pipeline.json")
    assert [x["method"] for x in b] == ["none", "mapl", "ssn", "mapl-rvq"]
    ttt = R.time_to_target_rows(rows, b, [1e7, 1e9], target_pct=2.0)
    by = {(t["method"], t["bandwidth_bps"]): t for t in ttt}
    assert by[("ssn", 1e7)]["time_s"] is None                            # SSN never gets within 2%
    assert not any(t["method"] == "mapl-rvq" for t in ttt)                # matched on the effective ratio
    assert R.time_to_target_table(ttt)[1][0][:3] == ["Uncompressed", "1×", "10"]
    slow_none, slow_mapl = by[("none", 1e7)], by[("mapl", 1e7)]
    assert slow_none["target"] == pytest.approx(3.5 * 1.02)
    assert slow_mapl["time_s"] < slow_none["time_s"]                      # 8x fewer bytes on a slow link
    assert by[("none", 1e9)]["step_s"] < slow_none["step_s"]
    R.time_to_target_figure(ttt, tmp_path / "ttt.png")
    R.time_to_target_figure([], tmp_path / "ttt-empty.png")
    assert (tmp_path / "ttt.png").exists() and (tmp_path / "ttt-empty.png").exists()


def test_data_helpers():
    from mapl.data import byte_tokenizer
    tok = byte_tokenizer()
    lengths = R.token_byte_lengths(tok)
    assert len(lengths) == 257 and lengths[256] == 0 and set(lengths[:256]) == {1}
    hist = R.token_length_histogram(np.array([65, 66, 256, 256]), lengths)
    assert hist == {0: 2, 1: 2}
    manifest = {"splits": {"train": {"tokens": 1000, "documents": 3, "works": ["a", "b", "c"]},
                           "val": {"tokens": 100, "documents": 1, "unigram_entropy": 3.25}}}
    header, body = R.data_summary_table(manifest)
    assert body == [["train", "1,000", 3, 3, R.DASH], ["val", "100", 1, R.DASH, "3.2500"]]


def test_code_fingerprint(tmp_path):
    (tmp_path / "mapl" / "compress").mkdir(parents=True)
    (tmp_path / "mapl" / "train.py").write_text("a")
    (tmp_path / "mapl" / "report.py").write_text("r")
    fp = R.code_fingerprint(tmp_path)
    (tmp_path / "mapl" / "report.py").write_text("changed")               # not a training source
    assert R.code_fingerprint(tmp_path) == fp
    (tmp_path / "mapl" / "compress" / "x.py").write_text("new")
    assert R.code_fingerprint(tmp_path) != fp


def _scal_row(method, projector, anchor, ratio, d, steps, loss):
    return {"run": f"{method}-{projector}-{d}-{steps}", "method": method, "projector": projector, "anchor": anchor,
            "nominal_ratio": ratio, "d_model": d, "steps": steps, "val_loss": loss, "seed": 0, "stages": 4,
            "boundary_diagnostics": []}


def test_scaling_rows_compute_gaps_in_points():
    from mapl import report
    rows = []
    for d, steps, base in ((64, 300, 5.0), (128, 300, 4.0), (128, 3000, 3.0)):
        rows += [_scal_row("none", None, "none", None, d, steps, base),
                 _scal_row("ssn", "fixed-shared", "static", 8, d, steps, base * 1.05),
                 _scal_row("mapl", "spel", "factorized", 8, d, steps, base * 1.02),
                 _scal_row("mapl", "fixed", "factorized", 8, d, steps, base * 1.03),
                 _scal_row("mapl", "spel", "none", 8, d, steps, base * 1.5)]      # an ablation: ignored
    pts = report.scaling_rows(rows)
    assert [(p["d_model"], p["steps"]) for p in pts] == [(64, 300), (128, 300), (128, 3000)]
    for p in pts:
        assert abs(p["gap_ssn_minus_mapl"] - 3.0) < 1e-9 and abs(p["gap_fixed_minus_mapl"] - 1.0) < 1e-9
    t = report.scaling_tables(rows)
    assert len(t["width"][1]) == 2 and len(t["tokens"][1]) == 2


def test_diagnostics_table_averages_boundaries():
    from mapl import report
    r = _scal_row("mapl", "spel", "factorized", 8, 128, 300, 4.0)
    r["boundary_diagnostics"] = [
        {"boundary": 0, "rank": 16, "captured_energy": 0.8, "pca_energy": 0.9, "angles_to_pca_deg": {"mean": 30},
         "angles_to_next_deg": {"mean": 50}, "ortho_err": 1e-6},
        {"boundary": 1, "rank": 16, "captured_energy": 0.6, "pca_energy": 0.7, "angles_to_pca_deg": {"mean": 40},
         "ortho_err": 2e-6}]
    header, body = report.diagnostics_table([r])
    assert body == [[r["run"], 16, "0.700", "0.800", "50.0", "35.0", "2.0e-06"]]
