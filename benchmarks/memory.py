"""The memory plan (mapl.core.memory) against measured peak memory per process, at the real 150M shape.

Writes: ``reports/bench/memory-plan.json``, ``reports/tables/memory-plan.md``.

Runs the multi-process pipeline on CPU (P = 4 processes, gloo) at d = 1024, 8 layers, V = 32000 with
short sequences, for a few steps, per (schedule, method) case. In each process: RSS before the model is
built (after imports and process-group setup) is the baseline; after setup (full-model build, then
pruning to the stage) the freed heap is returned to the OS and the peak RSS (VmHWM) is reset; the peak
over the training steps minus the baseline is compared with the plan's total for that stage (CPU:
fp32). The setup peak is reported too: every rank builds the full model before pruning it.

    python benchmarks/memory.py                        # 4 cases x 3 steps, ~3 min on 2 cores
    python benchmarks/memory.py --cases 1f1b:none --steps 2
    python benchmarks/memory.py --model micro --stages 2 --cases 1f1b:mapl --steps 2 --out-json /tmp/m.json --out-md /tmp/m.md
                                                       # a seconds-long check that the script runs

The token stream is the cpu profile's (BPE 2048) under a manifest that declares V = 32000, so the model
has the paper's vocabulary (embedding, head, logits) while no 32k tokenizer is needed; memory does not
depend on which ids arrive. Writes ``reports/bench/memory-plan.json`` and ``reports/tables/memory-plan.md``.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mapl.core.config import load_run_config
from mapl.core.memory import GiB, memory_plan
from mapl.base.io import atomic_write_json
from mapl.base.cli import EXIT_PEER_FAILED, fail

# schedule:method[:heap]; ":heap" runs with glibc's default malloc (freed heap memory stays in RSS)
CASES = ("gpipe:none", "1f1b:none", "gpipe:mapl", "1f1b:mapl-rvq", "1f1b:none:heap")
VOCAB = 32000


def _status() -> dict:
    text = Path("/proc/self/status").read_text()
    return {k: 1024 * int(re.search(rf"{k}:\s+(\d+)", text).group(1)) for k in ("VmRSS", "VmHWM")}


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")      # Linux: VmHWM := current RSS


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)          # hand freed heap back, so RSS is live memory
    except OSError:
        pass


def overrides(args, schedule: str, method: str, data_dir: Path) -> dict:
    over = {"model": args.model, "stages": args.stages, "method": method, "data_dir": str(data_dir),
            "data.vocab_size": VOCAB, "train.steps": args.steps, "train.seq_len": args.seq_len,
            "train.batch_size": args.micro_batches * args.micro_batch_size,
            "train.micro_batches": args.micro_batches, "train.schedule": schedule, "train.threads": 1,
            "train.eval_every": 10 ** 6, "train.eval_tokens": args.micro_batch_size * args.seq_len,
            "train.eval_batch_size": args.micro_batch_size, "train.checkpoint_every": 10 ** 6}
    if method != "none":
        over["ratio"] = 4
    return over


def _warm_up(cfg) -> None:
    """Load what the runtime pages in on first use (kernels, thread pools, lazily imported libraries) with
    a micro model of the same method, so that the baseline is the process without the model's tensors."""
    import dataclasses

    import torch
    # imported for their side effect only: loaded here, their memory is part of the baseline, not of the model
    from tqdm.auto import tqdm  # noqa: F401 -- the training loop's progress bar
    from mapl import data as mdata  # noqa: F401 -- the corpus readers
    from mapl.core.engine import build_optimizers
    from mapl.core.stages import build_staged_model
    tiny = dataclasses.replace(cfg, model="micro", model_overrides={}, stages=2,
                               train=dataclasses.replace(cfg.train, seq_len=16, schedule="gpipe"))
    sm = build_staged_model(tiny.validate(256), 256)
    opts = build_optimizers(sm, tiny)
    for _ in range(2):
        x = torch.randint(0, 256, (2, 16))
        sm(x, x).backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    del sm, opts


def worker(spec: dict) -> None:
    """One rank: baseline, setup, reset the peak, train, report (called in a fresh process). Runs the
    stage as ``mapl pipeline`` does (mapl.core.runtime.rank.run_rank); "setup" is
    ``PipelineEngine._build_model`` (full-model build, pruning to the stage, its optimizers)."""
    import torch.distributed as dist
    from mapl.core.runtime import worker as rw
    from mapl.core.runtime.rank import run_rank
    from mapl.core.runtime.topology import Topology, detect_launcher, init_distributed
    rank, world, device, backend = init_distributed()
    cfg = load_run_config("cpu", spec["overrides"])
    topo = Topology(rank, world, cfg.stages, device, backend, detect_launcher())
    _warm_up(cfg)
    _trim()
    base = _status()["VmRSS"]
    _reset_peak()
    marks = {}
    build = rw.PipelineEngine._build_model          # the one private hook: where a rank builds its stage

    def measured_build(self, *a, **k):
        build(self, *a, **k)
        marks["setup_peak"] = _status()["VmHWM"]
        _trim()
        marks["after_setup"] = _status()["VmRSS"]
        _reset_peak()

    rw.PipelineEngine._build_model = measured_build
    run_rank(cfg, topo, out=None, ckpt=None, progress=False, timeout_s=300, log=lambda *a, **k: None)
    st = _status()
    out = {"rank": rank, "baseline": base, "setup_peak": marks["setup_peak"] - base,
           "after_setup": marks["after_setup"] - base, "train_peak": st["VmHWM"] - base}
    Path(spec["out"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def derived_data(tmp: Path) -> Path:
    """The cpu profile's shards under a manifest declaring V = 32000 (ids < 2048 are valid ids of it)."""
    src = ROOT / "data" / "shakespeare-bpe2048"
    if not (src / "manifest.json").exists():
        fail(f"error: {src} is missing: run `mapl data --profile cpu` first")
    dst = tmp / f"shakespeare-bpe2048-as-v{VOCAB}"
    dst.mkdir(parents=True)
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        shutil.copy(src / name, dst / name)
    m = json.loads((src / "manifest.json").read_text())
    m["config"]["vocab_size"] = m["vocab_size"] = m["tokenizer"]["vocab_size"] = VOCAB
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def run_case(args, schedule: str, method: str, heap: bool, tmp: Path, data_dir: Path) -> list[dict]:
    spec = {"overrides": overrides(args, schedule, method, data_dir),
            "out": str(tmp / f"{schedule}-{method}{'-heap' if heap else ''}")}
    port = 29000 + (os.getpid() + len(list(tmp.iterdir()))) % 2000
    procs = []
    for r in range(args.stages):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.stages), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        if args.mmap_threshold and not heap:     # glibc: each allocation above it is a mapping, unmapped when freed
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, cwd=ROOT))
    codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        fail(f"error: {schedule}:{method}: a rank failed (exit codes {codes})", EXIT_PEER_FAILED)
    return [json.loads(Path(spec["out"]).with_suffix(f".rank{r}.json").read_text()) for r in range(args.stages)]


def compare(args, case: str, schedule: str, method: str, measured: list[dict], data_dir: Path) -> dict:
    cfg = load_run_config("cpu", overrides(args, schedule, method, data_dir))
    plan = memory_plan(cfg, VOCAB, device="cpu")
    rows = []
    for st, m in zip(plan.stages, measured):
        err = (st.total - m["train_peak"]) / m["train_peak"]
        rows.append({"stage": st.stage, "layers": st.layers, "alive": st.alive, "plan": st.total,
                     "plan_terms": st.terms(), "measured_train_peak": m["train_peak"],
                     "measured_setup_peak": m["setup_peak"], "measured_after_setup": m["after_setup"],
                     "baseline_rss": m["baseline"], "error": err})
    return {"case": case, "run": plan.run, "precision": plan.precision,
            "tokens_per_micro_batch": plan.tokens_per_micro_batch, "stages": rows}


def markdown(bench: dict) -> str:
    mib = 1024 ** 2
    shape = "150M shape: d = 1024, 8 layers" if bench["model"] == "150M" else f"model {bench['model']}"
    lines = [f"# Memory plan vs measured peak per process ({shape}, V = {VOCAB}; "
             f"P = {bench['stages']} processes on CPU, fp32)", "",
             f"{bench['micro_batches']} micro-batches of {bench['micro_batch_size']} x {bench['seq_len']} tokens, "
             f"{bench['steps']} steps. Measured: peak RSS over training minus the RSS before the model was built "
             f"(after a warm-up that pages in kernels and libraries), with MALLOC_MMAP_THRESHOLD_="
             f"{bench['mmap_threshold']} so that freed tensors leave RSS at once; `:heap` rows use glibc's default "
             f"malloc, whose heap keeps freed memory (what a plain process shows). Setup peak: the full-model "
             f"build every rank does before pruning to its stage. Largest |error| (rows without `:heap`): "
             f"{100 * bench['max_abs_error']:.1f}% (target 20%). Load average (1, 5, 15 min) before: {bench['load_before']} "
             f"(2 cores).", "",
             "| case | stage | layers | alive | plan (MiB) | measured (MiB) | error | setup peak (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for c in bench["cases"]:
        for r in c["stages"]:
            lay = f"{r['layers'][0]}-{r['layers'][-1]}" if len(r["layers"]) > 1 else str(r["layers"][0])
            lines.append(f"| {c['case']} | {r['stage']} | {lay} | {r['alive']} | {r['plan'] / mib:.0f} | "
                         f"{r['measured_train_peak'] / mib:.0f} | {100 * r['error']:+.1f}% | "
                         f"{r['measured_setup_peak'] / mib:.0f} |")
    return "\n".join(lines) + "\n"


def paper_table() -> str:
    """The plan at the paper's shapes (bf16, 32 micro-batches of 16 x 2048 tokens, P = 4): the peak stage per
    model, schedule and activation checkpointing, against one H200 (139.8 GiB) and one H100 (79.6 GiB)."""
    from mapl.core.memory import check_plan
    lines = ["# Memory plan at the paper's shapes (bf16 autocast, fp32 residual; P = 4; 32 micro-batches of "
             "16 x 2048 tokens; MAPL at the paper's ratio)", "",
             "Peak stage per configuration (`mapl memory --profile paper --model M --schedule S "
             "[--checkpointing]`). Fits: after a 10% reserve.", "",
             "| model | schedule | checkpointing | peak stage | activations | head | total (GiB) | H100 80 GB | H200 |",
             "|---|---|---|---|---|---|---|---|---|"]
    ratio = {"150M": 4, "500M": 6, "1B": 8}
    for model in ("150M", "500M", "1B"):
        for schedule, ckpt in (("gpipe", False), ("1f1b", False), ("1f1b", True)):
            cfg = load_run_config("paper", {"model": model, "method": "mapl", "ratio": ratio[model],
                                            "train.schedule": schedule})
            plan = memory_plan(cfg, device="cuda", checkpointing=ckpt)
            st = plan.peak
            fits = []
            for gib in (79.6, 139.8):
                try:
                    check_plan(plan, gib * GiB)
                    fits.append("fits")
                except ValueError:
                    fits.append("no")
            lines.append(f"| {model} | {schedule} | {'on' if ckpt else 'off'} | {st.stage} | {st.activations / GiB:.1f} | "
                         f"{st.head / GiB:.1f} | {st.total / GiB:.1f} | {fits[0]} | {fits[1]} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/memory.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cases", default=",".join(CASES), help="schedule:method list (default %(default)s)")
    ap.add_argument("--model", default="150M", help="model preset (default %(default)s; micro: a quick check)")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--mmap-threshold", type=int, default=65536,
                    help="MALLOC_MMAP_THRESHOLD_ for the ranks (default %(default)s: freed tensors leave RSS at "
                         "once, so RSS follows live tensors; 0: glibc's default, whose heap keeps freed memory)")
    ap.add_argument("--out-json", type=Path, default=ROOT / "reports" / "bench" / "memory-plan.json")
    ap.add_argument("--out-md", type=Path, default=ROOT / "reports" / "tables" / "memory-plan.md")
    ap.add_argument("--paper-table", action="store_true",
                    help="only write the plan at the paper's shapes (reports/tables/memory-plan-paper.md; no runs)")
    args = ap.parse_args(argv)
    if args.paper_table:
        text = paper_table()
        (ROOT / "reports" / "tables" / "memory-plan-paper.md").write_text(text)
        print(text)
        return 0
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    load = os.getloadavg()
    cases = []
    with tempfile.TemporaryDirectory(prefix="mapl-bench-memory-") as tmp:
        data_dir = derived_data(Path(tmp))
        for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
            schedule, method, *heap = case.split(":")
            t0 = time.time()
            print(f"{case}: {args.stages} processes ...", file=sys.stderr, flush=True)
            measured = run_case(args, schedule, method, heap == ["heap"], Path(tmp), data_dir)
            cases.append(compare(args, case, schedule, method, measured, data_dir))
            print(f"  {time.time() - t0:.0f} s; errors " + ", ".join(f"{100 * r['error']:+.1f}%" for r in
                                                                    cases[-1]["stages"]), file=sys.stderr)
    bench = {"model": args.model, "vocab_size": VOCAB, "stages": args.stages, "steps": args.steps, "seq_len": args.seq_len,
             "micro_batches": args.micro_batches, "micro_batch_size": args.micro_batch_size,
             "load_before": ", ".join(f"{x:.2f}" for x in load), "cases": cases,
             "mmap_threshold": args.mmap_threshold,
             "max_abs_error": max(abs(r["error"]) for c in cases if not c["case"].endswith(":heap")
                                  for r in c["stages"])}
    atomic_write_json(args.out_json, bench)
    args.out_md.parent.mkdir(parents=True, exist_ok=True)
    args.out_md.write_text(markdown(bench))
    print(markdown(bench))
    return 0


if __name__ == "__main__":
    sys.exit(main())
