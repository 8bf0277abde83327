"""params.yaml's group declaration (mapl.base.declared_groups) and a profile's runs (mapl.orchestration.groups):
every group declared once with its study and role, named budgets merged into runs, one-line errors, each run's
resolved config (what its DVC stage depends on), and the committed results of every cpu run still the results of
its spec; fast: nothing here trains."""
import copy
import json
from pathlib import Path

import pytest
import yaml

import mapl.cli.sweep
from mapl.base.declared_groups import ROLES, declaration
from mapl.core.config import ConfigError, config_hash, load_params
from mapl.orchestration import groups as G
from mapl.orchestration import sweep, validate
from mapl.report.rows import declared, study_groups, study_role

PARAMS = load_params()
ROOT = Path(__file__).resolve().parents[1]
PARAMS_TEXT = (ROOT / "params.yaml").read_text()


def _declared(**entries):
    return declaration({"groups": entries})


def test_the_declaration_gives_each_group_its_study_and_role_in_the_report_order():
    d = declaration(PARAMS)
    assert d.names()[:2] == ("main", "seeds") and d.names()[-1] == "long_redraw"
    assert [d.study_of(g) for g in ("main", "long_rvq", "long_fixed", "learned_fixed_4x", "ablations_long")] == [
        "main", "long", "long", "learned_fixed_4x", "ablations"]
    assert d.studies() == ("main", "seeds", "ablations", "long", "tokens", "width", "rvq_sync", "lr_check", "tune",
                           "tune2", "decompose", "decompose_capacity", "learned_fixed_4x", "frontier", "corpus", "blocks",
                           "ladder_tune", "ladder", "long_redraw")
    assert {s for s in d.studies() if d.role_of_study(s) == "tuning"} == {"lr_check", "tune", "tune2", "ladder_tune"}
    assert {s for s in d.studies() if d.role_of_study(s) == "other-corpus"} == {"corpus", "ladder"}
    assert d.role_of_study("long_redraw") == "redraw" and d.redrawn_study("long_redraw") == "long"
    assert d.redrawn_study("long") == ""
    assert d.role_of_study("main") == "reported" and d.groups_of("main") == ("main",)
    assert d.study_of("adhoc") == "adhoc" and d.role_of_study("adhoc") == "reported"     # an undeclared folder
    # the report reads the same declaration
    assert declared() == d and study_role("tune") == "tuning"
    assert study_groups("long") == "groups long, long_rvq, long_fixed and long_gradwire"
    assert study_groups("blocks") == "group blocks"


@pytest.mark.parametrize("entries,says", [
    ({}, r"^params\.yaml `groups:` = \{\} is invalid: declare every run group once"),
    ({"a": {"study": "a"}}, r"^groups\.a = \{'study': 'a'\} is invalid: every group declares study and role \(missing role\)$"),
    ({"a": {"study": "a", "role": "final"}}, r"^groups\.a\.role='final' is invalid: allowed: 'reported', 'tuning'"),
    ({"a": {"study": "a", "role": "reported", "seeds": [1]}}, r"^groups\.a: unknown key\(s\) \['seeds'\]"),
    ({"A-b": {"study": "a", "role": "reported"}}, r"^groups: group name 'A-b' is invalid: lower-case letters"),
    ({"a": {"study": "", "role": "reported"}}, r"^groups\.a\.study: '' is invalid"),
    ({"a": {"study": "s", "role": "reported"}, "b": {"study": "s", "role": "tuning"}},
     r"^groups\.b\.role='tuning' is invalid: study 's' is read as 'reported' \(group a\); a study's groups share one role"),
    ({"a": {"study": "a", "role": "redraw"}},
     r"^groups\.a\.redraws='' is invalid: a group of role 'redraw' names the reported study it draws again"),
    ({"a": {"study": "a", "role": "reported", "redraws": "a"}}, r"^groups\.a\.redraws='a' is invalid: a group of role"),
    ({"a": {"study": "a", "role": "tuning"}, "b": {"study": "b", "role": "redraw", "redraws": "a"}},
     r"^groups\.b\.redraws='a' is invalid: name a study of role 'reported' \(declared: \)$"),
    ({"a": {"study": "a", "role": "reported"}, "b": {"study": "a", "role": "redraw", "redraws": "a"}},
     r"^groups\.b\.role='redraw' is invalid: study 'a' is read as 'reported'"),
    ({"a": {"study": "a", "role": "reported"}, "b": {"study": "b", "role": "redraw", "redraws": "c"}},
     r"^groups\.b\.redraws='c' is invalid: name a study of role 'reported' \(declared: a\)$"),
])
def test_a_bad_declaration_is_one_line_naming_the_field(entries, says):
    with pytest.raises(ConfigError, match=says):
        _declared(**entries)


def test_every_role_is_one_some_group_has():
    assert {g.role for g in declaration(PARAMS).groups.values()} == set(ROLES)


def test_a_named_budget_is_merged_into_runs_and_a_run_keeps_its_own_keys():
    """YAML's merge key resolves `<<: *name`: every reader sees plain specs, and a run's own value wins."""
    name = "tiny-P4-none-3000steps-s0"
    params = yaml.safe_load(PARAMS_TEXT.replace(f"      {name}: {{group: long, <<: *steps_3000, method: none, "
                                                "train.seed: 0}",
                                                f"      {name}: {{group: long, <<: *steps_3000, method: none, "
                                                "train.seed: 0, train.steps: 7}", 1))
    runs = G.group_specs("cpu", "long", params)
    assert runs[0] == {"name": name, "train.steps": 7, "train.warmup_steps": 300, "train.eval_every": 250,
                       "method": "none", "train.seed": 0}
    assert runs[1] == {"name": "tiny-P4-ssn-8x-3000steps-s0", **PARAMS["budgets"]["steps_3000"], "method": "ssn",
                       "ratio": 8, "train.seed": 0}
    assert {G.spec_config("cpu", spec, PARAMS).train.steps for spec in G.group_specs("cpu", "tokens", PARAMS)} == {1000}
    assert PARAMS["frozen_trunk"]["cpu"]["trunk"] == {**PARAMS["budgets"]["steps_1000"], "method": "none"}


@pytest.mark.parametrize("budgets,says", [
    ([1], r"^budgets = \[1\] is invalid: a mapping of name -> run settings"),
    ({"b": {}}, r"^budgets\.b = \{\} is invalid: a non-empty mapping of run settings"),
    ({"b": {"name": "x", "train.steps": 5}}, r"^budgets\.b = .* is invalid: a non-empty mapping of run settings \(no `name`"),
    ({"b": {"group": "x", "train.steps": 5}}, r"^budgets\.b = .* is invalid: a non-empty mapping of run settings"),
    ({"b": {"train.stepz": 5}}, r"^budgets\.b \(\{'train.stepz': 5\}\): 'train.stepz': train has no key 'stepz'"),
    ({"b": {"train.steps": "many"}}, r"^budgets\.b \(\{'train.steps': 'many'\}\): train\.steps='many' is invalid"),
])
def test_a_bad_budget_is_one_line_naming_it(budgets, says):
    with pytest.raises(ConfigError, match=says):
        G.check_budgets({**PARAMS, "budgets": budgets})


@pytest.mark.parametrize("runs,says", [
    ([{"method": "none"}], r"^profiles\.micro\.runs is invalid: a mapping of run name -> \{group: <group>, <settings>\}$"),
    ({"r": "none"}, r"^profiles\.micro\.runs\.r\.group = 'none' is invalid: allowed the groups params\.yaml declares"),
    ({"r": {"method": "none"}}, r"^profiles\.micro\.runs\.r\.group = None is invalid: allowed the groups"),
    ({"r": {"group": "nope"}}, r"^profiles\.micro\.runs\.r\.group = 'nope' is invalid: allowed the groups"),
    ({"r": {"group": "main", "name": "x"}}, r"^profiles\.micro\.runs\.r\.name is invalid: a run's name is its key$"),
])
def test_a_bad_run_is_one_line_naming_it(runs, says):
    params = copy.deepcopy(PARAMS)
    params["profiles"]["micro"]["runs"] = runs
    with pytest.raises(ConfigError, match=says):
        G.profile_runs("micro", params)


def test_a_run_whose_settings_are_invalid_is_named_with_its_field():
    params = copy.deepcopy(PARAMS)
    params["profiles"]["micro"]["runs"] = {"r": {"group": "main", "method": "mapl", "ratio": 3}}
    with pytest.raises(ConfigError, match=r"^profiles\.micro\.runs\.r: .*ratio"):
        G.check_runs("micro", params)


def test_a_run_listed_twice_is_refused_with_its_line(tmp_path):
    text = PARAMS_TEXT.replace("      micro-P2-none-s0: {group: main, method: none}\n",
                               "      micro-P2-none-s0: {group: main, method: none}\n"
                               "      micro-P2-none-s0: {group: seeds, method: none}\n", 1)
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"params\.yaml: invalid YAML at line \d+, column 7: duplicate key "
                                          r"'micro-P2-none-s0'$"):
        load_params(tmp_path / "params.yaml")


def test_the_top_level_runs_are_the_default_profiles():
    """dvc.yaml's train stage iterates over top-level `runs:`; it must be the profile's (a workspace sets both)."""
    assert PARAMS["runs"] == PARAMS["profiles"][PARAMS["profile"]]["runs"]
    with pytest.raises(ConfigError, match=r"^runs \(the top-level `runs:` of params\.yaml, what DVC trains\) is "
                                          r"invalid: it must be the profile's runs: `runs: \*runs_cpu`$"):
        validate.check_params({**PARAMS, "runs": PARAMS["profiles"]["micro"]["runs"]})


def test_each_runs_resolved_config_is_written_for_its_stage(tmp_path):
    """The validate stage writes every run's resolved config: the file changes exactly when a number-changing
    setting of the run does (the method's tuned settings included), not for a checkpoint cadence."""
    assert G.write_configs("micro", PARAMS, tmp_path) == len(PARAMS["profiles"]["micro"]["runs"])
    path = G.config_path("micro", "micro-P2-ssn-4x-s0", tmp_path)
    record = json.loads(path.read_text())
    cfg = G.spec_config("micro", G.group_specs("micro", "main", PARAMS)[1], PARAMS).validate()
    assert record["run"] == cfg.name() == "micro-P2-ssn-4x-s0" and record["group"] == "main"
    assert record["config_hash"] == config_hash(cfg) and record["config"]["compressor"]["ratio"] == 4.0
    params = copy.deepcopy(PARAMS)
    params["profiles"]["micro"]["train"]["checkpoint_every"] = 3
    G.write_configs("micro", params, tmp_path)
    assert json.loads(path.read_text()) == record
    params["profiles"]["micro"]["method_overrides"] = {"ssn": {"train.lr_muon": 0.05}}
    G.write_configs("micro", params, tmp_path)
    assert json.loads(path.read_text())["config_hash"] != record["config_hash"]
    assert json.loads(G.config_path("micro", "micro-P2-none-s0", tmp_path).read_text())["config_hash"] == \
        config_hash(G.spec_config("micro", G.group_specs("micro", "main", PARAMS)[0], PARAMS).validate())
    # the folder persists across DVC runs (a refused params.yaml must not empty it): a removed run's config goes here
    del params["profiles"]["micro"]["runs"]["micro-P2-ssn-4x-s0"]
    G.write_configs("micro", params, tmp_path)
    assert not path.exists() and G.config_path("micro", "micro-P2-none-s0", tmp_path).exists()


def test_the_committed_configs_are_what_params_yaml_resolves_to():
    """reports/cpu/configs/ (the validate stage's output, the train stages' deps) is current."""
    folder = ROOT / "reports" / "cpu" / "configs"
    runs = G.profile_runs("cpu", PARAMS)
    assert sorted(p.stem for p in folder.glob("*.json")) == sorted(runs)
    for name in list(runs)[::25]:         # a sample: resolving every run costs seconds
        cfg = G.spec_config("cpu", {"name": name, **runs[name]}, PARAMS).validate()
        assert (folder / f"{name}.json").read_text() == G.config_record(cfg, runs[name]["group"]), name


def test_a_group_split_by_seed_trains_only_the_runs_of_those_seeds(monkeypatch):
    specs = G.group_specs("cpu", "blocks", PARAMS)
    one = G.runs_of_seeds("cpu", specs, [1], PARAMS)
    assert len(one) == 5 and {G.spec_config("cpu", s, PARAMS).train.seed for s in one} == {1}
    with pytest.raises(ConfigError, match=r"^--seeds 5 is invalid: no run of the group has it \(its seeds: 0, 1\)$"):
        G.runs_of_seeds("cpu", specs, [5], PARAMS)
    called = {}
    monkeypatch.setattr(sweep, "sweep", lambda profile, names, jobs: called.update(names=names, jobs=jobs) or [])
    assert mapl.cli.sweep.main(["--group", "blocks", "--seeds", "1"]) == 0
    assert called == {"names": [s["name"] for s in one], "jobs": 0}


@pytest.mark.parametrize("text,seeds", [("1", [1]), ("0,1", [0, 1]), ("4-7", [4, 5, 6, 7]), ("0,4-5", [0, 4, 5])])
def test_the_seeds_option_takes_lists_and_ranges(text, seeds, monkeypatch):
    called = {}
    monkeypatch.setattr(mapl.cli.sweep, "runs_of_seeds", lambda profile, specs, asked, params: called.update(seeds=asked) or [])
    monkeypatch.setattr(sweep, "sweep", lambda *a, **k: [])
    assert mapl.cli.sweep.main(["--group", "blocks", "--seeds", text]) == 0
    assert called["seeds"] == seeds


@pytest.mark.parametrize("text", ["one", "4-", "-1", "7-4", "1,,2"])
def test_a_bad_seeds_option_is_refused_by_argparse(text, capsys):
    with pytest.raises(SystemExit) as stop:
        mapl.cli.sweep.main(["--group", "blocks", "--seeds", text])
    assert stop.value.code == 2 and f"--seeds: {text!r} is invalid: seeds >= 0 and ranges" in capsys.readouterr().err


def test_every_committed_cpu_result_is_the_result_of_its_spec():
    """Each cpu run has its results JSON in its group's folder, of the config its spec resolves to (config hash and
    steps), and each folder holds its group's runs only: an edit of params.yaml that changes a run's config, or
    leaves a result in a folder no group has, shows here before DVC retrains anything."""
    results = ROOT / "reports" / "cpu" / "results"
    runs = G.profile_runs("cpu", PARAMS)
    assert {p.name for p in results.iterdir() if p.is_dir()} == {spec["group"] for spec in runs.values()}
    for group in G.group_names("cpu", PARAMS):
        cfgs = [G.spec_config("cpu", s, PARAMS).validate() for s in G.group_specs("cpu", group, PARAMS)]
        for cfg in cfgs:
            res = json.loads((results / group / f"{cfg.name()}.json").read_text())
            assert (res["provenance"]["config_hash"], res["steps"]) == (config_hash(cfg), cfg.train.steps), cfg.name()
        held = {p.name for p in (results / group).glob("*.json") if not p.name.endswith(".memory.json")}
        assert held == {f"{c.name()}.json" for c in cfgs}, group
