"""benchmarks/gpu_loan.sh: the one device call of a GPU loan, rehearsed on CPU.

What the call must get right without a second chance: the interpreter whose torch sees CUDA, nothing
installed, only the device's modules imported by the project's code, every result on disk as it exists
in at most 7 files, the budget kept, and a synthetic corpus when the prepared one was not carried."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_loan
import loan_guard

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_loan.sh"
DEVICE_FILE_LIMIT = 7          # the device returns at most 8 files per run: one spare


def _call(*args: str, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "MAPL_PYTHON": sys.executable, **env})


@pytest.mark.process
def test_dry_run_prints_the_plan_and_the_tree_to_carry_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    r = _call("--dry-run", "--out", str(out), "--data", str(tmp_path / "not-carried"))
    assert r.returncode == 0, r.stdout + r.stderr
    text = r.stdout
    assert f"interpreter: {sys.executable}" in text and "imports: ok" in text
    assert "tree: " in text and " MiB in " in text and "carry total" in text and ": fits" in text
    assert "absent (random tokens, part A only)" in text
    check, gpu = (next(line for line in text.splitlines() if line.startswith(f"phase {p}:")) for p in ("check", "gpu"))
    assert "gpu_check.py --device cuda --jsonl" in check and "loan_guard.py" in check
    assert "gpu.py --synthetic" in gpu and "--budget-s" in gpu
    assert not out.exists()


@pytest.mark.process
@pytest.mark.full
def test_the_cpu_rehearsal_runs_both_phases_into_at_most_seven_files(tmp_path, tiny_corpus):
    """The whole call on CPU at micro shapes (the check's fused RVQ kernel compiles here: most of the time)."""
    out = tmp_path / "out"
    r = _call("--cpu", "--out", str(out), "--data", str(tiny_corpus), "--budget-s", "480", timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    files = sorted(p.name for p in out.rglob("*"))
    assert files == sorted(gpu_loan.OUTPUT_FILES) and len(files) <= DEVICE_FILE_LIMIT
    loan = json.loads((out / "loan.json").read_text())
    assert loan["done"] and loan["ok"] and loan["mode"] == "cpu" and loan["imports"]["ok"]
    assert [(p["name"], p["rc"], p["timed_out"]) for p in loan["phases"]] == [("check", 0, False), ("gpu", 0, False)]
    assert loan["wall_s"] <= 480 and loan["tree"]["bytes"] > 0 and loan["corpus"]["present"]
    check = [json.loads(x) for x in (out / "check.jsonl").read_text().splitlines()]
    assert [c["item"] for c in check] == ["saved-bytes", "rvq-kernel", "host-reads", "boundary-error", "done"]
    assert all(c["ok"] for c in check)
    gpu = [json.loads(x) for x in (out / "gpu.jsonl").read_text().splitlines()]
    assert gpu[-1]["kind"] == "done" and gpu[-1]["errors"] == 0
    assert {r["method"] for r in gpu if r["kind"] == "quality"} == {"none", "ssn", "mapl"}
    log = (out / "loan.log").read_text()
    assert "== check: exit 0" in log and "== gpu: exit 0" in log and "done speed/micro/mapl-rvq" in log


@pytest.mark.process
def test_without_a_cuda_interpreter_the_call_refuses_in_one_line(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the call would start")
    out = tmp_path / "out"
    r = _call(OUT=str(out), timeout=900)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: no interpreter here imports a torch that sees CUDA (tried: ")
    assert sys.executable in r.stderr and "installs nothing" in (out / "loan.log").read_text()


def test_the_plan_gives_the_gpu_phase_what_the_check_leaves_and_falls_back_to_random_tokens(tmp_path):
    args = gpu_loan.parse_args(["--out", str(tmp_path / "o"), "--budget-s", "480"])
    absent = gpu_loan.corpus_facts(tmp_path / "none")
    check, gpu = gpu_loan.plan_phases(args, absent, 470.0)
    assert check.limit_s == gpu_loan.CHECK_LIMIT_S["gpu"] and "--synthetic" in gpu.argv
    assert gpu.limit_s == 470.0 - check.limit_s - gpu_loan.RESERVE_S
    assert float(gpu.argv[gpu.argv.index("--budget-s") + 1]) == gpu.limit_s - gpu_loan.STARTUP_S
    assert any("not carried" in n for n in gpu.notes)
    prepared = tmp_path / "corpus"
    prepared.mkdir()
    (prepared / "manifest.json").write_text("{}")
    rerun = gpu_loan.parse_args(["--out", str(tmp_path / "o"), "--phases", "gpu", "--budget-s", "300"])
    (only,) = gpu_loan.plan_phases(rerun, gpu_loan.corpus_facts(prepared), 290.0)
    assert only.name == "gpu" and only.argv[only.argv.index("--data") + 1] == str(prepared) and not only.notes
    cpu = gpu_loan.parse_args(["--cpu", "--out", str(tmp_path / "o")])
    check, gpu = gpu_loan.plan_phases(cpu, absent, 470.0)
    assert "--small" in check.argv and "fused" in check.argv and "--dry" in gpu.argv


@pytest.mark.process
def test_a_phase_past_its_limit_is_killed_and_what_it_wrote_is_summarised(tmp_path):
    """A child that overruns its limit is stopped (its process group: SIGTERM, then SIGKILL); its output came
    through line by line, and the JSON lines it wrote before the cut still give gpu.md."""
    import time
    child = ("import json, sys, time\n"
             "f = open(sys.argv[1], 'w')\n"
             "f.write(json.dumps({'kind': 'env', 'device': 'fake', 'torch': '0', 'budget_s': 1}) + '\\n'); f.flush()\n"
             "print('measuring', flush=True)\n"
             "time.sleep(120)\n")
    phase = gpu_loan.Phase("gpu", [sys.executable, "-c", child, str(tmp_path / "gpu.jsonl")], limit_s=5)
    lines: list[str] = []

    def say(line):
        lines.append(line.rstrip("\n"))
    started = time.monotonic()
    gpu_loan.run_phase(phase, say)
    assert phase.timed_out and phase.rc != 0 and time.monotonic() - started < 30
    assert "measuring" in lines and lines[-1].startswith("== gpu: exit") and "(time limit)" in lines[-1]
    gpu_loan._summarize_cut_run(tmp_path, say)
    assert "cut off" in (tmp_path / "gpu.md").read_text()


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    for args, says in ((["--phases", "check,train"], "--phases check,train is invalid"),
                       (["--budget-s", "0"], "--budget-s 0 is invalid: must be > 0")):
        with pytest.raises(SystemExit) as e:
            gpu_loan.parse_args(args)
        assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.process
def test_the_tree_size_is_what_git_would_copy(tmp_path):
    """With git: tracked and unignored untracked files (the device tool's rule); without: every file but caches."""
    got = gpu_loan.tree_size(ROOT)
    listed = [f for f in subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                                        capture_output=True, text=True, check=True).stdout.split("\0") if f]
    assert got["files"] == sum((ROOT / f).is_file() for f in listed) and got["how"].startswith("git")
    (tmp_path / "a.txt").write_text("x" * 10)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.pyc").write_text("y" * 100)
    assert gpu_loan.tree_size(tmp_path) == {"bytes": 10, "files": 1, "how": "every file (no git here)"}


# ---- the import guard: the device's modules only ------------------------------------------------------------
def test_the_guard_refuses_a_project_import_of_an_absent_module_and_leaves_libraries_alone(tmp_path, monkeypatch):
    inside, outside = tmp_path / "repo", tmp_path / "site"
    inside.mkdir(), outside.mkdir()
    (inside / "project_mod.py").write_text("import absent_pkg_xyz\n")
    (outside / "library_mod.py").write_text("import absent_pkg_xyz\n")
    monkeypatch.syspath_prepend(str(inside))
    monkeypatch.syspath_prepend(str(outside))
    guard = loan_guard.LoanImportGuard(frozenset({"absent_pkg_xyz"}), root=inside)
    monkeypatch.setattr(sys, "meta_path", [guard, *sys.meta_path])
    with pytest.raises(ImportError, match=r"absent_pkg_xyz is not on the GPU machine \(imported by project_mod.py:1\)"):
        __import__("project_mod")
    with pytest.raises(ModuleNotFoundError, match="No module named 'absent_pkg_xyz'"):
        __import__("library_mod")                       # not refused by the guard: simply not installed here


def test_the_refused_modules_are_the_projects_beyond_the_six():
    absent = loan_guard.absent_modules()
    assert {"datasets", "tokenizers", "dvc", "papermill", "pytest"} <= absent
    assert not absent & loan_guard.ON_DEVICE and not absent & set(sys.stdlib_module_names)
    assert "mapl" not in absent and "gpu_common" not in absent
