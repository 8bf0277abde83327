"""The scale ladder: the code corpus (pinned sdists, dedup by file, split by module, a manifest naming every
source), the budget rule params.yaml is held to, and the study's analysis (the paired gap per rung and its slope
in ln(parameters))."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

import mapl.data as D
from mapl import report as R
from mapl.base.settings import ConfigError
from mapl.core.config import load_params
from mapl.core.model_config import PRESETS, count_params
from mapl.data import DataConfig, DataError
from mapl.data.sources import CODE_PACKAGES, SYMPY, Sdist
from mapl.orchestration.ladder import check_ladder, ladder_settings, ladder_steps
from mapl.report.studies.ladder import gap_slope, ladder_rungs, ladder_table, rung_params
from tests.test_data import write_tarball


def _packages(cache: Path) -> tuple:
    """Two fake sdists: a module shared by both (dropped the second time), empty files, a non-UTF-8 fixture."""
    shared = "def shared():\n    return 1\n" * 10
    a = {"alpha-1.0/alpha/__init__.py": "", "alpha-1.0/alpha/core.py": "class Core:\n    pass\n" * 30,
         "alpha-1.0/alpha/util.py": shared, "alpha-1.0/tests/test_core.py": "def test():\n    assert True\n" * 20,
         "alpha-1.0/README.txt": "not code"}
    b = {"beta-2.0/beta/__init__.py": "\n", "beta-2.0/beta/graph.py": "def walk(g):\n    yield from g\n" * 25,
         "beta-2.0/beta/vendored.py": shared, "beta-2.0/beta/latin1.py": "x = 'caf\xe9'\n".encode("latin-1")}
    return (Sdist("alpha==1.0", "alpha-1.0.tar.gz", write_tarball(cache / "alpha-1.0.tar.gz", a), "MIT"),
            Sdist("beta==2.0", "beta-2.0.tar.gz", write_tarball(cache / "beta-2.0.tar.gz", b), "BSD-3-Clause"))


def test_the_code_corpus_keeps_each_distinct_module_once_named_by_package(tmp_path, monkeypatch):
    packages = _packages(tmp_path)
    monkeypatch.setattr(D.sources, "pip_download", lambda *a, **k: pytest.fail("pip called despite cached sdists"))
    monkeypatch.setattr(D.sources, "CODE_PACKAGES", packages)
    docs = D.sources.sdist_documents("python-code", tmp_path)
    assert [d.name for d in docs] == ["alpha/alpha/core.py", "alpha/alpha/util.py", "alpha/tests/test_core.py",
                                      "beta/beta/graph.py"]      # empty, duplicate and non-UTF-8 files dropped
    inventory = D.sources.code_inventory(docs)
    assert [(x["package"], x["licence"], x["modules"]) for x in inventory] == [("alpha==1.0", "MIT", 3),
                                                                               ("beta==2.0", "BSD-3-Clause", 1)]
    assert all(len(x["sha256"]) == 64 for x in inventory)


def test_a_damaged_sdist_is_one_line_naming_the_file(tmp_path):
    bad = tmp_path / "alpha-1.0.tar.gz"
    bad.write_bytes(b"not a tarball")
    with pytest.raises(DataError, match=r"alpha-1.0.tar.gz: not a readable sdist of alpha==1.0 .*delete it"):
        D.sources.tar_documents("python-code", Sdist("alpha==1.0", bad.name, "0" * 64, "MIT"), bad)


def test_the_prepared_code_corpus_splits_by_module_and_its_manifest_names_every_source(tmp_path, monkeypatch):
    packages = _packages(tmp_path / "cache")
    monkeypatch.setattr(D.sources, "CODE_PACKAGES", packages)
    monkeypatch.setenv("MAPL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = DataConfig(source="python-code", tokenizer="byte", val_fraction=0.25).validate()
    assert D.dataset_dir_name(cfg).startswith("python-code-byte")
    m = D.prepare(cfg, tmp_path / "out")
    assert m["splits"]["val"]["documents"] == 1 and m["splits"]["train"]["documents"] == 3
    assert [s["package"] for s in m["sources"]] == ["alpha==1.0", "beta==2.0"]
    assert "alpha==1.0 (MIT)" in m["source"] and "one document per module" in m["source"]
    docs = D.sources.sdist_documents("python-code", tmp_path / "cache")
    train, val = D.split_documents(docs, 0.25, 0)
    assert not {d.name for d in train} & {d.name for d in val}      # whole modules: none on both sides


def test_the_pinned_packages_are_pinned():
    assert len({p.name for p in CODE_PACKAGES}) == len(CODE_PACKAGES)
    assert all("==" in p.spec and len(p.sha256) == 64 and p.licence for p in CODE_PACKAGES)
    assert CODE_PACKAGES[0].spec == SYMPY.spec          # the sympy corpus is the first part of this one


# ---- the budget rule -------------------------------------------------------------------------------------------
def test_the_budget_rule_gives_every_rung_the_same_tokens_per_parameter():
    st = ladder_settings()
    assert st.rungs and all(r in PRESETS for r in st.rungs)
    params = [count_params(PRESETS[r], include_embeddings=False) for r in st.rungs]
    assert params[-1] / params[0] >= 6                       # the span the study needs
    for rung, n in zip(st.rungs, params):
        steps = ladder_steps(rung, st.tokens_per_param, 2048)
        assert abs(steps * 2048 / n - st.tokens_per_param) < 0.01
        assert PRESETS[rung].n_layers % st.stages == 0 and PRESETS[rung].n_layers // st.stages >= 2


def _with_ladder_run(**over) -> dict:
    """params.yaml with the cpu profile's ladder runs replaced by one (its tuning runs kept)."""
    params = copy.deepcopy(load_params())
    spec = {"group": "ladder", "model": "ladder-d64", "method": "none", "train.lr_muon": 0.02,
            "data.source": "python-code", "data.val_fraction": 0.01, "data.sampling": "epochs",
            "train.steps": ladder_steps("ladder-d64", 2, 2048), **over}
    runs = params["profiles"]["cpu"]["runs"]
    params["profiles"]["cpu"]["runs"] = {**{n: r for n, r in runs.items() if r["group"] != "ladder"},
                                         "ladder-d64-P4-none-mu0.02-s0": spec}
    return params


def test_a_ladder_run_off_the_budget_rule_is_refused_naming_it():
    params = _with_ladder_run()
    tuning = sum(r["group"] == "ladder_tune" for r in params["profiles"]["cpu"]["runs"].values())
    assert check_ladder("cpu", params) == tuning + 1                 # every ladder run is checked, the new one too
    with pytest.raises(ConfigError, match=r"runs\.ladder-d64-P4-none-mu0\.02-s0.*train.steps=400 breaks the ladder's "
                                          r"budget rule: 2 tokens per non-embedding parameter on ladder-d64 is 393 steps"):
        check_ladder("cpu", _with_ladder_run(**{"train.steps": 400}))
    with pytest.raises(ConfigError, match=r"data.sampling='uniform' is invalid for the ladder"):
        check_ladder("cpu", _with_ladder_run(**{"data.sampling": "uniform"}))
    with pytest.raises(ConfigError, match=r"model='mini' is not a rung"):
        check_ladder("cpu", _with_ladder_run(model="mini"))


# ---- the analysis ------------------------------------------------------------------------------------------------
def _ladder_row(model, method, seed, loss, group="ladder", steps=None):
    from tests.helpers.report_data import result
    d = PRESETS[model].d_model
    steps = steps or ladder_steps(model, 2, 2048)
    res = result(method, 8 if method != "none" else 1, seed=seed, steps=steps, loss=loss,
                 model=model, name=f"{model}-{steps}-{method}-s{seed}", d=d)
    return {**R.row_from_result({**res, "train_split_tokens": 23_907_284}, group), "data_source": "python-code"}


def _ladder_rows(gaps: dict, seeds=range(4)):
    """``gaps``: rung -> gap at the budget rule's steps, or (rung, steps) -> gap (a cell off the rule)."""
    rows = []
    for cell, gap in gaps.items():
        model, steps = cell if isinstance(cell, tuple) else (cell, None)
        for s in seeds:
            none = 3.0 - 0.1 * math.log(rung_params(model)) + 0.01 * s
            mapl = none * 1.02
            ssn = mapl + none * (gap + 0.05 * (s - 1.5)) / 100          # the paired gap in points, with a seed spread
            rows += [_ladder_row(model, "none", s, none, steps=steps), _ladder_row(model, "ssn", s, ssn, steps=steps),
                     _ladder_row(model, "mapl", s, mapl, steps=steps)]
    return rows


def test_the_slope_recovers_a_gap_that_grows_with_ln_params():
    models = ("ladder-d64", "ladder-d128", "ladder-d192")
    true = 0.8
    gaps = {m: 1.0 + true * math.log(rung_params(m) / rung_params(models[0])) for m in models}
    rungs = ladder_rungs(_ladder_rows(gaps))
    assert [r["model"] for r in rungs] == list(models)
    assert [r["gap"]["n"] for r in rungs] == [4, 4, 4]
    assert [round(r["gap"]["mean"], 6) for r in rungs] == [pytest.approx(gaps[m], abs=1e-6) for m in models]
    fit = gap_slope(rungs)
    assert fit["slope"] == pytest.approx(true, abs=1e-6) and fit["n"] == 12 and fit["rungs"] == 3
    assert fit["ci"][0] < true < fit["ci"][1]
    flat = gap_slope(ladder_rungs(_ladder_rows({m: 1.0 for m in models})))
    assert flat["ci"][0] < 0 < flat["ci"][1]
    assert gap_slope(ladder_rungs(_ladder_rows({"ladder-d64": 1.0}))) is None        # one rung: no slope


def test_the_ladder_table_states_budget_epochs_and_the_slope():
    models = ("ladder-d64", "ladder-d128")
    table = ladder_table(_ladder_rows({m: 1.0 for m in models}))
    assert [b[0] for b in table.body] == list(models)
    assert [b[4] for b in table.body] == ["2.00", "2.00"]                  # tokens per parameter, the rule's
    assert all(float(b[5]) < 1 for b in table.body)                       # every rung under one epoch
    assert "Slope of the SSN − MAPL gap per ln(parameters): " in table.takeaway
    assert "no runs of the scale ladder yet" in ladder_table([]).takeaway


_CELLS = (("ladder-d64", 400), ("ladder-d64", 2400), ("ladder-d128", 400), ("ladder-d128", 1600),
          ("ladder-d192", 1600), ("ladder-d192", 2400))
_WOBBLE = (0.05, -0.03, -0.04, 0.06, -0.02, 0.01)        # per-cell deviations: the fit has a residual to read


def _cell_gaps(size: float, length: float) -> dict:
    """(rung, steps) -> 1 + size ln(params / d64's) + length ln(steps / 400), plus a per-cell wobble."""
    p0 = rung_params("ladder-d64")
    return {(m, st): 1.0 + size * math.log(rung_params(m) / p0) + length * math.log(st / 400) + w
            for (m, st), w in zip(_CELLS, _WOBBLE)}


def test_the_size_coefficient_holds_steps_and_needs_cells_off_the_budget_rule():
    from mapl.report.studies.ladder import size_length_fit, size_length_table
    fit = size_length_fit(ladder_rungs(_ladder_rows(_cell_gaps(0.8, 0.0))))
    assert fit["identified"] and fit["cells"] == 6 and fit["df"] == 3 and fit["unit"] == "cell"
    assert fit["size"] == pytest.approx(0.8, abs=0.1) and fit["ci"][0] > 0
    length_only = size_length_fit(ladder_rungs(_ladder_rows(_cell_gaps(0.0, 0.8))))
    assert length_only["steps_coef"] == pytest.approx(0.8, abs=0.1) and length_only["ci"][0] < 0 < length_only["ci"][1]
    # the budget rule's rungs alone: three cells for three coefficients, and the slope on size cannot tell them apart
    rule = ladder_rungs(_ladder_rows({m: 1.0 + 0.8 * math.log(rung_params(m)) for m in _CELLS_RULE}))
    assert not size_length_fit(rule)["identified"] and size_length_fit(rule)["corr"] > 0.999
    assert "not separated yet" in size_length_table(_ladder_rows({m: 1.0 for m in _CELLS_RULE})).takeaway


_CELLS_RULE = ("ladder-d64", "ladder-d128", "ladder-d192")


def test_the_ledgers_scale_row_follows_the_size_coefficient_not_the_slope():
    def row(rows):
        return next(c for c in R.claims([], rows) if c["claim"].startswith("the SSN − MAPL gap grows"))
    grows = row(_ladder_rows(_cell_gaps(0.8, 0.0)))
    assert grows["verdict"] == "reproduced" and grows["table"] == "size-length.md"
    assert grows["ours"].startswith("ln(params) coefficient, steps held: +0.79 points") and "6 cells, 3 df" in grows["ours"]
    assert row(_ladder_rows(_cell_gaps(-0.8, 0.0)))["verdict"] == "contradicted"
    assert row(_ladder_rows(_cell_gaps(0.0, 0.8)))["verdict"] == "inconclusive"        # length, not size
    # on the budget rule's rungs a slope that grows with size is no verdict: size and length move together
    rule = row(_ladder_rows({m: 1.0 + 0.8 * math.log(rung_params(m)) for m in _CELLS_RULE}))
    assert rule["verdict"] == "inconclusive" and rule["grounds"] == ("confounded",)
    assert "not identified (3 cells" in rule["ours"] and "slope on size alone +0.80 points" in rule["ours"]
    none = next(c for c in R.claims([]) if "grows" in c["claim"])
    assert none["verdict"] == "not testable here" and "fewer than two rungs" in none["reason"]


def test_each_rungs_gap_joins_the_table_of_where_the_order_holds():
    from mapl.report.studies.exhibits import order_holds_table
    rows = _ladder_rows({"ladder-d64": 0.0, "ladder-d128": 3.0})
    body = [b for b in order_holds_table([], rows).body if b[0] == "the scale ladder"]
    assert [(b[1], b[3], b[5]) for b in body] == [("ladder-d64", "Python (code)", 4), ("ladder-d128", "Python (code)", 4)]
    assert [b[-1] for b in body] == ["not resolved", "MAPL ahead"]
