"""`mapl costmodel`: GPU-hour estimate of a profile's run groups (the code is mapl.planning.costmodel)."""
from __future__ import annotations

from pathlib import Path

from ..base.cli import run_cli
from ..base.settings import check_quantity
from ..base.io import atomic_write_text, check_writable
from . import add_profile, command_parser

__all__ = ["main", "PROG"]

PROG = "mapl costmodel"


def main(argv=None) -> int:
    return run_cli(_main, argv, prog=PROG)


def _main(argv: list[str]) -> int:
    from ..planning.costmodel import DEFAULT_MFU, GPUSpec, format_gpu_hours, gpu_hours
    ap = command_parser("costmodel", "Estimate the GPU-hours of a profile's run groups.", """
        mapl costmodel                                  # the paper profile on H100s
        mapl costmodel --groups main --mfu 0.25
        mapl costmodel --out reports/tables/gpu-hours.md""")
    add_profile(ap, "paper")
    ap.add_argument("--groups", help="comma-separated run groups (default: all)")
    ap.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="fraction of the bf16 peak while computing")
    ap.add_argument("--peak-tflops", type=float, default=989.0, metavar="T",
                    help="dense bf16 peak (H100/H200 SXM: 989)")
    ap.add_argument("--out", type=Path, help="also write the text here")
    a = ap.parse_args(argv)
    # a zero MFU or peak divided by zero deep in the clock (a traceback); a negative one gave negative hours
    check_quantity("mfu", a.mfu, "--mfu")
    check_quantity("peak_tflops", a.peak_tflops, "--peak-tflops")
    if a.out:
        check_writable(a.out)                   # before the estimate, not after it
    gpu = GPUSpec(f"NVIDIA H100/H200 SXM, dense bf16 {a.peak_tflops:g} TFLOP/s", a.peak_tflops * 1e12, a.mfu)
    text = format_gpu_hours(gpu_hours(a.profile, gpu, a.groups.split(",") if a.groups else None))
    print(text)
    if a.out:
        atomic_write_text(a.out, text)
    return 0
