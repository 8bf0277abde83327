"""GPU readiness and paper-width evidence, on one GPU in about 10 minutes.

(a) speed: the 150M model (d = 1024) through the single-process pipeline, P = 4, every method for a
    short fixed number of steps: step time, tokens/s, MFU, compressor overhead against ``none``;
(b) quality at the paper's width: none, ssn, mapl (r = 256, 4x), mapl-rvq (8x), token-matched, bf16,
    the same fixed token budget each; val loss and delta-% against none.

    python benchmarks/gpu.py --out reports/gpu                  # on a GPU (one H200: ~10 min)
    python benchmarks/gpu.py --dry --out /tmp/gpu               # the same code path on CPU in seconds

Data: the cpu profile's prepared Shakespeare shards (``python -m mapl.data --profile cpu``) travel
with the repo; nothing is downloaded. Writes ``gpu.json`` and ``gpu.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mapl.config import load_run_config  # noqa: E402
from mapl.model import count_params  # noqa: E402
from mapl.train import atomic_write_json, run  # noqa: E402

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}   # dense bf16, vendor figures

SPEED_METHODS = [("none", 1), ("int8", 1), ("ssn", 4), ("mapl", 4), ("mapl-rvq", 4)]
QUALITY_METHODS = [("none", 1), ("ssn", 4), ("mapl", 4), ("mapl-rvq", 4)]


def _config(method, ratio, *, dry: bool, steps: int, seq: int, batch: int):
    over = {"method": method, "ratio": ratio, "model": "micro" if dry else "150M", "stages": 2 if dry else 4,
            "train.steps": steps, "train.seq_len": seq, "train.batch_size": batch,
            "train.micro_batches": 2 if dry else 4, "train.eval_every": steps, "train.eval_tokens": seq * batch * (1 if dry else 8),
            "train.eval_batch_size": batch, "train.warmup_steps": max(1, steps // 10), "train.threads": 0,
            "train.precision": "auto", "train.checkpoint_every": 10**9}
    if not dry:
        over.update({"train.lr_muon": 0.02, "train.lr_adam": 0.01, "train.lr_embed": 0.01, "train.lr_head": 0.01})
    cfg = load_run_config("cpu", over)
    return cfg


def _peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def speed(dry: bool, steps: int, seq: int, batch: int, log) -> list[dict]:
    rows = []
    for method, ratio in SPEED_METHODS:
        # a 2-step warm-up run first: CUDA context, kernel selection and allocator warm-up stay out of the timing
        run(_config(method, ratio, dry=dry, steps=2, seq=seq, batch=batch), progress=False, log=lambda *a: None)
        cfg = _config(method, ratio, dry=dry, steps=steps, seq=seq, batch=batch)
        res = run(cfg, progress=False, log=lambda *a: None)
        n = count_params(cfg.model_config(_manifest_vocab()))
        peak = _peak_flops()
        flops = 6 * n * res["tokens_per_s"]
        rows.append({"method": method, "ratio": res["ratio"], "tokens_per_s": res["tokens_per_s"],
                     "step_s": batch * seq / res["tokens_per_s"], "mfu": flops / peak if peak else None,
                     "fwd_bytes_per_token": res["wire"]["fwd_bytes_per_token"]})
        log(json.dumps(rows[-1]))
    base = rows[0]["step_s"]
    for r in rows:
        r["overhead_vs_none_pct"] = 100 * (r["step_s"] - base) / base
    return rows


def _manifest_vocab() -> int:
    from mapl.data import read_manifest
    from mapl.train import resolve_data_dir
    return int(read_manifest(resolve_data_dir(load_run_config("cpu")))["vocab_size"])


def quality(dry: bool, steps: int, seq: int, batch: int, log) -> list[dict]:
    rows = []
    for method, ratio in QUALITY_METHODS:
        cfg = _config(method, ratio, dry=dry, steps=steps, seq=seq, batch=batch)
        res = run(cfg, progress=False, log=lambda *a: None)
        rows.append({"method": method, "ratio": res["ratio"], "tokens": res["tokens"], "val_loss": res["val_loss"],
                     "ortho_max_err": res["ortho_max_err"]})
        log(json.dumps(rows[-1]))
    ref = rows[0]["val_loss"]
    for r in rows:
        r["delta_pct"] = 100 * (r["val_loss"] - ref) / ref
    return rows


def table(speed_rows, quality_rows) -> str:
    out = ["| method | ratio | tokens/s | step (s) | MFU | overhead vs none |", "|---|---|---|---|---|---|"]
    for r in speed_rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        out.append(f"| {r['method']} | {r['ratio']:.0f}x | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | {mfu} | "
                   f"{r['overhead_vs_none_pct']:+.1f}% |")
    out += ["", "| method | ratio | tokens | val loss | delta vs none |", "|---|---|---|---|---|"]
    for r in quality_rows:
        out.append(f"| {r['method']} | {r['ratio']:.0f}x | {r['tokens']:,} | {r['val_loss']:.4f} | {r['delta_pct']:+.2f}% |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="tiny CPU setting (tests)")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "gpu")
    ap.add_argument("--speed-steps", type=int, default=None)
    ap.add_argument("--quality-steps", type=int, default=None)
    args = ap.parse_args(argv)
    seq, batch = (32, 4) if args.dry else (512, 64)
    speed_steps = args.speed_steps or (3 if args.dry else 20)
    quality_steps = args.quality_steps or (4 if args.dry else 400)
    t0 = time.time()
    env = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "dry": args.dry,
           "seq_len": seq, "batch_size": batch}
    print(json.dumps(env))
    s = speed(args.dry, speed_steps, seq, batch, print)
    q = quality(args.dry, quality_steps, seq, batch, print)
    env["wall_s"] = time.time() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "gpu.json", {"env": env, "speed": s, "quality": q})
    (args.out / "gpu.md").write_text(table(s, q))
    print(table(s, q))
    return 0


if __name__ == "__main__":
    sys.exit(main())
