"""Multi-process pipeline benchmark: per-stage compute, bytes per boundary, step time on slow links.

For each method (none, int8, ssn, mapl at 8x, mapl-rvq at 8x overall if it runs) a short real
multi-process run (cpu profile, P = 4 processes, gloo) measures each stage's forward/backward compute
per micro-batch and the bytes of every message (measured and declared). The link emulator
(``mapl.link``) then replays the step on 80 Mb/s, 200 Mb/s and 1 Gb/s links (latency per profile)
and gives the step time beside the physical floor (bytes / bandwidth of the busiest channel), and
time to a target validation loss = steps to target x step time.

    python benchmarks/pipeline.py                       # 10 steps per method, ~1 min each on 2 cores
    python benchmarks/pipeline.py --steps 4 --methods none,mapl

Steps to target come from ``--curves`` (default reports/results: the single-process runs of the cpu
profile, same run names, if present -- their full-length validation curves) or else from the short
run itself (indicative only). The default target is the highest of the methods' best validation
losses, so every method reaches it. Compute times are measured on shared CPU cores, 4 processes on
2 cores: they are upper bounds of what a stage costs alone.

Writes ``reports/bench/pipeline.json`` and ``reports/tables/pipeline.md``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mapl.config import load_run_config  # noqa: E402
from mapl.link import StepMeasurement, estimate, get_profile, steps_to_target  # noqa: E402
from mapl.pipeline import launch  # noqa: E402
from mapl.train import atomic_write_json  # noqa: E402

METHODS = {"none": 1, "int8": 1, "ssn": 8, "mapl": 8, "mapl-rvq": 4}     # mapl-rvq: 4x projection x 2x RVQ = 8x


def run_method(method: str, ratio: float, args, workdir: Path) -> dict:
    out, ckpt = workdir / f"{method}.json", workdir / f"{method}.pt"
    cli = ["--profile", args.profile, "--method", method, "--stages", str(args.stages), "--steps", str(args.steps),
           "--set", f"train.schedule={args.schedule}", "--set", f"train.eval_every={max(1, args.steps // 2)}",
           "--set", f"train.eval_tokens={args.eval_tokens}", "--set", "train.threads=1",
           "--set", f"train.checkpoint_every={10 ** 6}", "--no-progress", "--fresh",
           "--out", str(out), "--ckpt", str(ckpt)]
    if method not in ("none", "int8"):
        cli += ["--ratio", str(ratio)]
    t0 = time.time()
    r = launch(cli, args.stages, launcher=args.launcher, timeout=args.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{method}: launch failed ({r.returncode}):\n{r.stderr[-3000:]}")
    res = json.loads(out.read_text())
    res["_bench_wall_s"] = time.time() - t0
    return res


def summarize(method: str, res: dict, profiles, curves_dir: Path | None) -> dict:
    pipe = res["pipeline"]
    meas = StepMeasurement.from_results(res)
    est = estimate(meas, profiles)
    steps = max(1, res["steps"])
    P = res["stages"]
    per_b = {}
    for p in range(P - 1):
        m = pipe["bytes_per_step"].get(f"boundary{p}", {})
        d = pipe["declared_bytes_per_step"][f"boundary{p}"]
        fw, bw = m.get("fwd", {}), m.get("bwd", {})
        per_b[p] = {"fwd_data": fw.get("data", 0), "fwd_piggyback": fw.get("sync", 0), "fwd_ids": fw.get("ids", 0),
                    "fwd_state": fw.get("state", 0), "bwd_data": bw.get("data", 0), "bwd_state": bw.get("state", 0),
                    "declared_fwd": d["fwd"], "declared_bwd": d["bwd"], "declared_piggyback": d["piggyback"],
                    "declared_ids": d["ids"], "declared_state": d["state"]}
    curve, curve_src = res["val_loss_curve"], "this run"
    if curves_dir is not None:
        f = curves_dir / f"{res['run']}.json"
        if f.exists():
            full = json.loads(f.read_text())
            if full.get("val_loss_curve"):
                curve, curve_src = full["val_loss_curve"], str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f)
    return {"method": method, "run": res["run"], "ratio": res["ratio"], "steps": steps,
            "val_loss": res["val_loss"], "val_curve": curve, "curve_source": curve_src,
            "stage_compute_s_per_step": pipe["stage_compute_s_per_step"], "stage_opt_s_per_step": pipe["stage_opt_s_per_step"],
            "step_wall_s": pipe["step_wall_s"], "bytes_per_step": per_b,
            "measured_total": res["wire"]["measured"], "declared_total": res["wire"]["declared"],
            "measured_equals_declared": res["wire"]["measured"] == res["wire"]["declared"],
            "links": est, "timing": meas.to_dict(), "bench_wall_s": res.get("_bench_wall_s")}


def _fmt_s(x):
    if x is None:
        return "n/a"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def _fmt_b(x):
    return f"{x / 1024:.1f} KiB" if x >= 1024 else f"{x:.0f} B"


def markdown(bench: dict) -> str:
    rows = bench["methods"]
    profs = bench["profiles"]
    lines = [f"# Multi-process pipeline (profile {bench['profile']}, P = {bench['stages']}, schedule "
             f"{bench['schedule']}, {bench['steps']} steps per method)", "",
             "Per-stage compute is measured (forward + backward per step, waits excluded; 4 processes share "
             "2 cores). Bytes are per optimizer step, boundary 0 (all boundaries carry the same). Step time: "
             "the virtual clock on each link with the measured compute; floor = busiest channel's bytes / "
             "bandwidth.", ""]
    lines += ["| method | ratio | compute per stage (ms/step) | fwd data | fwd sync+ids | bwd data | state (A, grad) "
              "| measured = declared |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["bytes_per_step"].get(0) or r["bytes_per_step"].get("0") or {}
        comp = " / ".join(f"{1000 * c:.0f}" for c in r["stage_compute_s_per_step"])
        lines.append(f"| {r['method']} | {r['ratio']:.1f}x | {comp} | {_fmt_b(b.get('fwd_data', 0))} | "
                     f"{_fmt_b(b.get('fwd_piggyback', 0) + b.get('fwd_ids', 0))} | {_fmt_b(b.get('bwd_data', 0))} | "
                     f"{_fmt_b(b.get('fwd_state', 0) + b.get('bwd_state', 0))} | "
                     f"{'yes' if r['measured_equals_declared'] else 'NO'} |")
    lines += ["", f"Target validation loss {bench['target']:.4f}; steps to target from the curve named in the last column.", ""]
    head = "| method | " + " | ".join(f"{p}: step (floor)" for p in profs) + " | " + \
        " | ".join(f"{p}: time to target" for p in profs) + " | steps to target | curve |"
    lines += [head, "|" + "---|" * (2 * len(profs) + 3)]
    for r in rows:
        cells = [f"{_fmt_s(r['links'][p]['step_s'])} ({_fmt_s(r['links'][p]['floor_s'])})" for p in profs]
        ttt = [_fmt_s(r["time_to_target"][p]) for p in profs]
        n = r["steps_to_target"]
        lines.append(f"| {r['method']} | " + " | ".join(cells) + " | " + " | ".join(ttt) +
                     f" | {'n/a' if n is None else f'{n:.0f}'} | {r['curve_source']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/pipeline.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per method (default %(default)s)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated (default %(default)s)")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    ap.add_argument("--links", default="80Mbps,200Mbps,1Gbps", help="link profiles (default %(default)s)")
    ap.add_argument("--latency-ms", type=float, help="override every profile's latency")
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--target", type=float, help="target validation loss (default: highest final val loss)")
    ap.add_argument("--curves", type=Path, default=ROOT / "reports" / "results",
                    help="folder of full-length results JSONs to take steps-to-target from (default %(default)s)")
    ap.add_argument("--launcher", default="accelerate", choices=["accelerate", "torchrun", "direct"])
    ap.add_argument("--timeout", type=float, default=900, help="per-method launch timeout (s)")
    ap.add_argument("--out-json", type=Path, default=ROOT / "reports" / "bench" / "pipeline.json")
    ap.add_argument("--out-md", type=Path, default=ROOT / "reports" / "tables" / "pipeline.md")
    args = ap.parse_args(argv)
    profiles = [get_profile(p, args.latency_ms) for p in args.links.split(",")]
    load_run_config(args.profile)        # fail early on a bad profile
    rows = []
    with tempfile.TemporaryDirectory(prefix="mapl-bench-pipeline-") as tmp:
        for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
            if method not in METHODS:
                raise SystemExit(f"--methods: {method!r} is unknown; allowed {sorted(METHODS)}")
            print(f"{method}: {args.steps} steps, P={args.stages} ...", file=sys.stderr, flush=True)
            res = run_method(method, METHODS[method], args, Path(tmp))
            rows.append(summarize(method, res, profiles, args.curves if args.curves and args.curves.exists() else None))
            print(f"  done in {rows[-1]['bench_wall_s']:.0f} s; val {rows[-1]['val_loss']:.4f}", file=sys.stderr)
    if not rows:
        raise SystemExit("no method ran")
    target = args.target if args.target is not None else max(min(v for _, v in r["val_curve"]) for r in rows)
    for r in rows:
        n = steps_to_target(r["val_curve"], target)
        r["steps_to_target"] = n
        r["time_to_target"] = {p.name: (None if n is None else n * r["links"][p.name]["step_s"]) for p in profiles}
    bench = {"profile": args.profile, "stages": args.stages, "schedule": args.schedule, "steps": args.steps,
             "profiles": [p.name for p in profiles],
             "links": {p.name: {"bandwidth_bps": p.bandwidth_bps, "latency_s": p.latency_s} for p in profiles},
             "target": target, "methods": rows}
    atomic_write_json(args.out_json, bench)
    args.out_md.parent.mkdir(parents=True, exist_ok=True)
    args.out_md.write_text(markdown(bench))
    print(markdown(bench))
    return 0


if __name__ == "__main__":
    sys.exit(main())
