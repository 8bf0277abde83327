"""Validate the step-time model (mapl.planning.costmodel) against the multi-process runtime in real-delay mode.

Writes: ``reports/bench/costmodel-validation.json``, ``reports/tables/costmodel-validation.md``.

For every cell of widths x bandwidths x latencies (method none, plus MAPL at one width) a short real
pipeline run (P processes on gloo, ``--link-delay``: each message arrives when it would over that link)
measures the step time; the cost model predicts it from the run's own measured compute (per stage and
micro-batch, forward/backward/optimizer), the wire bytes asked from the compressor objects, the link,
the schedule and its overlap model. Error = (predicted - measured) / measured, per cell; the goal is
|error| <= 15% wherever communication is at least a quarter of the step.

    python benchmarks/costmodel.py                    # 21 cells, ~6 min on 2 idle cores
    python benchmarks/costmodel.py --widths 128 --bandwidths 10e6 --latencies-ms 1 --steps 3
    python benchmarks/costmodel.py --profile micro --widths 64 --bandwidths 10e6 --latencies-ms 1 --mapl-width 0 \
        --seq-len 32 --steps 2 --out-json /tmp/c.json --out-md /tmp/c.md       # a seconds-long check that it runs

Writes ``reports/bench/costmodel-validation.json`` and ``reports/tables/costmodel-validation.md``. The
cells run one after another; the load average is recorded (the machine is shared).
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
from mapl.planning.costmodel import build_case, measured_compute
from mapl.core.link import LinkProfile
from mapl.orchestration.launch import launch
from mapl.base.io import atomic_write_json


def cell_overrides(args, width: int, method: str, ratio: float) -> dict:
    over = {"method": method, "stages": args.stages, "model.d_model": width, "model.ffn_hidden": 3 * width,
            "model.n_layers": args.layers, "train.batch_size": args.micro_batches * args.micro_batch_size,
            "train.micro_batches": args.micro_batches, "train.seq_len": args.seq_len, "train.steps": args.steps,
            "train.schedule": args.schedule, "train.eval_every": 10 ** 6, "train.eval_tokens": 2 * args.seq_len,
            "train.eval_batch_size": 2, "train.checkpoint_every": 10 ** 6, "train.threads": 1}
    if method not in ("none", "int8"):
        over["ratio"] = ratio
    return over


def _cli(over: dict) -> list[str]:
    out = []
    for k, v in over.items():
        out += ["--set", f"{k}={v}"]
    return out


def run_cell(args, width: int, method: str, ratio: float, bw: float, lat_ms: float, tmp: Path) -> dict:
    over = cell_overrides(args, width, method, ratio)
    # one results file per cell: a run never replaces another config's results (`mapl train`'s guard)
    stem = f"cell-d{width}-{method}-{ratio:g}x-{bw:g}bps-{lat_ms:g}ms"
    out, ckpt = tmp / f"{stem}.json", tmp / f"{stem}.pt"
    cli = ["--profile", args.profile, *_cli(over), "--no-progress", "--fresh", "--out", str(out), "--ckpt", str(ckpt),
           "--link-delay", f"{bw:g}bps", "--link-latency-ms", f"{lat_ms:g}"]
    t0 = time.time()
    r = launch(cli, args.stages, launcher="direct", timeout=args.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"cell d={width} {method} {bw:g} bps {lat_ms:g} ms failed ({r.returncode}):\n{r.stderr[-2000:]}")
    res = json.loads(out.read_text())
    pipe = res["pipeline"]      # mapl.core.runtime.measure.pipeline_section: timing (a StepMeasurement), step_wall_s, ...
    cfg = load_run_config(args.profile, over)
    case = build_case(cfg, measured_compute(pipe["timing"], "this run"), vocab_size=cfg.data.vocab_size)
    link = LinkProfile(f"{bw:g}bps@{lat_ms:g}ms", bw, lat_ms / 1000)
    pred = case.predict(link)
    tm = pipe["timing"]
    metered = [(tm["fwd_bytes"][p], tm["bwd_bytes"][p], tm["state_fwd_bytes"][p], tm["state_bwd_bytes"][p])
               for p in range(args.stages - 1)]
    declared = [(b.fwd, b.bwd, b.state_fwd, b.state_bwd) for b in case.wire]
    meas = pipe["step_wall_s"]
    return {"width": width, "method": method, "ratio": ratio if method not in ("none", "int8") else 1.0,
            "bandwidth_bps": bw, "latency_s": lat_ms / 1000, "measured_step_s": meas,
            "predicted_step_s": pred.step_s, "predicted_compute_s": pred.compute_s, "floor_s": pred.floor_s,
            "comm_fraction": pred.comm_fraction, "error": (pred.step_s - meas) / meas,
            "runtime_clock_step_s": pipe["link_delay"]["model_step_s"], "timed_steps": pipe["timed_steps"],
            "wire_bytes_match_meter": declared == metered, "wire_bytes": declared,
            "stage_compute_s": pipe["stage_compute_s_per_step"], "stage_wait_s": pipe["stage_wait_s_per_step"],
            "cell_wall_s": time.time() - t0}


def grid(args) -> list[tuple]:
    cells = [(w, "none", 1.0, bw, lat) for w in args.widths for lat in args.latencies_ms for bw in args.bandwidths]
    if args.mapl_width:
        cells += [(args.mapl_width, "mapl", args.mapl_ratio, bw, args.latencies_ms[0]) for bw in args.bandwidths]
    return cells


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def markdown(bench: dict) -> str:
    lines = [f"# Cost model vs real-delay runtime (P = {bench['stages']}, {bench['schedule']}, {bench['micro_batches']} "
             f"micro-batches of {bench['micro_batch_size']} x {bench['seq_len']} tokens, {bench['layers']} layers)", "",
             "Measured: mean step time of the real-delay run (first step dropped). Predicted: mapl.planning.costmodel from the "
             "run's measured compute, compressor-declared bytes and the link. Comm: the share of the predicted step "
             f"that the link adds. Largest |error|: {_pct(bench['max_abs_error'])} over all cells; "
             f"{_pct(bench['max_abs_error_comm25'])} where comm >= 25% (goal 15%). Load average (1, 5, 15 min) before: "
             f"{bench['load_before']}; after: {bench['load_after']} (2 cores, shared).", "",
             "| d | method | Mbit/s | latency (ms) | measured (s) | predicted (s) | error | comm | bytes = meter |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in bench["cells"]:
        lines.append(f"| {c['width']} | {c['method']} {c['ratio']:g}x | {c['bandwidth_bps'] / 1e6:g} | "
                     f"{1000 * c['latency_s']:g} | {c['measured_step_s']:.3f} | {c['predicted_step_s']:.3f} | "
                     f"{100 * c['error']:+.1f}% | {100 * c['comm_fraction']:.0f}% | "
                     f"{'yes' if c['wire_bytes_match_meter'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/costmodel.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="cpu", help="profile of the data and settings not overridden (default %(default)s)")
    ap.add_argument("--widths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512, 1024])
    ap.add_argument("--bandwidths", type=lambda s: [float(x) for x in s.split(",")], default=[10e6, 100e6, 1e9])
    ap.add_argument("--latencies-ms", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 50.0])
    ap.add_argument("--mapl-width", type=int, default=512, help="also MAPL cells at this width (0: none)")
    ap.add_argument("--mapl-ratio", type=float, default=8)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="steps per cell; the first is not timed")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out-json", type=Path, default=ROOT / "reports" / "bench" / "costmodel-validation.json")
    ap.add_argument("--out-md", type=Path, default=ROOT / "reports" / "tables" / "costmodel-validation.md")
    args = ap.parse_args(argv)
    load_before = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    cells, t0 = [], time.time()
    with tempfile.TemporaryDirectory(prefix="mapl-bench-costmodel-") as tmp:
        for w, method, ratio, bw, lat in grid(args):
            c = run_cell(args, w, method, ratio, bw, lat, Path(tmp))
            cells.append(c)
            print(f"d={w} {method} {bw / 1e6:g} Mb/s {lat:g} ms: measured {c['measured_step_s']:.3f} s, predicted "
                  f"{c['predicted_step_s']:.3f} s ({100 * c['error']:+.1f}%, comm {100 * c['comm_fraction']:.0f}%)",
                  file=sys.stderr, flush=True)
    comm = [abs(c["error"]) for c in cells if c["comm_fraction"] >= 0.25]
    bench = {"profile": args.profile, "stages": args.stages, "layers": args.layers, "schedule": args.schedule,
             "micro_batches": args.micro_batches, "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len,
             "steps": args.steps, "runtime": "mapl pipeline --link-delay", "load_before": load_before,
             "load_after": ", ".join(f"{x:.2f}" for x in os.getloadavg()), "wall_s": time.time() - t0, "cells": cells,
             "max_abs_error": max(abs(c["error"]) for c in cells), "max_abs_error_comm25": max(comm) if comm else None}
    atomic_write_json(args.out_json, bench)
    args.out_md.parent.mkdir(parents=True, exist_ok=True)
    args.out_md.write_text(markdown(bench))
    print(markdown(bench))
    return 0


if __name__ == "__main__":
    sys.exit(main())
