"""Link emulator: per-boundary bandwidth/latency profiles and a deterministic virtual clock.

A pipeline step is a fixed sequence of compute operations per stage (the schedule: GPipe or 1F1B,
``mapl.core.schedule.schedule_ops``) joined by messages between neighbouring stages. Given the compute time of every
operation (measured once by ``mapl pipeline``) and the bytes of every message (metered), the virtual
clock replays the step on any link and returns its duration, with no wall clock and no randomness.

An operation starts when its stage is free and its input has arrived. Each boundary has a FIFO channel per
direction: start = max(ready, channel free), free = start + bytes * 8 / bandwidth, arrival = free + latency;
sending never blocks. After the last backward: receiver-side gradients back, one all-reduce (2 x the summed
latencies), the optimizer steps, the learned state forward. Steps replay back to back (``STEADY_STEPS``), so the
state still on the wire overlaps the next step's first forward, as on the runtime; the step time is stage 0's
mean period. ``floor``: the busiest channel's bytes per step / bandwidth. Seconds, bytes, bits per second.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

from .schedule import schedule_ops

__all__ = ["LinkProfile", "PROFILES", "IDEAL", "get_profile", "schedule_ops", "StepMeasurement", "SimResult",
           "STEADY_STEPS", "simulate", "step_time", "floor_time", "estimate", "steps_to_target", "time_to_target"]

# ---- link profiles ----------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkProfile:
    """One direction-symmetric, full-duplex link: ``bandwidth_bps`` bits/s each way, one-way ``latency_s``."""
    name: str
    bandwidth_bps: float
    latency_s: float = 0.0

    def __post_init__(self):
        if not self.bandwidth_bps > 0:
            raise ValueError(f"link {self.name!r}: bandwidth_bps={self.bandwidth_bps!r} is invalid: must be > 0")
        if not self.latency_s >= 0:
            raise ValueError(f"link {self.name!r}: latency_s={self.latency_s!r} is invalid: must be >= 0")

    def transfer_s(self, nbytes: float) -> float:
        return 0.0 if math.isinf(self.bandwidth_bps) else nbytes * 8.0 / self.bandwidth_bps

    def message_s(self, nbytes: float) -> float:
        return self.transfer_s(nbytes) + self.latency_s


# Slow links are internet paths between sites (50 ms one way); 1 Gb/s metro, 10 Gb/s in a campus.
PROFILES: dict[str, LinkProfile] = {
    "80Mbps": LinkProfile("80Mbps", 80e6, 0.050),
    "200Mbps": LinkProfile("200Mbps", 200e6, 0.050),
    "1Gbps": LinkProfile("1Gbps", 1e9, 0.010),
    "10Gbps": LinkProfile("10Gbps", 10e9, 0.001),
}
IDEAL = LinkProfile("ideal", math.inf, 0.0)       # no communication cost: the compute-only makespan

_UNITS = {"bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}
_SPEC = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?bps)\s*(?:@\s*([0-9]*\.?[0-9]+)\s*(ms|s|us))?\s*$",
                   re.IGNORECASE)


def get_profile(spec: "str | LinkProfile", latency_ms: float | None = None) -> LinkProfile:
    """A profile by name, ``"ideal"``, or parsed like ``"500Mbps@20ms"``; ``latency_ms`` overrides the latency."""
    if isinstance(spec, LinkProfile):
        prof = spec
    elif spec in PROFILES:
        prof = PROFILES[spec]
    elif str(spec).lower() == "ideal":
        prof = IDEAL
    else:
        m = _SPEC.match(str(spec))
        if not m:
            raise ValueError(f"link profile {spec!r} is invalid: allowed {sorted(PROFILES)}, 'ideal', or "
                             f"'<rate><bps|Kbps|Mbps|Gbps>[@<latency><ms|s|us>]' e.g. '500Mbps@20ms'")
        rate, unit, lat, lat_unit = m.groups()
        bw = float(rate) * _UNITS[unit.lower()]
        base = PROFILES.get(f"{rate}{unit}")
        latency = base.latency_s if base else 0.0
        if lat is not None:
            latency = float(lat) * {"ms": 1e-3, "s": 1.0, "us": 1e-6}[lat_unit.lower()]
        prof = LinkProfile(str(spec).strip(), bw, latency)
    if latency_ms is not None:
        prof = LinkProfile(prof.name, prof.bandwidth_bps, latency_ms / 1000.0)
    return prof


def _links(links, n_boundaries: int) -> list[LinkProfile]:
    if isinstance(links, (LinkProfile, str)):
        return [get_profile(links)] * n_boundaries
    links = [get_profile(x) for x in links]
    if len(links) != n_boundaries:
        raise ValueError(f"got {len(links)} link profiles for {n_boundaries} boundaries; give one per boundary")
    return links


# ---- measurements -----------------------------------------------------------------------------
@dataclass
class StepMeasurement:
    """One step's compute per stage and micro-batch and bytes per message: ``fwd_bytes[p]``/``bwd_bytes[p]`` one
    micro-batch's message over boundary p, ``state_fwd_bytes``/``state_bwd_bytes`` the learned state after the
    optimizer step and the receiver-side gradients before it, ``opt_s[s]`` stage s's step end."""
    schedule: str
    fwd_s: list[list[float]]
    bwd_s: list[list[float]]
    fwd_bytes: list[float]
    bwd_bytes: list[float]
    opt_s: list[float] = field(default_factory=list)
    state_fwd_bytes: list[float] = field(default_factory=list)
    state_bwd_bytes: list[float] = field(default_factory=list)
    collective: bool = True

    def __post_init__(self):
        P = len(self.fwd_s)
        if P < 1 or len(self.bwd_s) != P:
            raise ValueError("fwd_s and bwd_s need one row per stage")
        M = len(self.fwd_s[0])
        if M < 1 or any(len(r) != M for r in (*self.fwd_s, *self.bwd_s)):
            raise ValueError("fwd_s and bwd_s need one entry per micro-batch on every stage")
        self.opt_s = list(self.opt_s) or [0.0] * P
        self.state_fwd_bytes = list(self.state_fwd_bytes) or [0.0] * (P - 1)
        self.state_bwd_bytes = list(self.state_bwd_bytes) or [0.0] * (P - 1)
        for name, v, n in (("fwd_bytes", self.fwd_bytes, P - 1), ("bwd_bytes", self.bwd_bytes, P - 1),
                           ("state_fwd_bytes", self.state_fwd_bytes, P - 1),
                           ("state_bwd_bytes", self.state_bwd_bytes, P - 1), ("opt_s", self.opt_s, P)):
            if len(v) != n:
                raise ValueError(f"{name} has {len(v)} entries; need {n}")

    @property
    def n_stages(self) -> int:
        return len(self.fwd_s)

    @property
    def n_micro(self) -> int:
        return len(self.fwd_s[0])

    @classmethod
    def uniform(cls, schedule: str, stages: int, micro: int, fwd_s: float, bwd_s: float,
                fwd_bytes: Sequence[float], bwd_bytes: Sequence[float], **kw) -> "StepMeasurement":
        return cls(schedule, [[fwd_s] * micro for _ in range(stages)], [[bwd_s] * micro for _ in range(stages)],
                   list(fwd_bytes), list(bwd_bytes), **kw)

    @classmethod
    def from_results(cls, results: dict) -> "StepMeasurement":
        """From a ``mapl pipeline`` results dict."""
        tm = results["pipeline"]["timing"]
        return cls(results["pipeline"]["schedule"], tm["fwd_s"], tm["bwd_s"], tm["fwd_bytes"],
                   tm["bwd_bytes"], tm["opt_s"], tm["state_fwd_bytes"], tm["state_bwd_bytes"], tm.get("collective", True))

    def to_dict(self) -> dict:
        return asdict(self)


# ---- the virtual clock ------------------------------------------------------------------------
@dataclass
class SimResult:
    step_time: float                      # steady state: stage 0's period over back-to-back steps
    floor: float
    events: list[tuple[int, str, int, float, float]]          # (stage, "F"/"B", micro-batch, start, end): first step
    messages: list[tuple[int, str, int, float, float]]        # (boundary, "fwd"/"bwd"/"state_*", mb, sent, arrival)
    first_step_time: float                # one step from an idle pipeline: the last stage's end


# Steps replayed back to back: a max-plus system settles within a few, and the mean over five periods also
# averages a two-step cycle.
STEADY_STEPS = 6


class _Channel:
    def __init__(self, link: LinkProfile):
        self.link, self.free = link, 0.0

    def send(self, t: float, nbytes: float) -> float:
        start = max(t, self.free)
        self.free = start + self.link.transfer_s(nbytes)
        return self.free + self.link.latency_s


def simulate(meas: StepMeasurement, links, steps: int | None = None) -> SimResult:
    """Replay ``meas`` on ``links`` (one profile, or one per boundary) for ``steps`` back-to-back steps: each stage
    starts step k + 1 once its step k is over (its optimizer step run, its sender's state received).
    ``step_time`` is stage 0's mean period, ``first_step_time`` the first step's makespan."""
    P = meas.n_stages
    links = _links(links, P - 1)
    steps = STEADY_STEPS if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    fwd_ch = [_Channel(lk) for lk in links]
    bwd_ch = [_Channel(lk) for lk in links]
    free = [0.0] * P
    stage0_ends, first = [], None
    for _ in range(steps):
        replay = _replay_step(meas, links, fwd_ch, bwd_ch, free)
        first = first or replay
        free = replay.fin
        stage0_ends.append(replay.fin[0])
    first_step = max(first.fin)
    period = first_step if steps == 1 else (stage0_ends[-1] - stage0_ends[0]) / (steps - 1)
    return SimResult(step_time=period, floor=floor_time(meas, links), events=first.events, messages=first.messages,
                     first_step_time=first_step)


@dataclass
class _Replay:
    fin: list[float]                      # per stage: its step over (free for the next one)
    events: list
    messages: list


def _replay_step(meas: StepMeasurement, links, fwd_ch, bwd_ch, start: list[float]) -> _Replay:
    P, M = meas.n_stages, meas.n_micro
    ops = [schedule_ops(meas.schedule, P, M, s) for s in range(P)]
    pos, free = [0] * P, list(start)
    arr_f = [[None] * M for _ in range(P)]       # arr_f[s][m]: forward input of stage s arrived
    arr_b = [[None] * M for _ in range(P)]       # arr_b[s][m]: gradient for stage s's output arrived
    done_f = [[None] * M for _ in range(P)]
    events, messages = [], []
    remaining = sum(len(o) for o in ops)
    while remaining:
        progressed = False
        for s in range(P):
            while pos[s] < len(ops[s]):
                kind, m = ops[s][pos[s]]
                if kind == "F":
                    dep = start[s] if s == 0 else arr_f[s][m]
                else:
                    dep = done_f[s][m] if s == P - 1 else arr_b[s][m]
                if dep is None:
                    break
                begin = max(free[s], dep)
                end = begin + (meas.fwd_s[s][m] if kind == "F" else meas.bwd_s[s][m])
                free[s] = end
                events.append((s, kind, m, begin, end))
                if kind == "F":
                    done_f[s][m] = end
                    if s < P - 1:
                        arr_f[s + 1][m] = fwd_ch[s].send(end, meas.fwd_bytes[s])
                        messages.append((s, "fwd", m, end, arr_f[s + 1][m]))
                elif s > 0:
                    arr_b[s - 1][m] = bwd_ch[s - 1].send(end, meas.bwd_bytes[s - 1])
                    messages.append((s - 1, "bwd", m, end, arr_b[s - 1][m]))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {meas.schedule!r} deadlocks in the virtual clock (a bug)")
    compute_end = list(free)
    # step end: receiver-side gradients back, one all-reduce, optimizer steps, state forward
    ready = list(compute_end)
    for p in range(P - 1):
        if meas.state_bwd_bytes[p]:
            a = bwd_ch[p].send(compute_end[p + 1], meas.state_bwd_bytes[p])
            messages.append((p, "state_bwd", -1, compute_end[p + 1], a))
            ready[p] = max(ready[p], a)
    t_sync = max(ready)
    if meas.collective and P > 1:
        t_sync += 2.0 * sum(lk.latency_s for lk in links)
    done = [t_sync + meas.opt_s[s] for s in range(P)]
    fin = list(done)
    for p in range(P - 1):
        if meas.state_fwd_bytes[p]:
            a = fwd_ch[p].send(done[p], meas.state_fwd_bytes[p])
            messages.append((p, "state_fwd", -1, done[p], a))
            fin[p + 1] = max(fin[p + 1], a)
    return _Replay(fin, events, messages)


def step_time(meas: StepMeasurement, links) -> float:
    return simulate(meas, links).step_time


def floor_time(meas: StepMeasurement, links) -> float:
    """The busiest channel's bytes per step / its bandwidth."""
    links = _links(links, meas.n_stages - 1)
    M = meas.n_micro
    worst = 0.0
    for p, lk in enumerate(links):
        worst = max(worst, lk.transfer_s(M * meas.fwd_bytes[p] + meas.state_fwd_bytes[p]),
                    lk.transfer_s(M * meas.bwd_bytes[p] + meas.state_bwd_bytes[p]))
    return worst


def estimate(meas: StepMeasurement, profiles: Iterable = tuple(PROFILES)) -> dict:
    """Step time, floor and compute-only makespan per profile."""
    compute = step_time(meas, IDEAL)
    out = {}
    for spec in profiles:
        prof = get_profile(spec)
        sim = simulate(meas, prof)
        out[prof.name] = {"step_s": sim.step_time, "floor_s": sim.floor, "compute_s": compute,
                          "bandwidth_bps": prof.bandwidth_bps, "latency_s": prof.latency_s}
    return out


# ---- time to target ---------------------------------------------------------------------------
def steps_to_target(val_curve: Sequence[Sequence[float]], target: float) -> float | None:
    """The first step the validation loss reaches ``target``, interpolated between evaluations; None if never."""
    prev = None
    for step, loss in val_curve:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(step)
            (s0, l0) = prev
            return float(s0 + (step - s0) * (l0 - target) / (l0 - loss))
        prev = (step, loss)
    return None


def time_to_target(val_curve, target: float, step_s: float) -> float | None:
    """Seconds to reach ``target`` (None if never)."""
    n = steps_to_target(val_curve, target)
    return None if n is None else n * step_s
