"""The Markdown summary (and loss-curve figure) of benchmarks/gpu.py, built from its JSON lines alone.

    python benchmarks/gpu.py --summarize reports/gpu/gpu.jsonl     # rebuild gpu.md (+ gpu-loss.png)

A run cut off by the device's time limit has no ``done`` record and maybe a half-written last line;
the summary says so and shows everything measured before the cut.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_records", "summarize", "plot_curves", "write_summary"]

GIB = 2 ** 30


def read_records(path: Path) -> list[dict]:
    """Every complete JSON line of ``path`` (a torn last line, from a killed run, is dropped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _ms(x) -> str:
    return "n/a" if x is None else f"{1e3 * x:,.1f}"


def _gib(x) -> str:
    return "n/a" if x is None else f"{x / GIB:.1f}"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _header(recs: list[dict]) -> list[str]:
    env = next((r for r in recs if r["kind"] == "env"), {})
    done = next((r for r in recs if r["kind"] == "done"), None)
    state = (f"complete in {done['wall_s']:.0f} s" if done else
             "**cut off** (no end record: this summary is rebuilt from the JSON lines written before the cut)")
    lines = ["# GPU measurements (`benchmarks/gpu.py`)", "",
             f"Device: {env.get('device', '?')}, torch {env.get('torch', '?')}, CUDA {env.get('cuda_version')}; "
             f"budget {env.get('budget_s', 0):.0f} s; run {state}."]
    if env.get("dry"):
        lines += ["", "**Dry run on CPU (tiny shapes, bf16 autocast on CPU): the numbers test the code path only; "
                      "nothing here is a GPU measurement.**"]
    ceil = next((r for r in recs if r["kind"] == "ceiling"), None)
    if ceil:
        lines += ["", f"Measured ceilings: bf16 matmul {ceil['n']}^3 at {ceil['matmul_tflops']:.0f} TFLOP/s "
                      f"(datasheet dense bf16 989); device-to-device copy {ceil['copy_gbps']:.0f} GB/s."]
    return lines


def _speed_tables(recs: list[dict]) -> list[str]:
    rows = [r for r in recs if r["kind"] == "speed"]
    if not rows:
        return []
    r0 = rows[0]
    out = ["", f"## Part A: speed ({r0['micro_batch_tokens']:,} tokens per micro-batch, {r0['micro_batches']} "
               f"micro-batches per step, P = {r0['stages']}, {r0['schedule']})", "",
           "One GPU holds every stage, so stages are measured one after another in one process "
           "(`StagedModel.stage_forward` under bf16 autocast plus the compressor's `pack`/`unpack`, each bracketed "
           "by `torch.cuda.synchronize`; medians over the timed passes after an untimed warm-up that includes RVQ's "
           "k-means init). Step times on a link come from the virtual clock of `mapl/core/link.py` fed with these "
           "per-stage times and the real message bytes (80/200 Mb/s: 50 ms latency, 1 Gb/s: 10 ms). "
           "MFU: PaLM-convention model FLOPs (attention included) over 989 TFLOP/s; `one GPU` = all stages' "
           "compute back to back; per link = P GPUs over the simulated step.", "",
           "| model | method | r | compute / micro-batch (ms) | wire ops (ms) | optimizer / step (ms) | MFU one GPU "
           "| step compute-only (s) | step 1 Gb/s (s) | step 200 Mb/s (s) | step 80 Mb/s (s) | tokens/s at 80 Mb/s "
           "| fwd bytes/token | peak 1F1B est. (GiB, max stage) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lk = r["links"]
        est = r["memory"]["peak_1f1b_est_bytes"]
        out.append(f"| {r['model']} | {r['method']} | {r['rank']} | {_ms(r['compute_s_per_microbatch'])} | "
                   f"{_ms(r['wire_ops_s_per_microbatch'])} | {_ms(r['opt_s_per_step'])} | {_pct(r['mfu_compute'])} | "
                   f"{r['step_compute_only_s']:.2f} | {lk['1Gbps']['step_s']:.2f} | {lk['200Mbps']['step_s']:.2f} | "
                   f"{lk['80Mbps']['step_s']:.2f} | {lk['80Mbps']['tokens_per_s']:,.0f} | "
                   f"{max(r['fwd_bytes_per_token']):,.0f} | {_gib(max(est) if est else None)} |")
    out += ["", "Per stage (ms per micro-batch; F = unpack + forward + pack, B = unpack_grad + backward + pack_grad; "
                "GiB; `retained` = what one micro-batch's forward keeps for its backward, `static` = parameters, "
                "gradients, optimizer state and compressor copies):", "",
            "| model | method | stage | F | B | optimizer | retained | fwd peak | bwd peak | static | 1F1B peak est. |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tm, mem = r["timing"], r["memory"]
        for s in range(r["stages"]):
            est = mem["peak_1f1b_est_bytes"]
            out.append(f"| {r['model']} | {r['method']} | {s} | {_ms(tm['fwd_s'][s])} | {_ms(tm['bwd_s'][s])} | "
                       f"{_ms(tm['opt_s'][s])} | {_gib(mem['retained_bytes'][s])} | {_gib(mem['fwd_peak_bytes'][s])} | "
                       f"{_gib(mem['bwd_peak_bytes'][s])} | {_gib(mem['static_bytes'][s])} | "
                       f"{_gib(est[s] if est else None)} |")
    return out


def _quality_tables(recs: list[dict]) -> list[str]:
    plan = next((r for r in recs if r["kind"] == "quality_plan"), None)
    curve = [r for r in recs if r["kind"] == "curve"]
    if not plan and not curve:
        return []
    out = ["", "## Part B: quality at the paper's width (token-matched, no repeated window)", ""]
    if plan:
        out.append(f"{plan['model']}, {plan['steps']} steps x {plan['tokens_per_step']:,} tokens = {plan['tokens']:,} "
                   f"tokens per method ({100 * plan['corpus_fraction']:.0f}% of the corpus's "
                   f"{plan['corpus_train_tokens']:,} train tokens; each window read at most once); limited by "
                   f"{plan['limited_by']}; warm-up {plan['warmup_steps']} steps then linear decay to 10%; validation "
                   f"on {plan['eval_tokens']:,} held-out tokens every {plan['eval_every']} steps.")
    trunc = next((r for r in recs if r["kind"] == "quality_truncated"), None)
    if trunc:
        out.append(f"Stopped early at step {trunc['steps']} of {trunc['planned_steps']}: {trunc['reason']}.")
    vals = [r for r in curve if r.get("val_loss")]
    trains = [r for r in curve if r.get("train_loss")]
    final = vals[-1]["val_loss"] if vals else {}
    ref = final.get("none")
    rows = {r["method"]: r for r in recs if r["kind"] == "quality"}
    methods = list(final) or list(trains[-1]["train_loss"] if trains else {})
    out += ["", "| method | r | steps | tokens | final val loss | vs none | last train loss | train tokens/s (1 GPU) |",
            "|---|---|---|---|---|---|---|---|"]
    for m in methods:
        q = rows.get(m, {})
        v = final.get(m)
        delta = f"{100 * (v - ref) / ref:+.2f}%" if (v is not None and ref) else "n/a"
        last = trains[-1]["train_loss"].get(m) if trains else None
        out.append(f"| {m} | {q.get('rank', '')} | {q.get('steps', trains[-1]['step'] if trains else '')} | "
                   f"{q.get('tokens', trains[-1]['tokens'] if trains else 0):,} | {v if v is None else f'{v:.4f}'} | "
                   f"{delta} | {last if last is None else f'{last:.4f}'} | {q.get('tokens_per_s', 0):,.0f} |")
    if vals:
        out += ["", "Validation loss curve:", "", "| step | tokens | " + " | ".join(methods) + " |",
                "|---|---|" + "---|" * len(methods)]
        for r in vals:
            out.append(f"| {r['step']} | {r['tokens']:,} | " +
                       " | ".join(f"{r['val_loss'].get(m, float('nan')):.4f}" for m in methods) + " |")
    return out


def _notes(recs: list[dict]) -> list[str]:
    bad = [r for r in recs if r["kind"] in ("skipped", "error")]
    if not bad:
        return []
    out = ["", "## Skipped or failed items", ""]
    for r in bad:
        out.append(f"- `{r.get('item')}`: {r['kind']}: {r.get('reason') or r.get('error')}")
    return out


def summarize(recs: list[dict]) -> str:
    return "\n".join(_header(recs) + _speed_tables(recs) + _quality_tables(recs) + _notes(recs)) + "\n"


def plot_curves(recs: list[dict], path: Path) -> bool:
    """Train (thin) and validation (markers) loss against tokens; False when there is nothing to plot
    or no matplotlib."""
    curve = [r for r in recs if r["kind"] == "curve"]
    if not curve:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    methods = list(curve[0].get("train_loss") or curve[0].get("val_loss") or {})
    for i, m in enumerate(methods):
        tr = [(r["tokens"] / 1e6, r["train_loss"][m]) for r in curve if r.get("train_loss")]
        va = [(r["tokens"] / 1e6, r["val_loss"][m]) for r in curve if r.get("val_loss")]
        color = f"C{i}"
        if tr:
            ax.plot(*zip(*tr), color=color, alpha=0.35, lw=0.8)
        if va:
            ax.plot(*zip(*va), "o-", color=color, label=f"{m} (val)")
    ax.set_xlabel("tokens (millions)")
    ax.set_ylabel("loss (nats)")
    ax.set_title("Part B: token-matched loss (thin: train, markers: validation)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_summary(jsonl: Path) -> Path:
    """gpu.md (and gpu-loss.png) next to ``jsonl``; returns the Markdown path."""
    recs = read_records(jsonl)
    md = Path(jsonl).with_suffix(".md")
    tmp = md.with_suffix(".md.tmp")
    tmp.write_text(summarize(recs), encoding="utf-8")
    tmp.replace(md)
    plot_curves(recs, Path(jsonl).with_name(Path(jsonl).stem + "-loss.png"))
    return md
