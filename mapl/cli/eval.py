"""`mapl eval`: a finished run's downstream accuracy through lm-evaluation-harness (mapl.orchestration.downstream)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..base.cli import add_debug_flag, run_cli
from . import command_parser

__all__ = ["main", "PROG"]

PROG = "mapl eval"


def _limit(text: str) -> float:
    """lm-eval's --limit: a count of items (>= 1) or a fraction of each task (< 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0 (a count of items, or a fraction below 1)")
    return int(value) if value >= 1 else value


def _tasks(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected task names, comma-separated")
    return names


def _main(argv: list[str]) -> int:
    ap = command_parser("eval", "Score a finished run's checkpoint on lm-evaluation-harness tasks, compressors on.", """
        mapl eval checkpoints/cpu/tiny-P4-mapl-8x-s0.pt --tasks mapl_cloze_plays,mapl_cloze_kjv
        mapl eval reports/paper/results/main/1B-P4-mapl-8x-s0.json --tasks hellaswag,piqa --limit 200""")
    ap.add_argument("run", type=Path, help="the run: its checkpoint (.pt), results JSON, or a folder with one checkpoint")
    ap.add_argument("--tasks", type=_tasks, required=True, metavar="LIST",
                    help="comma-separated lm-eval tasks; local: mapl_cloze_plays, mapl_cloze_kjv, mapl_cloze_code")
    ap.add_argument("--limit", type=_limit, metavar="N",
                    help="items per task: a count, or a fraction below 1 (lm-eval's --limit)")
    ap.add_argument("--num-fewshot", type=int, metavar="K",
                    help="examples in each prompt (default: each task's own, 0 for local)")
    ap.add_argument("--out", type=Path, help="results JSON (default: <run>.lm-eval.json beside the run)")
    ap.add_argument("--ckpt", type=Path, help="the checkpoint of a results JSON, if not beside it or in checkpoints/")
    ap.add_argument("--task-data", type=Path, metavar="DIR",
                    help="folder of the local tasks' JSONL, built if absent (data/tasks)")
    ap.add_argument("--batch-size", type=int, metavar="N", help="sequences per forward (default: the run's eval_batch_size)")
    ap.add_argument("--device", help="torch device, e.g. cpu or cuda:0 (default: cuda if available)")
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    if args.num_fewshot is not None and args.num_fewshot < 0:
        ap.error(f"argument --num-fewshot: {args.num_fewshot} must be >= 0")
    if args.batch_size is not None and args.batch_size < 1:
        ap.error(f"argument --batch-size: {args.batch_size} must be >= 1")
    from ..orchestration.downstream import evaluate_run        # lm-eval and torch only after the flags are checked
    evaluate_run(args.run, args.tasks, limit=args.limit, num_fewshot=args.num_fewshot, out=args.out, ckpt=args.ckpt,
                 data_dir=args.task_data, batch_size=args.batch_size, device=args.device)
    return 0


def main(argv=None) -> int:
    return run_cli(_main, argv, prog=PROG)
