"""fp32 vs bf16 autocast: does mixed precision move the losses we compare methods by?

Writes: ``reports/bench/precision.json``, ``reports/tables/precision.md``.

Trains none / ssn / mapl on the cpu profile (tiny LLaMA, P = 4, 8x for the projections) once in fp32
and once under ``torch.autocast(bfloat16)`` (``train.precision=bf16``: matmuls in bf16, the residual
stream in fp32, bf16 on the wire either way), one run at a time, and reports the final validation
loss and the mean training loss of the last 10 steps of each, with the relative difference bf16 vs
fp32. Target: within 0.1%, an order of magnitude below the method differences we measure.

    nice python benchmarks/precision.py                          # 6 runs x 300 steps, ~1-3 min each on one core
    python benchmarks/precision.py --steps 20 --methods none     # a quick look
    python benchmarks/precision.py --methods mapl --seeds 1 --control mapl --merge   # another seed, a float-noise control

Writes ``--json`` (default reports/bench/precision.json) and ``--md`` (reports/tables/precision.md),
with the machine's load average before and after every run (timings are not the point here; the
losses do not depend on the load).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = {"none": {}, "ssn": {"ratio": 8}, "mapl": {"ratio": 8}}


def one_run(method: str, precision: str, steps: int, profile: str, seed: int, threads: int) -> dict:
    from mapl.core.config import load_run_config
    from mapl.core.run import run
    over = {"method": method, **METHODS[method], "train.precision": precision, "train.steps": steps,
            "train.eval_every": steps, "train.seed": seed, "train.threads": threads,
            "run_name": f"precision-{method}-{precision}-s{seed}-t{threads}"}
    cfg = load_run_config(profile, over)
    load0, t0 = os.getloadavg()[0], time.time()
    res = run(cfg, progress=False, log=lambda *a, **k: None)
    train = [loss for _, loss in res["train_loss_curve"]]
    tail = train[-10:]
    return {"method": method, "precision": precision, "seed": seed, "threads": threads, "steps": steps,
            "val_loss": res["val_loss"], "train_loss_last10": sum(tail) / len(tail), "wall_s": time.time() - t0,
            "loadavg_start": load0, "loadavg_end": os.getloadavg()[0]}


def _diff(a: dict, b: dict) -> dict:
    return {"val_a": a["val_loss"], "val_b": b["val_loss"],
            "val_rel_diff_pct": 100 * (b["val_loss"] - a["val_loss"]) / a["val_loss"],
            "train_a": a["train_loss_last10"], "train_b": b["train_loss_last10"],
            "train_rel_diff_pct": 100 * (b["train_loss_last10"] - a["train_loss_last10"]) / a["train_loss_last10"]}


def compare(runs: list[dict], threads: int) -> list[dict]:
    """One row per (method, seed): bf16 vs fp32 (a = fp32, b = bf16) and, where it was run, the
    float-noise control: fp32 at 2 threads vs fp32 at ``threads`` (a different summation order only)."""
    by = {(r["method"], r["seed"], r["precision"], r["threads"]): r for r in runs}
    rows = []
    for m, seed in dict.fromkeys((r["method"], r["seed"]) for r in runs):
        a = by.get((m, seed, "fp32", threads))
        for what, b in (("bf16 vs fp32", by.get((m, seed, "bf16", threads))),
                        ("fp32, 2 threads vs 1 (control)", by.get((m, seed, "fp32", 2)) if threads != 2 else None)):
            if a and b:
                rows.append({"method": m, "seed": seed, "comparison": what, **_diff(a, b)})
    return rows


def markdown(res: dict) -> str:
    L = ["# fp32 vs bf16 autocast (residual stream in fp32, bf16 wire)", "",
         f"Profile `{res['profile']}`, {res['steps']} steps per run, torch {res['torch']}, {res['threads']} thread(s); "
         f"target: |bf16 - fp32| / fp32 <= {res['target_pct']}%. A control row (fp32 at 2 threads: another "
         "summation order, nothing else) shows how far float noise alone moves a run.", "",
         "| method | seed | comparison (a -> b) | val a | val b | val diff % | train (last 10) a | b | train diff % |",
         "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        L.append(f"| {r['method']} | {r['seed']} | {r['comparison']} | {r['val_a']:.4f} | {r['val_b']:.4f} | "
                 f"{r['val_rel_diff_pct']:+.3f} | {r['train_a']:.4f} | {r['train_b']:.4f} | {r['train_rel_diff_pct']:+.3f} |")
    L += ["", "| run | wall s | load average start -> end |", "|---|---|---|"]
    L += [f"| {r['method']} {r['precision']} seed {r['seed']} {r['threads']} thread(s) | {r['wall_s']:.0f} | "
          f"{r['loadavg_start']:.2f} -> {r['loadavg_end']:.2f} |" for r in res["runs"]]
    return "\n".join(L) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--control", nargs="*", default=[], choices=list(METHODS),
                    help="methods that also get an fp32 run at 2 threads: how far float noise alone moves them")
    ap.add_argument("--merge", action="store_true", help="add to the runs already in --json instead of replacing them")
    ap.add_argument("--json", default=str(ROOT / "reports/bench/precision.json"))
    ap.add_argument("--md", default=str(ROOT / "reports/tables/precision.md"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch
    torch.set_num_threads(args.threads)
    runs = json.loads(Path(args.json).read_text())["runs"] if args.merge and Path(args.json).exists() else []
    todo = [(m, p, s, args.threads) for s in args.seeds for m in args.methods for p in ("fp32", "bf16")]
    todo += [(m, "fp32", s, 2) for s in args.seeds for m in args.control]
    for m, p, seed, threads in todo:
        runs.append(one_run(m, p, args.steps, args.profile, seed, threads))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    res = {"profile": args.profile, "steps": args.steps, "torch": torch.__version__, "threads": args.threads,
           "target_pct": 0.1, "runs": runs, "rows": compare(runs, args.threads)}
    _atomic_write(Path(args.json), json.dumps(res, indent=1))
    _atomic_write(Path(args.md), markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
