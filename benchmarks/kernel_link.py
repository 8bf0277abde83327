"""Validate the step-time model against a link it does not define: kernel traffic shaping between network namespaces.

Writes: ``reports/bench/kernel-link.json``, ``reports/tables/kernel-link.md``.

The runtime's real-delay mode (``--link-delay``) sleeps by the model's own channel rule, so a check against
it cannot fail for the reason that matters. Here the link is the kernel's: each of the P ranks runs in its
own network namespace, the namespaces are joined by a bridge, and on each rank's interface an HTB qdisc
gives each neighbour its own class at the cell's rate (one FIFO channel per direction per boundary, the
model's topology) and everything else (rendezvous, the step's all-reduce) an unshaped class; segmentation
offload is off, so the bucket charges each frame as it leaves. TCP/IP framing,
the kernel's queues and gloo's own buffering are the link; the model predicts the step from the run's own
measured compute and the compressors' declared bytes, at the shaped rate and at TCP's goodput over it
(payload 1448 of every 1514 bytes on the wire: the framing the model does not see).

Latency needs the kernel's ``sch_netem``; where ``tc`` does not know it, the latency cells are skipped and
the reason recorded. Needs root (CAP_NET_ADMIN) and iproute2 (``ip``, ``tc``): without them the script
exits 0 with the reason, writing nothing.

    python benchmarks/kernel_link.py                 # 4 methods x 3 rates (+ latencies if netem), ~8 min on 2 cores
    python benchmarks/kernel_link.py --quick --out-json /tmp/k.json --out-md /tmp/k.md    # one cell: it runs
    python benchmarks/kernel_link.py --methods mapl mapl-rvq --rates-mbps 2 --latencies-ms 0 --steps 8 \
        --set projector=fixed --out-json reports/bench/kernel-link-fixed-projector.json \
        --out-md reports/tables/kernel-link-fixed-projector.md     # the same cells without per-step state
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mapl.base.settings import parse_set
from mapl.core.link import LinkProfile
from mapl.orchestration.launch import RANK_COMMAND, child_env, free_port
from run_shape import add_shape_arguments, one_step_columns, run_case, set_flags, shape_overrides, write_report

PREFIX = "mapl-k"                 # namespaces mapl-k0 .. mapl-k{P-1} and the bridge's mapl-kbr
GOODPUT = 1448 / 1514             # TCP payload per Ethernet frame with timestamps (MTU 1500)
UNSHAPED = "10gbit"


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why this machine cannot shape a link between namespaces (None: it can)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to create network namespaces and qdiscs"
    probe = f"{PREFIX}probe"
    try:
        _sh("ip", "netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"cannot create a network namespace: {e.stderr.strip()}"
    try:          # every kind of step the setup takes, once: a veth pair, its offload setting, an HTB qdisc
        for what, cmd in (("a veth pair", ["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"]),
                          ("segmentation offload off", ["ip", "-n", probe, "link", "set", "pa", "gso_max_size", "1500",
                                                        "gso_max_segs", "1"]),
                          ("an HTB qdisc", ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "pa", "root",
                                            "htb"])):
            r = _sh(*cmd, check=False)
            if r.returncode:
                return f"cannot set up {what}: {r.stderr.strip()}"
        return None
    finally:
        _sh("ip", "netns", "del", probe, check=False)


def netem_missing() -> str | None:
    """Why latency cannot be added (None: sch_netem works)."""
    probe = f"{PREFIX}probe"
    _sh("ip", "netns", "add", probe)
    try:
        r = _sh("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                check=False)
        return None if r.returncode == 0 else f"tc qdisc netem: {r.stderr.strip()} (sch_netem is not in this kernel)"
    finally:
        _sh("ip", "netns", "del", probe, check=False)


def _ip(s: int) -> str:
    return f"10.77.0.{s + 1}"


class ShapedLinks:
    """P namespaces on a bridge; ``set(rate, latency)`` shapes every neighbour channel. A context manager
    that deletes every namespace it made, whatever happens."""

    def __init__(self, stages: int):
        self.P = stages
        self.made: list[str] = []

    def __enter__(self) -> "ShapedLinks":
        br = f"{PREFIX}br"
        for ns in [br] + [f"{PREFIX}{s}" for s in range(self.P)]:
            _sh("ip", "netns", "del", ns, check=False)          # a namespace left by an interrupted run
            _sh("ip", "netns", "add", ns)
            self.made.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", br, "link", "set", "br0", "up")
        for s in range(self.P):
            ns, dev = f"{PREFIX}{s}", f"k{s}a"
            _sh("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", f"k{s}b", "netns", br)
            _sh("ip", "-n", br, "link", "set", f"k{s}b", "master", "br0", "up")
            # one frame per segment: with GSO, HTB lets a 64 KB segment out at once and charges the bucket after,
            # so a message under 64 KB arrives before its bytes could have crossed (measured: 16 KB at 2 Mbit/s in
            # 0 ms with GSO, 62 ms without; a serial link takes 66 ms)
            for where, name in ((ns, dev), (br, f"k{s}b")):
                _sh("ip", "-n", where, "link", "set", name, "gso_max_size", "1500", "gso_max_segs", "1")
            _sh("ip", "-n", ns, "addr", "add", f"{_ip(s)}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.made:
            _sh("ip", "netns", "del", ns, check=False)

    def set(self, rate_bps: float, latency_s: float = 0.0) -> None:
        """Every rank's interface: an HTB class per neighbour at ``rate_bps`` (fed to netem for the latency
        when there is one), the rest unshaped."""
        for s in range(self.P):
            ns, dev = f"{PREFIX}{s}", f"k{s}a"
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            tc = ["ip", "netns", "exec", ns, "tc"]
            _sh(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "99")
            _sh(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:99", "htb", "rate", UNSHAPED)
            for d in (s - 1, s + 1):
                if not 0 <= d < self.P:
                    continue
                cls = f"1:{10 + d}"
                # the smallest bucket (one frame): HTB's default lets a message's first ~2 KB out unshaped
                _sh(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb", "rate",
                    f"{rate_bps:.0f}bit", "ceil", f"{rate_bps:.0f}bit", "burst", "1600b", "cburst", "1600b")
                if latency_s > 0:
                    _sh(*tc, "qdisc", "add", "dev", dev, "parent", cls, "netem", "delay", f"{1000 * latency_s:g}ms",
                        "limit", "100000")
                _sh(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
                    "ip", "dst", f"{_ip(d)}/32", "flowid", cls)

    def launch(self, args: list[str], timeout: float) -> tuple[list[int], str]:
        """``mapl pipeline <args>`` with rank s in namespace s; (exit codes, stderr of the ranks)."""
        port = free_port()
        env = child_env({"MASTER_ADDR": _ip(0), "MASTER_PORT": str(port), "WORLD_SIZE": str(self.P),
                         "LOCAL_WORLD_SIZE": str(self.P)})
        procs, errs = [], []
        for s in range(self.P):
            e = dict(env, RANK=str(s), LOCAL_RANK=str(s), GLOO_SOCKET_IFNAME=f"k{s}a")
            err = tempfile.TemporaryFile("w+")
            errs.append(err)
            procs.append(subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}{s}", sys.executable, *RANK_COMMAND, *args],
                                          cwd=ROOT, env=e, stdout=subprocess.DEVNULL, stderr=err, text=True))
        deadline = time.time() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                p.wait()
        text = ""
        for s, f in enumerate(errs):
            f.seek(0)
            text += "".join(f"[rank {s}] {line}" for line in f.read().splitlines(True))
            f.close()
        return [p.returncode for p in procs], text


def run_cell(links: ShapedLinks, args, method: str, rate: float, latency_s: float, tmp: Path) -> dict:
    links.set(rate, latency_s)
    over = {**shape_overrides(args, method, args.schedule, args.stages), **args.settings}
    out = tmp / f"{method}-{rate:g}-{latency_s:g}.json"
    cli = ["--profile", args.profile, *set_flags(over), "--no-progress", "--fresh", "--out", str(out),
           "--ckpt", str(out.with_suffix(".pt"))]
    codes, err = links.launch(cli, args.timeout)
    if any(codes):
        raise RuntimeError(f"{method} at {rate:g} bit/s failed ({codes}):\n{err[-2000:]}")
    pipe = json.loads(out.read_text())["pipeline"]
    case = run_case(args.profile, over, pipe["timing"])
    link = LinkProfile(f"{rate:g}bps", rate, latency_s)
    nominal = case.predict(link)
    goodput = case.predict(LinkProfile(f"{rate * GOODPUT:g}bps", rate * GOODPUT, latency_s))
    one_step = case.one_step_time(link)    # the replay of one step alone
    step = pipe["step_wall_s"]
    return {"method": method, "rate_bps": rate, "latency_s": latency_s, "measured_step_s": step,
            "predicted_step_s": nominal.step_s, "error": (nominal.step_s - step) / step,
            "predicted_one_step_s": one_step, "error_one_step": (one_step - step) / step,
            "predicted_goodput_step_s": goodput.step_s, "error_goodput": (goodput.step_s - step) / step,
            "floor_s": nominal.floor_s, "comm_fraction": nominal.comm_fraction, "timed_steps": pipe["timed_steps"],
            "step_walls_s": pipe["step_walls_s"],
            "fwd_bytes": [b.fwd for b in case.wire], "bwd_bytes": [b.bwd for b in case.wire],
            "timing": pipe["timing"]}         # the run's own measurement: the model can be replayed from it


def markdown(bench: dict) -> str:
    s = bench["setup"]
    lines = ["# The step-time model against a kernel-shaped link (network namespaces, HTB per neighbour)", "",
             f"P = {s['stages']}, {s['schedule']}, d = {s['width']}, {2 * s['stages']} layers, M = {s['micro_batches']} "
             f"micro-batches of {s['micro_batch_size']} x {s['seq_len']} tokens, {s['steps']} steps (the first not "
             f"timed), 8x for the compressed methods. Measured: the runtime's mean step over the shaped link. "
             f"Model: mapl.planning.costmodel from the run's own compute and declared bytes (steps replayed back to "
             f"back: stage 0's period), at the shaped rate and at TCP's goodput over it (x {GOODPUT:.3f}); one step: "
             f"the same replay of a single step from an idle pipeline (its last stage's end), at the shaped rate. "
             f"Comm: the share of the step the link adds. Largest "
             f"|error| where comm >= 25 %: {_pct(bench['max_abs_error_comm25'])} at the shaped rate, "
             f"{_pct(bench['max_abs_error_goodput_comm25'])} at the goodput. Load average before / after: "
             f"{bench['load_before']} / {bench['load_after']}.", ""]
    if s.get("settings"):
        lines += ["Every cell with " + ", ".join(f"`{k}={v}`" for k, v in s["settings"].items()) + ".", ""]
    if bench.get("skipped"):
        lines += [f"Skipped: {x}" for x in bench["skipped"]] + [""]
    lines += ["| method | Mbit/s | latency (ms) | measured (s) | model (s) | error | model at goodput (s) | error | "
              "one step (s) | error | comm |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in bench["cells"]:
        lines.append(f"| {c['method']} | {c['rate_bps'] / 1e6:g} | {1000 * c['latency_s']:g} | {c['measured_step_s']:.3f} | "
                     f"{c['predicted_step_s']:.3f} | {100 * c['error']:+.1f}% | {c['predicted_goodput_step_s']:.3f} | "
                     f"{100 * c['error_goodput']:+.1f}% | {one_step_columns(c)} | {100 * c['comm_fraction']:.0f}% |")
    return "\n".join(lines) + "\n"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernel_link.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one cell (MAPL at the lowest rate, 2 steps): it runs")
    ap.add_argument("--methods", nargs="+", default=["none", "ssn", "mapl", "mapl-rvq"])
    ap.add_argument("--rates-mbps", nargs="+", type=float, default=[2.0, 8.0, 32.0])
    ap.add_argument("--latencies-ms", nargs="+", type=float, default=[0.0, 20.0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config setting for every cell (repeatable), e.g. projector=fixed: what a cell's error "
                         "depends on")
    add_shape_arguments(ap, micro_batches=8, micro_batch_size=4, seq_len=128, out="kernel-link")
    a = ap.parse_args(argv)
    try:
        a.settings = parse_set(a.set)             # the `mapl train --set` parser: the same rule and message
    except ValueError as e:
        ap.error(str(e))
    if a.quick:
        a.methods, a.rates_mbps, a.latencies_ms, a.steps, a.micro_batches = ["mapl"], [2.0], [0.0], 2, 4
    why = unavailable()
    if why:
        print(f"kernel_link: skipped: {why}", file=sys.stderr)
        return 0
    skipped, latencies = [], [x / 1000 for x in a.latencies_ms]
    no_netem = netem_missing() if any(x > 0 for x in latencies) else None
    if no_netem:
        skipped.append(f"latencies {', '.join(f'{x:g} ms' for x in a.latencies_ms if x > 0)}: {no_netem}")
        latencies = [x for x in latencies if x == 0]
    load_before = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    cells, t0 = [], time.time()
    with tempfile.TemporaryDirectory(prefix="mapl-bench-kernel-") as tmp, ShapedLinks(a.stages) as links:
        for lat in latencies:
            for rate in a.rates_mbps:
                for method in a.methods:
                    c = run_cell(links, a, method, rate * 1e6, lat, Path(tmp))
                    cells.append(c)
                    print(f"{method} {rate:g} Mbit/s {1000 * lat:g} ms: measured {c['measured_step_s']:.3f} s, model "
                          f"{c['predicted_step_s']:.3f} s ({100 * c['error']:+.1f}%; at goodput "
                          f"{100 * c['error_goodput']:+.1f}%), comm {100 * c['comm_fraction']:.0f}%",
                          file=sys.stderr, flush=True)
    comm = [c for c in cells if c["comm_fraction"] >= 0.25]
    bench = {"setup": {"profile": a.profile, "stages": a.stages, "schedule": a.schedule, "width": a.width,
                       "micro_batches": a.micro_batches, "micro_batch_size": a.micro_batch_size, "seq_len": a.seq_len,
                       "steps": a.steps, "link": "HTB class per neighbour on each rank's veth (network namespaces)",
                       "settings": a.settings},
             "skipped": skipped, "cells": cells, "load_before": load_before,
             "load_after": ", ".join(f"{x:.2f}" for x in os.getloadavg()), "wall_s": time.time() - t0,
             "max_abs_error_comm25": max((abs(c["error"]) for c in comm), default=None),
             "max_abs_error_goodput_comm25": max((abs(c["error_goodput"]) for c in comm), default=None)}
    write_report(a, bench, markdown(bench))
    return 0


if __name__ == "__main__":
    sys.exit(main())
