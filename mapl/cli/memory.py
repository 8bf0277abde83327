"""`mapl memory`: the memory plan per pipeline stage (mapl.core.memory)."""
from __future__ import annotations


from ..base.cli import run_cli
from ..base.settings import check_quantity
from ..core.config import SCHEDULES, load_run_config
from . import add_profile, command_parser

__all__ = ["main", "PROG"]

PROG = "mapl memory"


def main(argv=None) -> int:
    return run_cli(_main, argv, prog=PROG)


def _main(argv: list[str]) -> int:
    ap = command_parser("memory", "Print the memory plan per pipeline stage; refuse one that exceeds --device-gib.", """
        mapl memory --model 1B --stages 4 --schedule 1f1b --device-gib 139.8
        mapl memory --profile cpu --device cpu""")
    add_profile(ap, "paper")
    ap.add_argument("--model", help="model preset")
    ap.add_argument("--method", help="boundary compressor")
    ap.add_argument("--ratio", type=float, help="compression ratio d/r")
    ap.add_argument("--stages", type=int, help="pipeline stages P")
    ap.add_argument("--schedule", choices=list(SCHEDULES), help="pipeline schedule")
    ap.add_argument("--micro-batches", type=int, metavar="M", help="micro-batches per step")
    ap.add_argument("--seq-len", type=int, metavar="T", help="tokens per sequence")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="what precision 'auto' resolves to")
    ap.add_argument("--checkpointing", action="store_true",
                    help="activation checkpointing (default: the profile's)")
    ap.add_argument("--device-gib", type=float, metavar="GIB", help="refuse a stage that exceeds this")
    a = ap.parse_args(argv)
    over = {"model": a.model, "method": a.method, "ratio": a.ratio, "stages": a.stages,
            "train.schedule": a.schedule, "train.micro_batches": a.micro_batches, "train.seq_len": a.seq_len}
    if a.device_gib is not None:
        check_quantity("device_gib", a.device_gib, "--device-gib")
    cfg = load_run_config(a.profile, over)
    from ..core.memory import GiB, check_plan, format_plan, memory_plan    # torch: the stages are built on meta
    device_bytes = a.device_gib * GiB if a.device_gib else None
    plan = memory_plan(cfg, device=a.device, checkpointing=True if a.checkpointing else None, device_bytes=device_bytes)
    print(format_plan(plan))
    if device_bytes:
        check_plan(plan, device_bytes)
    return 0
