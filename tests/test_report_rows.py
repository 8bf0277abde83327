"""The report's rows: loading results (and refusing damaged ones), selection, keys, bytes, references, budgets,
summaries, intervals and the paper's numbers."""
import csv
import json
import math
import re

import pytest

from mapl import report as R
from mapl.report import paper
from tests.helpers.report_data import result


@pytest.mark.parametrize("content,says", [
    ("{not json", r"is not valid JSON \(truncated\?"), ("", r"is empty"),
    (json.dumps({"method": "none", "val_loss": float("nan")}), r"val_loss is nan, not a finite number"),
    (json.dumps({"method": "none", "val_loss": "4.1"}), r"val_loss is '4\.1', not a finite number"),
    (json.dumps({"method": "none", "val_loss": 4.0, "val_loss_curve": [[10, float("inf")]]}),
     r"val_loss_curve holds \[10, inf\], not \[step, finite loss\]"),
])
def test_a_results_file_the_report_cannot_use_is_refused_naming_it(tree, content, says):
    """Was: skipped without a word (a table lost a seed) or an AttributeError on a NaN."""
    bad = R.results_dir("cpu", tree) / "main" / "bad.json"
    bad.write_text(content)
    with pytest.raises(R.ResultsError, match=rf"^{re.escape(str(bad))}:? .*{says}"):
        R.load_results(tree, R.results_dir("cpu"))


def test_a_run_that_differs_only_in_its_backward_wire_is_another_configuration(tree):
    """MAPL+VQ with an int8 backward is a variant of its own, never folded into the bf16 run of the same seed (was:
    dropped as a duplicate of it by the report's dedupe)."""
    folder = R.results_dir("cpu", tree) / "long"
    folder.mkdir(parents=True, exist_ok=True)
    base = {"method": "mapl-rvq", "model": "tiny", "stages": 4, "ratio": 14.2, "nominal_ratio": 8, "projector": "spel",
            "anchor": "factorized", "steps": 3000, "val_loss": 3.86,
            "config": {"profile": "cpu", "compressor": {"rvq": {"scale": "token"}}, "train": {"seed": 0}}}
    same = {**base, "run": "rvq-same"}
    int8 = {**base, "run": "rvq-int8", "val_loss": 3.85,
            "config": {**base["config"], "compressor": {"rvq": {"scale": "token"}, "grad_wire": "int8"}}}
    (folder / "rvq-same.json").write_text(json.dumps(same))
    (folder / "rvq-int8.json").write_text(json.dumps(int8))
    by = {r["run"]: r for r in R.load_results(tree, R.results_dir("cpu"))}
    assert by["rvq-int8"]["variant"] == "mapl-rvq-scaled-grad-int8" and by["rvq-same"]["variant"] == "mapl-rvq-scaled"
    assert R.run_key(by["rvq-int8"]) != R.run_key(by["rvq-same"])


def test_a_redraw_is_loaded_beside_the_study_it_redraws_and_only_redrawn_rows_reads_it(tree):
    """Group long_redraw (role redraw) repeats long's configurations under its own run names: the loader keeps both
    (never deduplicated as copies), no view of the report pools it, and :func:`redrawn_rows` gives it as study long."""
    base = R.results_dir("cpu", tree)
    committed = result("ssn", 8, seed=0, steps=3000, loss=3.90, name="long-ssn-s0")
    again = result("ssn", 8, seed=0, steps=3000, loss=3.91, name="redraw-long-ssn-s0")
    for group, res in (("long", committed), ("long_redraw", again)):
        (base / group).mkdir(parents=True, exist_ok=True)
        (base / group / f"{res['run']}.json").write_text(json.dumps(res))
    loaded = R.load_results(tree, R.results_dir("cpu"))
    assert {"long-ssn-s0", "redraw-long-ssn-s0"} <= {r["run"] for r in loaded}
    for view in R.report_selections(loaded, "cpu"):
        assert "redraw-long-ssn-s0" not in {r["run"] for r in view} and "long-ssn-s0" in {r["run"] for r in view}
    (mine,) = R.redrawn_rows(loaded, "cpu")
    assert (mine["run"], mine["group"], mine["draw"], mine["val_loss"]) == ("redraw-long-ssn-s0", "long", "long_redraw", 3.91)
    assert R.redrawn_rows(loaded, "micro") == []


def test_delta_pct():
    assert R.delta_pct(3.156, 3.13) == pytest.approx(0.8307, abs=1e-4)
    assert R.delta_pct(None, 3.0) is None and R.delta_pct(3.0, None) is None


def test_load_and_select(tree, rows, rows_all):
    everything = R.load_results(tree, R.results_dir("cpu"))
    names = {r["run"] for r in everything}
    assert "micro-x" in names and not {"zz-dup", "adhoc-lr"} & names
    assert {"zz-dup", "adhoc-lr"} <= {r["run"] for r in R.load_results(tree, R.results_dir("cpu"), dedupe=False)}
    assert {r["run"] for r in rows_all if r["eval_offset"]} == {"tune-mapl-a", "tune-mapl-b", "tune-none-a"}
    assert not [r for r in rows if r["eval_offset"] or r["profile"] != "cpu"]
    by = {r["run"]: r for r in rows}
    assert by["w64-none"]["model"] == "tiny[d_model=64]" and by["w64-none"]["d_model"] == 64
    fixed = by["abl-fixed"]
    assert (fixed["group"], fixed["variant"], fixed["wire_ratio"], fixed["projection_ratio"]) == ("ablations",
                                                                                                  "mapl-fixed", 8, 8)
    rvq = next(r for r in rows if r["method"] == "mapl-rvq" and r["projection_ratio"] == 8 and r["steps"] == 300
               and r["rvq_sync"] == "stream")
    assert rvq["wire_ratio"] == 16 and rvq["variant"] == "mapl-rvq"                # wire: twice the projection ratio
    assert by["rvq-full"]["variant"] == "mapl-rvq-sync-full"
    assert by[next(r["run"] for r in rows if r["method"] == "int8")]["projection_ratio"] is None


def test_total_bytes_per_token():
    res = result("mapl", 8)                                      # 32 fwd + 32 bwd + 2 ids + 8 projector exchange
    assert R.total_bytes_per_token(res) == pytest.approx(74.0)
    res["wire"]["declared"] = {"fwd": 3000, "bwd": 3000, "ids": 600, "piggyback": 6, "state": 900}
    res["tokens"], res["stages"] = 100, 4
    assert R.total_bytes_per_token(res) == pytest.approx(7506 / 300)   # / (tokens x boundaries)
    res["wire"]["total_bytes_per_token_per_boundary"] = 12.5            # what the results carry wins
    assert R.total_bytes_per_token(res) == 12.5
    assert R.total_bytes_per_token({"wire": {}, "tokens": 10, "stages": 4}) is None
    row = R.row_from_result(result("mapl-rvq", 8, sync="full"))
    assert (row["total_bytes_per_token"], row["sync_bytes_per_token"], row["state_bytes_per_token"]) == (122, 64, 8)


def test_reference_prefers_same_seed_then_mean(rows):
    m1 = next(r for r in rows if r["method"] == "mapl" and r["seed"] == 1)
    assert R.reference_loss(rows, m1) == 4.02
    assert R.reference_loss(rows, {**m1, "seed": 7}) == pytest.approx(4.01)
    assert R.reference_loss(rows, {**m1, "steps": 999}) is None


def test_reference_is_the_plain_uncompressed_run_of_the_same_corpus():
    """The control studies train beside the headline: "uncompressed + anchors" shares the uncompressed run's
    model, steps and seed, and the code corpus too, yet neither may serve as anyone's reference; the
    parameter-matched control (a model with overrides) is measured against its base model."""
    plain = R.row_from_result(result("none", steps=3000, loss=3.50))
    anchored = R.row_from_result(result("none", steps=3000, loss=3.40, anchor="factorized", name="none-anchor"))
    code = {**R.row_from_result(result("none", steps=3000, loss=1.20, name="none-code")), "data_source": "sympy-code"}
    mapl = R.row_from_result(result("mapl", 8, steps=3000, loss=3.55))
    wide = R.row_from_result(result("ssn", 8, steps=3000, loss=3.56, model="tiny", overrides={"ffn_hidden": 724}))
    assert anchored["variant"] == "none-anchor-factorized" and wide["model"] == "tiny[ffn_hidden=724]"
    for rows in ([anchored, plain, code, mapl, wide], [code, anchored, plain, mapl, wide]):
        assert R.reference_loss(rows, mapl) == 3.50 and R.reference_loss(rows, anchored) == 3.50
        assert R.reference_loss(rows, wide) == 3.50
        assert R.reference_loss(rows, {**mapl, "data_source": "sympy-code"}) == 1.20


def test_headline_variants_are_read_as_one_study(rows):
    """The fixed projector and MAPL+VQ train in DVC groups of their own; the report reads them as "long"."""
    long = [r for r in rows if r["group"] == "long"]
    assert {r["variant"] for r in long} == {"none", "ssn", "mapl", "mapl-fixed", "mapl-rvq"}
    assert not [r for r in rows if r["group"] in ("long_rvq", "long_fixed")]
    assert {s["variant"] for s in R.headline_summaries(rows)} == {"none", "ssn", "mapl", "mapl-fixed", "mapl-rvq"}


def test_budgets_and_summaries(rows):
    assert R.main_model(rows) == "tiny"
    assert [R.budget_steps(rows, g) for g in ("main", "long", "tokens", "missing")] == [300, 3000, 1000, None]
    main = {(s["variant"], s["wire_ratio"]): s for s in R.table1_summaries(rows)}
    assert len(main) == 8 and ("mapl-rvq", 16) in main and main[("mapl-rvq", 16)]["projection_ratio"] == 8
    m8 = main[("mapl", 8)]
    assert m8["n"] == 2 and m8["seeds"] == [0, 1] and m8["val_loss"] == pytest.approx(4.10)
    assert m8["val_loss_std"] == pytest.approx(math.sqrt(2) * 0.02)
    assert m8["deltas"] == pytest.approx({0: 2.0, 1: 100 * 0.10 / 4.02})           # each seed vs its own reference
    assert m8["delta_pct"] == pytest.approx((2.0 + 100 * 0.10 / 4.02) / 2)


def test_t_quantile_and_interval_by_hand():
    # two-sided 95% critical values of Student's t (printed tables)
    for df, t in ((1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (10, 2.2281), (30, 2.0423)):
        assert R.t_quantile(0.975, df) == pytest.approx(t, abs=1e-4)
    assert R.t_interval([1.0]) is None
    lo, hi = R.t_interval([1.0, 1.5, 2.3])
    mean, sd = 1.6, math.sqrt(((1.0 - 1.6) ** 2 + (1.5 - 1.6) ** 2 + (2.3 - 1.6) ** 2) / 2)
    assert (lo, hi) == pytest.approx((mean - 4.3027 * sd / math.sqrt(3), mean + 4.3027 * sd / math.sqrt(3)), abs=1e-3)
    p = R.paired({0: 3.0, 1: 2.5, 2: 4.0, 5: 9.9}, {0: 2.0, 1: 1.0, 2: 1.7})       # seed 5 unpaired
    assert p["seeds"] == [0, 1, 2] and p["diffs"] == pytest.approx([1.0, 1.5, 2.3]) and p["ci"] == pytest.approx((lo, hi))
    assert R.paired({0: 1.0}, {1: 1.0}) is None


def test_paper_numbers_file():
    with open(paper.PAPER_NUMBERS, newline="") as f:
        raw = list(csv.DictReader(f))
    assert {r["certainty"] for r in raw} <= set(paper.CERTAINTY)
    assert all(r["value"] and r["unit"] is not None and r["source"] for r in raw)
    t1 = R.paper_table1()
    assert len(t1) == 24 and {e["scale"] for e in t1} == {"150M", "500M", "1B"}
    assert {(e["method"], e["stages"]) for e in t1 if e["scale"] == "1B"} == {
        (m, p) for m in ("none", "ssn", "mapl", "mapl-rvq") for p in (4, 8)}
    assert all("val_loss" in e for e in t1)
    mapl150 = next(e for e in R.paper_table1("mapl", 4) if e["scale"] == "150M")
    assert (mapl150["val_loss"], mapl150["delta_pct"]) == (3.156, 0.84)
    vq = R.paper_match("mapl-rvq", 4, 4, "tiny")
    assert (vq["scale"], vq["reported_ratio"], vq["projection_ratio"]) == ("150M", 8, 4)
    assert R.paper_match("mapl", 8, 4, "tiny")["scale"] == "1B" and R.paper_match("mapl", 16, 4) is None
    assert R.paper_match("mapl", 6, 8, "500M")["delta_pct"] == 0.0
    anchors = {e["variant"]: e for e in R.paper_ablation("anchor")}
    assert anchors["none"]["delta_pct"] == 2.39 and anchors["static"]["delta_pct"] == 2.48   # no anchor is ahead
    assert {e["variant"] for e in R.paper_ablation("projector")} == {"fixed", "unconstrained", "spel"}


def test_output_paths(tmp_path):
    p = R.output_paths(tmp_path, "cpu")
    assert p == {"results": tmp_path / "reports/cpu/results", "tables": tmp_path / "reports/cpu/tables",
                 "figures": tmp_path / "reports/cpu/figures", "metrics": tmp_path / "reports/cpu/metrics.json"}
    q = R.output_paths(tmp_path, "cpu", results="reports/results", out="/elsewhere")
    assert q["results"] == tmp_path / "reports/results" and q["metrics"].as_posix() == "/elsewhere/metrics.json"
