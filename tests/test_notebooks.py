"""The DVC pipeline and its notebooks: `make smoke` (the profile's stages on the micro profile in a temporary
copy of this checkout), nbval on its executed notebooks, DVC retraining exactly the runs an edit touches,
the paper-smoke rehearsal, `make verify`; and fast static checks of dvc.yaml, params.yaml and the
committed notebooks. Nothing here writes into the repository (the smoke run checks `git status`).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mapl.core import fingerprint
from mapl.orchestration import workspace
from mapl.core.config import load_params

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ("data", "frozen_trunk", "rescore", "report", "when_it_pays")
MICRO_RUNS = load_params(ROOT / "params.yaml")["profiles"]["micro"]["runs"]     # dvc.yaml's train stages on micro
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())
VALIDATED = "reports/params-valid.txt"      # the validate stage's stamp: every other stage depends on it
# modules a training run imports that cannot change its numbers (so they are not training sources)
# Layers that compute no number (see tests/test_layers.py), and the command a training run starts from.
NUMBER_FREE = ("mapl/base/", "mapl/orchestration/", "mapl/cli/")


def _needs_tools():
    pytest.importorskip("papermill")
    pytest.importorskip("dvc")
    if shutil.which("git") is None:
        pytest.skip("git is needed by dvc and the workspace copy")


# Everything here that runs DVC, papermill or the paper-smoke is `full` (make test-all): `make smoke` alone is 2-3
# minutes on 2 cores and the 150M rehearsal several more, beyond make test's 12; make test keeps the static checks
# of dvc.yaml, params.yaml and the committed notebooks below; the functions the notebooks call are unit-tested in
# process (tests/test_report_*.py, tests/test_claims.py, tests/test_costmodel.py).
@pytest.fixture(scope="module")
def smoke():
    """`make smoke`, kept: (the copy, the first repro's output). The copy is removed afterwards."""
    _needs_tools()
    dest, log = workspace.smoke(ROOT, keep=True, capture=True)
    yield dest, log
    shutil.rmtree(dest, ignore_errors=True)


def _outputs(nb_path: Path) -> list[dict]:
    nb = json.loads(nb_path.read_text())
    return [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]


def _text(nb_path: Path) -> str:
    return "".join("".join(o.get("text", "")) or "".join(o.get("data", {}).get("text/markdown", ""))
                   for o in _outputs(nb_path))


def _checked_text(nb_path: Path) -> str:
    """Stream output of the cells nbval compares (``# NBVAL_CHECK_OUTPUT``)."""
    nb = json.loads(nb_path.read_text())
    return "".join("".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code"
                   and "NBVAL_CHECK_OUTPUT" in "".join(c["source"]) for o in c.get("outputs", []))


@pytest.mark.slow
@pytest.mark.full
def test_smoke_runs_every_stage_into_the_micro_folders(smoke):
    dest, log = smoke
    for stage in ["prepare", *(f"train@{r}" for r in MICRO_RUNS), "frozen_trunk", "rescore", "report", "plan"]:
        assert f"Running stage '{stage}'" in log, stage
    assert "Running stage 'plan-paper'" not in log
    assert "micro-P2-none-s0 step 20/20 loss" in log                    # a run's progress lines
    stamp = json.loads((dest / "data" / "micro.manifest.json").read_text())
    assert stamp["profile"] == "micro" and (dest / stamp["data_dir"] / "manifest.json").exists()
    out = dest / "reports" / "micro"
    assert sorted(p.name for p in (out / "results" / "main").glob("*.json")) == [
        "micro-P2-mapl-4x-s0.json", "micro-P2-mapl-rvq-4x-s0.json", "micro-P2-none-s0.json", "micro-P2-ssn-4x-s0.json"]
    assert len(list((out / "configs").glob("*.json"))) == len(MICRO_RUNS)              # each run's resolved config
    assert len(list((out / "frozen-trunk").glob("frozen-*.json"))) == 3                # one per projector
    res = json.loads((out / "results" / "width" / "micro-d32-P2-mapl-4x-s0.json").read_text())
    assert res["provenance"]["config_hash"] and res["provenance"]["data_hash"]          # what DVC's stage rests on
    assert sorted(p.name for p in (out / "notebooks").iterdir()) == [f"{n}.ipynb" for n in sorted(NOTEBOOKS)]
    # the rescore stage scored micro's prose group on the held-out text and its code group on its unread windows
    scored = {g: json.loads((out / "rescore" / f"{g}.json").read_text())["runs"] for g in ("long", "ladder")}
    assert len(scored["long"]) == 2 and all(set(e["scores"]) == {"heldout-kjv"} for e in scored["long"].values())
    assert len(scored["ladder"]) == 2 and all(set(e["scores"]) == {"unread-train"} for e in scored["ladder"].values())
    for nb in (out / "notebooks").iterdir():
        assert not [o for o in _outputs(nb) if o["output_type"] == "error"], nb.name
        checked = _checked_text(nb)
        assert checked and str(dest) not in checked, f"{nb.name}: a checked cell prints an absolute path"
    assert (out / "metrics.json").exists() and list((out / "figures").glob("*.png")) and list((out / "tables").glob("*.md"))
    plan = _checked_text(out / "notebooks" / "when_it_pays.ipynb")       # FLOP-based: no step measurement of micro
    assert "no step measurement of micro" in plan
    assert "Target: validation loss" in plan            # the report's time-to-target rule, applied by the planner
    text = _text(out / "notebooks" / "when_it_pays.ipynb")   # the crossover table is displayed as Markdown
    assert "Crossover bandwidth" in text or "No crossover" in text
    assert (out / "plan" / "tables" / "when-it-pays-profile.md").exists()
    assert (out / "plan" / "tables" / "when-it-pays-profile.csv").exists()
    drawn = {p.name for p in (out / "plan" / "figures").glob("*.png")}
    for kind in ("heatmap", "curve"):                  # each view is drawn or says why not: never a blank figure
        assert f"when-it-pays-{kind}.png" in drawn or f"no {kind} to draw" in text, kind
    assert not (ROOT / "reports" / "micro").exists()


@pytest.mark.slow
@pytest.mark.full
def test_nbval_on_executed_micro_notebooks(smoke):
    """nbval re-executes executed notebooks with their injected parameters, from their own folder."""
    pytest.importorskip("nbval")
    dest, _ = smoke
    nbs = [f"reports/micro/notebooks/{n}.ipynb" for n in NOTEBOOKS]
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                        "--nbval-current-env", "--rootdir", str(dest), *nbs], cwd=dest, env=workspace.tool_env(ROOT, dest),
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and " passed" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]
    assert not (dest / "reports" / "micro" / "notebooks" / "reports").exists()     # no side files from a wrong cwd


@pytest.mark.slow
@pytest.mark.full
def test_dvc_retrains_exactly_the_runs_an_edit_touches(smoke):
    """After the smoke run every stage is current; a run edited in params.yaml (and one method's tuned setting)
    makes DVC retrain those runs only, and a checkpoint cadence (no number changes) retrains nothing."""
    dest, _ = smoke
    env = workspace.tool_env(ROOT, dest)
    params = dest / "params.yaml"
    text = params.read_text()
    edited = text.replace("      micro-P2-none-s1: {group: seeds, method: none, train.seed: 1}",
                          "      micro-P2-none-s1: {group: seeds, method: none, train.seed: 7}", 1)
    edited = edited.replace("    method_overrides: {}\n", "    method_overrides: {ssn: {train.lr_embed: 0.02}}\n", 1)
    edited = edited.replace("      checkpoint_every: 10\n", "      checkpoint_every: 5\n", 1)
    assert "train.seed: 7}" in edited and "lr_embed: 0.02}}" in edited and "checkpoint_every: 5" in edited
    params.write_text(edited)
    from mapl.core.config import config_hash
    from mapl.orchestration.groups import spec_config
    old, new = load_params(ROOT / "params.yaml"), load_params(params)
    changed = sorted(f"train@{name}" for name, spec in MICRO_RUNS.items() if config_hash(
        spec_config("micro", {"name": name, **spec}, old)) != config_hash(spec_config("micro", {"name": name, **spec}, new)))
    assert "train@micro-P2-none-s1" in changed and "train@micro-P2-ssn-4x-s0" in changed and len(changed) < 8
    workspace.dvc(["repro", "validate"], dest, env, capture=True)          # the runs' configs, written again
    status = subprocess.run([str(Path(sys.executable).parent / "dvc"), "status", "--json"], cwd=dest, env=env,
                            capture_output=True, text=True, check=True).stdout
    stale = sorted(stage for stage in json.loads(status) if stage.startswith("train@"))
    assert stale == changed, status[-3000:]
    params.write_text(text)
    workspace.dvc(["repro", "validate"], dest, env, capture=True)


def _bf16_matmul_slowdown() -> float:
    """How many times slower this CPU multiplies 512 x 512 matrices in bf16 than in fp32 (best of three each)."""
    import torch
    a = torch.randn(512, 512)
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = a.to(dtype)
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            x @ x
            runs.append(time.perf_counter() - start)
        times[dtype] = min(runs)
    return times[torch.bfloat16] / times[torch.float32]


@pytest.mark.slow
@pytest.mark.full
def test_paper_smoke_rehearsal_150M(tmp_path):
    """The paper code path at the 150M shape on CPU: every method, one `accelerate launch` of the 4-process
    1F1B pipeline each, 2 steps, Mistral 32k tokenizer; results in the copy's reports/paper-smoke/."""
    _needs_tools()
    # torch's Muon orthogonalises each update in bf16 (Newton-Schulz): on a CPU without bf16 units that is an order
    # of magnitude slower than fp32 (measured on such a CPU: 0.92 s against 0.08 s for one 1024 x 2816 product, 77 s
    # for one Newton-Schulz call), so one 150M step takes about an hour there and the rehearsal cannot finish
    slowdown = _bf16_matmul_slowdown()
    if slowdown > 4:
        pytest.skip(f"this CPU multiplies in bf16 {slowdown:.0f}x slower than in fp32 (no bf16 units): torch's Muon "
                    "orthogonalises in bf16, so a 150M step takes about an hour here; run it on a CPU with bf16 "
                    "support or on a GPU")
    pytest.importorskip("accelerate")
    pytest.importorskip("mapl.core.memory", reason="the launcher checks each run's memory plan (mapl.core.memory, planner)")
    dest = workspace.make_copy(tmp_path / "w", "paper-smoke", ROOT)
    p = subprocess.run([sys.executable, "-m", "mapl.cli", "sweep", "--group", "main"], cwd=dest,
                       env=workspace.tool_env(ROOT, dest), capture_output=True, text=True, timeout=3000)
    assert p.returncode == 0, p.stderr[-4000:]
    results = sorted(p for p in (dest / "reports" / "paper-smoke" / "results" / "main").glob("*.json")
                     if not p.name.endswith(".memory.json"))
    assert [r.name for r in results] == sorted(f"150M-P4-{m}-s0.json" for m in ("none", "int8", "ssn-4x", "mapl-4x",
                                                                                "mapl-rvq-4x"))
    for path in results:
        res = json.loads(path.read_text())
        assert res["runtime"] == "multiprocess" and res["schedule"] == "1f1b" and res["steps"] == 2
        assert res["pipeline"]["processes"] == 4 and res["pipeline"]["launcher"] == "accelerate"
        assert res["n_params"] > 100e6 and res["provenance"]["config_hash"]
        assert path.with_suffix(".memory.md").read_text().rstrip().endswith("launched")    # the memory plan


@pytest.mark.slow
@pytest.mark.full
def test_verify_detects_a_changed_table(tmp_path):
    """`make verify` on a copy whose committed table was edited must fail naming the table."""
    _needs_tools()
    profile = load_params(ROOT / "params.yaml")["profile"]
    tables = sorted((ROOT / "reports" / profile / "tables").glob("*.md"))
    if not tables:
        pytest.skip(f"no committed report of {profile}")
    src = workspace.make_copy(tmp_path / "src", profile, ROOT)
    edited = src / "reports" / profile / "tables" / tables[0].name
    edited.write_text(edited.read_text() + "an edit\n")
    with pytest.raises(workspace.WorkspaceError, match=f"differs: reports/{profile}/tables/{tables[0].name}"):
        workspace.verify(profile, root=src, capture=True)


# ---- static checks of dvc.yaml, params.yaml and the committed notebooks (fast) -------------------------
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_clean_and_parameterized(name):
    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), "commit without outputs"
    assert sum("parameters" in c.get("metadata", {}).get("tags", []) for c in code) == 1
    src = "\n".join("".join(c["source"]) for c in code)
    assert "from mapl.orchestration.notebook import setup" in src and "setup(profile)" in src       # one shared setup helper
    assert "NBVAL_CHECK_OUTPUT" in src
    assert nb["metadata"]["kernelspec"]["name"] == "python3"


def test_plan_paper_outputs_are_committed_and_labelled():
    """The paper case (stage plan-paper) is committed: a model-based prediction, crossovers of MAPL,
    MAPL+RVQ and SSN against uncompressed at 150M and 1B, once from the paper's penalties and once
    from the cpu profile's measured steps to target (its one read of another profile's outputs)."""
    import csv
    base = ROOT / "reports" / "paper"
    md = (base / "plan-paper" / "tables" / "when-it-pays-paper.md").read_text()
    assert md.startswith("# When compression pays (paper case, model-based prediction; rows '<model>-our-measured-steps' "
                         "take the steps-to-target ratios measured in reports/cpu/results")
    with open(base / "plan-paper" / "tables" / "when-it-pays-paper.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for model in ("150M", "1B", "150M-our-measured-steps", "1B-our-measured-steps"):
        against_none = {r["method"].split()[0] for r in rows if r["model"] == model and r["against"] == "none"}
        assert against_none == {"ssn", "mapl", "mapl-rvq"}, model
        for kind in ("heatmap", "curve"):
            assert (base / "plan-paper" / "figures" / f"when-it-pays-{kind}-{model}.png").exists()
    assert "MODEL-BASED PREDICTION" in _checked_text(base / "notebooks" / "when_it_pays-paper.ipynb")
    stage = DVC["stages"]["plan-paper"]
    assert "-p case paper" in stage["cmd"] and not any("${profile}" in d for d in stage["deps"])
    assert [d for d in stage["deps"] if d.startswith("reports/cpu")] == ["reports/cpu/results"]


def _outs(st: dict) -> list[str]:
    return [next(iter(o)) for o in st.get("outs", []) + st.get("metrics", []) + st.get("plots", [])]


def test_dvc_yaml_stages():
    stages = DVC["stages"]
    assert list(stages) == ["validate", "prepare", "train", "frozen_trunk", "rescore", "report", "plan", "plan-paper"]
    assert stages["train"]["foreach"] == "${runs}"              # params.yaml's runs of the profile, in their order
    assert "params" not in stages["train"]["do"]                 # staleness is each run's resolved config
    for name, st in stages.items():
        st = st.get("do", st)
        assert st.get("desc"), f"stage {name} has no desc"
        for out in st.get("outs", []) + st.get("metrics", []) + st.get("plots", []):
            (path, opts), = out.items()
            # the rescore stage's scores persist: they are its resume state (a scored run is not scored again); the
            # validate stage's configs persist: a refused params.yaml must not have DVC delete them
            persist = {"persist": True} if (name, path) in (("rescore", "reports/${profile}/rescore"),
                                                             ("validate", "reports/${profile}/configs")) else {}
            assert opts == {"cache": False, **persist}, f"{name}: {path} must be committed (cache: false)"
            # plan-paper (the paper's shapes, no training) and validate (every profile's params) are the
            # profile-independent stages
            allowed = {"plan-paper": ("reports/paper/",), "validate": (VALIDATED, "reports/${profile}/")}.get(
                name, ("reports/${profile}/", "data/${profile}."))
            assert path.startswith(allowed), f"{name}: {path} is not per profile"
    assert "mapl sweep --estimate --profile ${profile}" in stages["prepare"]["cmd"][0]


def test_every_stage_waits_for_params_yaml_to_be_validated():
    """DVC removes a stage's outputs before its command runs: every stage depends on the validate stage's
    stamp, so DVC runs `mapl sweep --check` first and stops there on a bad value."""
    from mapl.orchestration.validate import STAMP_TEXT
    assert _outs(DVC["stages"]["validate"]) == [VALIDATED, "reports/${profile}/configs"]
    assert DVC["stages"]["validate"]["cmd"] == f"mapl sweep --check --stamp {VALIDATED}"
    assert set(DVC["stages"]["validate"]["params"]) == {"profile", "groups", "profiles", "frozen_trunk", "rescore",
                                                          "ladder"}
    for name, st in DVC["stages"].items():
        deps = st.get("do", st)["deps"]
        if name == "train":         # its run's config, an output of the validate stage
            assert deps[0] == "reports/${profile}/configs/${key}.json"
        elif name != "validate":
            assert VALIDATED in deps, f"stage {name} does not depend on {VALIDATED}"
    assert (ROOT / VALIDATED).read_text() == STAMP_TEXT


@pytest.mark.slow
@pytest.mark.full
def test_dvc_repro_with_a_bad_params_value_touches_no_output(tmp_path):
    """Was: `steps: many` deleted every results JSON of the group and overwrote its notebook, and the error was
    a papermill traceback. Now the validate stage fails first, in one line, and every output stays."""
    _needs_tools()
    dest = workspace.make_copy(tmp_path / "copy", load_params(ROOT / "params.yaml")["profile"], ROOT)
    params = dest / "params.yaml"
    text = params.read_text()
    assert "      steps: 300\n" in text
    params.write_text(text.replace("      steps: 300\n", "      steps: many\n", 1))
    # every output but the validate stage's own stamp (gone: params.yaml is not valid)
    outputs = sorted(p for p in (dest / "reports").rglob("*") if p.is_file() and p != dest / VALIDATED) + \
        sorted(dest.glob("data/*.json"))
    before = {p: p.read_bytes() for p in outputs}
    p = subprocess.run([str(Path(sys.executable).parent / "dvc"), "repro"], cwd=dest, env=workspace.tool_env(ROOT, dest),
                       capture_output=True, text=True, timeout=600)
    log = p.stdout + p.stderr
    assert p.returncode != 0
    assert "error: profiles.cpu.train.steps='many' is invalid: must be an integer" in log, log[-3000:]
    assert "Running stage 'validate'" in log and "Running stage 'prepare'" not in log, log[-3000:]
    assert "Traceback" not in log and "papermill" not in log.lower(), log[-3000:]
    assert {p: p.read_bytes() for p in outputs if p.exists()} == before      # nothing removed, nothing changed
    assert len(before) > 100 and not (dest / VALIDATED).exists()


def test_no_two_stages_share_an_output_in_any_profile():
    """DVC refuses overlapping outputs: with every profile of params.yaml substituted (paper included,
    where `plan` writes under reports/paper/ too), no output is inside another stage's output."""
    for profile, tree in load_params(ROOT / "params.yaml")["profiles"].items():
        outs = []
        for name, st in DVC["stages"].items():
            items = tree["runs"].items() if "foreach" in st else [(None, None)]
            for item, spec in items:
                for path in _outs(st.get("do", st)):
                    path = path.replace("${profile}", profile).replace("${key}", str(item))
                    path = path.replace("${item.group}", str((spec or {}).get("group")))
                    outs.append((f"{name}@{item}" if item else name, path.rstrip("/")))
        for i, (a, pa) in enumerate(outs):
            for b, pb in outs[i + 1:]:
                assert pa != pb and not pb.startswith(pa + "/") and not pa.startswith(pb + "/"), \
                    f"profile {profile}: {a} ({pa}) and {b} ({pb}) overlap"


def test_every_committed_figure_is_a_declared_plot():
    """`dvc plots show` lists a stage's `plots:` only: every committed PNG under reports/<profile>/ (the params.yaml
    profile's, and the paper case's) lies in one, and no stage declares a folder both as an output and as plots."""
    profile = load_params(ROOT / "params.yaml")["profile"]
    plots, outs = [], []
    for st in DVC["stages"].values():
        st = st.get("do", st)
        plots += [next(iter(o)).replace("${profile}", profile) for o in st.get("plots", [])]
        outs += [next(iter(o)).replace("${profile}", profile) for o in st.get("outs", [])]
    pngs = sorted(p.relative_to(ROOT).as_posix() for sub in (profile, "paper") for p in (ROOT / "reports" / sub).rglob("*.png"))
    assert pngs, "no committed figures"
    for png in pngs:
        assert any(png.startswith(d.rstrip("/") + "/") for d in plots), f"{png} is in no stage's plots"
        assert not any(png.startswith(d.rstrip("/") + "/") for d in outs), f"{png} is also under an outs folder"


def test_train_deps_are_the_fingerprinted_sources():
    """dvc.yaml's train deps and mapl.core.fingerprint.TRAIN_SOURCES are one list (what 'the training code' is)."""
    deps = [p for p in DVC["stages"]["train"]["do"]["deps"] if "$" not in p]
    assert deps == list(fingerprint.TRAIN_SOURCES)
    assert fingerprint.source_files(ROOT)                                     # every entry exists
    assert {"mapl/report.py", "mapl/report", "mapl/core/link.py"}.isdisjoint(deps)   # editing the report never retrains


def test_the_prepare_stage_depends_on_each_report_module_the_data_notebook_draws_with():
    """prepare lists mapl.report's files one by one (a report edit must not prepare the data again): each function
    data.ipynb calls as ``report.<name>`` must be defined in a listed file, or an edit to it would leave the executed
    notebook stale."""
    import inspect
    import re
    from mapl import report
    deps = set(DVC["stages"]["prepare"]["deps"])
    assert "mapl/report" not in deps
    source = "".join("".join(c["source"]) for c in json.loads((ROOT / "notebooks/data.ipynb").read_text())["cells"])
    called = set(re.findall(r"\breport\.(\w+)", source))
    assert called, "data.ipynb calls no mapl.report function"
    for name in called:
        where = Path(inspect.getsourcefile(getattr(report, name))).resolve().relative_to(ROOT).as_posix()
        assert where in deps, f"data.ipynb calls report.{name} from {where}, which the prepare stage does not list"


@pytest.mark.process
def test_training_imports_only_fingerprinted_modules():
    """Every mapl module a training run imports is a training source (mapl/core, mapl/data) or in a
    layer that computes no number (base, orchestration, the command): a module put elsewhere would let
    the reuse of checkpoints survive a change to it."""
    # `mapl train` imports the engine only when a run starts: import what run() imports too
    code = ("import sys, pkgutil, importlib, mapl.cli.train, mapl.core.engine, mapl.core.loop, "
            "mapl.orchestration.sweep, mapl.core.compress\n"
            "for m in pkgutil.walk_packages(mapl.core.compress.__path__, 'mapl.core.compress.'): "
            "importlib.import_module(m.name)\n"
            "print('\\n'.join(sorted(m.__file__ for n, m in sys.modules.items() if n.startswith('mapl') and m.__file__)))")
    files = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    imported = {Path(f).resolve().relative_to(ROOT).as_posix() for f in files}
    sources = {p.relative_to(ROOT).as_posix() for p in fingerprint.source_files(ROOT)}
    assert {f for f in imported - sources if not f.startswith(NUMBER_FREE)} == set()


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_cell_ids_are_unique(name):
    """nbformat 'corrects' a repeated cell id to a random one on every execution (a warning, and executed copies
    that differ run to run)."""
    ids = [c.get("id") for c in json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]]
    assert len(ids) == len(set(ids))


# ---- papermill parameters: a name the notebook does not declare, or a value of another type, is refused ------------
DECLARED = ('profile = ""          # a comment\njobs = 0\ntarget_pct = 2.0\nlatencies_ms = [0.0, 50.0]\nmfu = 0.35\n'
            'mfu_range = [0.25, 0.5]\n')


@pytest.mark.parametrize("injected, message", [
    ("methods = []", "parameter 'methods' is not one of this notebook's: allowed jobs, latencies_ms, mfu, mfu_range, "
     "profile, target_pct (its parameters cell)"),
    # the rules of the CLI flags of the same quantity (was: accepted by the notebook, refused by the CLI)
    ("target_pct = 0", "parameter target_pct=0 is invalid: must be a finite number > 0 (percent above uncompressed's "
     "best loss)"),
    ("mfu = 2.0", "parameter mfu=2 is invalid: must be in (0, 1] (the fraction of the peak sustained while computing)"),
    ("mfu_range = [0.25, 0.0]", "parameter mfu_range=0 is invalid: must be in (0, 1] (the fraction of the peak "
     "sustained while computing)"),
    ("jobs = 2.5", "parameter jobs=2.5 is invalid: must be an integer like its default 0"),
    ("profile = 3", "parameter profile=3 is invalid: must be a string like its default ''"),
    ("target_pct = float('nan')", "parameter target_pct=nan is invalid: must be a finite number >= 0 (its default is 2.0)"),
    ("jobs = -1", "parameter jobs=-1 is invalid: must be a finite number >= 0 (its default is 0)"),
    ("latencies_ms = 50", "parameter latencies_ms=50 is invalid: must be a list like its default [0.0, 50.0]"),
])
def test_a_papermill_parameter_the_notebook_does_not_take_is_refused_naming_it(injected, message):
    from mapl.orchestration.notebook import NotebookParameterError, check_parameters
    namespace: dict = {}
    exec(injected, {}, namespace)
    with pytest.raises(NotebookParameterError) as e:
        check_parameters(namespace, ["", DECLARED, f"# Parameters\n{injected}\n", "nb = setup(profile)"])
    assert str(e.value) == message
    assert e.value._render_traceback_() == [f"error: {message}"]     # the cell's error output: one line


def test_declared_parameters_of_their_type_pass_and_nbval_has_none_to_check():
    from mapl.orchestration.notebook import check_parameters
    check_parameters({"jobs": 2, "target_pct": 3, "profile": "cpu"},                # an int where a float is declared
                     ["", DECLARED, '# Parameters\njobs = 2\ntarget_pct = 3\nprofile = "cpu"\n'])
    check_parameters({}, ["", DECLARED, "nb = setup(profile)"])                   # nbval: no injected cell


def test_mapl_notebook_types_parameters_as_papermill_does():
    from mapl.cli.notebook import parameter_value
    assert [parameter_value(v) for v in ("True", "False", "None", "50", "-2", "0.5", "1e3", "cpu", "")] == \
        [True, False, None, 50, -2, 0.5, 1000.0, "cpu", ""]


def test_mapl_notebook_keeps_the_kernel_connection_file_in_a_folder_of_its_own(tmp_path, monkeypatch):
    # was: a /tmp/tmp*.json connection file left by every killed run; now a killed run's folder goes at the next run
    import tempfile

    from mapl.cli.notebook import _kernel_runtime
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed = tmp_path / "mapl-kernel-999999999-abc"
    killed.mkdir()
    (killed / "tmpx.json").write_text("{}")
    with _kernel_runtime():
        inside = Path(tempfile.gettempdir())
        assert inside.parent == tmp_path and inside.name.startswith(f"mapl-kernel-{os.getpid()}-")
    assert tempfile.gettempdir() == str(tmp_path) and list(tmp_path.iterdir()) == []


def _mapl_notebook(args: list[str], **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "mapl.cli", "notebook", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


@pytest.mark.process
def test_mapl_notebook_prints_a_refused_parameter_in_one_line(tmp_path):
    # was (papermill's command, as dvc.yaml ran it): the good line inside papermill's traceback, exit 1
    p = _mapl_notebook(["notebooks/when_it_pays.ipynb", str(tmp_path / "o.ipynb"), "-p", "case", "paper", "-p", "mfu",
                        "2.0"])
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2 and err == ("error: parameter mfu=2 is invalid: must be in (0, 1] (the fraction of the "
                                         "peak sustained while computing)\n"), err


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.full      # the kernel start and a report's first cells: ~15 s; the one-line path is checked above
def test_mapl_notebook_interrupted_is_one_line_and_exit_130(tmp_path):
    # Ctrl-C reaches the command's process group; the kernel (a session of its own) is shut down by the client
    p = _mapl_notebook(["notebooks/report.ipynb", str(tmp_path / "r.ipynb"), "-p", "profile", "cpu", "-p", "out",
                        str(tmp_path / "rep")], start_new_session=True,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(12)
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and err.count("\n") == 1 and err.startswith("interrupted: notebooks/report.ipynb "), err


@pytest.mark.process
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_notebook_refuses_a_parameter_it_does_not_take(name, tmp_path):
    """`papermill notebooks/<nb>.ipynb out.ipynb -p <a name it does not declare> 1` (was: run to the end, ignored)."""
    papermill = pytest.importorskip("papermill")
    with pytest.raises(papermill.PapermillExecutionError) as e:
        papermill.execute_notebook(str(ROOT / "notebooks" / f"{name}.ipynb"), str(tmp_path / "out.ipynb"),
                                   parameters={"no_such_parameter": 1}, cwd=str(ROOT), progress_bar=False)
    assert e.value.ename == "NotebookParameterError"
    assert e.value.evalue.startswith("parameter 'no_such_parameter' is not one of this notebook's: allowed ")


@pytest.mark.process
@pytest.mark.parametrize("parameters, message", [
    ({"case": "paper", "profile": "cpu"}, "parameter profile is not used in the paper case"),
    ({"case": "profile", "profile": "micro", "models": ["1B"]}, "parameter models is not used in the profile case"),
    ({"case": "profile", "profile": "cpu", "methods": []}, "parameter methods is not used: reports/bench/pipeline.json "
                                                          "measured profile cpu"),
])
def test_when_it_pays_refuses_a_parameter_its_case_ignores(parameters, message, tmp_path):
    """`-y 'methods: []'` on the measured profile changed nothing (the benchmark's methods are drawn)."""
    papermill = pytest.importorskip("papermill")
    with pytest.raises(papermill.PapermillExecutionError) as e:
        papermill.execute_notebook(str(ROOT / "notebooks" / "when_it_pays.ipynb"), str(tmp_path / "out.ipynb"),
                                   parameters=parameters, cwd=str(ROOT), progress_bar=False)
    assert e.value.ename == "NotebookParameterError" and e.value.evalue.startswith(message), e.value.evalue
