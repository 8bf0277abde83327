"""Multi-process pipeline benchmark: per-stage compute, bytes per boundary, step time on slow links.

Writes: ``reports/bench/pipeline.json``, ``reports/tables/pipeline.md``.

For each method (none, int8, ssn, mapl at 8x, mapl-rvq at 8x overall if it runs) a short real
multi-process run (cpu profile, P = 4 processes, gloo) measures each stage's forward/backward compute
per micro-batch and the bytes of every message (measured and declared). The link emulator
(``mapl.core.link``) then replays the step on 80 Mb/s, 200 Mb/s and 1 Gb/s links (latency per profile)
and gives the step time beside the physical floor (bytes / bandwidth of the busiest channel), and
time to a target validation loss = steps to target x step time.

    python benchmarks/pipeline.py                       # 10 steps per method, ~1 min each on 2 cores
    python benchmarks/pipeline.py --steps 4 --methods none,mapl

Steps to target come from ``--curves`` (default reports/cpu/results/main: the single-process runs of the cpu
profile, same run names, if present -- their full-length validation curves) or else from the short
run itself (indicative only). The default target is the highest of the methods' best validation
losses, so every method reaches it. Compute times are measured on shared CPU cores, 4 processes on
2 cores: they are upper bounds of what a stage costs alone.

Writes ``reports/bench/pipeline.json`` and ``reports/tables/pipeline.md``.

Two more tables:

    python benchmarks/pipeline.py --overlap       # real-delay runs: measured vs virtual-clock step time
    python benchmarks/pipeline.py --parity        # blocking transport: every method, P 2/4, GPipe/1F1B

``--overlap`` runs one pipeline (method none, the largest messages) on links of three bandwidths chosen
around the one where a micro-batch's message takes as long as its forward compute, with the runtime's
real-delay mode (each message sleeps until it would have arrived): the measured step time is set
beside the compute-only makespan, compute + communication without overlap, and the virtual clock's
prediction from the run's own measurements. Writes ``reports/bench/pipeline-overlap.json`` and
``reports/tables/pipeline-overlap.md``. ``--parity`` checks that the blocking transport (every send
waits for its receive, as on NCCL) gives losses bit-identical to the single-process loop; it writes
``reports/bench/pipeline-blocking-parity.json`` and ``reports/tables/pipeline-blocking-parity.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mapl.core.config import load_run_config, SCHEDULES
from mapl.base.cli import fail
from mapl.base.io import atomic_write_json, atomic_write_text
from mapl.core.link import IDEAL, LinkProfile, StepMeasurement, estimate, get_profile, step_time, steps_to_target
from mapl.orchestration.launch import launch

METHODS = {"none": 1, "int8": 1, "ssn": 8, "mapl": 8, "mapl-rvq": 4}     # mapl-rvq: 4x projection x 2x RVQ = 8x


def run_method(method: str, ratio: float, args, workdir: Path) -> dict:
    name = method if method in ("none", "int8") else f"{method}-{ratio:g}x"     # one results file per config
    out, ckpt = workdir / f"{name}.json", workdir / f"{name}.pt"
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


def once_bytes(res: dict) -> list[float]:
    """Per boundary, the forward bytes a run sends once on top of its steady messages (RVQ's whole codebook
    right after its k-means init): the metered piggyback less the declared per-step piggyback over the run's
    steps. Refused unless the run's metered totals equal its declared totals (which count the one-off once)."""
    wire, pipe, steps = res["wire"], res["pipeline"], max(1, res["steps"])
    if wire["measured"] != wire["declared"]:
        raise ValueError(f"{res['run']}: metered bytes {wire['measured']} differ from the declared {wire['declared']}")
    P = res["stages"]
    out = [steps * (pipe["bytes_per_step"].get(f"boundary{p}", {}).get("fwd", {}).get("sync", 0)
                    - pipe["declared_bytes_per_step"][f"boundary{p}"]["piggyback"]) for p in range(P - 1)]
    declared_once = wire["declared"]["piggyback"] - steps * sum(
        pipe["declared_bytes_per_step"][f"boundary{p}"]["piggyback"] for p in range(P - 1))
    if round(sum(out)) != declared_once:
        raise ValueError(f"{res['run']}: one-off bytes {out} do not add up to the declared {declared_once}")
    return out


def steady_measurement(res: dict, once: list[float] | None = None) -> StepMeasurement:
    """The run's step measurement with each forward message at its steady size. The meter's mean message
    spreads a one-off (``once_bytes``) over the run's steps x M; the link columns, the plan and the report's
    time to target replay a steady step, and the plan matches these bytes against the compressors'
    steady-state declarations. ``once``: ``once_bytes(res)`` when the caller has it."""
    once = once_bytes(res) if once is None else once
    meas = StepMeasurement.from_results(res)
    per_message = max(1, res["steps"]) * res["pipeline"]["micro_batches"] * res["pipeline"].get("replicas", 1)
    meas.fwd_bytes = [b - extra / per_message for b, extra in zip(meas.fwd_bytes, once)]
    return meas


def summarize(method: str, res: dict, profiles, curves_dir: Path | None) -> dict:
    pipe = res["pipeline"]
    once = once_bytes(res)
    meas = steady_measurement(res, once)
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
                    "declared_ids": d["ids"], "declared_state": d["state"], "fwd_piggyback_once": once[p]}
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


def _boundary0(row: dict) -> dict:
    """A row's bytes of boundary 0 (an int key in memory, a string once read back from the JSON)."""
    return row["bytes_per_step"].get(0) or row["bytes_per_step"].get("0") or {}


def _once(row: dict) -> float:
    return _boundary0(row).get("fwd_piggyback_once", 0)


def _steady_piggyback(b: dict, steps: int) -> float:
    """A steady step's piggyback: the metered mean less the one-off spread over the run's steps."""
    return b.get("fwd_piggyback", 0) - b.get("fwd_piggyback_once", 0) / max(1, steps)


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
        b = _boundary0(r)
        comp = " / ".join(f"{1000 * c:.0f}" for c in r["stage_compute_s_per_step"])
        lines.append(f"| {r['method']} | {r['ratio']:.1f}x | {comp} | {_fmt_b(b.get('fwd_data', 0))} | "
                     f"{_fmt_b(_steady_piggyback(b, r['steps']) + b.get('fwd_ids', 0))} | {_fmt_b(b.get('bwd_data', 0))} | "
                     f"{_fmt_b(b.get('fwd_state', 0) + b.get('bwd_state', 0))} | "
                     f"{'yes' if r['measured_equals_declared'] else 'NO'} |")
    once = [f"{r['method']} sends {_fmt_b(_once(r))} once per boundary (the whole codebook after its k-means init)"
            for r in rows if _once(r)]
    if once:
        lines += ["", "Per-step bytes are a steady step's; " + "; ".join(once) + ", counted in measured = declared."]
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


# ---- overlap: real-delay runs against the virtual clock ------------------------------------------
def _run_once(args, cli_extra: list[str], workdir: Path, name: str) -> dict:
    out, ckpt = workdir / f"{name}.json", workdir / f"{name}.pt"
    cli = ["--profile", args.profile, "--method", "none", "--stages", str(args.stages), "--steps", str(args.steps),
           "--set", f"train.schedule={args.schedule}", "--set", f"train.eval_every={10 ** 6}",
           "--set", f"train.eval_tokens={args.eval_tokens}", "--set", "train.threads=1",
           "--set", f"train.checkpoint_every={10 ** 6}", "--no-progress", "--fresh",
           "--out", str(out), "--ckpt", str(ckpt), *cli_extra]
    r = launch(cli, args.stages, launcher="direct", timeout=args.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{name}: launch failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


def _no_overlap_s(meas: StepMeasurement, link: LinkProfile) -> float:
    """The step if nothing overlapped: the compute-only makespan plus every message's time on the link
    along the pipeline (each boundary's forward and backward messages one after the other)."""
    comm = sum(meas.n_micro * (link.message_s(meas.fwd_bytes[p]) + link.message_s(meas.bwd_bytes[p]))
               + link.message_s(meas.state_fwd_bytes[p]) + link.message_s(meas.state_bwd_bytes[p])
               for p in range(meas.n_stages - 1))
    return step_time(meas, IDEAL) + comm


def overlap_table(args) -> dict:
    """Three real-delay runs around the bandwidth where a message takes as long as a forward."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="mapl-bench-overlap-") as tmp:
        base = StepMeasurement.from_results(_run_once(args, [], Path(tmp), "ideal"))
        fwd_s = sum(map(sum, base.fwd_s)) / (base.n_stages * base.n_micro)
        equal_bps = 8 * max(base.fwd_bytes) / fwd_s
        for factor in (2.0, 1.0, 0.5):
            bps = equal_bps * factor
            spec = f"{bps / 1e6:.3f}Mbps@{args.latency_ms if args.latency_ms is not None else 1.0}ms"
            res = _run_once(args, ["--link-delay", spec], Path(tmp), f"delay{factor}")
            meas, link = StepMeasurement.from_results(res), get_profile(spec)
            ld = res["pipeline"]["link_delay"]
            rows.append({"bandwidth_bps": bps, "latency_s": link.latency_s, "message_over_forward": 1 / factor,
                         "measured_step_s": ld["measured_step_s"], "predicted_step_s": ld["model_step_s"],
                         "compute_only_s": step_time(meas, IDEAL), "no_overlap_s": _no_overlap_s(meas, link),
                         "error": ld["measured_step_s"] / ld["model_step_s"] - 1.0,
                         "timed_steps": res["pipeline"]["timed_steps"], "timing": meas.to_dict()})
            print(f"  {spec}: measured {ld['measured_step_s']:.3f} s, predicted {ld['model_step_s']:.3f} s",
                  file=sys.stderr, flush=True)
    return {"profile": args.profile, "stages": args.stages, "schedule": args.schedule, "steps": args.steps,
            "method": "none", "forward_s_per_micro_batch": fwd_s, "message_bytes": max(base.fwd_bytes),
            "load": os.getloadavg(), "rows": rows}


def overlap_markdown(b: dict) -> str:
    lines = [f"# Communication overlaps compute (profile {b['profile']}, P = {b['stages']}, {b['schedule']}, "
             f"method {b['method']}, {b['steps']} steps per link)", "",
             f"Real-delay mode: every message sleeps until it would have arrived over the link. A forward takes "
             f"{1000 * b['forward_s_per_micro_batch']:.1f} ms per micro-batch and a message is "
             f"{b['message_bytes'] / 1024:.1f} KiB. Predicted = the virtual clock (mapl.core.link) fed with the run's own "
             f"measured compute and bytes; no overlap = compute-only makespan + every message's link time in "
             f"sequence. Load average during the runs: {', '.join(f'{x:.1f}' for x in b['load'])} (2 cores).", "",
             "| link | message / forward | measured step | predicted step | error | compute only | no overlap |",
             "|---|---|---|---|---|---|---|"]
    for r in b["rows"]:
        lines.append(f"| {r['bandwidth_bps'] / 1e6:.2f} Mb/s, {1000 * r['latency_s']:.0f} ms | "
                     f"{r['message_over_forward']:.1f} | {_fmt_s(r['measured_step_s'])} | "
                     f"{_fmt_s(r['predicted_step_s'])} | {100 * r['error']:+.1f}% | {_fmt_s(r['compute_only_s'])} | "
                     f"{_fmt_s(r['no_overlap_s'])} |")
    return "\n".join(lines) + "\n"


# ---- parity of the blocking transport ---------------------------------------------------------------
def parity_grid(args) -> dict:
    """Every method at P 2/4 x GPipe/1F1B with the blocking transport vs the single-process loop."""
    from mapl.cli.train import config_from_args, parse_args
    from mapl.core.run import run
    rows = []
    with tempfile.TemporaryDirectory(prefix="mapl-bench-parity-") as tmp:
        for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
            for P, schedule in ((2, "gpipe"), (2, "1f1b"), (4, "gpipe"), (4, "1f1b")):
                cli = ["--profile", "micro", "--method", method, "--stages", str(P), "--set", f"train.schedule={schedule}",
                       "--set", f"train.micro_batches={P}", "--set", f"train.batch_size={2 * P}",
                       "--set", "train.threads=1", "--no-progress"] + (["--ratio", "4"] if method not in ("none", "int8") else [])
                ref = run(config_from_args(parse_args(cli)), progress=False, log=lambda *a, **k: None)
                out = Path(tmp) / f"{method}-{P}-{schedule}.json"
                t0 = time.time()
                r = launch([*cli, "--blocking-transport", "--timeout", "60", "--out", str(out), "--ckpt",
                            str(out.with_suffix(".pt"))], P, launcher="direct", timeout=args.timeout)
                res = json.loads(out.read_text()) if r.returncode == 0 else None
                same = res is not None and res["train_loss_curve"] == ref["train_loss_curve"] and \
                    res["val_loss_curve"] == ref["val_loss_curve"]
                rows.append({"method": method, "stages": P, "schedule": schedule, "returncode": r.returncode,
                             "bit_identical": same, "steps": len(ref["train_loss_curve"]), "wall_s": time.time() - t0})
                print(f"  {method} P={P} {schedule}: {'identical' if same else 'DIFFERENT/FAILED'}", file=sys.stderr)
    return {"profile": "micro", "transport": "blocking", "rows": rows}


def parity_markdown(b: dict) -> str:
    lines = ["# Blocking transport (every send waits for its receive, as NCCL's do) vs the single-process loop", "",
             "Per-step training and validation losses of the micro profile (20 steps), gloo, one process per stage.", "",
             "| method | P | schedule | exit | losses bit-identical |", "|---|---|---|---|---|"]
    for r in b["rows"]:
        lines.append(f"| {r['method']} | {r['stages']} | {r['schedule']} | {r['returncode']} | "
                     f"{'yes' if r['bit_identical'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/pipeline.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per method (default %(default)s)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated (default %(default)s)")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    ap.add_argument("--links", default="80Mbps,200Mbps,1Gbps", help="link profiles (default %(default)s)")
    ap.add_argument("--latency-ms", type=float, help="override every profile's latency")
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--target", type=float, help="target validation loss (default: highest final val loss)")
    ap.add_argument("--curves", type=Path, default=ROOT / "reports" / "cpu" / "results" / "main",
                    help="folder of full-length results JSONs to take steps-to-target from (default %(default)s)")
    ap.add_argument("--launcher", default="accelerate", choices=["accelerate", "torchrun", "direct"])
    ap.add_argument("--timeout", type=float, default=900, help="per-method launch timeout (s)")
    ap.add_argument("--out-json", type=Path, default=ROOT / "reports" / "bench" / "pipeline.json")
    ap.add_argument("--out-md", type=Path, default=ROOT / "reports" / "tables" / "pipeline.md")
    ap.add_argument("--overlap", action="store_true", help="the real-delay overlap table instead (method none)")
    ap.add_argument("--parity", action="store_true", help="the blocking-transport parity grid instead (micro profile)")
    args = ap.parse_args(argv)
    if args.overlap or args.parity:
        name = "pipeline-overlap" if args.overlap else "pipeline-blocking-parity"
        bench = overlap_table(args) if args.overlap else parity_grid(args)
        md = overlap_markdown(bench) if args.overlap else parity_markdown(bench)
        atomic_write_json(ROOT / "reports" / "bench" / f"{name}.json", bench)
        atomic_write_text(ROOT / "reports" / "tables" / f"{name}.md", md)
        print(md)
        return 0
    profiles = [get_profile(p, args.latency_ms) for p in args.links.split(",")]
    load_run_config(args.profile)        # fail early on a bad profile
    rows = []
    with tempfile.TemporaryDirectory(prefix="mapl-bench-pipeline-") as tmp:
        for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
            if method not in METHODS:
                fail(f"error: --methods: {method!r} is unknown; allowed {sorted(METHODS)}")
            print(f"{method}: {args.steps} steps, P={args.stages} ...", file=sys.stderr, flush=True)
            res = run_method(method, METHODS[method], args, Path(tmp))
            rows.append(summarize(method, res, profiles, args.curves if args.curves and args.curves.exists() else None))
            print(f"  done in {rows[-1]['bench_wall_s']:.0f} s; val {rows[-1]['val_loss']:.4f}", file=sys.stderr)
    if not rows:
        fail("error: --methods: no method ran")
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
    atomic_write_text(args.out_md, markdown(bench))
    print(markdown(bench))
    return 0


if __name__ == "__main__":
    sys.exit(main())
