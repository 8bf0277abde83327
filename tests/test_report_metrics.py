"""metrics.json (the ledger's verdicts and the primary contrasts, the same few keys in every profile) and the LaTeX
macros (the per-run numbers)."""
import json

from mapl import report as R
from tests.helpers.report_data import rescored, study_rows

KEYS = ["reproduced", "contradicted", "inconclusive", "not_testable", "ssn_minus_mapl", "ladder_slope", "heldout_kjv",
        "unread_train"]


def test_metrics_json_holds_the_verdicts_and_the_primary_contrasts_in_a_few_short_keys(rows, tmp_path):
    ledger = R.claims(rows)
    m = R.write_metrics(R.metrics(ledger, rows), tmp_path / "m" / "metrics.json")
    assert json.loads((tmp_path / "m" / "metrics.json").read_text()) == m and list(m) == KEYS
    assert [m[k] for k in KEYS[:4]] == [sum(c["verdict"] == v for c in ledger) for v in R.VERDICTS]
    assert sum(m[k] for k in KEYS[:4]) == len(ledger) > 10
    primary = next(c for c in R.tested_comparisons(R.comparisons(R.headline_summaries(rows))) if c["primary"])
    assert m["ssn_minus_mapl"] == f"{primary['mean']:+.2f} {R.fmt_ci(primary['ci'])}"
    assert (m["ladder_slope"], m["heldout_kjv"], m["unread_train"]) == ("not run",) * 3
    # `dvc metrics show` prints one column per key and `dvc metrics diff` one row: short keys, short values
    assert all(len(k) <= 14 and len(str(v)) <= 24 and isinstance(v, (int, str)) for k, v in m.items())
    # the same keys without any run (the micro profile runs in tests)
    assert list(R.metrics(R.claims([]), [])) == KEYS


def test_the_heldout_contrast_is_the_heldout_ledgers_primary_row():
    rows = [r for r in study_rows() if r["data_source"] == ""]
    scores = rescored(rows, lambda r: 0.3 if r["method"] == "mapl" else 0.0)
    m = R.metrics(R.claims(rows), rows, rows, scores)
    mean, ci = m["heldout_kjv"].split(" ", 1)
    row = next(b for b in R.heldout_claims_table(rows, rows, scores).body
               if b[0].startswith("MAPL is ahead of SSN by over 5 % at"))
    assert row[3].startswith(f"SSN − MAPL: {mean} points {ci} (95%, n = 3") and mean.startswith("-")
    assert m["unread_train"] == "not run" and m["ssn_minus_mapl"] != m["heldout_kjv"]


def test_macros_hold_every_headline_number_by_key(rows, tmp_path):
    m = R.macro_numbers(rows)
    flat = json.dumps(m)
    assert "tiny" not in flat                                           # no key embeds the model's name
    assert m["runs"] == len(rows)
    assert set(m["main"]) == {"none", "int8", "ssn_4x", "ssn_8x", "mapl_4x", "mapl_8x", "mapl_rvq_8x", "mapl_rvq_16x"}
    assert m["main"]["mapl_8x"]["seeds"] == 2 and "delta_pct" not in m["main"]["none"]
    assert set(m["long"]) == {"none", "ssn_8x", "mapl_8x", "mapl_fixed_8x", "mapl_rvq_16x"}
    assert set(m["long_paired"]) == {"ssn_8x_minus_mapl_8x", "mapl_fixed_8x_minus_mapl_8x", "mapl_rvq_16x_minus_mapl_8x"}
    assert {"mean", "std", "n", "ci95_low", "ci95_high"} == set(m["long_paired"]["ssn_8x_minus_mapl_8x"])
    assert set(m["token_axis"]) == {"main", "tokens", "long"} and set(m["width"]) == {"d64", "d128"}
    assert "mapl_anchor_static_8x" in m["ablations"]
    other = dict(R.table1_summaries(rows)[0], model="500M", stages=8)
    assert R.metric_name(other, "tiny", 4) == "none_m500m_p8"
    text = R.write_macros(m, tmp_path / "macros.tex")
    assert (tmp_path / "macros.tex").read_text() == text
    assert "\\newcommand{\\resMainMaplEightXDeltaPct}{+" in text
    assert "\\newcommand{\\resLongPairedSsnEightXMinusMaplEightXCiNineFiveLow}{" in text
    for line in text.splitlines()[1:]:
        name = line.split("{\\", 1)[1].split("}", 1)[0]
        assert name.isalpha(), name                                     # LaTeX command names: letters only


def test_macros_of_nothing():
    assert R.macro_numbers([]) == {"runs": 0}
    assert R.macros({"runs": 0}) == {"resRuns": "0"}
