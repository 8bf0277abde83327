"""The shape of the short multi-process runs the link benchmarks time (slow_link.py, kernel_link.py): flags and
overrides, and the model's prediction of such a run from its own measurement.

One place for them, so the two benchmarks time the same kind of run: P = 4 stages of two blocks each, a width
of d, M micro-batches, a few steps (the first not timed), no evaluation or checkpoint in between.
"""
from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_case(profile: str, over: dict, timing: dict):
    """The cost model's Case of a measured run: its config's declared bytes, the run's own compute (``timing``)."""
    from mapl.core.config import load_run_config
    from mapl.planning.costmodel import build_case, measured_compute
    cfg = load_run_config(profile, over)
    return build_case(cfg, measured_compute(timing, "this run"), vocab_size=cfg.data.vocab_size)


def host_work(pipe: dict) -> list[float]:
    """Per stage, the seconds of a step outside every timer: the step's wall time less the stage's compute, its
    step-end compute and its waits (a run's ``pipeline`` block). On this CPU that is per-message host work
    (packing, posting, unpacking), serial with the stage's compute; the model's compute does not hold it."""
    return [pipe["step_wall_s"] - c - o - w for c, o, w in zip(pipe["stage_compute_s_per_step"],
                                                                 pipe["stage_opt_s_per_step"],
                                                                 pipe["stage_wait_s_per_step"])]


def with_host_work(timing: dict, host: list[float]) -> dict:
    """``timing`` with each stage's ``host`` seconds spread evenly over its forwards and backwards (2M ops)."""
    out = dict(timing)
    for key in ("fwd_s", "bwd_s"):
        out[key] = [[t + h / (2 * len(ops)) for t in ops] for ops, h in zip(timing[key], host)]
    return out


def host_columns(row: dict) -> str:
    """A table's "with host work (s) | error" cells (dashes for a row measured before host work was kept)."""
    if "predicted_with_host_s" not in row:
        return "– | –"
    return f"{row['predicted_with_host_s']:.3f} | {100 * row['error_with_host']:+.1f}%"


def one_step_columns(row: dict) -> str:
    """A table's "one step (s) | error" cells (dashes for a row measured before they were kept)."""
    if "predicted_one_step_s" not in row:
        return "– | –"
    return f"{row['predicted_one_step_s']:.3f} | {100 * row['error_one_step']:+.1f}%"


def add_shape_arguments(ap: argparse.ArgumentParser, *, micro_batches: int, micro_batch_size: int, seq_len: int,
                        out: str) -> None:
    """The run-shape flags, and ``--out-json``/``--out-md`` to ``reports/bench/<out>.json`` and
    ``reports/tables/<out>.md``."""
    ap.add_argument("--profile", default="cpu", help="data and settings not overridden (default %(default)s)")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=micro_batches)
    ap.add_argument("--micro-batch-size", type=int, default=micro_batch_size)
    ap.add_argument("--seq-len", type=int, default=seq_len)
    ap.add_argument("--steps", type=int, default=4, help="steps per run; the first is not timed")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out-json", type=Path, default=ROOT / "reports" / "bench" / f"{out}.json")
    ap.add_argument("--out-md", type=Path, default=ROOT / "reports" / "tables" / f"{out}.md")


def shape_overrides(a: argparse.Namespace, method: str, schedule: str, stages: int = 4, ratio: float = 8) -> dict:
    """``--set`` overrides of one run: two blocks per stage, the flags' shape, ``ratio`` for a compressed
    method (MAPL+VQ: the same projection, then codes)."""
    over = {"method": method, "stages": stages, "model.d_model": a.width, "model.ffn_hidden": 3 * a.width,
            "model.n_layers": 2 * stages, "train.batch_size": a.micro_batches * a.micro_batch_size,
            "train.micro_batches": a.micro_batches, "train.seq_len": a.seq_len, "train.steps": a.steps,
            "train.schedule": schedule, "train.eval_every": 10 ** 6, "train.eval_tokens": 2 * a.seq_len,
            "train.eval_batch_size": 2, "train.checkpoint_every": 10 ** 6, "train.threads": 1}
    if method != "none":
        over["ratio"] = ratio
    return over


def set_flags(over: dict) -> list[str]:
    return sum((["--set", f"{k}={v}"] for k, v in over.items()), [])


def write_report(a: argparse.Namespace, bench: dict, text: str) -> None:
    """The measurement to ``--out-json`` and its table to ``--out-md`` (each written whole, atomically), and
    the table to stdout."""
    from mapl.base.io import atomic_write_json, atomic_write_text
    atomic_write_json(a.out_json, bench)
    atomic_write_text(a.out_md, text)
    print(text)
