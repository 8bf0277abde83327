"""How close to the link's floor each method trains: 1F1B against the planner's schedule, modelled and measured.

Writes: ``reports/bench/slow-link.json``, ``reports/tables/slow-link.md``, ``reports/bench/slow-link.png``.

The floor of a step is the busiest channel's bytes over the bandwidth: no schedule can beat it. Under 1F1B a
stage runs at most P - s micro-batches ahead of its first gradient, which returns only after a round trip of
2 (P - 1 - s) messages, so on a slow link the channel idles for much of the step. The deep warm-ups
(``1f1b-x2``..``x4``, mapl.core.schedule) keep it busy; the planner (``Case.predict``) takes the fastest
that fits the GPU's memory (``with_schedule_variants``).

* **Model** (seconds): the paper shapes (150M, 1B; P = 4, sequences of 2,048) on H100 and H200 memory,
  M = 32 (the paper profile) and M = 64 (the same batch in half-size micro-batches), on four links: the
  step and its distance to the floor under 1F1B and under the planner's choice.
* **Measured** (minutes, ``--measure``): the same contrast on the multi-process runtime at CPU scale with a
  real link delay (``--link-delay``, the FIFO channel rule of mapl.core.link), each method on a bandwidth
  that gives it the 1B model's ratio of message time to compute at 200 Mb/s: a first run on a free link
  measures compute and bytes, then each schedule runs on the slow link; measured step against the floor and
  against the model's prediction from that run's own compute.

    python benchmarks/slow_link.py                     # model only, about a minute
    python benchmarks/slow_link.py --measure           # + the CPU runs (MAPL+VQ also with the int8 backward), ~10 min
    python benchmarks/slow_link.py --measure --quick --out-json /tmp/s.json --out-md /tmp/s.md   # seconds: it runs
    python benchmarks/slow_link.py --keep-measured     # the model again; the measured part kept from --out-json
    python benchmarks/slow_link.py --measure --stages 2 --methods mapl-rvq --micro-factors 2 \
        --out-json reports/bench/slow-link-p2.json --out-md reports/tables/slow-link-p2.md   # one process a core

The default measured runs put 4 processes on this machine's 2 cores; ``--stages 2`` is the control with one
process a core, which separates what the runtime and the model disagree on from what sharing cores costs.

The model needs no quiet machine (it is arithmetic); the measured part does, so ``--keep-measured`` refreshes the
model (a new method, a changed cost model) without rerunning it: its rows, set-up and load averages are carried over
as they were measured, and ``measured_kept_from`` says so; each row keeps its run's own measurement (``timing``,
``overrides``), from which the current model predicts it again.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mapl.core.link import LinkProfile, get_profile
from mapl.orchestration.launch import launch
from mapl.planning import planner_views as views
from mapl.planning.costmodel import H100, H200
from run_shape import (add_shape_arguments, host_columns, host_work, one_step_columns, run_case, set_flags, shape_overrides,
                       with_host_work, write_report)

LINKS = ("80Mbps", "200Mbps", "1Gbps", "10Gbps")
PAPER_METHODS = ("none", "ssn", "mapl", "mapl-rvq")
# the compressed backward message (compressor.grad_wire: int8, r + 2 bytes a token instead of 2r): modelled beside the
# bf16 gradient of the same methods
INT8_BACKWARD = ("mapl", "mapl-rvq")
INT8_SUFFIX = ", int8 backward"
TARGET = ("1B", "200Mbps")            # the case whose link-to-compute ratio the measured runs copy


def _row(case, link) -> dict:
    base = replace(case, variants=()).predict(link)
    best = case.predict(link)
    return {"link": link.name, "bandwidth_bps": link.bandwidth_bps, "latency_s": link.latency_s,
            "floor_s": best.floor_s, "compute_s": base.compute_s,
            "one_f_one_b_s": base.step_s, "one_f_one_b_over_floor": base.step_s / best.floor_s,
            "planner_s": best.step_s, "planner_over_floor": best.step_s / best.floor_s, "planner_schedule": best.schedule}


def cases(model: str, micro_batches: int, gpu, **kw) -> dict:
    """Label -> Case of the paper shape: every method with its bf16 gradient, then MAPL and MAPL+VQ with the int8
    backward message ("mapl-rvq 16x, int8 backward")."""
    out = {views.label(k): (k[0], c) for k, c in
           views.paper_cases(model, PAPER_METHODS, 4, micro_batches, 512 // micro_batches, 2048, gpu, **kw).items()}
    int8 = views.paper_cases(model, INT8_BACKWARD, 4, micro_batches, 512 // micro_batches, 2048, gpu,
                             overrides={"compressor.grad_wire": "int8"}, **kw)
    out.update({views.label(k) + INT8_SUFFIX: (k[0], c) for k, c in int8.items()})
    return out


def modelled(models, micro_batches, gpus, links) -> list[dict]:
    rows = []
    for gpu in gpus:
        for model in models:
            for M in micro_batches:
                for label, (_, case) in cases(model, M, gpu).items():
                    for name in links:
                        rows.append({"model": model, "gpu": gpu.name, "gpu_memory_gb": gpu.memory_bytes / 1e9,
                                     "micro_batches": M, "method": label, **_row(case, get_profile(name))})
                print(f"model: {model} M={M} on {gpu.name}: done", file=sys.stderr, flush=True)
    return rows


def curves(model: str = "1B", gpu=H100, micro_batches: int = 32, points: int = 25) -> dict:
    """Step time against bandwidth (50 ms latency) under 1F1B and the planner's schedule, and the floor,
    per method: the figure's data."""
    bws = [10 ** (7.5 + 3.5 * i / (points - 1)) for i in range(points)]          # 31.6 Mb/s .. 100 Gb/s
    out = {"model": model, "gpu": gpu.name, "micro_batches": micro_batches, "latency_s": 0.05, "bandwidth_bps": bws,
           "methods": {}}
    for label, (method, case) in cases(model, micro_batches, gpu).items():
        links = [LinkProfile(f"{b:g}", b, 0.05) for b in bws]
        best = [case.predict(lk) for lk in links]
        out["methods"][label] = {
            "method": method, "one_f_one_b_s": [replace(case, variants=()).predict(lk).step_s for lk in links],
            "planner_s": [p.step_s for p in best], "planner_schedule": [p.schedule for p in best],
            "floor_s": [p.floor_s for p in best]}
    return out


def figure(data: dict, path: Path) -> None:
    """One panel per method: 1F1B, the planner's schedule and the floor against bandwidth (log-log)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mapl.report.style import NEUTRAL, colour, variant_label
    names = list(data["methods"])
    fig, axes = plt.subplots(1, len(names), figsize=(2.9 * len(names), 3.2), sharey=True)
    x = [b / 1e6 for b in data["bandwidth_bps"]]
    for ax, name in zip(axes, names):
        m = data["methods"][name]
        c = colour(m["method"])
        ax.loglog(x, m["one_f_one_b_s"], color=c, linestyle="--", label="1F1B")
        ax.loglog(x, m["planner_s"], color=c, label="planner's schedule")
        ax.loglog(x, m["floor_s"], color=NEUTRAL["reference"], linestyle=":", label="link floor")
        ratio = name.removesuffix(INT8_SUFFIX).split()[1] if " " in name else "1x"
        ax.set_title(f"{variant_label(m['method'])} ({ratio})" + ("\nint8 backward" if name.endswith(INT8_SUFFIX) else ""),
                     fontsize=9)
        ax.set_xlabel("bandwidth (Mbit/s)")
    axes[0].set_ylabel("step time (s)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{data['model']}, P = 4, M = {data['micro_batches']}, {data['latency_s'] * 1000:g} ms latency, "
                 f"{data['gpu']} (model)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def message_to_compute(rows: list[dict]) -> dict:
    """Per method: the target case's time of one forward message over the link against one micro-batch's
    compute on a stage (forward + backward), the ratio the measured runs reproduce (a method with the int8
    backward has its bf16 twin's: the same forward message and compute)."""
    model, link = TARGET
    cases = views.paper_cases(model, PAPER_METHODS, 4, 32, 16, 2048, H100, schedules=())
    prof = get_profile(link)
    out = {}
    for key, case in cases.items():
        per_mb = max(f + b for f, b in zip((r[0] for r in case.compute.fwd_s), (r[0] for r in case.compute.bwd_s)))
        out[key[0]] = prof.transfer_s(case.wire[0].fwd) / per_mb
    return out


def measured_variants(methods: list[str], int8_backward: list[str]) -> list[tuple[str, str, dict]]:
    """(label, method, extra config) of each measured run: every method with its bf16 gradient, then those of
    ``int8_backward`` with the int8 backward message (labelled as in the model's rows)."""
    return [(m, m, {}) for m in methods] + [(m + INT8_SUFFIX, m, {"compressor.grad_wire": "int8"})
                                            for m in int8_backward]


def _run(args, over: dict, tmp: Path, stem: str, link: LinkProfile | None) -> dict:
    out, ckpt = tmp / f"{stem}.json", tmp / f"{stem}.pt"
    cli = ["--profile", args.profile, *set_flags(over), "--no-progress", "--fresh", "--out", str(out), "--ckpt", str(ckpt)]
    if link is not None:
        cli += ["--link-delay", f"{link.bandwidth_bps:g}bps", "--link-latency-ms", f"{1000 * link.latency_s:g}"]
    r = launch(cli, args.stages, launcher="direct", timeout=args.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{stem} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return json.loads(out.read_text())


def measured(args, ratios: dict) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="mapl-bench-slowlink-") as tmp:
        for label, method, extra in measured_variants(args.methods, args.int8_backward):
            stem = label.replace(INT8_SUFFIX, "-int8-backward")
            over = {**shape_overrides(args, method, "1f1b", stages=args.stages), **extra}
            free = _run(args, over, Path(tmp), f"{stem}-free", None)["pipeline"]["timing"]
            per_mb = max(f[0] + b[0] for f, b in zip(free["fwd_s"], free["bwd_s"]))
            bps = free["fwd_bytes"][0] * 8 / (ratios[method] * per_mb)
            link = LinkProfile(f"{bps / 1e6:.3g}Mbps", bps, args.latency_ms / 1000)
            for k, schedule in ((k, sch) for k in args.micro_factors for sch in args.schedules):
                # k > 1: the same batch in k x M micro-batches on the same link (the planner's other choice)
                over = {**shape_overrides(args, method, schedule, stages=args.stages), **extra,
                        "train.micro_batches": k * args.micro_batches}
                pipe = _run(args, over, Path(tmp), f"{stem}-{schedule}-x{k}M", link)["pipeline"]
                row = predicted({"method": label, "schedule": schedule, "micro_batches": k * args.micro_batches,
                                 "link": link.name, "bandwidth_bps": bps,
                                 "latency_s": link.latency_s, "message_to_compute": ratios[method],
                                 "measured_step_s": pipe["step_wall_s"], "timed_steps": pipe["timed_steps"],
                                 "step_walls_s": pipe["step_walls_s"], "stage_host_s_per_step": host_work(pipe),
                                 "overrides": over, "timing": pipe["timing"]}, args.profile)
                rows.append(row)
                print(f"measured: {label} {schedule} M={k * args.micro_batches} on {link.name}: "
                      f"{row['measured_step_s']:.3f} s = {row['measured_over_floor']:.2f}x floor "
                      f"(model {row['predicted_step_s']:.3f} s)", file=sys.stderr, flush=True)
    return rows


def predicted(row: dict, profile: str) -> dict:
    """``row`` with the model's step from its run's own compute (``timing``) and its config's declared bytes:
    the steady state (steps back to back) and, beside it, the replay of one step from an idle pipeline."""
    case = run_case(profile, row["overrides"], row["timing"])
    link = LinkProfile(row["link"], row["bandwidth_bps"], row["latency_s"])
    pred, step = case.predict(link), row["measured_step_s"]
    one_step = case.one_step_time(link)
    out = {**row, "predicted_step_s": pred.step_s, "floor_s": pred.floor_s, "measured_over_floor": step / pred.floor_s,
           "error": (pred.step_s - step) / step, "predicted_one_step_s": one_step,
           "error_one_step": (one_step - step) / step}
    if "stage_host_s_per_step" in row:        # the same model with the run's untimed host work on each stage
        hosted = run_case(profile, row["overrides"], with_host_work(row["timing"], row["stage_host_s_per_step"]))
        out["predicted_with_host_s"] = hosted.predict(link).step_s
        out["error_with_host"] = (out["predicted_with_host_s"] - step) / step
    return out


def markdown(bench: dict) -> str:
    lines = ["# Training at the link's floor: 1F1B against the planner's schedule", "",
             "Floor: the busiest channel's bytes per step over the bandwidth. Model: the paper shapes (P = 4, "
             "512 sequences of 2,048 per step, FLOPs at MFU 0.35 on a 989 TFLOP/s GPU); the planner takes the "
             "fastest of 1F1B and 1F1B with 2-4x its warm-up, with or without activation checkpointing, whose "
             "memory plan fits the GPU.", "",
             "| model | GPU memory (GB) | M | method | link | floor (s) | 1F1B (s) | 1F1B / floor | planner (s) | "
             "planner / floor | schedule |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in bench["model"]:
        lines.append(f"| {r['model']} | {r['gpu_memory_gb']:g} | {r['micro_batches']} | {r['method']} | {r['link']} | "
                     f"{r['floor_s']:.3g} | {r['one_f_one_b_s']:.3g} | {r['one_f_one_b_over_floor']:.2f} | "
                     f"{r['planner_s']:.3g} | {r['planner_over_floor']:.2f} | {r['planner_schedule']} |")
    if bench.get("measured"):
        m = bench["measured_setup"]
        lines += ["", f"## Measured at CPU scale (real link delay, {m['runtime']})", "",
                  f"P = {m.get('stages', 4)}, d = {m['width']}, {2 * m.get('stages', 4)} layers, "
                  f"M = {m['micro_batches']} micro-batches of {m['micro_batch_size']} "
                  f"x {m['seq_len']} tokens, {m['steps']} steps (the first not timed), latency {m['latency_ms']:g} ms; "
                  f"each method's bandwidth gives one message {{ratio}} x a micro-batch's compute, as the 1B model at "
                  f"200 Mb/s has; a run with 2M micro-batches carries the same batch in half-size micro-batches on its "
                  f"method's link. Load average before / after: {bench['load_before']} / {bench['load_after']}.", "",
                  "Model: the steady state (steps replayed back to back, stage 0's period) from the run's own compute; "
                  "one step: the replay of a single step from an idle pipeline (its last stage's end); with host work: "
                  "the steady state with each stage's untimed seconds (step wall time less its compute, step-end "
                  "compute and waits: per-message host work on this CPU) spread over its operations.", "",
                  "| method | message / compute | link | schedule | M | measured (s) | model (s) | error | one step (s) | "
                  "error | with host work (s) | error | floor (s) | measured / floor |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in bench["measured"]:
            lines.append(f"| {r['method']} | {r['message_to_compute']:.2f} | {r['link']} | {r['schedule']} | "
                         f"{r.get('micro_batches', m['micro_batches'])} | "
                         f"{r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | {100 * r['error']:+.1f}% | "
                         f"{one_step_columns(r)} | {host_columns(r)} | {r['floor_s']:.3f} | {r['measured_over_floor']:.2f} |")
    return "\n".join(lines).replace("{ratio}", "the listed ratio") + "\n"


MEASURED_KEYS = ("message_to_compute", "measured_setup", "measured", "load_before", "load_after")


def _measured_part(path: Path) -> dict:
    """What a previous ``--measure`` wrote to ``path``: its measured rows with their set-up and load averages."""
    from mapl.base.cli import fail
    try:
        old = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        fail(f"error: --keep-measured: {path} is not readable JSON ({e}); run with --measure")
    if not isinstance(old, dict) or not old.get("measured"):
        fail(f"error: --keep-measured: {path} holds no measured part; run with --measure")
    return {**{k: old[k] for k in MEASURED_KEYS if k in old}, "measured_kept_from": str(path)}


def repredicted(kept: dict, profile: str) -> dict:
    """The kept measured part with the current model's predictions, for every row that kept its run's
    measurement (``timing``); a row measured before rows kept it keeps its old prediction."""
    if not kept:
        return kept
    return {**kept, "measured": [predicted(r, profile) if "timing" in r else r for r in kept["measured"]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/slow_link.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", action="store_true", help="also the CPU runs on a real-delay link")
    ap.add_argument("--keep-measured", action="store_true",
                    help="model only; carry the measured part over from --out-json (refused if it has none)")
    ap.add_argument("--quick", action="store_true", help="a seconds-long check: 150M on H100 only, one method measured")
    ap.add_argument("--methods", nargs="+", default=["none", "mapl", "mapl-rvq"])
    ap.add_argument("--int8-backward", nargs="*", default=["mapl-rvq"], choices=list(INT8_BACKWARD),
                    help="methods also measured with the int8 backward message (default: %(default)s)")
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "1f1b-x2", "1f1b-x3"])
    ap.add_argument("--micro-factors", nargs="+", type=int, default=[1, 2],
                    help="measure every schedule also with k x --micro-batches (the same batch; default %(default)s)")
    ap.add_argument("--latency-ms", type=float, default=1.0)
    ap.add_argument("--stages", type=int, default=4,
                    help="pipeline stages (processes) of the measured runs, two blocks each (default %(default)s; 2 "
                         "gives every process its own core on this machine)")
    add_shape_arguments(ap, micro_batches=16, micro_batch_size=2, seq_len=64, out="slow-link")
    a = ap.parse_args(argv)
    if a.keep_measured and a.measure:
        ap.error("--keep-measured and --measure: choose one (measure again, or keep what was measured)")
    kept = _measured_part(a.out_json) if a.keep_measured else {}
    if a.quick:
        a.methods, a.schedules, a.micro_batches, a.steps, a.width = ["mapl"], ["1f1b", "1f1b-x2"], 4, 2, 64
        a.int8_backward, a.micro_factors = ["mapl"], [1]
    if a.stages < 2:
        ap.error(f"--stages {a.stages} is invalid: a pipeline needs at least 2")
    bad = [k for k in a.micro_factors if k < 1 or a.micro_batch_size % k]
    if bad:
        ap.error(f"--micro-factors {bad[0]} is invalid: must be >= 1 and divide --micro-batch-size "
                 f"{a.micro_batch_size} (the same batch in k x M micro-batches)")
    load_before = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    t0 = time.time()
    rows = modelled(["150M"] if a.quick else ["150M", "1B"], [32] if a.quick else [32, 64],
                    [H100] if a.quick else [H100, H200], LINKS)
    bench = {"model": rows, "target": {"model": TARGET[0], "link": TARGET[1]}, "load_before": load_before,
             "curves": curves("150M" if a.quick else "1B", points=5 if a.quick else 25)}
    if a.stages == 4:        # the model's figure (the paper shape, P = 4); a --stages control would only repeat it
        figure(bench["curves"], a.out_json.with_suffix(".png"))
    if a.measure:
        ratios = message_to_compute(rows)
        bench["message_to_compute"] = ratios
        bench["measured_setup"] = {"runtime": "mapl pipeline --link-delay", "stages": a.stages, "width": a.width,
                                   "micro_batches": a.micro_batches, "micro_batch_size": a.micro_batch_size,
                                   "seq_len": a.seq_len, "steps": a.steps, "latency_ms": a.latency_ms}
        bench["measured"] = measured(a, ratios)
    bench["load_after"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    bench["wall_s"] = time.time() - t0
    bench.update(repredicted(kept, a.profile))
    write_report(a, bench, markdown(bench))
    return 0


if __name__ == "__main__":
    sys.exit(main())
