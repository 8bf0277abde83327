"""Time to a target loss on a simulated link (mapl.core.link) from measured step times and validation curves."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Sequence

from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter

from .. import paper
from ..figures import empty_note, new_figure
from ..render import DASH, Plot, Table, fmt_int
from ..rows import METHOD_ORDER, at_best_validation, is_reference, main_model
from ..style import NEUTRAL, label, style

__all__ = ["load_bench", "common_target", "on_target_set", "method_curve", "time_to_target_rows", "time_to_target_table",
           "time_to_target_plot"]


def load_bench(path: str | Path, profile: str | None = None) -> list[dict]:
    """The pipeline benchmark's step measurement per method (``[]`` when missing or of another ``profile``)."""
    from ...core.link import StepMeasurement
    path = Path(path)
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if profile and data.get("profile", profile) != profile:
        return []
    return [{"method": e["method"], "wire_ratio": float(f"{float(e['ratio']):.3g}"),
             "measurement": StepMeasurement(**e["timing"])} for e in data["methods"] if "timing" in e]


def common_target(rows: Sequence[dict], target_pct: float = 2.0) -> tuple[float, int, int] | None:
    """(target, budget, seeds) of time to target (docs/report.md; the planner's too); None without a reference."""
    dense = _target_runs(rows)
    if not dense:
        return None
    best = [r["val_loss"] for r in at_best_validation(dense)]
    return statistics.fmean(best) * (1 + target_pct / 100), dense[0]["steps"], len(best)


def _target_runs(rows: Sequence[dict]) -> list[dict]:
    """The main model's uncompressed runs at their longest budget."""
    model = main_model(rows)
    dense = [r for r in rows if r["model"] == model and is_reference(r)]
    longest = max((r["steps"] for r in dense), default=None)
    return [r for r in dense if r["steps"] == longest]


def on_target_set(rows: Sequence[dict]) -> list[dict]:
    """The rows measured on the target's validation tokens (a curve on other tokens is no comparison)."""
    dense = _target_runs(rows)
    if not dense:
        return list(rows)
    sets = {r.get("eval_set") for r in dense}
    return [r for r in rows if r.get("eval_set") in sets]


def method_curve(rows: Sequence[dict], method: str, wire_ratio: float | None) -> tuple[int | None, int, list]:
    """(budget, seeds, mean val curve) of the longest default-configured run of ``method`` at ``wire_ratio``."""
    cands = [r for r in rows if r["method"] == method and r["variant"] == method
             and (method == "none" or r["wire_ratio"] == wire_ratio)]
    if not cands:
        return None, 0, []
    steps = max(r["steps"] for r in cands)
    runs = [dict(r["val_loss_curve"]) for r in cands if r["steps"] == steps and r["val_loss_curve"]]
    common = sorted(set.intersection(*(set(c) for c in runs))) if runs else []
    return steps, len(runs), [(s, statistics.fmean(c[s] for c in runs)) for s in common]


def time_to_target_rows(rows: Sequence[dict], bench: Sequence[dict], bandwidths_bps: Sequence[float],
                        target_pct: float = 2.0, latencies_s: Sequence[float] = (0.0,)) -> list[dict]:
    """One dict per (measured method, latency, bandwidth): ``budget``, ``seeds``, ``target``, ``steps_to_target``,
    ``step_s`` and ``time_s`` (None: never)."""
    from ...core.link import LinkProfile, step_time, steps_to_target
    common = common_target(rows, target_pct)
    if common is None or not bench:
        return []
    target = common[0]
    model = main_model(rows)                 # once: the comprehension would recount the rows for each row
    pool = [r for r in on_target_set(rows) if r["model"] == model]
    out = []
    for b in bench:
        budget, seeds, curve = method_curve(pool, b["method"], b["wire_ratio"])
        n = steps_to_target(curve, target) if curve else None
        for lat in latencies_s:
            for bw in bandwidths_bps:
                st = step_time(b["measurement"], LinkProfile(f"{bw:g}bps", bw, lat))
                out.append({"method": b["method"], "variant": b["method"], "wire_ratio": b["wire_ratio"],
                            "budget": budget, "seeds": seeds, "target": target, "target_pct": target_pct,
                            "steps_to_target": n, "latency_s": lat, "bandwidth_bps": bw, "step_s": st,
                            "time_s": None if n is None else n * st})
    return out


def _never(t: dict) -> str:
    return "no run on the target's validation set" if t["budget"] is None else f"never in {t['budget']:,} steps"


def time_to_target_table(ttt: Sequence[dict]) -> Table:
    """One row per method and latency; one column of seconds per bandwidth."""
    bws = sorted({t["bandwidth_bps"] for t in ttt})
    header = ["method", "latency (ms)", "curve (steps, seeds)", "steps to target",
              *(f"time (s) at {bw / 1e6:g} Mbit/s" for bw in bws)]
    body = []
    for (method, ratio, lat), ts in _by_line(ttt).items():
        t0 = ts[0]
        body.append([label(method, ratio), f"{lat * 1e3:g}",
                     DASH if t0["budget"] is None else f"{t0['budget']:,}, {t0['seeds']}",
                     _never(t0) if t0["steps_to_target"] is None else f"{t0['steps_to_target']:,.0f}",
                     *(DASH if t["budget"] is None else "never" if t["time_s"] is None else f"{t['time_s']:,.1f}"
                       for t in ts)])
    target = ttt[0] if ttt else None
    caption = ("Simulated link (mapl.core.link virtual clock on the pipeline benchmark's measured step times, full duplex, "
               "one-way latency as listed): seconds to reach the target val loss = steps to target × simulated "
               "step time" + (f"; target {target['target']:.4f} = uncompressed best (lowest point of its curve) + "
                              f"{target['target_pct']:g}%."
                              if target else "."))
    return Table("time-to-target", "Time to target on a simulated link", header, body, caption, _takeaway(ttt))


def _by_line(ttt: Sequence[dict]) -> dict[tuple, list[dict]]:
    lines: dict[tuple, list[dict]] = {}
    for t in sorted(ttt, key=lambda t: (METHOD_ORDER.index(t["method"]) if t["method"] in METHOD_ORDER else 99,
                                       t["wire_ratio"] or 0, t["latency_s"], t["bandwidth_bps"])):
        lines.setdefault((t["method"], t["wire_ratio"], t["latency_s"]), []).append(t)
    return lines


def _takeaway(ttt: Sequence[dict]) -> str:
    if not ttt:
        return "no pipeline benchmark of this profile with matching runs: nothing to show."
    parts = []
    for lat in sorted({t["latency_s"] for t in ttt}):
        for bw in (min(t["bandwidth_bps"] for t in ttt), max(t["bandwidth_bps"] for t in ttt)):
            reach = [t for t in ttt if t["latency_s"] == lat and t["bandwidth_bps"] == bw and t["time_s"] is not None]
            if reach:
                best = min(reach, key=lambda t: t["time_s"])
                parts.append(f"{bw / 1e6:g} Mbit/s at {lat * 1e3:g} ms: {label(best['method'], best['wire_ratio'])} "
                             f"({best['time_s']:,.0f} s)")
    never = sorted({label(t["method"], t["wire_ratio"]) for t in ttt
                    if t["steps_to_target"] is None and t["budget"] is not None})
    unrun = sorted({label(t["method"], t["wire_ratio"]) for t in ttt if t["budget"] is None})
    text = "Fastest to the target: " + ("; ".join(parts) or "no method reaches it")
    text += f". Never within their runs: {', '.join(never)}." if never else ". Every method run reaches it."
    if unrun:
        text += f" Not measured (no run on the target's validation set): {', '.join(unrun)}."
    return text + _protocol_sentence(ttt)


def _protocol_sentence(ttt: Sequence[dict]) -> str:
    """Our SSN's steps to target relative to uncompressed, beside the SSN authors' own record."""
    dense = paper.paper_value("protocolnanogpt", "steps_to_loss", method="none")
    ssn_p = paper.paper_value("protocolnanogpt", "steps_to_loss", method="ssn")
    steps = {t["method"]: t for t in ttt}
    if "none" not in steps or "ssn" not in steps or not dense or not ssn_p:
        return ""
    ssn, none = steps["ssn"], steps["none"]
    ours = (f"SSN {ssn['wire_ratio']:g}× needs {ssn['steps_to_target'] / none['steps_to_target']:.2f}× the "
            f"uncompressed steps" if ssn["steps_to_target"] and none["steps_to_target"]
            else f"SSN {ssn['wire_ratio']:g}× does not reach the target within {fmt_int(ssn['budget'])} steps")
    return (f" {ours}; in the SSN authors' ProtocolNanoGPT records SSN at {ssn_p['reported_ratio']:g}× needs "
            f"{ssn_p['value'] / dense['value']:.2f}× the dense steps ({ssn_p['certainty']}).")


def _draw_panel(ax, lines: dict, lat: float) -> None:
    """One latency: a line per method that reaches the target, hollow markers in a grey band for the others."""
    mine = {k: ts for k, ts in lines.items() if k[2] == lat}
    never = [k for k, ts in mine.items() if ts[0]["time_s"] is None]
    band = 1.0 - 0.07 * len(never) - 0.05 if never else 1.0      # axes fraction where the band starts
    top = ax.get_xaxis_transform()                                # x in data, y in axes fraction
    for (method, ratio, _), ts in mine.items():
        kw, name = style(method), label(method, ratio)
        x = [t["bandwidth_bps"] / 1e6 for t in ts]
        if (method, ratio, lat) in never:
            y = 1.0 - 0.07 * (never.index((method, ratio, lat)) + 0.5) - 0.01
            ax.plot(x, [y] * len(x), transform=top, ls="none", ms=6, label=f"{name}: {_never(ts[0])}",
                    **{**kw, "markerfacecolor": "none"})
        else:
            ax.plot(x, [t["time_s"] for t in ts], ms=6, label=name, **kw)
    times = [t["time_s"] for ts in mine.values() for t in ts if t["time_s"]]
    ax.set_xscale("log"), ax.set_yscale("log")
    if times and never:                     # the curves stay below the band; no time labels inside it
        lo, hi = min(times) / 1.3, max(times) * 1.3
        ax.set_ylim(lo, math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) / band))
        ax.add_patch(Rectangle((0, band), 1, 1 - band, transform=ax.transAxes, color=NEUTRAL["shade"], zorder=0, lw=0))
        ax.text(0.01, band + 0.005, "never reach the target", transform=ax.transAxes, fontsize=7,
                color=NEUTRAL["guide"], va="bottom")
    limit = max(times) * 1.3 if times else math.inf
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v <= limit else ""))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v <= limit and f"{v:g}"[0] in "235" else ""))
    ax.set(xlabel="link bandwidth (Mbit/s, log)", ylabel="time to target (s, log)",
           title=f"simulated link, {lat * 1e3:g} ms one-way latency")
    ax.grid(alpha=0.3, which="both")


def time_to_target_plot(ttt: Sequence[dict]) -> Plot:
    """Time to target against bandwidth (log-log), a panel per latency, every measured method."""
    lats = sorted({t["latency_s"] for t in ttt}) or [0.0]
    fig, axes = new_figure(len(lats), 5.2, 4.4)
    lines = _by_line(ttt)
    for ax, lat in zip(axes, lats):
        if ttt:
            _draw_panel(ax, lines, lat)
        else:
            empty_note(ax, "no pipeline benchmark of this profile with matching runs")
    if ttt:
        t0 = ttt[0]
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=8)
        fig.suptitle(f"Time to val loss {t0['target']:.3f} (uncompressed best + {t0['target_pct']:g}%), "
                     f"virtual clock on measured step times")
    caption = ("Simulated, not measured on a real network: the pipeline benchmark's per-operation compute times and "
               "exact message sizes replayed on full-duplex links of each bandwidth and one-way latency "
               "(mapl.core.link), times each method's steps to the target. Hollow markers in the band at the top: "
               "methods whose runs never reach the target.")
    return Plot("time-to-target", caption, _takeaway(ttt), fig, empty=not ttt)
