"""Compressor cost on one CPU thread: per-op times, overhead against a stage's step, wire efficiency, memory.

Writes: ``reports/bench/compress.json``, ``reports/tables/compress.md``.

    python benchmarks/compress.py                 # full grid, ~10 min on 1 core (writes the two reports)
    python benchmarks/compress.py --quick         # tiny shapes, seconds (the test suite runs this)
    python benchmarks/compress.py --paper-shape   # RVQ pack at d=1024, r=256, 16 x 2048 tokens; SPEL at r=256; GPU estimates

Every time is the median of ``--reps`` timed runs after ``--warmup`` untimed ones, with
``torch.set_num_threads(--threads)`` (default 1). What is measured (benchmarks/README.md has the details):

* ``ops``: per (d, r, method) at B x T tokens (default 8 x 512): in-graph ``encode``/``decode`` forward and
  backward (gradients into the input and, for learned projectors, into A), and on the wire ``pack``/
  ``unpack`` (forward message) and ``pack_grad``/``unpack_grad`` (backward message). ``mapl-rvq`` packs in
  training mode (nearest-codeword search + EMA update + sync slice), as a training stage does.
* ``spel``: one SPEL step on a d x r projector, exact SVD polar vs Polar Express (10 steps).
* ``search``: ResidualVQ.search alone (default layout G = r/2, R = 2) for K in {256, 4096, 65536}; large
  K run on fewer tokens (``tokens`` in each row) and are also reported per token.
* ``stage``: forward + backward of a stage of 2 LLaMA blocks at the model preset with that d
  (d=256 -> mini, 1024 -> 150M, 2048 -> 1B), same tokens; ``overhead`` = per-micro-batch compressor cost
  (encode+decode fwd/bwd, pack/unpack both legs, SPEL step / micro-batches-per-step) / stage time.
* ``wire``: bytes per token from real ``pack()``/``pack_grad()`` output (+ 16-bit token ids where the
  method's anchors need them) against the information floor; efficiency = floor / measured.
* ``memory``: peak RSS (ru_maxrss) of a fresh process running one stage step, per method.

Before/after: ``--ab-before DIR`` times a pre-change copy of the package (DIR/mapl) alternately with the
current code in one process (RVQ search, int8/mapl-rvq pack/unpack). Alternatively ``--mapl-path DIR``
measures the old package in a separate run and ``--baseline OLD.json`` folds that run's numbers in.
Writes ``--json`` (default reports/bench/compress.json) and ``--md`` (default reports/tables/compress.md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

METHODS = ("none", "int8", "ssn", "mapl", "mapl-rvq")
PRESET_FOR_D = {64: "micro", 128: "tiny", 256: "mini", 1024: "150M", 1536: "500M", 2048: "1B"}
ID_BITS = 16            # token ids on the wire (int16 for vocabularies <= 65536, mapl/core/wire.py)

FULL = dict(batch=8, seq=512, dims=(256, 1024, 2048), ranks=(64, 128, 256), search_K=(256, 4096, 65536),
            search_dim=256, search_elems=1 << 31, warmup=2, reps=5, stage_reps=3, micro_batches=4,
            memory_dims=(1024,), headline=(1024, 256))
QUICK = dict(batch=2, seq=16, dims=(64,), ranks=(16,), search_K=(16, 256), search_dim=16,
             search_elems=1 << 20, warmup=1, reps=3, stage_reps=2, micro_batches=4, memory_dims=(64,),
             headline=(64, 16))


# ---- environment ---------------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _environment(torch, device: str) -> dict:
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_model": _cpu_model(),
           "cpu_count": os.cpu_count(), "python": platform.python_version(), "device": device,
           "loadavg_start": os.getloadavg()[0], "mkldnn": torch.backends.mkldnn.is_available()}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


# ---- timing ------------------------------------------------------------------------------------

class Timer:
    def __init__(self, torch, device: str, warmup: int, reps: int):
        self.torch, self.device, self.warmup, self.reps = torch, device, warmup, reps

    def _sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def __call__(self, fn, *, reps: int | None = None, warmup: int | None = None) -> dict:
        """Median (and min) seconds of ``fn()`` over ``reps`` runs after ``warmup`` untimed runs."""
        for _ in range(self.warmup if warmup is None else warmup):
            fn()
        self._sync()
        ts = []
        for _ in range(self.reps if reps is None else reps):
            t0 = time.perf_counter()
            fn()
            self._sync()
            ts.append(time.perf_counter() - t0)
        return {"median_s": statistics.median(ts), "min_s": min(ts), "n": len(ts)}


# ---- building blocks ---------------------------------------------------------------------------

def _compressor(mapl, torch, method: str, d: int, r: int, *, search_with: str | None = None):
    from mapl.core.compress import build_boundary
    from mapl.core.config import CompressorConfig, RVQConfig
    ratio = 1.0 if method in ("none", "int8") else d / r
    rvq = RVQConfig(search_with=search_with) if search_with is not None else RVQConfig()
    comp = CompressorConfig(method=method, ratio=ratio, rvq=rvq).validate(d)
    return build_boundary(comp, d, 0), comp


def _needs_ids(method: str) -> bool:
    from mapl.core.config import METHODS as CFG_METHODS
    return CFG_METHODS[method]["anchor"] != "none"


def bench_ops(torch, timer: Timer, method: str, d: int, r: int, B: int, T: int, device: str) -> dict:
    """encode/decode fwd+bwd and pack/unpack/pack_grad/unpack_grad of one boundary compressor."""
    import mapl
    comp, _ = _compressor(mapl, torch, method, d, r)
    comp = comp.to(device).train()
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(B, T, d, generator=gen).to(device).requires_grad_(True)
    params = [p for p in comp.parameters() if p.requires_grad]
    out = {}
    # encode: forward, then backward on a retained graph (gradients into x and, if learned, A)
    out["encode_fwd"] = timer(lambda: comp.encode(x))
    z = comp.encode(x)
    gz = torch.randn(z.shape, generator=gen).to(device)
    ins = [x, *params]
    if z.requires_grad and z.grad_fn is not None:
        out["encode_bwd"] = timer(lambda: torch.autograd.grad(z, ins, gz, retain_graph=True, allow_unused=True))
    else:
        out["encode_bwd"] = timer(lambda: None)
    zin = z.detach().clone().requires_grad_(True)
    out["decode_fwd"] = timer(lambda: comp.decode(zin))
    xh = comp.decode(zin)
    gx = torch.randn(xh.shape, generator=gen).to(device)
    dins = [zin, *params]
    if xh.grad_fn is not None:
        out["decode_bwd"] = timer(lambda: torch.autograd.grad(xh, dins, gx, retain_graph=True, allow_unused=True))
    else:
        out["decode_bwd"] = timer(lambda: None)
    # the wire, both legs; mapl-rvq packs in training mode (search + EMA update + stream slice)
    zd = z.detach()
    with torch.no_grad():
        for _ in range(2):                       # first pack runs the one-off k-means init: not timed
            payload = comp.pack(zd)
            comp.unpack(payload, zd.dtype)
        out["pack"] = timer(lambda: comp.pack(zd))
        payload = comp.pack(zd)
        out["unpack"] = timer(lambda: comp.unpack(payload, zd.dtype))
        out["pack_grad"] = timer(lambda: comp.pack_grad(gz))
        gpay = comp.pack_grad(gz)
        out["unpack_grad"] = timer(lambda: comp.unpack_grad(gpay, gz.dtype))
    return ({k: v["median_s"] for k, v in out.items()} | {"_min": {k: v["min_s"] for k, v in out.items()}}
            | {"_learned": comp.learned})


def wire_row(torch, method: str, d: int, r: int, B: int, T: int, micro_batches: int) -> dict:
    """Measured bytes/token of real payloads vs the information floor."""
    import mapl
    from mapl.core.compress.base import payload_bytes
    comp, cfg = _compressor(mapl, torch, method, d, r)
    comp.train()
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(B, T, comp.code_dim, generator=gen)
    with torch.no_grad():
        for _ in range(2):
            comp.unpack(comp.pack(z), z.dtype)
        fwd = comp.pack(z)
        bwd = comp.pack_grad(torch.randn(B, T, comp.code_dim, generator=gen))
    roles = comp.payload_roles("fwd")
    n = B * T
    data_fwd = sum(t.numel() * t.element_size() for t, ro in zip(fwd, roles) if ro == "data")
    sync_fwd = payload_bytes(fwd) - data_fwd
    bwd_b = payload_bytes(bwd)
    ids = ID_BITS / 8 if _needs_ids(method) else 0.0
    floor_fwd, floor_bwd = comp.wire_efficiency_floor("fwd"), comp.wire_efficiency_floor("bwd")   # bits/token
    meas_fwd = (data_fwd + sync_fwd) / n + ids
    meas_bwd = bwd_b / n
    floor_fwd_B = floor_fwd / 8 + ids
    floor_bwd_B = floor_bwd / 8
    # per optimizer step: learned projector A (fp32) to the receiver and the receiver's dL/dA back
    step_bytes = comp.sync_bytes_per_step() + comp.receiver_grad_bytes_per_step()
    state_per_tok = step_bytes / (n * micro_batches)
    row = {
        "method": method, "d": d, "r": comp.code_dim if method not in ("none", "int8") else None,
        "tokens_per_message": n,
        "fwd_bytes_per_token": meas_fwd, "fwd_floor_bytes_per_token": floor_fwd_B,
        "fwd_data_bytes_per_token": data_fwd / n, "fwd_sync_bytes_per_message": sync_fwd,
        "ids_bytes_per_token": ids,
        "bwd_bytes_per_token": meas_bwd, "bwd_floor_bytes_per_token": floor_bwd_B,
        "efficiency_fwd": floor_fwd_B / meas_fwd, "efficiency_bwd": floor_bwd_B / meas_bwd,
        "efficiency": (floor_fwd_B + floor_bwd_B) / (meas_fwd + meas_bwd),
        "state_sync_bytes_per_step": step_bytes, "state_sync_bytes_per_token": state_per_tok,
        "efficiency_with_state_sync": (floor_fwd_B + floor_bwd_B) / (meas_fwd + meas_bwd + state_per_tok),
        "declared_fwd_bytes_per_token": comp.wire_bytes_per_token("fwd") + ids,
    }
    notes = []
    if sync_fwd:
        notes.append(f"fwd message carries {sync_fwd} B of piggybacked sync (RVQ header 24 B + codebook "
                     f"stream slice), independent of tokens: {sync_fwd / n:.3f} B/token at {n} tokens")
    pad = data_fwd / n - (floor_fwd / 8)
    if pad > 1e-9:
        notes.append(f"bit-packing pads each sequence to a whole byte: {pad:.4f} B/token")
    if step_bytes:
        notes.append(f"per optimizer step (not in messages): projector A sync + receiver dL/dA = {step_bytes} B, "
                     f"{state_per_tok:.2f} B/token at {micro_batches} x {n} tokens/step")
    row["explained_by"] = "; ".join(notes)
    return row


def bench_spel(torch, timer: Timer, d: int, r: int, device: str) -> dict:
    from mapl.core.optim import SPEL, stiefel_random
    out = {}
    for polar in ("svd", "polar_express"):
        A = torch.nn.Parameter(stiefel_random(d, r, 0, device=device))
        opt = SPEL([A], lr=0.002, momentum=0.95, polar=polar, polar_steps=10)
        g = torch.randn(d, r, generator=torch.Generator().manual_seed(2)).to(device) * 1e-2

        def step():
            A.grad = g
            opt.step()
        out[polar] = timer(step)["median_s"]
    return out


def bench_search(torch, timer: Timer, dim: int, K: int, n_tokens: int, device: str) -> dict:
    from mapl.core.compress.rvq import ResidualVQ
    q = ResidualVQ(dim=dim, codebook_size=K, kmeans_init=False, seed=0).to(device)
    z = torch.randn(n_tokens, dim, generator=torch.Generator().manual_seed(3)).to(device)
    t = timer(lambda: q.search(z), reps=max(3, timer.reps // 2), warmup=1)
    elems = n_tokens * q.groups * q.rounds * K
    return {"K": K, "dim": dim, "groups": q.groups, "rounds": q.rounds, "tokens": n_tokens,
            "median_s": t["median_s"], "us_per_token": t["median_s"] / n_tokens * 1e6,
            "ns_per_distance": t["median_s"] / elems * 1e9,
            "tile_bytes": q.tile_bytes}


def _stage_blocks(torch, d: int):
    from mapl.core.model import Block, ModelConfig, rope_tables
    cfg = ModelConfig.preset(PRESET_FOR_D[d])
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Block(cfg) for _ in range(2)])
    return cfg, blocks, rope_tables


def bench_stage(torch, timer: Timer, d: int, B: int, T: int, device: str, reps: int) -> dict:
    cfg, blocks, rope_tables = _stage_blocks(torch, d)
    blocks = blocks.to(device)
    cos, sin = rope_tables(cfg.head_dim, T, cfg.rope_theta, device=device)
    x = torch.randn(B, T, d).to(device).requires_grad_(True)
    gy = torch.randn(B, T, d).to(device)

    def fwd_bwd():
        h = x
        for b in blocks:
            h = b(h, cos, sin)
        h.backward(gy)
        x.grad = None
        for p in blocks.parameters():
            p.grad = None
    t = timer(fwd_bwd, reps=reps, warmup=1)
    return {"preset": PRESET_FOR_D[d], "fwd_bwd_s": t["median_s"], "min_s": t["min_s"], "n": t["n"]}


# ---- memory (one fresh process per configuration) --------------------------------------------------

def _rss_mb(field: str) -> float:
    """VmHWM (peak) / VmRSS (now) of this process in MB from /proc/self/status. Not ru_maxrss: Linux
    carries ru_maxrss over fork+exec, so a child of a big benchmark process would report the parent's
    peak; VmHWM belongs to the new image. Falls back to ru_maxrss where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _memory_child(spec: dict) -> dict:
    """One stage step in this process: decode(in) -> 2 blocks -> encode(out), wire both legs; peak RSS."""
    import torch
    torch.set_num_threads(spec["threads"])
    from mapl.core.compress.base import WireTransfer
    d, r, method, B, T = spec["d"], spec["r"], spec["method"], spec["B"], spec["T"]
    cfg, blocks, rope_tables = _stage_blocks(torch, d)
    cos, sin = rope_tables(cfg.head_dim, T, cfg.rope_theta)
    comp = None
    if method != "blocks-only":
        import mapl
        comp, _ = _compressor(mapl, torch, method, d, r)
        comp.train()
    rss0 = _rss_mb("VmRSS")
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        if comp is None:
            x = torch.randn(B, T, d, generator=gen, requires_grad=True)
            h = x
        else:
            zin = torch.randn(B, T, comp.code_dim, generator=gen)
            zin = WireTransfer.apply(zin.requires_grad_(True), comp, None, 0)   # received message
            h = comp.decode(zin)
        for b in blocks:
            h = b(h, cos, sin)
        if comp is not None:
            h = WireTransfer.apply(comp.encode(h), comp, None, 0)              # sent message
        h.backward(torch.randn(h.shape, generator=gen))
        blocks.zero_grad(set_to_none=True)
    peak = _rss_mb("VmHWM")
    return {"method": method, "d": d, "r": r, "peak_rss_mb": peak, "rss_after_build_mb": rss0,
            "step_peak_increase_mb": peak - rss0}


def bench_memory(methods, d: int, r: int, B: int, T: int, threads: int, mapl_path: str | None) -> list[dict]:
    rows = []
    for method in ("blocks-only", *methods):
        spec = {"d": d, "r": r, "method": method, "B": B, "T": T, "threads": threads}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_memory-child", json.dumps(spec)]
        if mapl_path:
            cmd += ["--mapl-path", mapl_path]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    base = next(x["peak_rss_mb"] for x in rows if x["method"] == "none")
    for x in rows:
        x["delta_vs_none_mb"] = x["peak_rss_mb"] - base
    return rows


# ---- interleaved before/after (A/B) --------------------------------------------------------------

def _load_package_as(alias: str, root: str):
    """Import the ``mapl`` package found under ``root`` as ``alias`` (its imports are all relative), so
    an old copy and the current one live side by side in one process."""
    import importlib
    import importlib.util
    init = Path(root).resolve() / "mapl" / "__init__.py"
    spec = importlib.util.spec_from_file_location(alias, init, submodule_search_locations=[str(init.parent)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    for sub in ("core.config", "core.compress", "core.compress.rvq", "core.compress.int8"):
        importlib.import_module(f"{alias}.{sub}")
    return mod


def _ab(torch, fa, fb, warmup: int, reps: int) -> tuple[float, float]:
    """Medians of fa and fb timed alternately (order flipped every rep): both see the same load."""
    for _ in range(warmup):
        fa()
        fb()
    ta, tb = [], []
    for i in range(reps):
        pair = [(fa, ta), (fb, tb)]
        for f, acc in (pair if i % 2 == 0 else pair[::-1]):
            t0 = time.perf_counter()
            f()
            acc.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def bench_ab(torch, before_root: str, cfg: dict, methods, log) -> list[dict]:
    """Before (package under ``before_root``) vs after (current) on the ops the speed work touched,
    timed alternately in one process."""
    import mapl
    old = _load_package_as("mapl_before", before_root)
    pkgs = {"before": old, "after": mapl}
    B, T = cfg["batch"], cfg["seq"]
    rows = []

    def build(pkg, method, d, r):
        ratio = 1.0 if method in ("none", "int8") else d / r
        c = pkg.core.config.CompressorConfig(method=method, ratio=ratio).validate(d)
        return pkg.core.compress.build_boundary(c, d, 0).train()

    reps = max(5, cfg["reps"])
    for K in cfg["search_K"]:
        dim = cfg["search_dim"]
        n = max(16, min(B * T, (cfg["search_elems"] // 4) // ((dim // 2) * 2 * K)))
        z = torch.randn(n, dim, generator=torch.Generator().manual_seed(3))
        q = {k: p.core.compress.rvq.ResidualVQ(dim=dim, codebook_size=K, kmeans_init=False, seed=0) for k, p in pkgs.items()}
        tb, ta = _ab(torch, lambda: q["before"].search(z), lambda: q["after"].search(z), 1, reps)
        rows.append({"op": "search", "K": K, "dim": dim, "tokens": n, "before_s": tb, "after_s": ta,
                     "before_us_per_token": tb / n * 1e6, "after_us_per_token": ta / n * 1e6, "speedup": tb / ta})
        log(f"A/B search K={K}: {tb / n * 1e6:.1f} -> {ta / n * 1e6:.1f} us/token")
    for d in cfg["dims"]:
        for method in [m for m in ("int8", "mapl-rvq") if m in methods]:
            for r in ([None] if method == "int8" else [x for x in cfg["ranks"] if x < d]):
                comps = {k: build(p, method, d, r or d) for k, p in pkgs.items()}
                code = comps["after"].code_dim
                z = torch.randn(B, T, code, generator=torch.Generator().manual_seed(4))
                with torch.no_grad():
                    for c in comps.values():                 # k-means init etc. out of the way
                        for _ in range(2):
                            c.unpack(c.pack(z), z.dtype)
                    tb, ta = _ab(torch, lambda: comps["before"].pack(z), lambda: comps["after"].pack(z), 1, reps)
                    pay = {k: c.pack(z) for k, c in comps.items()}
                    ub, ua = _ab(torch, lambda: comps["before"].unpack(pay["before"], z.dtype),
                                 lambda: comps["after"].unpack(pay["after"], z.dtype), 1, reps)
                rows.append({"op": "pack", "method": method, "d": d, "r": r, "before_s": tb, "after_s": ta, "speedup": tb / ta})
                rows.append({"op": "unpack", "method": method, "d": d, "r": r, "before_s": ub, "after_s": ua,
                             "speedup": ub / ua})
                log(f"A/B {method} d={d} r={r}: pack {tb * 1e3:.2f} -> {ta * 1e3:.2f} ms, "
                    f"unpack {ub * 1e3:.2f} -> {ua * 1e3:.2f} ms")
    return rows


# ---- paper shapes: RVQ pack at r = 256 and SPEL at d = 1024/2048, measured on CPU, estimated for a GPU ----

# Vendor peak figures (dense): HBM bandwidth, fp32 non-tensor-core and bf16 tensor-core FLOP/s; a kernel
# is assumed to reach BW_EFF of the bandwidth and FP_EFF of the fp32 peak, a launch to cost LAUNCH_S.
GPUS = {"H100-SXM": {"bw": 3.35e12, "fp32": 67e12, "bf16": 989e12},
        "H200": {"bw": 4.8e12, "fp32": 67e12, "bf16": 989e12}}
BW_EFF, FP_EFF, LAUNCH_S, MFU = 0.7, 0.5, 5e-6, 0.4
PAPER = dict(d=1024, r=256, batch=16, seq=2048, micro_batches=32, blocks=2, K=256, rounds=2)


def _gpu_time(gpu: dict, nbytes: float, flops: float, launches: int) -> float:
    return max(nbytes / (gpu["bw"] * BW_EFF), flops / (gpu["fp32"] * FP_EFF)) + launches * LAUNCH_S


def _stage_step_flops(p: dict) -> float:
    """fwd+bwd FLOPs of one 150M stage (``blocks`` LLaMA blocks) over a step's micro-batches: 6 x
    matmul parameters per token, plus causal attention 6 * T * d per token per block."""
    from mapl.core.model import ModelConfig
    from mapl.core.stages import _block_cost
    cfg = ModelConfig.preset("150M")
    tokens = p["batch"] * p["seq"] * p["micro_batches"]
    return p["blocks"] * tokens * (6 * _block_cost(cfg) + 6 * p["seq"] * cfg.d_model)


def rvq_gpu_estimate(p: dict, tile_bytes: int = 256 << 20) -> dict:
    """Expected pack time per message on a GPU, from the search's distances (N*G*R*K), and its share of
    a 150M stage's step (``micro_batches`` packs per step) at MFU 40%."""
    N, G, R, K, ds = p["batch"] * p["seq"], p["r"] // 2, p["rounds"], p["K"], 2
    D = N * G * R * K
    tiles = -(-D // R // (tile_bytes // 4))
    ema_bytes = 40 * N * p["r"] * R                          # targets, index_add, bincount, bit-packing: a few passes
    kernels = {"matmul": (8 * D, 2 * (ds + 1) * D, tiles * R * 8),     # distances written then read back (fp32)
               "fused": (4 * N * p["r"] * (R + 1), (2 * ds + 2) * D, R * 4)}   # one tile; distances stay in registers
    step_flops = _stage_step_flops(p)
    out = {"distances_per_message": D, "stage_step_flops": step_flops, "assumptions": {
        "bw_eff": BW_EFF, "fp32_eff": FP_EFF, "launch_s": LAUNCH_S, "mfu": MFU, "tile_bytes": tile_bytes}}
    for name, gpu in GPUS.items():
        step_s = step_flops / (gpu["bf16"] * MFU)
        row = {"stage_step_s_at_mfu": step_s}
        for kern, (nbytes, flops, launches) in kernels.items():
            t = _gpu_time(gpu, nbytes + ema_bytes, flops, launches + 30)
            row[kern] = {"pack_s": t, "bytes": nbytes + ema_bytes, "flops": flops,
                         "pct_of_step": 100 * p["micro_batches"] * t / step_s,
                         "pct_of_3s_step": 100 * p["micro_batches"] * t / 3.0}
        out[name] = row
    return out


def spel_gpu_estimate(d: int, r: int, steps: int = 10) -> dict:
    """One SPEL step on a GPU: Polar Express is 2 x ``steps`` iterations of three r x r / r x d matmuls
    (direction and retraction); the SVD route is two thin SVDs, latency-bound (not estimated from FLOPs)."""
    flops = 2 * steps * (2 * r * r * d + 2 * r ** 3 + 2 * r * r * d)
    return {name: {"polar_express_s": _gpu_time(gpu, 2 * steps * 6 * d * r * 4, flops, 2 * steps * 6 + 10),
                   "polar_express_flops": flops} for name, gpu in GPUS.items()}


def bench_rvq_paper(torch, p: dict, reps: int, kernels=("matmul", "fused"), device: str = "cpu") -> dict:
    """Pack (search + EMA update + bit-packing + sync tensors), unpack and search alone at the paper's
    shape, one row per search kernel (on a CPU "fused" is compiled by inductor's CPU backend)."""
    from mapl.core.compress import ProjectionCompressor
    from mapl.core.compress.rvq import RVQCompressor, RVQSettings
    from mapl.core.optim import stiefel_random
    z = torch.randn(p["batch"], p["seq"], p["r"], generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        return out, time.perf_counter() - t0

    rows = []
    for kern in kernels:
        comp = RVQCompressor(ProjectionCompressor(p["d"], stiefel_random(p["d"], p["r"], 0), "fixed"),
                             RVQSettings(search_kernel=kern)).to(device).train()
        _, init_s = timed(lambda: comp.unpack(comp.pack(z), z.dtype))   # k-means init (+ compilation): once per run
        comp.rvq.search(z[:1, :64])                         # compile for a second shape before timing
        ts = {"search": [], "pack": [], "unpack": []}
        for _ in range(reps):
            ts["search"].append(timed(lambda: comp.rvq.search(z))[1])
            payload, t = timed(lambda: comp.pack(z))
            ts["pack"].append(t)
            ts["unpack"].append(timed(lambda: comp.unpack(payload, z.dtype))[1])
        D = p["batch"] * p["seq"] * comp.rvq.groups * comp.rvq.rounds * comp.rvq.codebook_size
        rows.append({"kernel": kern, "init_s": init_s, **{f"{k}_s": statistics.median(v) for k, v in ts.items()},
                     "ns_per_distance": statistics.median(ts["search"]) / D * 1e9, "loadavg": os.getloadavg()[0]})
    return {"shape": p, "cpu": rows, "gpu_estimate": rvq_gpu_estimate(p)}


def bench_spel_paper(torch, dims=(1024, 2048), r: int = 256, reps: int = 3, drift_steps: int = 200,
                     device: str = "cpu") -> list[dict]:
    """SPEL step time (SVD vs Polar Express, 10 iterations) at r = 256, and how far each keeps A from
    the manifold over ``drift_steps`` steps with random gradients (max |AᵀA - I|)."""
    from mapl.core.optim import SPEL, ortho_error, stiefel_random
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for d in dims:
        row = {"d": d, "r": r, "gpu_estimate": spel_gpu_estimate(d, r)}
        for polar in ("svd", "polar_express"):
            A = torch.nn.Parameter(stiefel_random(d, r, 0, device=device))
            opt = SPEL([A], lr=0.002, momentum=0.95, polar=polar, polar_steps=10)
            g = torch.Generator().manual_seed(1)
            times, worst = [], 0.0
            for i in range(drift_steps):
                A.grad = (torch.randn(d, r, generator=g) * 1e-2).to(device)
                sync()
                t0 = time.perf_counter()
                opt.step()
                sync()
                times.append(time.perf_counter() - t0)
                worst = max(worst, ortho_error(A)) if i % 10 == 9 else worst
            row[polar] = {"step_s": statistics.median(times[:max(reps, 1) * 10]), "ortho_err_max": worst,
                          "ortho_err_final": ortho_error(A), "steps": drift_steps}
        rows.append(row)
    return rows


def paper_markdown(res: dict) -> str:
    rv, env = res["rvq"], res["environment"]
    p = rv["shape"]
    L = [f"# Paper shapes: RVQ pack (d={p['d']}, r={p['r']}, {p['batch']} x {p['seq']} tokens) and SPEL at r = 256", "",
         f"Measured on {env.get('gpu', 'CPU')}: {env['cpu_model']}, {env['threads']} thread(s), torch {env['torch']}; "
         "load average "
         f"{env['loadavg_start']:.2f} -> {env['loadavg_end']:.2f} (2 cores shared: times are upper bounds).", "",
         "| kernel | k-means init s | search s | pack s | unpack s | ns/distance |", "|---|---|---|---|---|---|"]
    L += [f"| {r['kernel']} | {r['init_s']:.1f} | {r['search_s']:.2f} | {r['pack_s']:.2f} | {r['unpack_s']:.3f} | "
          f"{r['ns_per_distance']:.2f} |" for r in rv["cpu"]]
    g = rv["gpu_estimate"]
    L += ["", f"GPU estimate per message ({g['distances_per_message']:.3g} distances; bandwidth x{BW_EFF}, fp32 x{FP_EFF}, "
          f"{p['micro_batches']} messages per step, stage step = {g['stage_step_flops']:.3g} FLOP at MFU {MFU}):", "",
          "| GPU | stage step s | kernel | pack ms | % of step | % of a 3 s step |", "|---|---|---|---|---|---|"]
    for name in GPUS:
        for kern in ("matmul", "fused"):
            e = g[name][kern]
            L.append(f"| {name} | {g[name]['stage_step_s_at_mfu']:.2f} | {kern} | {1e3 * e['pack_s']:.2f} | "
                     f"{e['pct_of_step']:.1f} | {e['pct_of_3s_step']:.1f} |")
    L += ["", "| d | r | SVD step ms | Polar Express step ms | max ortho err SVD | Polar Express | GPU PE est. ms (H100) |",
          "|---|---|---|---|---|---|---|"]
    for s in res["spel"]:
        L.append(f"| {s['d']} | {s['r']} | {1e3 * s['svd']['step_s']:.1f} | {1e3 * s['polar_express']['step_s']:.1f} | "
                 f"{s['svd']['ortho_err_max']:.2e} | {s['polar_express']['ortho_err_max']:.2e} | "
                 f"{1e3 * s['gpu_estimate']['H100-SXM']['polar_express_s']:.2f} |")
    return "\n".join(L) + "\n"


def run_paper(args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    env = _environment(torch, args.device)
    reps = args.reps or 2
    res = {"environment": env, "rvq": bench_rvq_paper(torch, PAPER, reps, tuple(args.kernels), args.device),
           "spel": bench_spel_paper(torch, reps=reps, drift_steps=args.spel_steps, device=args.device)}
    env["loadavg_end"] = os.getloadavg()[0]
    return res


# ---- the report ----------------------------------------------------------------------------------

def overhead_row(ops: dict, spel: dict | None, stage_s: float, learned: bool, micro_batches: int) -> dict:
    """Per-micro-batch compressor cost against the stage's fwd+bwd; a learned projector adds one SPEL
    step per optimizer step (amortised over its micro-batches)."""
    enc = ops["encode_fwd"] + ops["encode_bwd"]
    dec = ops["decode_fwd"] + ops["decode_bwd"]
    wire = ops["pack"] + ops["unpack"] + ops["pack_grad"] + ops["unpack_grad"]
    spel_s = (spel["svd"] / micro_batches) if (learned and spel) else 0.0
    spel_pe = (spel["polar_express"] / micro_batches) if (learned and spel) else 0.0
    total = enc + dec + wire + spel_s
    return {"encode_s": enc, "decode_s": dec, "wire_s": wire, "spel_amortized_s": spel_s,
            "total_s": total, "stage_fwd_bwd_s": stage_s, "overhead_pct": 100 * total / stage_s,
            "overhead_pct_polar_express": 100 * (total - spel_s + spel_pe) / stage_s}


def run(args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    cfg = dict(QUICK if args.quick else FULL)
    if args.batch:
        cfg["batch"] = args.batch
    if args.seq:
        cfg["seq"] = args.seq
    if args.dims:
        cfg["dims"] = tuple(args.dims)
    if args.ranks:
        cfg["ranks"] = tuple(args.ranks)
    if args.reps:
        cfg["reps"] = args.reps
    B, T, M = cfg["batch"], cfg["seq"], cfg["micro_batches"]
    dev = args.device
    timer = Timer(torch, dev, cfg["warmup"], cfg["reps"])
    log = (lambda *a: None) if args.silent else (lambda *a: print(*a, file=sys.stderr, flush=True))
    t_start = time.time()
    res = {"settings": {**{k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
                        "quick": args.quick, "methods": list(args.methods)},
           "environment": _environment(torch, dev), "ops": [], "spel": [], "search": [], "stage": [],
           "overhead": [], "wire": [], "memory": []}
    if args.mapl_path:
        res["environment"]["mapl_path"] = args.mapl_path
    import mapl
    res["environment"]["mapl_module"] = str(Path(mapl.__file__).resolve().parent)

    stages = {}
    for d in cfg["dims"]:
        ranks = [r for r in cfg["ranks"] if r < d]
        if not args.skip_stage:
            stages[d] = bench_stage(torch, timer, d, B, T, dev, cfg["stage_reps"])
            res["stage"].append({"d": d, **stages[d]})
            log(f"stage d={d} ({stages[d]['preset']}): {stages[d]['fwd_bwd_s']:.3f} s fwd+bwd")
        for r in ([] if args.skip_ops else ranks):
            spel = bench_spel(torch, timer, d, r, dev)
            res["spel"].append({"d": d, "r": r, **spel})
            for method in args.methods:
                if method in ("none", "int8") and r != ranks[0]:
                    continue              # rank-independent: measured once per d
                ops = bench_ops(torch, timer, method, d, r, B, T, dev)
                mins, learned = ops.pop("_min"), ops.pop("_learned")
                row = {"method": method, "d": d, "r": None if method in ("none", "int8") else r,
                       "tokens": B * T, **ops, "min": mins, "learned": learned}
                res["ops"].append(row)
                if d in stages:
                    ov = overhead_row(ops, spel, stages[d]["fwd_bwd_s"], learned, M)
                    # the same from the fastest run of each piece: less sensitive to a busy machine
                    ov["overhead_pct_from_min"] = overhead_row(mins, spel, stages[d]["min_s"], learned, M)["overhead_pct"]
                    res["overhead"].append({"method": method, "d": d, "r": row["r"], **ov})
                res["wire"].append(wire_row(torch, method, d, r, B, T, M))
                log(f"d={d} r={r} {method}: " + ", ".join(f"{k} {v * 1e3:.2f}ms" for k, v in ops.items()))
    for K in ([] if args.skip_search else cfg["search_K"]):
        dim = cfg["search_dim"]
        per_tok = (dim // 2) * 2 * K                 # distance evaluations per token (default layout)
        n_tok = max(16, min(B * T, cfg["search_elems"] // per_tok))
        res["search"].append(bench_search(torch, timer, dim, K, n_tok, dev))
        log(f"search K={K}: {res['search'][-1]}")
    if not args.skip_memory:
        for d in cfg["memory_dims"]:
            r = max(x for x in cfg["ranks"] if x < d)
            res["memory"].extend(bench_memory(args.memory_methods or args.methods, d, r, B, T, args.threads,
                                              args.mapl_path))
            log(f"memory d={d}: {[(x['method'], round(x['peak_rss_mb'])) for x in res['memory']]}")
    if args.ab_before:
        res["ab"] = {"before": str(Path(args.ab_before).resolve()),
                     "rows": bench_ab(torch, args.ab_before, cfg, args.methods, log)}
        # overhead at each (d, r) with the wire legs scaled back by the A/B speedups (ratios, not the A/B
        # run's absolute times: those carry the load of the moment); stage, encode/decode, SPEL unchanged
        ops_now = {_key(r): r for r in res["ops"]}
        for o in res["overhead"]:
            if o["method"] not in ("int8", "mapl-rvq"):
                continue
            ab = {x["op"]: x for x in res["ab"]["rows"] if x.get("method") == o["method"] and x["d"] == o["d"]
                  and x["r"] == o["r"]}
            now = ops_now.get(_key(o))
            if "pack" in ab and "unpack" in ab and now:
                extra = (now["pack"] * (ab["pack"]["speedup"] - 1) + now["unpack"] * (ab["unpack"]["speedup"] - 1))
                if o["method"] == "int8":                  # int8 quantises the gradient leg with the same code
                    extra += (now["pack_grad"] * (ab["pack"]["speedup"] - 1)
                              + now["unpack_grad"] * (ab["unpack"]["speedup"] - 1))
                o["overhead_pct_before_ab"] = 100 * (o["total_s"] + extra) / o["stage_fwd_bwd_s"]
    hd, hr = cfg["headline"]
    head = [o for o in res["overhead"] if o["d"] == hd and o["r"] in (hr, None)]
    res["headline"] = {"d": hd, "r": hr, "target_pct": 5.0,
                       "overhead_pct": {o["method"]: o["overhead_pct"] for o in head},
                       "min_wire_efficiency": min((w["efficiency"] for w in res["wire"]), default=None)}
    res["environment"]["loadavg_end"] = os.getloadavg()[0]
    res["environment"]["wall_s"] = time.time() - t_start
    if args.baseline:
        res["baseline"] = _baseline_compare(json.loads(Path(args.baseline).read_text()), res)
        res["baseline"]["file"] = args.baseline
    return res


def _key(row: dict) -> tuple:
    return (row.get("method"), row.get("d"), row.get("r"), row.get("K"))


def _baseline_compare(old: dict, new: dict) -> dict:
    """before/after (speedup = before / after) for every op, overhead, search and SPEL row both runs have."""
    out = {"environment": old.get("environment", {}), "ops": [], "overhead": [], "search": [], "spel": []}
    ops_old = {_key(r): r for r in old.get("ops", [])}
    ops_new = {_key(r): r for r in new["ops"]}
    for r in new["ops"]:
        o = ops_old.get(_key(r))
        if o:
            out["ops"].append({"method": r["method"], "d": r["d"], "r": r["r"],
                               **{k: {"before": o[k], "after": r[k], "speedup": o[k] / r[k] if r[k] else None}
                                  for k in ("pack", "unpack", "encode_bwd", "decode_bwd") if k in o}})
    # "before" overhead: the earlier run's op times over this run's stage time and SPEL step (so a
    # baseline run may skip the slow stage measurement: --skip-stage)
    spel_new = {(s["d"], s["r"]): s for s in new.get("spel", [])}
    stage_new = {s["d"]: s["fwd_bwd_s"] for s in new.get("stage", [])}
    M = new["settings"]["micro_batches"]
    for r in new["overhead"]:
        o = ops_old.get(_key(r))
        if o:
            spel = spel_new.get((r["d"], r["r"])) if r["r"] else None
            learned = ops_new[_key(r)]["learned"]
            before = overhead_row(o, spel, stage_new[r["d"]], learned, M)
            out["overhead"].append({"method": r["method"], "d": r["d"], "r": r["r"],
                                    "overhead_pct_before": before["overhead_pct"], "overhead_pct_after": r["overhead_pct"],
                                    "total_ms_before": 1e3 * before["total_s"], "total_ms_after": 1e3 * r["total_s"]})
    s_old = {r["K"]: r for r in old.get("search", [])}
    for r in new["search"]:
        o = s_old.get(r["K"])
        if o:
            out["search"].append({"K": r["K"], "us_per_token_before": o["us_per_token"],
                                  "us_per_token_after": r["us_per_token"],
                                  "speedup": o["us_per_token"] / r["us_per_token"]})
    return out


def _f(v, scale=1e3, nd=2):
    return "-" if v is None else f"{v * scale:.{nd}f}"


def markdown(res: dict) -> str:
    env, st = res["environment"], res["settings"]
    L = [f"# Compressor benchmark ({'quick' if st['quick'] else 'full'})", "",
         f"torch {env['torch']}, {env['threads']} thread(s), {env['cpu_model']} ({env['device']}); "
         f"B x T = {st['batch']} x {st['seq']} tokens; median of {st['reps']} runs after {st['warmup']} warm-up; "
         f"load average {env['loadavg_start']:.2f} -> {env.get('loadavg_end', float('nan')):.2f}.", ""]
    hd = res["headline"]
    if hd["overhead_pct"]:
        L += [f"**Headline** (d={hd['d']}, r={hd['r']}, 2 blocks/stage, {st['micro_batches']} micro-batches/step): "
              + ", ".join(f"{m} {v:.2f}%" for m, v in hd["overhead_pct"].items())
              + f" of the stage's fwd+bwd (target < {hd['target_pct']:.0f}%).", ""]
    if res["overhead"]:
        L += ["## Overhead per micro-batch vs the stage's forward+backward", "",
              "| method | d | r | encode f+b ms | decode f+b ms | wire 4 legs ms | SPEL/μb ms | total ms | stage f+b ms "
              "| overhead % | from min times % | w/ Polar Express % |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for o in res["overhead"]:
            L.append(f"| {o['method']} | {o['d']} | {o['r'] or '-'} | {_f(o['encode_s'])} | {_f(o['decode_s'])} | "
                     f"{_f(o['wire_s'])} | {_f(o['spel_amortized_s'])} | {_f(o['total_s'])} | "
                     f"{_f(o['stage_fwd_bwd_s'], 1e3, 0)} | "
                     f"{o['overhead_pct']:.2f} | {o.get('overhead_pct_from_min', float('nan')):.2f} | "
                     f"{o['overhead_pct_polar_express']:.2f} |")
        L.append("")
    L += ["## Per-op times (ms, median)", "",
          "| method | d | r | encode fwd | encode bwd | decode fwd | decode bwd | pack | unpack | pack_grad | unpack_grad |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for o in res["ops"]:
        L.append(f"| {o['method']} | {o['d']} | {o['r'] or '-'} | " + " | ".join(
            _f(o[k], 1e3, 3) for k in ("encode_fwd", "encode_bwd", "decode_fwd", "decode_bwd", "pack", "unpack",
                                       "pack_grad", "unpack_grad")) + " |")
    L += ["", "## SPEL step (ms)", "", "| d | r | SVD polar | Polar Express (10 steps) |", "|---|---|---|---|"]
    for s in res["spel"]:
        L.append(f"| {s['d']} | {s['r']} | {_f(s['svd'])} | {_f(s['polar_express'])} |")
    L += ["", "## RVQ nearest-codeword search (ResidualVQ.search, default layout)", "",
          "| K | dim | G x R | tokens | time ms | μs/token | ns/distance |", "|---|---|---|---|---|---|---|"]
    for s in res["search"]:
        L.append(f"| {s['K']} | {s['dim']} | {s['groups']} x {s['rounds']} | {s['tokens']} | {_f(s['median_s'])} | "
                 f"{s['us_per_token']:.2f} | {s['ns_per_distance']:.3f} |")
    if res["stage"]:
        L += ["", "## Stage (2 blocks) forward+backward", "", "| d | preset | s |", "|---|---|---|"]
        L += [f"| {s['d']} | {s['preset']} | {s['fwd_bwd_s']:.3f} |" for s in res["stage"]]
    L += ["", "## Wire efficiency (bytes/token; floor / measured)", "",
          "| method | d | r | fwd measured | fwd floor | bwd measured | bwd floor | efficiency | w/ per-step state sync "
          "| explained by |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for w in res["wire"]:
        L.append(f"| {w['method']} | {w['d']} | {w['r'] or '-'} | {w['fwd_bytes_per_token']:.3f} | "
                 f"{w['fwd_floor_bytes_per_token']:.3f} | {w['bwd_bytes_per_token']:.3f} | "
                 f"{w['bwd_floor_bytes_per_token']:.3f} | "
                 f"{100 * w['efficiency']:.2f}% | {100 * w['efficiency_with_state_sync']:.2f}% | {w['explained_by'] or '-'} |")
    if res["memory"]:
        L += ["", "## Peak memory of a stage process (one fwd+bwd of 2 blocks + the boundary)", "",
              "| method | d | r | peak RSS MB (VmHWM) | after build MB | step increase MB | peak vs none MB |",
              "|---|---|---|---|---|---|---|"]
        L += [f"| {m['method']} | {m['d']} | {m['r']} | {m['peak_rss_mb']:.1f} | {m['rss_after_build_mb']:.1f} | "
              f"{m['step_peak_increase_mb']:.1f} | {m['delta_vs_none_mb']:+.1f} |" for m in res["memory"]]
    if res.get("ab"):
        L += ["", f"## Before / after, interleaved in one process (before: {res['ab']['before']})", "",
              "| op | method | d | r / K | before ms | after ms | speedup |", "|---|---|---|---|---|---|---|"]
        for a in res["ab"]["rows"]:
            L.append(f"| {a['op']} | {a.get('method', 'rvq')} | {a.get('d', '-')} | {a.get('r') or a.get('K') or '-'} | "
                     f"{_f(a['before_s'])} | {_f(a['after_s'])} | {a['speedup']:.2f}x |")
        rows = [o for o in res["overhead"] if "overhead_pct_before_ab" in o]
        if rows:
            L += ["", "| method | d | r | overhead % before | after |", "|---|---|---|---|---|"]
            L += [f"| {o['method']} | {o['d']} | {o['r'] or '-'} | {o['overhead_pct_before_ab']:.2f} | {o['overhead_pct']:.2f} |"
                  for o in rows]
    if "baseline" in res:
        b = res["baseline"]
        load = b["environment"].get("loadavg_start", float("nan"))
        L += ["", f"## Before / after (before: {b.get('file')}, load {load:.2f})", ""]
        if b["search"]:
            L += ["| search K | μs/token before | after | speedup |", "|---|---|---|---|"]
            L += [f"| {s['K']} | {s['us_per_token_before']:.2f} | {s['us_per_token_after']:.2f} | {s['speedup']:.2f}x |"
                  for s in b["search"]]
            L.append("")
        rows = [o for o in b["ops"] if o["method"] in ("mapl-rvq", "int8")]
        if rows:
            L += ["| method | d | r | pack before ms | after | speedup | unpack before ms | after | speedup |",
                  "|---|---|---|---|---|---|---|---|---|"]
            for o in rows:
                L.append(f"| {o['method']} | {o['d']} | {o['r'] or '-'} | {_f(o['pack']['before'])} | {_f(o['pack']['after'])} | "
                         f"{o['pack']['speedup']:.2f}x | {_f(o['unpack']['before'])} | {_f(o['unpack']['after'])} | "
                         f"{o['unpack']['speedup']:.2f}x |")
            L.append("")
        if b["overhead"]:
            L += ["| method | d | r | overhead % before | after |", "|---|---|---|---|---|"]
            L += [f"| {o['method']} | {o['d']} | {o['r'] or '-'} | {o['overhead_pct_before']:.2f} | "
                  f"{o['overhead_pct_after']:.2f} |" for o in b["overhead"]]
    return "\n".join(L) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, a few seconds")
    ap.add_argument("--json", help="default reports/bench/compress.json (paper shape: paper_shape.json)")
    ap.add_argument("--md", help="default reports/tables/compress.md (paper shape: paper_shape.md)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--memory-methods", nargs="+", choices=METHODS, help="default: --methods")
    ap.add_argument("--dims", type=int, nargs="+")
    ap.add_argument("--ranks", type=int, nargs="+")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--skip-stage", action="store_true")
    ap.add_argument("--skip-ops", action="store_true", help="skip per-op, SPEL and wire measurements")
    ap.add_argument("--skip-search", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--baseline", help="an earlier compress.json: report before/after speedups")
    ap.add_argument("--mapl-path", help="import mapl from this directory (e.g. a pre-change copy)")
    ap.add_argument("--ab-before", help="directory holding a pre-change copy of mapl/: time its int8/mapl-rvq "
                                        "pack/unpack and RVQ search alternately with the current code")
    ap.add_argument("--paper-shape", action="store_true",
                    help="only the paper-shape section: RVQ pack at d=1024, r=256, 16 x 2048 tokens and SPEL at "
                         "r=256 on CPU, plus GPU estimates (writes --json/--md, default reports/bench/paper_shape.*)")
    ap.add_argument("--kernels", nargs="+", default=["matmul", "fused"], choices=("matmul", "fused"))
    ap.add_argument("--spel-steps", type=int, default=200)
    ap.add_argument("--silent", action="store_true")
    ap.add_argument("--_memory-child", dest="memory_child", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(args.mapl_path).resolve()) if args.mapl_path else str(ROOT))
    if args.memory_child:
        print(json.dumps(_memory_child(json.loads(args.memory_child))))
        return {}
    name, run_fn, md_fn = ("paper_shape", run_paper, paper_markdown) if args.paper_shape else ("compress", run, markdown)
    res = run_fn(args)
    out_json = args.json or str(ROOT / f"reports/bench/{name}.json")
    out_md = args.md or str(ROOT / f"reports/tables/{name}.md")
    for path, text in ((out_json, json.dumps(res, indent=1)), (out_md, md_fn(res))):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.{os.getpid()}.tmp")             # unique: two runs never share a temp file
        tmp.write_text(text)
        tmp.replace(path)
    if not args.silent:
        print(md_fn(res))
    return res


if __name__ == "__main__":
    main()
