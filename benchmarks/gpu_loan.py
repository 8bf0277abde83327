"""One call on a lent GPU machine: the GPU check, then speed (and quality) at the paper shape, in one budget.

Started by benchmarks/gpu_loan.sh, which picks the interpreter whose torch sees CUDA; docs/gpu.md says what
each output decides. Run from the repository root:

    bash benchmarks/gpu_loan.sh                        # on the device: $OUT, 480 s in all
    bash benchmarks/gpu_loan.sh --budget-s 300         # a shorter rerun (--phases gpu: part A/B only)
    bash benchmarks/gpu_loan.sh --dry-run              # anywhere: what it would run, the tree size to carry
    bash benchmarks/gpu_loan.sh --cpu --out /tmp/loan  # the CPU rehearsal of the same call, micro shapes

Two phases, each a child process under benchmarks/loan_guard.py (the device's modules only), killed at its
time limit:

1. ``check``: benchmarks/gpu_check.py, every item (``--jsonl``: one file);
2. ``gpu``: benchmarks/gpu.py with the time left, on the prepared corpus when it was carried
   (``data/gpu-corpus``), else on random tokens (``--synthetic``: part A only).

Everything lands in ``--out`` (default ``$OUT``) as soon as it exists, six files at most: ``loan.log`` (the
console, line by line), ``loan.json`` (facts, plan, each phase's outcome; rewritten after each step),
``check.jsonl``, ``gpu.jsonl``, ``gpu.md``, ``gpu-loss.png``. Nothing is installed or downloaded. Exit 0 when
every phase ended with 0, 1 otherwise, 2 when the call cannot start (no CUDA, a module the device lacks).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import loan_guard

__all__ = ["main", "parse_args", "plan_phases", "tree_size", "Phase", "OUTPUT_FILES", "DEFAULT_BUDGET_S",
           "CARRY_LIMIT_BYTES"]

DEFAULT_BUDGET_S = 480.0                 # 8 minutes: a 10-minute device call with room for its start
# the check's share at most: ~2 minutes on an H200 (five 150M models built and run under a Python dispatch
# counter, one cold compile); the CPU compiles slowly on 2 busy cores
CHECK_LIMIT_S = {"gpu": 200.0, "cpu": 360.0}
GPU_MIN_S = 60.0                         # below this, part A would not finish one 150M item
STARTUP_S = 30.0                         # a child's imports and CUDA start before its own budget counts
RESERVE_S = 15.0                         # kept for the last loan.json
CARRY_LIMIT_BYTES = 64 * 2**20           # the device tool's limit on the tree plus carried paths
CORPUS = ROOT / "data" / "gpu-corpus"
OUTPUT_FILES = ("loan.log", "loan.json", "check.jsonl", "gpu.jsonl", "gpu.md", "gpu-loss.png")
GPU_MODULES = ("host_reads", "gpu_common", "gpu_corpus", "gpu_speed", "gpu_quality", "gpu_summary", "gpu_check", "gpu")


@dataclass
class Phase:
    """One child process of the call: its command line and the seconds it may run."""
    name: str
    argv: list[str]
    limit_s: float
    rc: int | None = None
    wall_s: float | None = None
    timed_out: bool = False
    notes: list[str] = field(default_factory=list)


# ---- facts ------------------------------------------------------------------------------------------------
def tree_size(root: Path = ROOT, out: Path | None = None) -> dict:
    """Bytes the device tool copies: git's tracked and unignored untracked files (the tool's rule), or, without
    git (on the device), every file under ``root`` but caches and ``out``."""
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
                                capture_output=True, timeout=30, check=True).stdout.decode().split("\0")
        files, how = [root / f for f in listed if f], "git ls-files -co --exclude-standard"
    except (OSError, subprocess.SubprocessError):
        skip = {"__pycache__", ".git", ".venv"}
        files = [p for p in root.rglob("*") if p.is_file() and not skip & set(p.relative_to(root).parts)
                 and not (out is not None and out in p.parents)]
        how = "every file (no git here)"
    sizes = [p.stat().st_size for p in files if p.is_file()]
    return {"bytes": sum(sizes), "files": len(sizes), "how": how}


def corpus_facts(data: Path) -> dict:
    """Whether the prepared corpus is here (carried) and its size; the synthetic fallback otherwise."""
    present = (data / "manifest.json").is_file()
    size = sum(p.stat().st_size for p in data.iterdir() if p.is_file()) if present else 0
    return {"dir": str(data), "present": present, "bytes": size, "fallback": None if present else "synthetic"}


def torch_facts() -> dict:
    import torch
    facts = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda": torch.cuda.is_available()}
    if facts["cuda"]:
        p = torch.cuda.get_device_properties(0)
        facts.update(device=p.name, memory_gib=round(p.total_memory / 2**30, 1), devices=torch.cuda.device_count())
    return facts


def import_check() -> dict:
    """Import every module of the loan's code path under the guard: one line naming what is missing."""
    loan_guard.install()
    versions, missing = {}, []
    for name in sorted(loan_guard.ON_DEVICE):
        try:
            versions[name] = getattr(__import__(name), "__version__", "?")
        except ImportError as e:
            missing.append(f"{name} ({e})")
    for name in GPU_MODULES:
        try:
            __import__(name)
        except ImportError as e:
            missing.append(f"{name}: {e}")
    return {"ok": not missing, "versions": versions, "missing": missing,
            "refused_here": sorted(loan_guard.absent_modules())}


def gather_facts(args) -> dict:
    carried = corpus_facts(args.data)
    tree = tree_size(ROOT, args.out)
    total = tree["bytes"] + carried["bytes"]
    return {"mode": "cpu" if args.cpu else "gpu", "python": platform.python_version(), "executable": sys.executable,
            "interpreter_tried": os.environ.get("MAPL_LOAN_TRIED", "").split() or None, **torch_facts(),
            "cpus": os.cpu_count(), "tree": tree, "corpus": carried,
            "carry_total_bytes": total, "carry_fits": total <= CARRY_LIMIT_BYTES, "imports": import_check()}


# ---- the plan -------------------------------------------------------------------------------------------------
def _guarded(script: str, *args: str) -> list[str]:
    return [sys.executable, str(ROOT / "benchmarks" / "loan_guard.py"), str(ROOT / "benchmarks" / script), *args]


def check_phase(args) -> Phase:
    device = ["--device", "cpu", "--small", "--search-kernel", "fused"] if args.cpu else ["--device", "cuda"]
    limit = min(CHECK_LIMIT_S["cpu" if args.cpu else "gpu"], 0.45 * args.budget_s)
    return Phase("check", _guarded("gpu_check.py", *device, "--jsonl", str(args.out / "check.jsonl")), limit)


def gpu_phase(args, corpus: dict, seconds_left: float) -> Phase:
    """gpu.py with what the call has left (less its start and the final record) as its own budget."""
    budget = max(0.0, seconds_left - STARTUP_S - RESERVE_S)
    data = ["--data", corpus["dir"]] if corpus["present"] else ["--synthetic"]
    argv = _guarded("gpu.py", *(["--dry"] if args.cpu else []), *data, "--out", str(args.out),
                    "--budget-s", f"{budget:.0f}")
    phase = Phase("gpu", argv, budget + STARTUP_S)
    if not corpus["present"]:
        phase.notes.append(f"{corpus['dir']} was not carried: part A on random tokens, part B skipped")
    return phase


def plan_phases(args, corpus: dict, seconds_left: float) -> list[Phase]:
    """The phases ``--phases`` asks for; the gpu phase's limit is what the budget leaves after the check's."""
    phases = []
    if "check" in args.phases:
        phases.append(check_phase(args))
        seconds_left -= phases[-1].limit_s
    if "gpu" in args.phases:
        phases.append(gpu_phase(args, corpus, seconds_left))
    return phases


# ---- running --------------------------------------------------------------------------------------------------
class Console:
    """Lines to stdout and to ``loan.log`` at once (flushed): a call cut off keeps every line printed."""

    def __init__(self, path: Path | None):
        self.file = open(path, "a", encoding="utf-8", buffering=1) if path else None

    def __call__(self, line: str) -> None:
        line = line.rstrip("\n")
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")

    def close(self) -> None:
        if self.file:
            self.file.close()


def run_phase(phase: Phase, say: Console) -> Phase:
    """Run the phase's child in its own process group, its output through ``say``; killed at its limit."""
    say(f"== {phase.name}: limit {phase.limit_s:.0f} s: {' '.join(phase.argv[1:])}")
    for note in phase.notes:
        say(f"== {phase.name}: {note}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           loan_guard.ABSENT_ENV: ",".join(sorted(loan_guard.absent_modules()))}
    t0 = time.monotonic()
    proc = subprocess.Popen(phase.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    reader = threading.Thread(target=lambda: [say(line) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        phase.rc = proc.wait(timeout=phase.limit_s)
    except subprocess.TimeoutExpired:
        phase.timed_out = True
        phase.rc = _stop(proc)
    reader.join(timeout=10)
    phase.wall_s = round(time.monotonic() - t0, 1)
    say(f"== {phase.name}: exit {phase.rc}{' (time limit)' if phase.timed_out else ''} after {phase.wall_s:.0f} s")
    return phase


def _stop(proc: subprocess.Popen) -> int:
    """SIGTERM to the child's process group, SIGKILL 10 s later if it is still there."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def _summarize_cut_run(out: Path, say: Console) -> None:
    """gpu.md (and the figure) from the JSON lines of a gpu phase that did not end by itself: what it measured
    before the cut, summarised here as ``python benchmarks/gpu.py --summarize`` would."""
    if not (out / "gpu.jsonl").is_file():
        return
    try:
        from gpu_summary import write_summary
        say(f"== gpu: summary of the records written before the end: {write_summary(out / 'gpu.jsonl')}")
    except Exception as e:  # noqa: BLE001 -- the records are what matters; the summary can be rebuilt here later
        say(f"== gpu: no summary ({type(e).__name__}: {e}); rebuild it with python benchmarks/gpu.py --summarize")


class LoanRecord:
    """``loan.json``: the facts, the plan and each phase's outcome, rewritten atomically after each step."""

    def __init__(self, path: Path, facts: dict, budget_s: float):
        self.path = path
        self.rec = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "budget_s": budget_s, **facts, "phases": [], "done": False}

    def write(self, phases: list[Phase], **extra) -> None:
        from mapl.base.io import atomic_write_json
        self.rec.update(phases=[asdict(p) for p in phases], **extra)
        atomic_write_json(self.path, self.rec)


# ---- the call -------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="bash benchmarks/gpu_loan.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "reports" / "gpu" / "loan"
    ap.add_argument("--out", type=Path, default=default_out, help="where every file goes (default $OUT)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall-clock seconds for the whole call")
    ap.add_argument("--phases", default="check,gpu", help="check, gpu or check,gpu (a rerun may skip the check)")
    ap.add_argument("--data", type=Path, default=CORPUS, help="the prepared corpus (synthetic tokens if absent)")
    ap.add_argument("--cpu", action="store_true", help="the CPU rehearsal: micro shapes, the same phases and files")
    ap.add_argument("--dry-run", action="store_true", help="print the facts and the plan, run and write nothing")
    a = ap.parse_args(argv)
    a.phases = [p for p in a.phases.split(",") if p]
    if not a.phases or set(a.phases) - {"check", "gpu"}:
        ap.error(f"--phases {','.join(a.phases)} is invalid: allowed check, gpu or check,gpu")
    if not a.budget_s > 0:
        ap.error(f"--budget-s {a.budget_s:g} is invalid: must be > 0")
    a.out, a.data = a.out.resolve(), a.data.resolve()
    return a


def _refusal(facts: dict, dry_run: bool) -> str | None:
    """Why the call cannot start, in one line (None: it can)."""
    if not facts["imports"]["ok"]:
        return f"the loan's code path does not import with the device's modules: {'; '.join(facts['imports']['missing'])}"
    if facts["mode"] == "gpu" and not facts["cuda"] and not dry_run:
        return (f"{facts['executable']}'s torch {facts['torch']} sees no CUDA device; use --cpu for the rehearsal "
                f"(tried: {' '.join(facts['interpreter_tried'] or [facts['executable']])})")
    return None


def describe(facts: dict, phases: list[Phase], args) -> list[str]:
    mib = 2 ** 20
    c = facts["corpus"]
    lines = [f"interpreter: {facts['executable']} (Python {facts['python']}, torch {facts['torch']}, CUDA build "
             f"{facts['cuda_build']}, CUDA here: {facts.get('device') or facts['cuda']})",
             f"tree: {facts['tree']['bytes'] / mib:.1f} MiB in {facts['tree']['files']} files ({facts['tree']['how']}); "
             f"corpus {c['dir']}: " + (f"{c['bytes'] / mib:.1f} MiB, carried" if c["present"] else
                                        "absent (random tokens, part A only)"),
             f"carry total {facts['carry_total_bytes'] / mib:.1f} MiB of {CARRY_LIMIT_BYTES / mib:.0f} MiB: "
             + ("fits" if facts["carry_fits"] else "DOES NOT FIT"),
             f"imports: {'ok' if facts['imports']['ok'] else 'MISSING ' + '; '.join(facts['imports']['missing'])} "
             f"(refused: {', '.join(facts['imports']['refused_here'])})",
             f"budget {args.budget_s:.0f} s; files under {args.out}: {', '.join(OUTPUT_FILES)}"]
    lines += [f"phase {p.name}: limit {p.limit_s:.0f} s: {' '.join(p.argv[1:])}" for p in phases]
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    facts = gather_facts(args)
    phases = plan_phases(args, facts["corpus"], args.budget_s - (time.monotonic() - started))
    refusal = _refusal(facts, args.dry_run)
    if args.dry_run:
        for line in describe(facts, phases, args):
            print(line)
        if refusal:
            print(f"error: {refusal}", file=sys.stderr)
        return 2 if refusal else 0
    args.out.mkdir(parents=True, exist_ok=True)
    say, record = Console(args.out / "loan.log"), LoanRecord(args.out / "loan.json", facts, args.budget_s)
    for line in describe(facts, phases, args):
        say(line)
    if refusal:
        say(f"error: {refusal}")
        record.write([], done=True, error=refusal)
        return 2
    record.write(phases)
    done: list[Phase] = []
    for phase in phases:
        if phase.name == "gpu":                                  # what the check left, not what it was allowed
            phase = gpu_phase(args, facts["corpus"], args.budget_s - (time.monotonic() - started))
        if phase.name == "gpu" and phase.limit_s - STARTUP_S < GPU_MIN_S:
            phase.notes.append(f"skipped: {phase.limit_s - STARTUP_S:.0f} s left, part A needs {GPU_MIN_S:.0f} s")
            say(f"== gpu: {phase.notes[-1]}")
        else:
            run_phase(phase, say)
            if phase.name == "gpu" and phase.rc != 0:
                _summarize_cut_run(args.out, say)
        done.append(phase)
        record.write(done + phases[len(done):])
    wall = round(time.monotonic() - started, 1)
    ok = all(p.rc == 0 for p in done)
    files = sorted(p.name for p in args.out.iterdir() if p.is_file())
    record.write(done, done=True, ok=ok, wall_s=wall, files=files)
    say(f"== loan {'complete' if ok else 'INCOMPLETE'} in {wall:.0f} s; files: {', '.join(files)}")
    say.close()
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
