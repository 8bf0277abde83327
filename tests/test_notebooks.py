"""The DVC pipeline and its notebooks, end to end on the micro profile, in a temporary copy.

The copy holds mapl/, notebooks/, dvc.yaml, pyproject.toml and a params.yaml whose micro profile
reads a generated text corpus (no download) and defines small run groups. There `dvc repro` runs
prepare -> train@{main,ablations,seeds,long} -> report; a second repro must do nothing; nbval then
re-executes the executed notebooks (from their own folder, as a reader would) and compares the
cells marked ``# NBVAL_CHECK_OUTPUT``. Nothing is written into the repository.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mapl import fingerprint

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ("data", "train", "report")
GROUPS = ["main", "ablations", "seeds", "long"]
MICRO_GROUPS = {                      # ablations stays undefined: its stage must be a no-op
    "main": [{"method": "none"}, {"method": "mapl", "ratio": 4}],
    "seeds": [{"method": "mapl", "ratio": 4, "train.seed": 1}],
    "long": [{"name": "micro-P2-none-long30-s0", "method": "none", "train.steps": 30}],
}
_TEXT = ("Now is the winter of our discontent\nMade glorious summer by this sun of York;\n"
         "And all the clouds that lour'd upon our house\nIn the deep bosom of the ocean buried.\n")


def _tool(name: str) -> str:
    """A console script of the running venv (DVC does not put the venv on PATH for its commands)."""
    return str(Path(sys.executable).parent / name)


def _run(args, cwd, env, timeout=300):
    p = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(map(str, args))} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout + p.stderr


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    pytest.importorskip("papermill")
    pytest.importorskip("dvc")
    if shutil.which("git") is None:
        pytest.skip("git is needed by dvc")
    root = tmp_path_factory.mktemp("project")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    for d in ("mapl", "notebooks"):
        shutil.copytree(ROOT / d, root / d, ignore=ignore)
    for f in ("dvc.yaml", "pyproject.toml", "reports/paper-numbers.csv"):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, root / f)
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i:02d}.txt").write_text(_TEXT.replace("York", f"York{i}") * 40)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["profile"] = "micro"
    micro = params["profiles"]["micro"]
    micro["data"] = {"source": "text", "paths": [str(corpus / "doc*.txt")], "tokenizer": "byte"}
    micro["groups"] = MICRO_GROUPS
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / ".gitignore").write_text("/data/*/\n/checkpoints/\n__pycache__/\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONHASHSEED": "0",
           "PYTHONDONTWRITEBYTECODE": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    _run(["git", "init", "-q"], root, env)
    _run([_tool("dvc"), "init", "-q"], root, env)
    _run(["git", "add", "-A"], root, env)
    _run(["git", "commit", "-qm", "micro copy"], root, env)
    log = _run([_tool("dvc"), "repro"], root, env, timeout=600)
    return root, env, log


def _outputs(nb_path: Path) -> list[dict]:
    nb = json.loads(nb_path.read_text())
    return [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]


def _text(nb_path: Path) -> str:
    return "".join("".join(o.get("text", "")) for o in _outputs(nb_path) if o["output_type"] == "stream")


def _checked_text(nb_path: Path) -> str:
    """Stream output of the cells nbval compares (``# NBVAL_CHECK_OUTPUT``)."""
    nb = json.loads(nb_path.read_text())
    return "".join("".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code"
                   and "NBVAL_CHECK_OUTPUT" in "".join(c["source"]) for o in c.get("outputs", []))


@pytest.mark.slow
def test_repro_runs_every_stage(project):
    root, _, log = project
    for stage in ["prepare", *(f"train@{g}" for g in GROUPS), "report"]:
        assert f"Running stage '{stage}'" in log
    stamp = json.loads((root / "data" / "micro.manifest.json").read_text())
    assert stamp["profile"] == "micro" and (root / stamp["data_dir"] / "manifest.json").exists()
    assert stamp["splits"]["val"]["sha256"]
    results = root / "reports" / "results"
    assert sorted(p.name for p in (results / "main").glob("*.json")) == ["micro-P2-mapl-4x-s0.json",
                                                                        "micro-P2-none-s0.json"]
    assert [p.name for p in (results / "ablations").iterdir()] == [".gitkeep"]      # undefined group: no-op
    nbs = root / "reports" / "notebooks"
    assert sorted(p.name for p in nbs.iterdir()) == sorted(["data.ipynb", "report.ipynb",
                                                            *(f"train-{g}.ipynb" for g in GROUPS)])
    for nb in nbs.iterdir():
        assert not [o for o in _outputs(nb) if o["output_type"] == "error"], nb.name
        checked = _checked_text(nb)
        assert checked and str(root) not in checked, f"{nb.name}: a checked cell prints an absolute path"
    assert "nothing to train" in _text(nbs / "train-ablations.ipynb")


@pytest.mark.slow
def test_report_outputs(project):
    root, _, _ = project
    figs, tabs = root / "reports" / "micro" / "figures", root / "reports" / "micro" / "tables"
    assert {p.name for p in figs.glob("*.png")} == {"pareto.png", "curves-main.png", "curves-long.png", "tokens.png",
                                                    "width.png", "time-to-target.png"}
    for name in ("table1", "paper-table1", "headline", "headline-paired", "tokens", "width", "ablation-projector",
                 "ablation-anchor", "rvq-sync", "seeds", "diagnostics", "tuning", "time-to-target"):
        assert all((tabs / f"{name}.{ext}").exists() for ext in ("md", "csv", "tex")), name
    t1 = (tabs / "table1.md").read_text()
    assert "| micro | 2 | MAPL | 4× | 4× |" in t1 and "150M, P=4, 4×" in t1
    assert "| Uncompressed | — | 1× |" in (tabs / "headline.md").read_text()
    m = json.loads((root / "reports" / "micro" / "metrics.json").read_text())
    assert m["runs"] == 4
    assert set(m["main"]) == {"none", "mapl_4x"}                          # keys without the model's name
    assert m["main"]["mapl_4x"]["seeds"] == 2 and "delta_pct" in m["main"]["mapl_4x"]
    assert set(m["long"]) == {"none"}
    assert "\\newcommand{\\resMainMaplFourXDeltaPct}" in (tabs / "macros.tex").read_text()


@pytest.mark.slow
def test_second_repro_is_a_noop(project):
    root, env, _ = project
    log = _run([_tool("dvc"), "repro"], root, env)
    assert "Running stage" not in log and "Data and pipelines are up to date" in log


@pytest.mark.slow
def test_nbval_on_executed_notebooks(project):
    """nbval re-executes executed notebooks with their injected parameters, from their own folder."""
    pytest.importorskip("nbval")
    root, env, _ = project
    nbs = [f"reports/notebooks/{n}.ipynb" for n in ("data", "train-main", "report")]   # train-* share one notebook
    out = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
                "--rootdir", str(root), *nbs], root, env, timeout=600)
    assert " passed" in out and "failed" not in out
    assert not (root / "reports" / "notebooks" / "reports").exists()     # no side files from a wrong cwd


# ---- static checks on the committed notebooks and dvc.yaml (fast) --------------------------------
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_clean_and_parameterized(name):
    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), "commit without outputs"
    assert sum("parameters" in c.get("metadata", {}).get("tags", []) for c in code) == 1
    src = "\n".join("".join(c["source"]) for c in code)
    assert '(p / "dvc.yaml").exists()' in src                           # project root, not the cwd
    assert "NBVAL_CHECK_OUTPUT" in src
    assert nb["metadata"]["kernelspec"]["name"] == "python3"


def test_dvc_yaml_stages():
    d = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    stages = d["stages"]
    assert list(stages) == ["prepare", "train", "report"]
    assert stages["train"]["foreach"] == GROUPS
    for name, st in stages.items():
        st = st.get("do", st)
        assert st.get("desc"), f"stage {name} has no desc"
        for out in st.get("outs", []) + st.get("metrics", []):
            (path, opts), = out.items()
            assert opts == {"cache": False}, f"{name}: {path} must be committed (cache: false)"
    # the training deps are exactly the sources fingerprinted for checkpoints (mapl.fingerprint.TRAIN_SOURCES)
    deps = {p for p in stages["train"]["do"]["deps"] if "$" not in p and not p.startswith("notebooks/")}
    fingerprinted = {p.relative_to(ROOT).as_posix() for pat in fingerprint.TRAIN_SOURCES for p in ROOT.glob(pat)}
    assert deps == fingerprinted
    assert {"mapl/report", "mapl/link.py"}.isdisjoint(deps)             # editing the report never retrains
    assert d["plots"] == ["reports/${profile}/figures"]
