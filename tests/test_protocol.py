"""The measurement protocol behind the verdict: seeds resample every random draw of a run,
the validation split is evaluated whole in two interleaved sets (report and selection), and when a
run evaluates never changes how it trains."""
import numpy as np
import pytest
import torch

from mapl.data.batches import eval_batches
from mapl.core.seeds import OFFSETS, RUN_STRIDE, run_base
from mapl.core.stages import build_staged_model
from mapl.core.run import run


def quiet(*args, **kwargs):
    pass


# ---- seeds ----------------------------------------------------------------------------------------------
def test_run_base_moves_with_the_seed_and_never_collides():
    assert run_base(1234, 0) == 1234                      # seed 0 keeps the draws of every earlier round
    assert run_base(1234, 3, "fixed") == 1234
    assert run_base(1234, 3) == 1234 + 3 * RUN_STRIDE
    assert RUN_STRIDE > max(offset + span for offset, span in OFFSETS.values())
    with pytest.raises(ValueError, match="compressor.draws='all' is invalid; allowed: per-seed, fixed"):
        run_base(1234, 1, "all")


@pytest.mark.parametrize("method,part", [("ssn", "shared"), ("mapl", "boundaries.0.A")])
def test_seeds_resample_the_compressor_draws(micro_cfg, method, part):
    """Per-seed draws: SSN's U and every projector's start differ between seeds; ``fixed`` keeps them."""
    def draw(seed, draws="per-seed"):
        cfg = micro_cfg(method, 4, **{"train.seed": seed, "compressor.draws": draws})
        sm = build_staged_model(cfg, 256)
        if part == "shared":        # SSN's U: the basis every residual writer is constrained to
            return sm.boundaries["0"].A.detach().clone()
        return dict(sm.named_parameters())[part].detach().clone()
    assert torch.equal(draw(0), draw(0))
    assert not torch.allclose(draw(0), draw(1))
    assert torch.equal(draw(0, "fixed"), draw(1, "fixed"))
    assert torch.equal(draw(0), draw(0, "fixed"))          # seed 0: the same draws as before the option


def test_seeds_resample_the_anchors(micro_cfg):
    tables = [dict(build_staged_model(micro_cfg("mapl", 4, **{"train.seed": s}), 256).named_buffers())
              for s in (0, 1)]
    fixed = [k for k in tables[0] if k.startswith("anchors.")]
    assert fixed and any(not torch.equal(tables[0][k], tables[1][k]) for k in fixed)


# ---- evaluation sets ------------------------------------------------------------------------------------
def _windows(batches):
    return [tuple(row.tolist()) for x, _ in batches for row in x]


@pytest.mark.parametrize("every", [2, 3])
def test_report_and_selection_sets_interleave_and_cover_the_split(every):
    tokens = np.arange(1000) % 251
    both = eval_batches(tokens, 4, 10, 0)
    report = eval_batches(tokens, 4, 10, 0, select_every=every)
    select = eval_batches(tokens, 4, 10, 0, select_every=every, part="select")
    whole, rep, sel = _windows(both), _windows(report), _windows(select)
    assert len(rep) + len(sel) == len(whole) == 99
    assert set(rep).isdisjoint(sel) and sorted(rep + sel) == sorted(whole)
    assert sel == whole[every - 1::every]                  # interleaved: both sets span the whole split
    assert eval_batches(tokens, 4, 10, 0, part="select") == []
    with pytest.raises(ValueError, match="part='both' is invalid"):
        eval_batches(tokens, 4, 10, 0, part="both")


def test_a_run_records_both_curves_and_reports_the_report_set(micro_cfg):
    res = run(micro_cfg("mapl", 4, **{"train.select_every": 2, "train.eval_tokens": 0}), progress=False, log=quiet)
    assert [s for s, _ in res["select_loss_curve"]] == [s for s, _ in res["val_loss_curve"]] == [10, 20]
    assert res["select_loss"] == res["select_loss_curve"][-1][1] != res["val_loss"]
    plain = run(micro_cfg("mapl", 4, **{"train.eval_tokens": 0, "train.select_every": 0}), progress=False, log=quiet)
    assert plain["select_loss"] is None and plain["select_loss_curve"] == []
    assert plain["train_loss_curve"] == res["train_loss_curve"]        # evaluation does not train
    # the whole split is the token-weighted mean of its two sets
    n_rep, n_sel = 0, 0
    from mapl.core.engine import LocalEngine
    data = LocalEngine.build(micro_cfg("mapl", 4, **{"train.select_every": 2, "train.eval_tokens": 0})).data
    n_rep, n_sel = (sum(y.numel() for _, y in b) for b in (data.val_batches, data.select_batches))
    whole = (res["val_loss"] * n_rep + res["select_loss"] * n_sel) / (n_rep + n_sel)
    assert whole == pytest.approx(plain["val_loss"], rel=1e-5)


def test_a_selection_set_that_leaves_no_report_window_is_refused(micro_cfg):
    with pytest.raises(ValueError, match=r"train\.select_every=1 is invalid: it leaves no report window"):
        run(micro_cfg("none", **{"train.select_every": 1}), progress=False, log=quiet)


# ---- evaluation never trains ----------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["mapl-rvq", "mapl"])
def test_how_often_a_run_evaluates_does_not_change_its_training(micro_cfg, method):
    """MAPL+VQ's streamed codebook used to keep flowing in evaluation, so the evaluation cadence and
    batch size changed the training curve; now they cannot (every loss identical, bit for bit)."""
    curves = [run(micro_cfg(method, 4, **over), progress=False, log=quiet)["train_loss_curve"]
              for over in ({"train.eval_every": 10}, {"train.eval_every": 3, "train.eval_batch_size": 3})]
    assert curves[0] == curves[1]


# ---- the verdict's statistics and the claims ledger's rule -----------------------------------------------
def test_exact_tests_match_their_textbook_values():
    from mapl.report.stats import holm, sign_test_p, t_test_p, wilcoxon_p
    assert t_test_p([1, 2, 3]) == pytest.approx(0.074180, abs=1e-6)       # t = 3.464, df = 2
    assert wilcoxon_p([1, 2, 3, 4, 5, 6, 7, 8]) == 2 / 256                  # every sign positive
    assert wilcoxon_p([1, -2, 3, 4, 5, 6, 7, 8]) == 6 / 256                 # W- = 2: 3 of 256 patterns, two-sided
    assert sign_test_p([1, -2, 3, 4, 5, 6, 7, 8]) == 18 / 256
    assert wilcoxon_p([0.5, 0.5, 0.5]) == 0.25 and wilcoxon_p([0, 0]) is None    # 3 seeds cannot reach 0.05
    adj = holm([0.01, 0.04, 0.03, None])
    assert [a["p_adj"] for a in adj[:3]] == pytest.approx([0.03, 0.06, 0.06]) and adj[3]["p_adj"] is None
    assert [a["rejected"] for a in adj[:3]] == [True, False, False]


def test_holm_reads_at_the_bonferroni_level_after_its_first_non_rejection():
    """Holm stops at the first p it does not reject: that test and every later one get the level 1 - alpha/m,
    never the step level 1 - alpha/(m - k) that assumes the earlier nulls false (the earlier code did)."""
    from mapl.report.stats import holm
    stopped = holm([0.01, 0.04, 0.03, None])            # 0.01 <= 0.05/3 rejected; 0.03 > 0.05/2: Holm stops
    assert [a["level"] for a in stopped[:3]] == pytest.approx([1 - 0.05 / 3] * 3)
    every = holm([0.001, 0.01, 0.02])                    # each rejected at its step: the step levels
    assert [a["level"] for a in every] == pytest.approx([1 - 0.05 / 3, 1 - 0.05 / 2, 0.95])
    assert all(a["rejected"] for a in every)
    first = holm([0.2, 0.3])                             # the smallest not rejected: all at Bonferroni
    assert [a["level"] for a in first] == pytest.approx([0.975, 0.975]) and not any(a["rejected"] for a in first)


@pytest.mark.parametrize("ci,size,verdict", [
    ((0.3, 2.5), None, "reproduced"), ((-0.5, 0.8), None, "inconclusive"), ((-2.0, -0.1), None, "contradicted"),
    (None, None, "not testable here"),
    ((1.03, 2.15), 5, "contradicted"),                   # the order holds, the claimed lead of 5 points does not
    ((0.3, 6.0), 5, "reproduced"), ((6.0, 7.0), 5, "reproduced"), ((-0.5, 6.0), 5, "inconclusive"),
    ((-0.92, 0.36), 0.35, "inconclusive"), ((-0.9, 0.30), 0.35, "contradicted")])
def test_an_ordering_claim_tests_its_sign_and_its_size(ci, size, verdict):
    from mapl.report.claims import order_verdict
    c = None if ci is None else {"n": 8, "ci": ci, "level": 0.95}
    got, reason, grounds = order_verdict(c, size)
    assert got == verdict
    if ci is not None:
        assert reason.startswith("sign: ") and (("; size: " in reason) == (size is not None))
        assert grounds[:2] == ("sign", "claimed" if ci[0] > 0 else "reversed" if ci[1] < 0 else "unresolved")
        assert (len(grounds) == 4) == (size is not None)


@pytest.mark.parametrize("ci,verdict", [((2.6, 3.6), "contradicted"), ((1.0, 9.0), "inconclusive"),
                                        ((9.0, 12.0), "reproduced"), ((8.0, 16.0), "inconclusive"),
                                        (None, "not testable here")])
def test_a_range_claim_is_reproduced_only_inside_and_contradicted_only_outside(ci, verdict):
    from mapl.report.claims import range_verdict
    assert range_verdict(ci, 8.37, 15.05)[0] == verdict


@pytest.mark.parametrize("n,deltas,verdict", [
    (2, [1.0, 1.2], "not testable here"),                 # no verdict from two seeds, whatever they say
    (3, [0.5, 1.5, 3.5], "inconclusive"),                 # wide: the old rule read "reproduced" (it met ≤ 2 %)
    (3, [1.0, 1.1, 1.2], "reproduced"),                   # tight and inside
    (3, [3.0, 3.1, 3.2], "contradicted")])                # tight and outside
def test_few_seeds_make_a_range_row_inconclusive_never_reproduced(n, deltas, verdict):
    from mapl.report.claims import Claim, PaperSide, abstract_bound, headline, range_row
    spec = Claim("MAPL ≤ 2 %", abstract_bound("mapl"), headline("mapl"), "range", "t.md", "MAPL")
    s = {"delta_pct": sum(deltas) / n, "deltas": dict(enumerate(deltas)), "n": n, "steps": 3000, "wire_ratio": 8,
         "total_bytes_per_token": 74.0, "variant": "mapl"}
    assert range_row(spec, PaperSide("≤ 2 %", None, 2.0), s)[1].verdict == verdict


def test_the_bytes_claim_reads_the_int8_backward_where_it_was_trained():
    """"RVQ halves the bytes again" reads all bytes: MAPL+VQ with its gradient in int8 where the headline has it
    (the row says so), else MAPL+VQ as the paper describes it; the verdict is the count against 1.8x."""
    from mapl.report.claims import CLAIMS, Evidence, bytes_row
    spec = next(c for c in CLAIMS if c.claim == "RVQ halves the bytes again")
    def summary(variant, fwd, total):
        return {"variant": variant, "fwd_bytes_per_token": fwd, "total_bytes_per_token": total}
    mapl = summary("mapl", 34.0, 70.0)
    same, int8 = summary("mapl-rvq-scaled", 19.0, 57.0), summary("mapl-rvq-scaled-grad-int8", 19.0, 38.0)
    before, after = Evidence(rows=[]), Evidence(rows=[])
    before.__dict__["headline"], after.__dict__["headline"] = [mapl, same], [mapl, same, int8]   # cached summaries
    assert spec.reads(before) == (same, mapl) and spec.reads(after) == (int8, mapl)
    ours, ruling = bytes_row(spec, None, (int8, mapl))
    assert ruling.verdict == "reproduced" and "all 1.84×" in ours and "int8 backward" in ours
    assert "the gradient is int8" in ruling.reason
    assert bytes_row(spec, None, (same, mapl))[1].verdict == "contradicted"


def test_the_rows_of_one_claim_are_one_family_read_at_holms_levels():
    """A claim read in three rows is one family of three: the third row's tiny p is rejected first (step level
    1 - 0.05/3); Holm stops at the next, so the other two read at 1 - 0.05/3."""
    from mapl.report.claims import Claim, family_levels, stated, study_contrast
    def spec(fam, rule="order"):
        return Claim("c", stated("x"), study_contrast("s"), rule, "t.md", family=fam)
    specs = [spec("lf"), spec("lf"), spec("lf"), spec(""), spec("r", "range"), spec("r", "range")]
    measured = [{"n": 8, "diffs": [0.1, -0.3, 0.4, 0.2, -0.1, 0.3, 0.0, 0.2]},
                {"n": 8, "diffs": [-0.1, -0.5, 0.2, -0.4, 0.1, -0.3, -0.6, 0.0]},
                {"n": 3, "diffs": [11.5, 11.9, 12.3]}, {"n": 8, "diffs": [1.0, 2.0, 1.5, 1.2, 1.8, 1.1, 2.2, 1.9]},
                {"n": 8}, {"n": 2}]
    levels = family_levels(specs, measured)
    assert levels[:3] == [(pytest.approx(1 - 0.05 / 3), 3)] * 3
    assert levels[3] == (0.95, 1)                         # a family of one (the primary contrast's case)
    assert levels[4] == (0.95, 1) and levels[5] == (0.95, 1)  # two seeds have no interval: not counted in m


def test_a_claim_with_no_runs_says_so_rather_than_too_few_seeds():
    from mapl.report.claims import NOT_RUN, order_verdict, range_verdict
    assert order_verdict(None)[:2] == ("not testable here", NOT_RUN)
    assert range_verdict(None, 8.37, 15.05, n=0)[:2] == ("not testable here", NOT_RUN)
    assert range_verdict(None, 8.37, 15.05, n=2)[1] == "fewer than 3 seeds"
    assert order_verdict({"n": 2, "ci": None, "level": 0.95})[1] == "fewer than 3 paired seeds"


def test_a_one_seed_comparison_has_a_ledger_cell_without_a_level():
    """The micro profile's headline has one seed: its comparison has no interval and no Holm level."""
    from mapl.report.claims import _comparison_cell, order_verdict
    c = {"mean": 0.5, "ci": None, "level": None, "n": 1, "a": {"steps": 40}}
    assert _comparison_cell(c).startswith("+0.50 points") and "n = 1, 40 steps" in _comparison_cell(c)
    assert order_verdict(c)[:2] == ("not testable here", "fewer than 3 paired seeds")


def test_each_row_names_the_validation_tokens_its_loss_is_measured_on():
    from mapl.report.rows import eval_set
    assert eval_set({"train": {"eval_tokens": 0, "select_every": 2}}) == "whole split"
    assert eval_set({"train": {"eval_tokens": 65536}}) == "val[0:65,536)"
    assert eval_set({"train": {}}) == "val[0:65,536)"                     # results from before the key
    assert eval_set({"train": {"eval_tokens": 65536, "eval_offset": 65536}}) == "val[65,536:131,072)"


def test_the_token_axis_warns_when_budgets_were_evaluated_on_different_sets():
    from mapl.report.studies.axes import token_table
    rows = [{"run": f"{m}-{s}-{seed}", "group": "g", "model": "tiny", "stages": 4, "method": m, "variant": m,
             "wire_ratio": 1.0 if m == "none" else 8.0, "projection_ratio": None if m == "none" else 8,
             "projector": None if m == "none" else "spel", "anchor": None, "anchor_rank": 0, "rvq_sync": None,
             "rvq_scale": None, "data_source": "", "steps": s, "seed": seed, "tokens": s * 2048,
             "val_loss": base + (0.1 if m == "ssn" else 0.05 if m == "mapl" else 0) + 0.01 * seed,
             "val_loss_curve": [], "eval_offset": 0, "profile": "cpu",
             "eval_set": "whole split" if s == 3000 else "val[0:65,536)", "total_bytes_per_token": 1.0,
             "fwd_bytes_per_token": 1.0, "n_params": 1}
            for s, base in ((300, 4.0), (3000, 3.6)) for m in ("none", "ssn", "mapl") for seed in range(3)]
    t = token_table(rows)
    assert t.header[-1] == "eval set" and [b[-1] for b in t.body] == ["val[0:65,536)", "whole split"]
    assert "different validation sets (val[0:65,536): 300 steps; whole split: 3,000 steps)" in t.takeaway
    same = token_table([{**r, "eval_set": "whole split"} for r in rows])
    assert "different validation sets" not in same.takeaway


def test_the_width_axis_names_each_widths_validation_set_and_warns_when_they_differ():
    """A retrain under way can leave the main model (d = 128, retrained) and the other widths on different
    validation sets: the width table says which, per row, and its takeaway warns."""
    from mapl.report.studies.axes import width_table
    rows = [{"run": f"{m}-d{d}-{seed}", "group": "main" if d == 128 else "width", "model": "tiny" if d == 128 else
             f"tiny[d_model={d}]", "base_model": "tiny", "d_model": d, "stages": 4, "method": m, "variant": m,
             "wire_ratio": 1.0 if m == "none" else 8.0, "projection_ratio": None if m == "none" else 8,
             "projector": None if m == "none" else "spel", "anchor": None, "anchor_rank": 0, "rvq_sync": None,
             "rvq_scale": None, "data_source": "", "steps": 300, "seed": seed, "tokens": 300 * 2048,
             "val_loss": 4.0 + (0.1 if m == "ssn" else 0.05 if m == "mapl" else 0) + 0.01 * seed + d / 1e4,
             "val_loss_curve": [], "eval_offset": 0, "profile": "cpu",
             "eval_set": "whole split" if d == 128 else "val[0:65,536)", "total_bytes_per_token": 1.0,
             "fwd_bytes_per_token": 1.0, "n_params": 1}
            for d in (64, 128, 256) for m in ("none", "ssn", "mapl") for seed in range(2)]
    t = width_table(rows)
    assert t.header[-1] == "eval set" and [b[-1] for b in t.body] == ["val[0:65,536)", "whole split", "val[0:65,536)"]
    assert ("widths were evaluated on different validation sets (val[0:65,536): d = 64, d = 256; whole split: "
            "d = 128)") in t.takeaway
    assert "different validation sets" not in width_table([{**r, "eval_set": "whole split"} for r in rows]).takeaway


def test_time_to_target_compares_only_curves_on_the_targets_validation_set():
    """The target comes from the uncompressed runs at the longest budget; a method whose runs were evaluated
    on other tokens (an older protocol) is 'no run on the target's validation set', not 'never'."""
    from mapl.report.studies.ttt import method_curve, on_target_set
    def row(method, steps, eval_set, curve):
        return {"model": "tiny", "group": "g", "method": method, "variant": method, "wire_ratio": 1.0 if method == "none"
                else 8.0, "steps": steps, "eval_set": eval_set, "val_loss": curve[-1][1], "val_loss_curve": curve}
    rows = [row("none", 3000, "whole split", [[1000, 4.0], [3000, 3.8]]),
            row("mapl", 3000, "whole split", [[1000, 4.1], [3000, 3.85]]),
            row("int8", 300, "val[0:65,536)", [[300, 4.0]])]
    kept = on_target_set(rows)
    assert [r["method"] for r in kept] == ["none", "mapl"]
    assert method_curve(kept, "int8", 8.0)[0] is None and method_curve(rows, "int8", 8.0)[0] == 300
    from mapl.report.studies.ttt import time_to_target_table
    def ttt(method, budget, n):
        return {"method": method, "wire_ratio": 1.0 if method == "none" else 8.0, "budget": budget, "seeds": 8,
                "target": 3.9, "target_pct": 2.0, "steps_to_target": n, "latency_s": 0.0, "bandwidth_bps": 1e7,
                "step_s": 0.5, "time_s": None if n is None else n * 0.5}
    table = time_to_target_table([ttt("none", 3000, 1500), ttt("ssn", 3000, None), ttt("int8", None, None)])
    assert [b[-1] for b in table.body] == ["750.0", "—", "never"]        # METHOD_ORDER: none, int8, ssn
    assert "Never within their runs: SSN 8×." in table.takeaway
    assert "Not measured (no run on the target's validation set): int8" in table.takeaway


def test_the_best_step_is_chosen_on_the_selection_set():
    from mapl.report.rows import at_best_validation
    row = {"steps": 30, "val_loss": 3.0, "val_loss_curve": [[10, 3.5], [20, 2.9], [30, 3.0]],
           "select_loss_curve": [[10, 3.4], [20, 3.2], [30, 3.1]]}
    best = at_best_validation([row])[0]
    assert (best["best_step"], best["val_loss"], best["best_chosen_on"]) == (30, 3.0, "selection set")
    old = at_best_validation([{**row, "select_loss_curve": []}])[0]
    assert (old["best_step"], old["val_loss"], old["best_chosen_on"]) == (20, 2.9, "report set")
