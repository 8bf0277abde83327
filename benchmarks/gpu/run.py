"""The GPU kit: what one CUDA card says about the paper's assumptions (MFU, memory plan, RVQ kernel, device syncs).

Run from the repository root on a machine with CUDA, torch, numpy and PyYAML (no internet, nothing to install):

    python benchmarks/gpu/run.py                 # every item that fits the card; prints the expected wall time first
    python benchmarks/gpu/run.py --plan          # only the plan: items, memory each needs, expected wall time
    python benchmarks/gpu/run.py --plan --card h100   # the plan for a named card, on any machine
    python benchmarks/gpu/run.py --cpu --out /tmp/g   # the same code at micro shapes on a CPU (seconds per item)

Each result is one JSON line in reports/gpu/<card>-<time>.jsonl, written the moment it is measured, and
reports/gpu/<card>-<time>.md summarises the file so far after every item. benchmarks/gpu/README.md says what
each item decides.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import re
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [p for p in (str(ROOT), str(Path(__file__).resolve().parent)) if p not in sys.path]   # mapl, measure
GIB = 2 ** 30
RESERVE = 0.10                 # memory kept free on the card, as mapl.core.memory.check_plan keeps it
MFU_GUESS = 0.35               # the cost model's assumption, for the compute part of the wall-time estimate
# seconds of an item beyond its compute (building the models, the untimed passes, the fused kernel's cold compile):
# guesses for an H100 or H200, replaced by the measured seconds of an earlier run on the same card (--out)
OVERHEAD_S = {"ceiling": 5, "rvq-kernel": 60, "syncs": 30, "150M": 30, "1B": 60, "micro": 2, "tiny": 3}
ITEM_KINDS = ("ceiling", "speed", "rvq-kernel", "syncs")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python benchmarks/gpu/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "gpu", help="folder of the results "
                    "(default reports/gpu; a run never overwrites an earlier one)")
    ap.add_argument("--items", default="", metavar="PREFIX[,PREFIX]",
                    help="run only the items whose name starts with one of these, e.g. speed/1B or rvq-kernel "
                         f"(kinds: {', '.join(ITEM_KINDS)})")
    ap.add_argument("--reps", type=int, default=3, help="timed passes per speed item (default 3)")
    ap.add_argument("--plan", action="store_true", help="print the plan and the expected wall time, then exit")
    ap.add_argument("--card", choices=("h100", "h200"),
                    help="plan for this card (80 GB or 141 GB, dense bf16 989 TFLOP/s) instead of the one found")
    ap.add_argument("--cpu", action="store_true", help="the same code on a CPU at micro shapes (tests)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps {args.reps} is invalid: must be >= 1")
    if args.card and not args.plan:
        ap.error("--card plans for a card that is not here: use it with --plan")
    return args


# ---- the items and the card -----------------------------------------------------------------------------------
def items(small: bool) -> list[dict]:
    """Every item, in the order they run: the half-size micro-batch (8 sequences, M = 64) beside the paper's
    (16 sequences, M = 32) for each configuration."""
    mid, big = ("micro", "tiny") if small else ("150M", "1B")
    out = [{"name": "ceiling", "kind": "ceiling"}]
    for model, methods in ((mid, ("none", "int8", "ssn", "mapl", "mapl-rvq")), (big, ("none", "mapl"))):
        for method in methods:
            for seqs in ((2, 1) if small else (16, 8)):
                M = (8 if small else 512) // seqs
                out.append({"name": f"speed/{model}/{method}/M{M}", "kind": "speed", "model": model,
                            "method": method, "seqs": seqs})
    out.append({"name": "rvq-kernel", "kind": "rvq-kernel"})
    out.append({"name": "syncs", "kind": "syncs"})
    return out


def card(args) -> dict:
    """The card to plan for: its name, memory and dense bf16 peak (datasheet, the cost model's H100/H200 figure;
    None for another card: the run then takes the matmul rate it measures)."""
    from mapl.planning.costmodel import H100, H200
    if args.card:
        spec = {"h100": H100, "h200": H200}[args.card]
        return {"name": spec.name, "slug": args.card, "memory_bytes": spec.memory_bytes, "peak_flops": spec.peak_flops}
    import torch
    from mapl.base.cli import fail
    if args.cpu:
        return {"name": "CPU rehearsal", "slug": "cpu", "memory_bytes": None, "peak_flops": None}
    if not torch.cuda.is_available():
        fail("error: no CUDA device here: run on the GPU machine, or plan with --plan --card h100|h200, or "
             "rehearse with --cpu")
    p = torch.cuda.get_device_properties(0)
    sxm = ("H100" in p.name and "PCIe" not in p.name and "NVL" not in p.name) or "H200" in p.name
    return {"name": p.name, "slug": re.sub(r"[^a-z0-9]+", "-", p.name.lower()).strip("-"),
            "memory_bytes": p.total_memory, "peak_flops": H100.peak_flops if sxm else None}


@functools.cache
def need_bytes(model: str, method: str, seqs: int, small: bool) -> int:
    """What a speed item holds at once, from the memory plan (mapl.core.memory): every stage's parameters,
    gradients, optimizer and compressor state, and the largest stage's one micro-batch with its transient."""
    from measure import speed_config
    from mapl.core.memory import memory_plan
    cfg = speed_config(model, method, seqs, small)
    plan = memory_plan(cfg, cfg.model_config().vocab_size, device="cuda", checkpointing=False)
    static = sum(st.params + st.grads + st.optimizer + st.compressor for st in plan.stages)
    return static + max((st.activations + st.head) // max(1, st.alive) + st.working for st in plan.stages)


def plan(run_items: list[dict], crd: dict, small: bool, measured: dict, reps: int = 3) -> list[dict]:
    """Each item with what it needs (memory, seconds) and whether it runs on this card: an item that needs more
    than the card's memory less 10 % is skipped, with the reason."""
    from measure import speed_config
    from mapl.planning.costmodel import stage_flops
    rate = (crd["peak_flops"] or 300e12) * MFU_GUESS          # an unknown card's plan, before its ceiling is measured
    out = []
    for it in run_items:
        it = dict(it, need_bytes=None, skip=None)
        est = OVERHEAD_S.get(it.get("model", it["kind"]), 0)
        if it["kind"] == "speed":
            cfg = speed_config(it["model"], it["method"], it["seqs"], small)
            vocab = cfg.model_config().vocab_size
            it["need_bytes"] = need_bytes(it["model"], it["method"], it["seqs"], small)
            passes = 2 + reps                                  # two untimed passes, then the timed ones
            est += 0 if small else passes * sum(f["fwd"] + f["bwd"] for f in stage_flops(cfg, vocab)) / rate
            if crd["memory_bytes"] and it["need_bytes"] > (1 - RESERVE) * crd["memory_bytes"]:
                it["skip"] = (f"needs {it['need_bytes'] / GIB:.1f} GiB, more than the card's "
                              f"{crd['memory_bytes'] / GIB:.1f} GiB less {RESERVE:.0%}")
        it["expected_s"] = measured.get(it["name"], est)
        out.append(it)
    return out


def earlier_seconds(out: Path, card_name: str) -> dict:
    """Seconds each item took in earlier runs on this card (the latest run's), from the JSON lines in ``out``."""
    seen = {}
    for path in sorted(out.glob("*.jsonl"), key=lambda p: p.stat().st_mtime):
        recs = read_records(path)
        if recs and recs[0].get("kind") == "env" and recs[0].get("card") == card_name:
            seen.update({r["item"]: r["item_s"] for r in recs if "item_s" in r})
    return seen


def format_plan(planned: list[dict], crd: dict) -> str:
    mem = f"{crd['memory_bytes'] / GIB:.1f} GiB" if crd["memory_bytes"] else "no GPU memory"
    lines = [f"{crd['name']} ({mem}):"]
    for it in planned:
        need = f"{it['need_bytes'] / GIB:6.1f} GiB" if it["need_bytes"] else " " * 10
        lines.append(f"  {it['name']:28s} {need}  " + (f"skipped: {it['skip']}" if it["skip"] else
                                                        f"~{it['expected_s']:.0f} s"))
    total = sum(it["expected_s"] for it in planned if not it["skip"])
    lines.append(f"expected wall time: about {math.ceil(total / 60)} min ({total:.0f} s) for "
                 f"{sum(not it['skip'] for it in planned)} items")
    return "\n".join(lines)


# ---- results ----------------------------------------------------------------------------------------------------
def _clean(obj):
    """Strict JSON: NaN and infinities become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_record(path: Path, kind: str, **fields) -> None:
    """One JSON line, on disk (flushed and synced) before the next item starts."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(_clean({"kind": kind, **fields})) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path: Path) -> list[dict]:
    """Every complete line of a results file (a torn last line, from a killed run, is dropped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def summary(recs: list[dict]) -> str:
    """The Markdown of a results file: the card, the speed table, half- against full-size MFU, the rest."""
    env = recs[0] if recs and recs[0]["kind"] == "env" else {}
    done = next((r for r in recs if r["kind"] == "done"), None)
    lines = [f"# GPU kit: {env.get('card', '?')}", "",
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}; MFU against {(env.get('peak_flops') or 0) / 1e12:.3g} "
             f"TFLOP/s ({env.get('peak_source')}); " + (f"complete in {done['wall_s']:.0f} s." if done else
                                                        "**not finished** (the items measured so far).")]
    by = {r["item"]: r for r in recs if "item" in r}
    if "ceiling" in by and by["ceiling"]["kind"] == "ceiling":
        c = by["ceiling"]
        lines.append(f"Measured: bf16 matmul {c['matmul_flops'] / 1e12:.3g} TFLOP/s, "
                     f"copy {c['copy_bytes_per_s'] / 1e9:.3g} GB/s.")
    speed = [r for r in recs if r["kind"] == "speed"]
    if speed:
        lines += ["", "| item | tokens / micro-batch | compute / micro-batch (ms) | wire ops (ms) | MFU | saved / plan "
                  "(max) | peak / planned (GiB) | step 1 Gb/s (s) | step 200 Mb/s (s) | step 80 Mb/s (s) |", "|---" * 10 + "|"]
        for r in speed:
            ratio = max((x for x in r["saved_over_plan"] if x is not None), default=None)
            peak = ("n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / GIB:.1f}") + f" / {r['need_bytes'] / GIB:.1f}"
            lines.append(f"| {r['item']} | {r['tokens_per_micro_batch']:,} | {1e3 * (sum(r['fwd_s']) + sum(r['bwd_s'])):,.1f} "
                         f"| {1e3 * r['wire_ops_s']:,.1f} | {r['mfu']:.1%} | {'n/a' if ratio is None else f'{ratio:.3f}'} "
                         f"| {peak} | " + " | ".join(f"{r['links'][k]['step_s']:.2f}" for k in ("1Gbps", "200Mbps", "80Mbps"))
                         + " |")
        pairs = [(r, by.get(re.sub(r"/M\d+$", f"/M{2 * r['micro_batches']}", r["item"]))) for r in speed]
        pairs = [(a, b) for a, b in pairs if b is not None and b["kind"] == "speed"]
        if pairs:
            lines += ["", "MFU of half-size micro-batches (M doubled, the same tokens per step) beside full-size:", "",
                      "| configuration | MFU, full size | MFU, half size | half / full |", "|---|---|---|---|"]
            lines += [f"| {a['item'].rsplit('/', 1)[0]} | {a['mfu']:.1%} (M = {a['micro_batches']}) | {b['mfu']:.1%} "
                      f"(M = {b['micro_batches']}) | {b['mfu'] / a['mfu']:.3f} |" for a, b in pairs]
    if by.get("rvq-kernel", {}).get("kind") == "rvq-kernel":
        k = by["rvq-kernel"]
        over = "n/a" if k["transient_over_plan"] is None else f"{k['transient_over_plan']:.2f}"
        lines += ["", f"Fused RVQ search: cold compile {k['compile_s']:.1f} s, one search of {k['tokens']:,} tokens "
                      f"{1e3 * k['search_s']:.1f} ms, transient / plan {over}, fused {k['fused']}."]
    if by.get("syncs", {}).get("kind") == "syncs":
        lines += ["", "Device syncs per training micro-batch: " +
                  ", ".join(f"{m} {n}" for m, n in by["syncs"]["syncs"].items()) + "."]
    bad = [r for r in recs if r["kind"] in ("skipped", "error")]
    if bad:
        lines += ["", "Not measured:", ""] + [f"- `{r['item']}`: {r['kind']}: {r.get('reason') or r.get('error')}"
                                              for r in bad]
    return "\n".join(lines) + "\n"


# ---- the run ----------------------------------------------------------------------------------------------------
def measure_item(it: dict, device, peak: float, args):
    import measure
    small = args.cpu
    if it["kind"] == "ceiling":
        return measure.ceiling(device, small)
    if it["kind"] == "speed":
        cfg = measure.speed_config(it["model"], it["method"], it["seqs"], small)
        return {"model": it["model"], "method": it["method"], "need_bytes": it["need_bytes"],
                **measure.speed(cfg, cfg.model_config().vocab_size, device, peak, args.reps)}
    if it["kind"] == "rvq-kernel":       # 150M at r = 256: G = 128 groups of 2-dim codewords, K = 256, 2 rounds
        shape = dict(groups=8, K=16, tokens=256) if small else dict(groups=128, K=256, tokens=16 * 2048)
        return measure.rvq_kernel(device, ds=2, rounds=2, **shape)
    return measure.syncs(device, "micro" if small else "150M", 2, 32 if small else 2048, small)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import measure
    from mapl.base.cli import fail
    crd = card(args)
    selected = [it for it in items(args.cpu) if not args.items or it["name"].startswith(tuple(args.items.split(",")))]
    if not selected:
        fail(f"error: --items {args.items} matches no item: names start with {', '.join(ITEM_KINDS)} "
             f"(e.g. speed/1B, speed/150M/mapl)")
    device = torch.device("cpu" if args.cpu or args.plan else "cuda")
    peak, source = crd["peak_flops"], "datasheet"
    if not args.plan and peak is None:
        peak, source = measure.ceiling(device, args.cpu)["matmul_flops"], "measured bf16 matmul"
    planned = plan(selected, {**crd, "peak_flops": peak}, args.cpu, earlier_seconds(args.out, crd["name"]), args.reps)
    print(format_plan(planned, crd), flush=True)
    if args.plan:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{crd['slug']}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    jsonl, md = stem.with_suffix(".jsonl"), stem.with_suffix(".md")
    write_record(jsonl, "env", card=crd["name"], memory_bytes=crd["memory_bytes"], peak_flops=peak, peak_source=source,
                 torch=torch.__version__, cuda=torch.version.cuda, python=sys.version.split()[0], argv=sys.argv[1:])
    started, errors = time.perf_counter(), 0
    for it in planned:
        if it["skip"]:
            write_record(jsonl, "skipped", item=it["name"], reason=it["skip"])
        else:
            t0 = time.perf_counter()
            try:
                fields = measure_item(it, device, peak, args)
                write_record(jsonl, it["kind"], item=it["name"], item_s=time.perf_counter() - t0, **fields)
            except Exception as e:     # noqa: BLE001 -- an out-of-memory error or a bug in one item must not lose the rest
                errors += 1
                write_record(jsonl, "error", item=it["name"], error=f"{type(e).__name__}: {str(e)[:400]}",
                             traceback=traceback.format_exc()[-2000:])
            measure.free(device)               # here, not in the except block: its traceback holds the item's tensors
            print(f"[{time.perf_counter() - started:7.1f} s] {it['name']}", flush=True)
        md.write_text(summary(read_records(jsonl)), encoding="utf-8")
    write_record(jsonl, "done", wall_s=time.perf_counter() - started, errors=errors)
    md.write_text(summary(read_records(jsonl)), encoding="utf-8")
    print(md.read_text(encoding="utf-8") + f"\nwrote {jsonl} and {md}", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
