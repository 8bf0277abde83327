"""Against the peer: our step-time model at ProtocolNanoGPT's conditions (`mapl peer`).

ProtocolNanoGPT (Pluralis) trains a 203.8M-parameter GPT (d = 1024, 8 layers, one layer per H100, 1F1B,
512 x 1024 tokens per step) over emulated 200 Mb/s, 50 ms links; its records give the dense baseline
100.475 s/step and 2925 steps to val 3.276, ReparamSSN (k = 160) 19.889 s/step and 9125 steps: net 1.62x.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..core.config import load_run_config, PROJECT_ROOT
from ..core.link import IDEAL, LinkProfile
from .costmodel import GPUSpec, StageCompute, build_case

__all__ = ["PEER", "peer_comparison", "peer_markdown", "write_report"]


# their records/ READMEs and logs (shared/design/ANCHORS.md)
PEER = {
    "source": "PluralisResearch/ProtocolNanoGPT @0551bc3, records/20260917_vanilla_baseline and "
              "records/20260918_reparamssn_baseline (8xH100, one layer per stage, 1F1B, 512 x 1024 tokens/step)",
    "bandwidth_bps": 200e6, "latency_s": 0.050, "stages": 8, "seq_len": 1024, "batch": 512, "vocab": 50304,
    # method -> micro-batch size, FFN width giving the same matmul FLOPs in our SwiGLU block (theirs: relu^2
    # MLP 4096 dense, 11292 under SSN), published s/step with the WAN on and off (loss-run step_avg), steps
    "runs": {"none": {"mbs": 8, "ffn": 2731, "step_s": 100.475, "wan_off_s": 0.5390, "steps": 2925},
             "ssn": {"mbs": 16, "ffn": 6055, "ratio": 6.4, "step_s": 19.889, "wan_off_s": 0.6555, "steps": 9125}},
    "speedup": 1.62,
}


def _peer_config(method: str, spec: dict):
    over = {"method": method, "stages": PEER["stages"], "model.d_model": 1024, "model.n_layers": 8, "model.n_heads": 8,
            "model.n_kv_heads": 8, "model.ffn_hidden": spec["ffn"], "model.max_seq_len": PEER["seq_len"],
            "train.seq_len": PEER["seq_len"], "train.batch_size": PEER["batch"], "train.schedule": "1f1b",
            "train.micro_batches": PEER["batch"] // spec["mbs"]}
    if "ratio" in spec:
        over["ratio"] = spec["ratio"]
    return load_run_config("cpu", over)


def peer_comparison() -> dict:
    """Our step-time model at ProtocolNanoGPT's conditions (compute at the rate of their WAN-off step time)."""
    link = LinkProfile("200Mbps@50ms", PEER["bandwidth_bps"], PEER["latency_s"])
    out = {"source": PEER["source"], "link": link.name, "methods": {}}
    for method, spec in PEER["runs"].items():
        case = build_case(_peer_config(method, spec), gpu=GPUSpec("unit", 1.0, 1.0), vocab_size=PEER["vocab"])
        flops_per_s = case.predict(IDEAL, "inbound").compute_s / spec["wan_off_s"]     # FLOP-seconds -> seconds
        case = replace(case, compute=StageCompute(
            *[[[x / flops_per_s for x in row] for row in rows] for rows in (case.compute.fwd_s, case.compute.bwd_s)],
            [x / flops_per_s for x in case.compute.opt_s], f"FLOPs at {flops_per_s / 1e12:.0f} TFLOP/s per GPU"))
        w = case.wire[0]
        tokens = PEER["batch"] * PEER["seq_len"] // case.micro_batches
        out["methods"][method] = {
            "published_step_s": spec["step_s"], "wan_off_step_s": spec["wan_off_s"], "steps_to_target": spec["steps"],
            "fitted_flops_per_s": flops_per_s, "implied_mfu_h100": flops_per_s / 989e12,
            "bytes_per_token_fwd": w.fwd / tokens, "bytes_per_token_bwd": w.bwd / tokens,
            "ours_step_s": case.step_time(link, "duplex"), "theirs_step_s": case.step_time(link, "inbound")}
    for sem in ("ours", "theirs"):
        d, s = out["methods"]["none"], out["methods"]["ssn"]
        out[f"speedup_{sem}"] = d["steps_to_target"] * d[f"{sem}_step_s"] / (s["steps_to_target"] * s[f"{sem}_step_s"])
    out["speedup_published"] = PEER["speedup"]
    return out


def peer_markdown(res: dict) -> str:
    m = res["methods"]
    lines = [f"# Against ProtocolNanoGPT ({res['link']}, 8 stages, 1F1B, 512 x 1024 tokens per step)", "",
             f"Source: {res['source']}. Per-operation compute is not published; the loss runs' WAN-off step time "
             f"is, and per-op compute is FLOPs at the rate that reproduces it (implied MFU on H100 dense bf16 in "
             f"the table). Ours: mapl.core.link's clock (a FIFO channel per direction, latency in flight, a step-end "
             f"all-reduce). Theirs: their emulator's rule (one inbound wire per stage for both directions, latency "
             f"holding the wire, steps back to back).", "",
             "| run | bytes/token fwd + bwd | WAN-off s/step | implied MFU | published s/step | ours | theirs |",
             "|---|---|---|---|---|---|---|"]
    for name, r in m.items():
        lines.append(f"| {name} | {r['bytes_per_token_fwd']:.0f} + {r['bytes_per_token_bwd']:.0f} | {r['wan_off_step_s']:.3f} "
                     f"| {100 * r['implied_mfu_h100']:.0f}% | {r['published_step_s']:.3f} | {r['ours_step_s']:.2f} "
                     f"({100 * (r['ours_step_s'] / r['published_step_s'] - 1):+.1f}%) | {r['theirs_step_s']:.2f} "
                     f"({100 * (r['theirs_step_s'] / r['published_step_s'] - 1):+.1f}%) |")
    lines += ["", f"Net speedup to target (steps x step time): published {res['speedup_published']:.2f}x; ours "
              f"{res['speedup_ours']:.2f}x; theirs {res['speedup_theirs']:.2f}x."]
    return "\n".join(lines) + "\n"


def write_report(root: Path = PROJECT_ROOT) -> str:
    """Write reports/bench/peer-protocolnanogpt.json and reports/tables/peer.md under ``root``; returns the table."""
    res = peer_comparison()
    text = peer_markdown(res)
    for path, content in ((Path(root) / "reports" / "bench" / "peer-protocolnanogpt.json", json.dumps(res, indent=1) + "\n"),
                          (Path(root) / "reports" / "tables" / "peer.md", text)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return text
