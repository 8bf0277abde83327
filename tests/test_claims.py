"""The claims ledger: which runs a row reads, its families, and the held-out ledger's verdicts and their moves."""


from mapl import report as R
from tests.helpers.report_data import rescored, study_row, study_rows


def test_ablation_rows_read_the_setting_with_the_most_seeds():
    rows = []
    for s in range(3):
        none = 3.50 + 0.01 * s
        rows += [study_row("long", "none", seed=s, loss=none), study_row("long", "mapl", 8, seed=s, loss=none + 0.05),
                 study_row("ablations_long", "mapl", 8, seed=s, loss=none + 0.08 + 0.001 * s, projector="unconstrained"),
                 study_row("ablations_long", "mapl", 8, seed=s, loss=none + 0.09 + 0.002 * s, anchor="none")]
    for s in range(2):                     # the 300-step ablations: two seeds, so the 3,000-step rerun is read
        rows += [study_row("seeds", "none", seed=s, steps=300, loss=4.0),
                 study_row("seeds", "mapl", 8, seed=s, steps=300, loss=4.1),
                 study_row("ablations", "mapl", 8, seed=s, steps=300, loss=4.3, projector="unconstrained"),
                 study_row("ablations", "mapl", 8, seed=s, steps=300, loss=4.4, anchor="none")]
    ledger = {c["claim"]: c for c in R.claims(rows)}
    stiefel = ledger["the Stiefel constraint helps: a learned projector without it is worse by 1.72 points (under "
                     "joint training)"]
    assert "n = 3, 3,000 steps" in stiefel["ours"] and stiefel["ours"].startswith("unconstrained − MAPL: +")
    assert stiefel["verdict"] in ("reproduced", "contradicted")        # 3 seeds, a spread of 0.001: resolved
    assert stiefel["family_size"] == 1          # the frozen-trunk row is a mechanism study, outside the ledger
    anchor = ledger["the anchors matter: no anchor is worse than the factorized one by 1.28 points"]
    assert "n = 3, 3,000 steps" in anchor["ours"]
    # without the rerun the 300-step pair is read: two seeds give no verdict
    short = [r for r in rows if r["group"] != "ablations_long"]
    row = {c["claim"]: c for c in R.claims(short)}["the anchors matter: no anchor is worse than the factorized one by "
                                                   "1.28 points"]
    assert "n = 2, 300 steps" in row["ours"] and row["verdict"] == "not testable here"


def test_heldout_claims_say_which_verdict_moves():
    rows = [r for r in study_rows() if r["data_source"] == ""]
    same = R.heldout_claims_table(rows, rows, rescored(rows, lambda r: 0.0))
    assert same.body and all(b[2] == b[4] and b[5] == "no" for b in same.body) and same.takeaway.endswith("none moves.")
    cost = next(b for b in same.body if b[0].startswith("MAPL at 4-8×"))
    assert cost[2] == "reproduced"
    # on the held-out text MAPL loses 0.2 more on every seed: its cost claim's verdict moves
    moved = R.heldout_claims_table(rows, rows, rescored(rows, lambda r: 0.2 if r["method"] == "mapl" else 0.0))
    cost = next(b for b in moved.body if b[0].startswith("MAPL at 4-8×"))
    assert (cost[2], cost[4], cost[5]) == ("reproduced", "contradicted", "yes")
    assert "MAPL at 4-8× costs at most ~2 % of validation loss: reproduced -> contradicted (held-out text (KJV))" \
        in moved.takeaway
    assert R.heldout_claims_table(rows, rows, {}).body == []


def test_a_redraws_heldout_verdicts_move_from_its_own_validation_verdicts_not_the_committed_ledgers():
    committed = [r for r in study_rows() if r["data_source"] == ""]
    # the redraw: long's configurations again, MAPL 0.2 worse on every seed (its own validation ledger: contradicted)
    redrawn = [{**r, "run": "redraw-" + r["run"], "draw": "long_redraw",
                "val_loss": r["val_loss"] + (0.2 if r["method"] == "mapl" else 0.0)}
               for r in committed if r["group"] == "long"]
    scores = {r["run"]: {"val_loss": r["val_loss"], "group": "long_redraw",
                         "scores": {"heldout-kjv": r["val_loss"] - (0.2 if r["method"] == "mapl" else 0.0)}}
              for r in redrawn}
    table = R.heldout_claims_table(committed, committed, scores, redrawn)
    assert table.body and {b[1] for b in table.body} == {"held-out text (KJV), draw long_redraw"}
    cost = next(b for b in table.body if b[0].startswith("MAPL at 4-8×"))
    # the committed ledger says reproduced; the redraw's own validation says contradicted, its held-out text reproduced
    assert (cost[2], cost[4], cost[5]) == ("contradicted", "reproduced", "yes")
    assert "(held-out text (KJV), draw long_redraw)" in table.takeaway
    # the held-out Δ% table reads the redraw's runs under the redraw's group
    rows = R.heldout_table(committed, scores, redrawn).body
    assert {b[0] for b in rows} == {"long_redraw"} and {b[1] for b in rows} == {"none", "ssn", "mapl"}


def test_a_verdict_that_stays_for_another_reason_says_so_in_the_heldout_ledger():
    committed = [r for r in study_rows() if r["data_source"] == ""]
    redrawn = [{**r, "run": "redraw-" + r["run"], "draw": "long_redraw"} for r in committed if r["group"] == "long"]
    # held out, MAPL falls far behind SSN on every seed: the order reverses
    scores = {r["run"]: {"val_loss": r["val_loss"], "group": "long_redraw",
                         "scores": {"heldout-kjv": r["val_loss"] + (0.5 if r["method"] == "mapl" else 0.0)}}
              for r in redrawn}
    table = R.heldout_claims_table(committed, committed, scores, redrawn)
    primary = next(b for b in table.body if b[0].startswith("MAPL is ahead of SSN by over 5 % at equal compression"))
    # contradicted on its size on validation (ahead by less than the paper's 5 points), on its sign held out
    assert (primary[2], primary[4], primary[5]) == ("contradicted", "contradicted", "no, its reason moves")
    assert "the order is reversed" in table.takeaway
    # the level alone (another family size) is not another reason
    same = {k: {**v, "scores": {"heldout-kjv": v["val_loss"]}} for k, v in scores.items()}
    assert all(b[5] == "no" for b in R.heldout_claims_table(committed, committed, same, redrawn).body)


def test_the_heldout_ledger_compares_a_verdicts_grounds_never_its_wording():
    """Whether a verdict stays for another reason is read from the rule's grounds (data), so a reason sentence
    that is worded otherwise, or names another level, is no move, and other grounds under the same words are."""
    from mapl.report.claims import order_verdict
    from mapl.report.studies.heldout import _move
    short = order_verdict({"n": 8, "ci": (1.03, 2.15), "level": 0.95}, 5)
    reversed_ = order_verdict({"n": 8, "ci": (-6.22, -0.63), "level": 0.99}, 5)
    assert short.verdict == reversed_.verdict == "contradicted"
    before = {"verdict": short.verdict, "reason": short.reason, "grounds": short.grounds}
    assert _move(before, {**before, "reason": "worded otherwise entirely"}) == "no"
    assert _move(before, {"verdict": reversed_.verdict, "reason": short.reason, "grounds": reversed_.grounds}) \
        == "no, its reason moves"
    assert _move(before, {**before, "verdict": "inconclusive"}) == "yes"


def test_every_claim_states_the_size_the_paper_claims():
    """A claim's text carries its claimed size, so "contradicted" never sits beside a number that reads as agreement
    (an order contradicted because it falls short of the paper's lead says which lead)."""
    from mapl.report.claims import CLAIMS, MECHANISMS
    for spec in (*CLAIMS, *MECHANISMS):
        side = spec.paper()
        if spec.rule == "order" and side.size is not None and spec not in MECHANISMS:
            assert f"{side.size:g}" in spec.claim or f"over {side.size:g} %" in spec.claim, spec.claim
        if spec.rule == "range" and side.high is not None:
            assert f"{side.high:g} %" in spec.claim or "8-15 %" in spec.claim, spec.claim


def test_the_ledgers_held_out_columns_and_the_mechanisms_stay_out_of_its_tally():
    rows = [r for r in study_rows() if r["data_source"] == ""]
    scores = rescored(rows, lambda r: 0.2 if r["method"] == "mapl" else 0.0)
    ledger = R.claims(rows, rows)
    held = R.heldout_verdicts(rows, rows, scores, (), ledger)
    assert list(held) == ["held-out text (KJV)"]
    table = R.claims_table(rows, rows, ledger=ledger, heldout=held)
    assert table.header[4] == "verdict on held-out text (KJV)"
    cost = next(b for b in table.body if b[0].startswith("MAPL at 4-8×"))
    assert (cost[3], cost[4]) == ("reproduced", "contradicted")         # validation, then held out
    assert all(b[4] == "—" for b in table.body if b[0] not in held["held-out text (KJV)"])
    assert not any("frozen trunk" in c["claim"] for c in ledger)
    assert table.takeaway.startswith(f"{len(ledger)} claims: ")
    assert [c["verdict"] for c in R.mechanisms(rows, rows)] == ["not testable here"] * 2    # no frozen-trunk runs
