"""``mapl rerun`` (mapl.orchestration.rerun): the judge answers both ways on synthetic rows, the tolerance is the
largest redraw-against-committed difference, and end to end on micro runs a rerun on this machine is consistent
with identical losses until a committed result is perturbed."""
import copy
import json

import pytest

from mapl import report as R
from mapl.base.cli import EXIT_NOT_CONSISTENT, EXIT_USER_ERROR
from mapl.cli import rerun as cli
from mapl.base.io import OutputError
from mapl.core.config import ConfigError, load_params
from mapl.orchestration import groups, rerun, sweep
from mapl.report.stats import t_quantile
from tests.helpers.report_data import result, write

LOSSES = {"none": [3.50, 3.52, 3.48], "ssn": [3.60, 3.63, 3.57], "mapl": [3.55, 3.56, 3.52]}


def _rows(losses=LOSSES, seeds=(0, 1, 2), prefix="") -> list[dict]:
    return [R.row_from_result(result(m, 1 if m == "none" else 8, seed=s, steps=3000, loss=losses[m][s],
                                     name=f"{prefix}tiny-{m}-s{s}"))
            for s in seeds for m in losses]


def _perturbed(rows: list[dict], method: str, factor: float) -> list[dict]:
    return [{**r, "val_loss": r["val_loss"] * factor} if r["method"] == method else r for r in rows]


TOL = rerun.Tolerance(0.5, 0.5, "test")


def test_a_rerun_of_committed_seeds_with_their_losses_is_consistent():
    committed = _rows()
    checks = rerun.judge(committed, _rows(seeds=(0, 1)), TOL)
    assert [c.label for c in checks] == ["tiny-ssn", "tiny-mapl", "tiny-ssn − tiny-mapl"]
    assert all(c.consistent for c in checks)
    assert checks[1].rerun == pytest.approx({s: 100 * (LOSSES["mapl"][s] / LOSSES["none"][s] - 1) for s in (0, 1)})
    assert [(n, a - b) for n, a, b in rerun.same_run_differences(committed, _rows(seeds=(0,)))] == \
        [("tiny-none-s0", 0.0), ("tiny-ssn-s0", 0.0), ("tiny-mapl-s0", 0.0)]
    text = rerun.format_judgement(checks, [], TOL)
    assert text.endswith("verdict: consistent (3 of 3 checks inside)") and "committed  mean" in text


def test_mapls_loss_five_percent_higher_is_not_consistent_in_its_own_check_and_the_gap():
    checks = rerun.judge(_rows(), _perturbed(_rows(seeds=(0,)), "mapl", 1.05), TOL)
    assert [c.consistent for c in checks] == [True, False, False]
    assert "verdict: not consistent: tiny-mapl, tiny-ssn − tiny-mapl (1 of 3" in rerun.format_judgement(checks, [], TOL)


def test_the_interval_is_the_prediction_interval_for_k_new_seeds_widened_by_the_tolerance():
    committed, k = {0: 1.0, 1: 2.0, 2: 3.0}, 2
    check = rerun._check("x", committed, {0: 2.0, 1: 2.0}, 0.25)
    half = t_quantile(0.975, 2) * 1.0 * (1 / k + 1 / 3) ** 0.5 + 0.25          # sd of 1, 2, 3 is 1
    assert (check.low, check.high) == pytest.approx((2 - half, 2 + half))
    # one committed seed: no spread to predict from, the tolerance alone
    alone = rerun._check("x", {0: 1.0}, {0: 1.4}, 0.5)
    assert (alone.low, alone.high, alone.consistent) == (0.5, 1.5, True)


def test_the_tolerance_is_the_largest_redraw_difference_of_a_run_and_of_a_gap():
    committed = _rows()
    losses = copy.deepcopy(LOSSES)
    losses["mapl"][1] *= 1.01                    # the largest Δ% difference, and the largest gap difference
    losses["ssn"][2] *= 0.998
    redraw = _rows(losses, prefix="redraw-")
    tol = rerun.measured_tolerance(committed, redraw, "here")
    mapl_move = 100 * LOSSES["mapl"][1] * 0.01 / LOSSES["none"][1]
    assert tol.delta == pytest.approx(mapl_move) and tol.gap == pytest.approx(mapl_move)
    assert tol.source == "here (6 matched runs, 3 matched gaps)"
    # the redraw judged as the rerun of the committed seeds is consistent by its own spread
    assert all(c.consistent for c in rerun.judge(committed, redraw, tol))
    # no pair to measure a gap on: the triangle bound
    only = rerun.measured_tolerance(*(
        [r for r in rows if r["method"] != "ssn"] for rows in (committed, redraw)), "here")
    assert only.gap == pytest.approx(2 * only.delta)
    assert rerun.measured_tolerance(committed, [], "here") is None


def _synthetic_results(tmp_path):
    results = tmp_path / "results"
    for r in _rows():
        (results / "long").mkdir(parents=True, exist_ok=True)
        (results / "long" / f"{r['run']}.json").write_text("{}")
    return results


def test_the_command_exits_6_on_not_consistent_and_names_the_check(tmp_path, monkeypatch, capsys):
    results = _synthetic_results(tmp_path)
    monkeypatch.setattr(rerun, "rerun_group", lambda *a: (_rows(), _perturbed(_rows(seeds=(0,)), "mapl", 1.05)))
    argv = ["--profile", "micro", "--group", "long", "--seeds", "0", "--results", str(results), "--tolerance", "0.5"]
    assert EXIT_NOT_CONSISTENT not in (0, 1, 2, 3, 130)             # bugs, user errors, a failed rank, Ctrl-C
    assert cli.main(argv) == EXIT_NOT_CONSISTENT
    assert "verdict: not consistent: tiny-mapl" in capsys.readouterr().out
    monkeypatch.setattr(rerun, "rerun_group", lambda *a: (_rows(), _rows(seeds=(0,))))
    assert cli.main(argv) == 0


@pytest.mark.parametrize("argv, line", [
    (["--group", "nope", "--seeds", "0"], "error: --group 'nope' is invalid: profile micro has groups main,"),
    (["--group", "long", "--seeds", "0", "--results", "/nonexistent"],
     "error: --results /nonexistent is invalid: no such folder"),
    (["--group", "long", "--seeds", "0"], "error: --tolerance is required: "),
    (["--group", "long", "--seeds", "0", "--tolerance", "-1"], "error: --tolerance -1.0 is invalid"),
    (["--group", "long", "--seeds", "0", "--tolerance", "inf"], "error: --tolerance inf is invalid"),
    (["--group", "long", "--seeds", "7", "--tolerance", "1"], "error: --seeds 7 is invalid: no run of the group has it"),
    (["--group", "frontier", "--seeds", "0", "--tolerance", "1"],
     "error: --group frontier is invalid for a rerun: profile micro has no uncompressed run of seed(s) 0"),
    (["--group", "corpus", "--seeds", "0", "--tolerance", "1"],
     "error: --group corpus is invalid for a rerun: it has no compressed run to judge"),
    (["--group", "main", "--seeds", "0", "--tolerance", "1"],
     "error: --results {results} is invalid: no committed results of group main in it"),
])
def test_a_user_error_is_one_line_and_exit_2_before_any_training(argv, line, tmp_path, monkeypatch, capsys):
    results = _synthetic_results(tmp_path)
    monkeypatch.setattr(sweep, "train_pool", lambda *a, **k: pytest.fail("trained"))
    if "--results" not in argv:
        argv = [*argv, "--results", str(results)]
    assert cli.main(["--profile", "micro", *argv]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line.format(results=results)), err


def test_a_committed_result_of_another_config_is_refused_before_any_training(tmp_path, monkeypatch):
    results = tmp_path / "results"
    for name, method in (("micro-P2-none-40steps-s0", "none"), ("micro-P2-mapl-4x-40steps-s0", "mapl")):
        write(results, "long", result(method, 4, steps=40, model="micro", stages=2, profile="micro", name=name))
    monkeypatch.setattr(sweep, "train_pool", lambda *a, **k: pytest.fail("trained"))
    with pytest.raises(ConfigError, match=r"^micro-P2-none-40steps-s0: no committed result of this config in .*long: "
                                          r"params.yaml builds another config than was committed"):
        rerun.rerun_group("micro", "long", [0], results, tmp_path / "out")


# ---- end to end on micro runs ----------------------------------------------------------------------------------
def _probe_params(tiny_corpus) -> dict:
    """Group probe: none, SSN and MAPL on seed 0, 6 steps on the tests' corpus."""
    data = {"data.source": "text", "data.paths": [str(tiny_corpus.parent / "doc*.txt")], "data.tokenizer": "byte",
            "data_dir": str(tiny_corpus), "train.steps": 6, "train.eval_every": 3}
    params = copy.deepcopy(load_params())
    params["groups"]["probe"] = {"study": "probe", "role": "reported"}
    params["profiles"]["micro"]["runs"] = {
        f"probe-{m}-s0": {"group": "probe", "method": m, **({"ratio": 4} if m != "none" else {}), **data}
        for m in ("none", "ssn", "mapl")}
    return params


@pytest.mark.slow             # six micro runs (about 40 s on 2 cores)
@pytest.mark.process          # train_pool's spawn pool
def test_a_rerun_on_this_machine_is_consistent_until_a_committed_loss_moves(tiny_corpus, tmp_path, monkeypatch,
                                                                          capsys):
    params = _probe_params(tiny_corpus)
    for module in (sweep, groups):
        monkeypatch.setattr(module, "PROJECT_ROOT", tmp_path)       # the committed runs' checkpoints
    monkeypatch.setattr(cli, "load_params", lambda: params)
    results, out = tmp_path / "results", tmp_path / "rerun"
    sweep.train_pool("micro", groups.group_specs("micro", "probe", params), results / "probe", params=params)
    argv = ["--profile", "micro", "--group", "probe", "--seeds", "0", "--results", str(results), "--out", str(out),
            "--tolerance", "0.1"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert text.count("(+0.0000 %)") == 3 and "verdict: consistent (3 of 3 checks inside)" in text, text
    assert sorted(p.name for p in (out / "checkpoints").glob("*.pt")) == [f"probe-{m}-s0.pt" for m in
                                                                          ("mapl", "none", "ssn")]

    # MAPL's committed loss 5 % lower: judged again from the reruns already there, no training
    path = results / "probe" / "probe-mapl-s0.json"
    res = json.loads(path.read_text())
    path.write_text(json.dumps({**res, "val_loss": res["val_loss"] * 0.95}))
    monkeypatch.setattr(sweep, "train_pool", lambda *a, **k: pytest.fail("trained again"))
    assert cli.main(argv) == EXIT_NOT_CONSISTENT
    assert "verdict: not consistent: probe-mapl, probe-ssn − probe-mapl" in capsys.readouterr().out

    # a launch that wrote nothing is an error, never "consistent, 0 checks"
    monkeypatch.setattr(sweep, "train_pool", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="no results of probe-mapl-s0, probe-none-s0, probe-ssn-s0 after training"):
        rerun.rerun_group("micro", "probe", [0], results, tmp_path / "empty", params)
    # never into the committed results
    with pytest.raises(OutputError, match="is inside the committed results"):
        rerun.rerun_group("micro", "probe", [0], results, results / "probe" / "x", params)
