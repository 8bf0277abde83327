"""What a multi-process run measured (per-operation compute, bytes per message, step wall time), as the link
clock's ``StepMeasurement`` and the results' ``pipeline`` section. On a GPU spans are CUDA events read once
complete, so timing adds no device sync; peak memory is ``max_memory_allocated`` there, the peak RSS on a CPU."""
from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from ..link import PROFILES, StepMeasurement, estimate, step_time
from ..wire import ByteMeter

__all__ = ["OpTimer", "SpanClock", "merge_meters", "step_measurement", "pipeline_section", "peak_memory"]


def peak_memory(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    try:            # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork+exec from the parent
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None, "unavailable"
    found = re.search(r"VmHWM:\s+(\d+)\s+kB", status)
    return (1024 * int(found.group(1)), "process_peak_rss") if found else (None, "unavailable")


def _mark(cuda: bool):
    """Now: a CUDA event on the current stream, or the host clock."""
    if cuda:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


class OpTimer:
    """Accumulates seconds per (kind, micro-batch) of one step."""

    def __init__(self, device: torch.device, n_micro: int):
        self.cuda = device.type == "cuda"
        self.M = n_micro
        self.reset()

    def reset(self) -> None:
        self.events: list = []
        self.seconds = {"F": [0.0] * self.M, "B": [0.0] * self.M}

    def start(self):
        return _mark(self.cuda)

    def stop(self, kind: str, m: int, started) -> None:
        if self.cuda:
            self.events.append((kind, m, started, _mark(True)))
        else:
            self.seconds[kind][m] += time.perf_counter() - started

    def read(self) -> tuple[list[float], list[float]]:
        """(forward, backward) seconds per micro-batch; after the step's host sync."""
        for kind, m, a, b in self.events:
            b.synchronize()
            self.seconds[kind][m] += a.elapsed_time(b) / 1000.0
        out = (self.seconds["F"], self.seconds["B"])
        self.reset()
        return out


class SpanClock:
    """Seconds per training step of named spans (``wait``: blocked on communication; ``opt``: the step's end),
    measured where the work runs: on a GPU two CUDA events (an NCCL wait reads ~0 on the host clock)."""

    def __init__(self, device: torch.device, kinds: tuple[str, ...] = ("wait", "opt")):
        self.cuda = device.type == "cuda"
        self.per_step: dict[str, list[float]] = {k: [] for k in kinds}
        self._pending: list = []         # (kind, step index, start event, end event)
        self._open = False

    def begin_step(self) -> None:
        for seconds in self.per_step.values():
            seconds.append(0.0)
        self._open = True

    def end_step(self) -> None:
        self._open = False
        self.collect()

    def start(self):
        return _mark(self.cuda) if self._open else None

    def stop(self, kind: str, started) -> None:
        if started is None:
            return
        if self.cuda:
            self._pending.append((kind, len(self.per_step[kind]) - 1, started, _mark(True)))
        else:
            self.per_step[kind][-1] += time.perf_counter() - started

    def collect(self, block: bool = False) -> dict[str, list[float]]:
        """Add the spans whose end event fired (all, waiting, with ``block``); per_step."""
        left = []
        for kind, i, a, b in self._pending:
            if block:
                b.synchronize()
            elif not b.query():
                left.append((kind, i, a, b))
                continue
            self.per_step[kind][i] += a.elapsed_time(b) / 1000.0
        self._pending = left
        return self.per_step


def merge_meters(states: list[dict]) -> ByteMeter:
    merged = ByteMeter()
    for st in states:
        for b, d, k, v in st["bytes"]:
            merged.add(b, d, k, v)
        for b, d, v in st["tokens"]:
            merged.tokens[(b, d)] += v
    return merged


def _mean(xs):
    xs = xs[1:] if len(xs) > 1 else xs          # the first step warms up: dropped when there are others
    return sum(xs) / len(xs) if xs else None


def _mean_rows(rows, M):
    rows = rows[1:] if len(rows) > 1 else rows
    return [sum(r[m] for r in rows) / max(1, len(rows)) for m in range(M)] if rows else [0.0] * M


def step_measurement(schedule: str, merged: ByteMeter, timings: list[dict], steps: int, M: int,
                     replicas: int = 1) -> StepMeasurement:
    """``timings``: one per stage (replica 0); ``merged``: every rank's meter (bytes divided by R)."""
    P, per_step = len(timings), max(1, steps) * replicas

    def message(direction, p):               # one micro-batch's message: data, piggybacked sync, ids
        return sum(merged.total(k, direction, p) for k in ("data", "sync", "ids")) / (per_step * M)
    return StepMeasurement(schedule, [_mean_rows(tm["fwd"], M) for tm in timings],
                           [_mean_rows(tm["bwd"], M) for tm in timings],
                           [message("fwd", p) for p in range(P - 1)], [message("bwd", p) for p in range(P - 1)],
                           [_mean(tm["opt"]) or 0.0 for tm in timings],
                           [merged.total("state", "fwd", p) / per_step for p in range(P - 1)],
                           [merged.total("state", "bwd", p) / per_step for p in range(P - 1)], collective=True)


def pipeline_section(*, schedule: str, everyone: list[dict], merged: ByteMeter, boundaries: list[dict], steps: int,
                     M: int, replicas: int, info: dict, link) -> dict:
    P = len(everyone) // replicas
    stage_timings = [r["timing"] for r in everyone[:P]]         # replica 0's stages
    meas = step_measurement(schedule, merged, stage_timings, steps, M, replicas)
    per_step = max(1, steps)
    pipe = {
        "schedule": schedule, "processes": len(everyone), "stages": P, "replicas": replicas,
        "backend": info["backend"], "launcher": info["launcher"], "transport": info["transport"],
        "pids": [r["pid"] for r in everyone], "hosts": [r["host"] for r in everyone],
        "timeout_s": info["timeout_s"], "micro_batches": M,
        "stage_compute_s_per_step": [sum(meas.fwd_s[s]) + sum(meas.bwd_s[s]) for s in range(P)],
        "stage_opt_s_per_step": meas.opt_s,
        "stage_wait_s_per_step": [_mean(tm["wait"]) for tm in stage_timings],
        "stage_peak_memory_bytes": [r["peak_memory"][0] for r in everyone[:P]],
        "peak_memory_kind": everyone[0]["peak_memory"][1],
        "stage_peak_held_sends": [r["held_sends"][0] for r in everyone[:P]],        # sends in flight at once
        "stage_peak_held_send_bytes": [r["held_sends"][1] for r in everyone[:P]],
        "step_wall_s": _mean(stage_timings[0]["wall"]),
        "step_walls_s": list(stage_timings[0]["wall"]),       # every step's, the first (warm-up) included
        "timed_steps": max(0, len(stage_timings[0]["wall"]) - 1) or len(stage_timings[0]["wall"]),
        "bytes_per_step": {b: {d: {k: v / per_step for k, v in kinds.items()} for d, kinds in dirs.items()}
                           for b, dirs in merged.summary().items()},
        "declared_bytes_per_step": {f"boundary{b['boundary']}": b["declared_per_step"] for b in boundaries},
        "timing": meas.to_dict(),
        "link_estimates": estimate(meas, PROFILES),
        "state_checksum_match": info["state_checksum_match"],
    }
    if link is not None:
        pipe["link_delay"] = {"profile": link.name, "bandwidth_bps": link.bandwidth_bps, "latency_s": link.latency_s,
                              "measured_step_s": pipe["step_wall_s"], "model_step_s": step_time(meas, link)}
    return pipe
