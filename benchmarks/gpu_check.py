"""One call on one GPU before a paper run: does the memory plan, the RVQ kernel, the wire and bf16 hold on CUDA?

Writes: ``<out>/check-<name>.json`` as each is measured, ``<out>/check.json``.

    python benchmarks/gpu_check.py --out reports/gpu                       # on the GPU
    python benchmarks/gpu_check.py --device cpu --small --out /tmp/check   # the same code path on CPU, micro shapes

Four measurements, each written to ``<out>/check-<name>.json`` (atomically) the moment it is measured,
so a call cut off by the device's time limit keeps every finished one; ``<out>/check.json`` gathers them
at the end. What each decides is in benchmarks/README.md ("One-call GPU check"):

* ``saved-bytes``: bytes autograd saves per token for one block of the 150M and 1B shapes under bf16
  autocast (and fp32), per ``train.norm_cast``, against the memory plan's block term
  (:func:`mapl.core.memory.block_activation_bytes_per_token`); on CUDA also the allocator's growth over the
  forward. CUDA's SDPA saves other tensors than the CPU's math path: the ratio says whether the plan's
  term holds on the GPU;
* ``rvq-kernel``: the fused RVQ search (:mod:`mapl.core.compress.rvq.search`) at the paper's shape: cold
  compile time (what a neighbour waits for under ``train.comm_timeout_s`` were it not warmed) and the
  transient memory of one search over a 16 x 2048-token micro-batch against
  :func:`~mapl.core.compress.rvq.search.search_transient_bytes` (the plan's ``rvq_search``);
* ``host-reads``: device-to-host reads in one training micro-batch through a boundary, per method, the
  first micro-batch and a later one, and one evaluation micro-batch (benchmarks/host_reads.py: ATen ops
  that must read the device, copies to the CPU, and ``tolist``/``numpy``/``item``/``bool`` which read a CPU
  tensor without dispatching, so the CPU rehearsal counts them too); on CUDA also the syncs
  ``torch.cuda.set_sync_debug_mode`` reports over a later micro-batch run outside the counter (under a
  dispatch mode the RVQ search runs its matmul kernel, :func:`mapl.core.compress.rvq.search.fused_allowed`);
* ``boundary-error``: ||decode(received) - sent|| / ||sent|| per method at one boundary, fp32 and bf16
  autocast on the same weights (the residual stream stays fp32 under bf16).

Every measurement runs at a short sequence on a randomly initialised model: shapes, not training,
decide each of these numbers. ``--search-kernel`` sets ``compressor.rvq.search_kernel`` of the
``host-reads`` and ``boundary-error`` models (``fused`` on a CPU rehearses what ``auto`` picks on a GPU);
``--jsonl FILE`` appends each item's record to one JSON-lines file instead of one file per item (a
device call that brings back few files); ``--shape BxT`` sets the pipeline items' micro-batch (the paper
profile's ``norm_cast`` choice was measured on CPU with ``--device cpu --items boundary-error --shape 1x256``,
reports/bench/norm-cast-cpu.jsonl). Exit 0 when every item was measured, 1 when one failed (its
error is in its record), 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch

from host_reads import HostReads, counting_host_reads
from mapl.base.io import atomic_write_json
from mapl.core.config import RVQ_SEARCH_KERNELS, load_run_config
from mapl.core.memory import block_activation_bytes_per_token
from mapl.core.model import Block, ModelConfig, rope_tables
from mapl.core.stages import build_staged_model

__all__ = ["main", "saved_bytes", "rvq_kernel", "host_reads", "boundary_error", "HostReads", "ITEMS", "METHODS"]

METHODS = {"none": 1.0, "int8": 1.0, "ssn": 4.0, "mapl": 4.0, "mapl-rvq": 4.0}
ITEMS = ("saved-bytes", "rvq-kernel", "host-reads", "boundary-error")


# ---- helpers -------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _saved(fn, *args) -> tuple[int, object]:
    """Bytes of the distinct storages autograd saves while ``fn(*args)`` runs (parameters included: they
    cancel in a difference of two lengths)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return sum(seen.values()), out


def _autocast(device: torch.device, precision: str):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def _block(mc: ModelConfig, device: torch.device) -> Block:
    with torch.device("meta"):
        blk = Block(mc)
    blk = blk.to_empty(device=device)
    for p in blk.parameters():
        torch.nn.init.normal_(p, 0.0, 0.02)
    return blk


# ---- 1. saved bytes per block against the plan ----------------------------------------------------------
def saved_bytes(device: torch.device, presets: dict[str, ModelConfig], lengths: tuple[int, int]) -> dict:
    """Per preset, precision and norm cast: saved bytes per token (difference of two sequence lengths,
    so autocast's weight copies and the RoPE tables cancel), the plan's count, their ratio; on CUDA the
    allocator's growth over the forward per token too."""
    rows = []
    for name, mc in presets.items():
        blk = _block(mc, device)
        cos, sin = rope_tables(mc.head_dim, max(lengths), mc.rope_theta, device=device)
        for precision in ("fp32", "bf16"):
            for cast in ("per-linear", "once"):
                if precision == "fp32" and cast == "once":
                    continue                      # nothing is cast in fp32
                blk.cast_norm_once = cast == "once"
                saved, grown = [], []
                for T in lengths:
                    x = torch.zeros(1, T, mc.d_model, device=device, requires_grad=True)
                    _sync(device)
                    before = _allocated(device)
                    with _autocast(device, precision):
                        got, out = _saved(blk, x, cos[:T], sin[:T])
                    _sync(device)
                    saved.append(got)
                    grown.append(_allocated(device) - before - out.numel() * out.element_size())
                    del out
                dT = lengths[1] - lengths[0]
                measured = (saved[1] - saved[0]) / dT
                plan = block_activation_bytes_per_token(mc, precision, cast)
                rows.append({"preset": name, "precision": precision, "norm_cast": cast,
                             "saved_per_token": measured, "plan_per_token": plan, "ratio": measured / plan,
                             "allocated_per_token": (grown[1] - grown[0]) / dT if device.type == "cuda" else None})
        del blk
    worst = max(abs(r["ratio"] - 1) for r in rows)
    return {"rows": rows, "worst_rel_error": worst, "within_3pct": worst <= 0.03}


# ---- 2. the fused RVQ search: compile time and transient memory -----------------------------------------
def rvq_kernel(device: torch.device, groups: int, K: int, ds: int, tokens: int, rounds: int) -> dict:
    """Cold compile of the fused kernel for (groups, K, ds), then one search of ``tokens`` tokens with
    ``rounds`` rounds: its peak transient (the CUDA allocator's) against the plan's. On a CPU the
    transient is not measured (None): compiled code runs no Python dispatch to count, and the
    rehearsal's shapes are far below what the process's RSS resolves."""
    from mapl.core.compress.rvq.search import residual_search, search_transient_bytes, warm_fused_search
    torch._dynamo.reset()
    t0 = time.perf_counter()
    warm_fused_search(groups, K, ds, torch.float32, device)
    _sync(device)
    compile_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, groups, ds, generator=g).to(device)
    C = torch.randn(groups, rounds, K, ds, generator=g).to(device)

    def search():
        with torch.no_grad():
            return residual_search(x, C, kernel="fused", return_residual=True)
    t0 = time.perf_counter()
    search()                                             # a new token count: compiled once more if at all
    _sync(device)
    first_s = time.perf_counter() - t0
    transient = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    search()
    _sync(device)
    search_s = time.perf_counter() - t0
    if device.type == "cuda":
        transient = torch.cuda.max_memory_allocated(device) - before
    plan = search_transient_bytes(tokens, groups, rounds, K, ds, kernel="fused", device=device)
    block = groups * tokens * K * 4                      # what an unfused kernel would write: (G, N, K) fp32
    return {"groups": groups, "K": K, "ds": ds, "tokens": tokens, "rounds": rounds, "compile_s": compile_s,
            "first_call_s": first_s, "search_s": search_s, "transient_bytes": transient, "plan_bytes": plan,
            "ratio": None if transient is None else transient / plan, "distance_block_bytes": block,
            "fused": None if transient is None else transient < block / 4}


# ---- 3. host reads per micro-batch ----------------------------------------------------------------------
def _count_reads(fn) -> dict:
    """Host reads of one call of ``fn`` (benchmarks/host_reads.py), by name."""
    with counting_host_reads() as reads:
        fn()
    return {"reads": reads.total, "by_op": dict(reads.counts)}


def _cuda_syncs(fn, device: torch.device) -> int | None:
    """Syncs CUDA's own detector reports over one call of ``fn`` (no dispatch mode: the fused kernel runs)."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def _micro_batch(sm, ids: torch.Tensor, y: torch.Tensor, device: torch.device) -> None:
    """One training micro-batch of the single-process pipeline: forward through every wire, backward."""
    with _autocast(device, "bf16" if device.type == "cuda" else "fp32"):
        loss = sm(ids, y)
    loss.backward()


def _eval_micro_batch(sm, ids: torch.Tensor, y: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One evaluation micro-batch: eval mode, no graph, the loss left on the device (read once per evaluation)."""
    sm.eval()
    try:
        with torch.no_grad(), _autocast(device, "bf16" if device.type == "cuda" else "fp32"):
            return sm(ids, y)
    finally:
        sm.train()


def host_reads(device: torch.device, profile: str, model: str, vocab: int, shape: tuple[int, int],
               micro_batches: int = 3, search_kernel: str = "auto") -> dict:
    """For each method, P = 2 in one process: one training micro-batch (stage 0, the boundary's pack and
    unpack both ways, stage 1 with its loss, backward) counted for the first and the last of
    ``micro_batches`` (the first includes MAPL+RVQ's k-means start), then one evaluation micro-batch; on
    CUDA one more training micro-batch under the sync detector alone."""
    rows = []
    for method, ratio in METHODS.items():
        cfg = load_run_config(profile, {"model": model, "method": method, "ratio": ratio, "stages": 2,
                                        "train.loss_chunk_tokens": 0, "compressor.rvq.search_kernel": search_kernel})
        sm = build_staged_model(cfg, vocab).to(device)
        sm.train()
        g = torch.Generator().manual_seed(0)

        def batch():
            return (torch.randint(0, vocab, shape, generator=g).to(device),
                    torch.randint(0, vocab, shape, generator=g).to(device))
        counts = []
        for m in range(micro_batches):
            step = functools.partial(_micro_batch, sm, *batch(), device)
            if m in (0, micro_batches - 1):
                counts.append(_count_reads(step))
            else:
                step()
        evaluation = _count_reads(functools.partial(_eval_micro_batch, sm, *batch(), device))
        syncs = _cuda_syncs(functools.partial(_micro_batch, sm, *batch(), device), device)
        rows.append({"method": method, "ratio": ratio, "first": counts[0], "later": {**counts[-1], "cuda_syncs": syncs},
                     "eval": evaluation})
        del sm
    return {"shape": list(shape), "model": model, "search_kernel": search_kernel, "rows": rows,
            "methods_without_reads": [r["method"] for r in rows if r["later"]["reads"] == 0 == r["eval"]["reads"]]}


# ---- 4. bf16 vs fp32 boundary error (and the gradient, per norm cast) -----------------------------------
PRECISIONS = (("fp32", "per-linear"), ("bf16", "per-linear"), ("bf16", "once"))


def _boundary_and_gradient(sm, ids: torch.Tensor, y: torch.Tensor, device: torch.device,
                           precision: str) -> tuple[float, torch.Tensor]:
    """(||decode(received) - h|| / ||h|| at boundary 0, the loss's gradient over every parameter as one
    fp32 vector) under ``precision``; the model is in eval mode, so no compressor state moves."""
    comp = sm.boundaries["0"]
    with torch.no_grad(), _autocast(device, precision):
        h = sm.boundary_input(0, None, ids).float()
        z = sm.stage_forward(0, None, ids)
        x = comp.unpack(comp.pack(z), z.dtype)
        err = float((comp.decode(x).float() - h).norm() / h.norm())
    sm.zero_grad(set_to_none=True)
    with _autocast(device, precision):
        loss = sm(ids, y)
    loss.backward()
    grad = torch.cat([p.grad.float().flatten() for p in sm.parameters() if p.grad is not None])
    sm.zero_grad(set_to_none=True)
    return err, grad


def boundary_error(device: torch.device, profile: str, model: str, vocab: int, shape: tuple[int, int],
                   search_kernel: str = "auto") -> dict:
    """Per method at the one boundary of P = 2, the same weights and tokens: ||decode(unpack(pack(z))) - h||
    / ||h|| (h: the residual the projector sees, the anchor removed) in fp32, bf16 autocast, and bf16 with
    ``train.norm_cast: once``; and the relative error of the loss's gradient (every parameter) of each bf16
    variant against fp32's. ``once`` casts a norm's output once instead of once per linear: the forward is
    the same bits, the three (two) bf16 input gradients are summed in bf16 before the cast back."""
    rows = []
    for method, ratio in METHODS.items():
        cfg = load_run_config(profile, {"model": model, "method": method, "ratio": ratio, "stages": 2,
                                        "compressor.rvq.search_kernel": search_kernel})
        sm = build_staged_model(cfg, vocab).to(device)
        sm.eval()
        g = torch.Generator().manual_seed(1)
        ids, y = (torch.randint(0, vocab, shape, generator=g).to(device) for _ in range(2))
        errs, grads = {}, {}
        for precision, cast in PRECISIONS:
            for block in sm.model.layers.values():
                block.cast_norm_once = cast == "once"
            key = precision if cast == "per-linear" else f"{precision}_once"
            errs[key], grads[key] = _boundary_and_gradient(sm, ids, y, device, precision)
        ref = grads.pop("fp32")
        grad_err = {f"grad_{k}": float((v - ref).norm() / ref.norm()) for k, v in grads.items()}
        rows.append({"method": method, "ratio": ratio, **errs, **grad_err,
                     "bf16_over_fp32": errs["bf16"] / max(errs["fp32"], 1e-12),
                     "grad_once_over_per_linear": grad_err["grad_bf16_once"] / max(grad_err["grad_bf16"], 1e-12)})
        del sm, grads, ref
    return {"shape": list(shape), "model": model, "search_kernel": search_kernel, "rows": rows}


# ---- the call ---------------------------------------------------------------------------------------------
def _settings(small: bool) -> dict:
    """Shapes of each item: the paper's on the GPU, micro ones for the CPU rehearsal (seconds)."""
    if small:
        micro = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=1, ffn_hidden=192,
                            max_seq_len=64)
        return {"presets": {"micro-gqa": micro}, "lengths": (16, 32),
                "rvq": dict(groups=8, K=16, ds=2, tokens=256, rounds=2),
                "pipe": dict(profile="micro", model="micro", vocab=256, shape=(2, 32))}
    return {"presets": {"150M": ModelConfig.preset("150M"), "1B": ModelConfig.preset("1B")}, "lengths": (256, 512),
            # 150M at r = 256 (4x): G = r / 2 groups of 2-dim codewords, K = 256, 2 rounds, 16 x 2048 tokens
            "rvq": dict(groups=128, K=256, ds=2, tokens=16 * 2048, rounds=2),
            "pipe": dict(profile="paper", model="150M", vocab=32000, shape=(2, 2048))}


class _Records:
    """Where each item's record goes the moment it is measured: ``<out>/check-<item>.json`` (atomic) and
    ``check.json`` at the end, or one line per item appended (flushed, fsynced) to a JSON-lines file."""

    def __init__(self, out: Path, jsonl: Path | None):
        self.out, self.jsonl = out, jsonl
        (jsonl.parent if jsonl else out).mkdir(parents=True, exist_ok=True)
        if jsonl is not None:
            jsonl.write_text("", encoding="utf-8")          # this call's records only

    def item(self, rec: dict) -> None:
        if self.jsonl is None:
            atomic_write_json(self.out / f"check-{rec['item']}.json", rec)
        else:
            self._append(rec)

    def end(self, summary: dict, recs: dict) -> Path:
        if self.jsonl is None:
            atomic_write_json(self.out / "check.json", {**summary, "items": recs})
            return self.out / "check.json"
        self._append({"item": "done", **summary})
        return self.jsonl

    def _append(self, rec: dict) -> None:
        with open(self.jsonl, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())


def run_item(name: str, fn, records: _Records, device: torch.device, log) -> dict:
    """Measure one item and record it at once (its error instead, if it fails)."""
    t0 = time.perf_counter()
    try:
        rec = {"item": name, "ok": True, **fn()}
    except Exception as e:           # noqa: BLE001 -- one failed item must not cost the others their loan time
        rec = {"item": name, "ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    rec.update(device=str(device), wall_s=round(time.perf_counter() - t0, 3),
               gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None, torch=torch.__version__)
    records.item(rec)
    log(f"[{rec['wall_s']:7.1f}s] {'done' if rec['ok'] else 'FAILED'} {name}")
    return rec


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "gpu", help="folder for check-*.json")
    ap.add_argument("--jsonl", type=Path, default=None, help="append every record to this one file instead")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--small", action="store_true", help="micro shapes: the CPU rehearsal the tests run")
    ap.add_argument("--items", default=",".join(ITEMS), help=f"comma-separated subset of {', '.join(ITEMS)}")
    ap.add_argument("--search-kernel", default="auto",
                    help=f"compressor.rvq.search_kernel of the pipeline items: {', '.join(RVQ_SEARCH_KERNELS)}")
    ap.add_argument("--shape", default=None, metavar="BxT",
                    help="sequences x tokens of the pipeline items (default 2x2048; --small 2x32): a CPU measurement "
                         "at the paper's width, e.g. --device cpu --items boundary-error --shape 1x256")
    a = ap.parse_args(argv)
    items = [i for i in a.items.split(",") if i]
    bad = [i for i in items if i not in ITEMS]
    if bad:
        ap.error(f"--items {','.join(bad)} is invalid: allowed {', '.join(ITEMS)}")
    if a.device not in ("cuda", "cpu"):
        ap.error(f"--device {a.device} is invalid: allowed cuda, cpu")
    if a.search_kernel not in RVQ_SEARCH_KERNELS:
        ap.error(f"--search-kernel {a.search_kernel} is invalid: allowed {', '.join(RVQ_SEARCH_KERNELS)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; use --device cpu --small for the CPU rehearsal")
    a.items = items
    a.shape = _parse_shape(ap, a.shape)
    return a


def _parse_shape(ap, text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        ap.error(f"--shape {text} is invalid: write sequences x tokens, e.g. 1x256")
    return int(parts[0]), int(parts[1])


def main(argv=None, log=print) -> int:
    a = parse_args(argv)
    device, s = torch.device(a.device), _settings(a.small)
    records = _Records(a.out, a.jsonl)
    pipe = dict(s["pipe"], search_kernel=a.search_kernel, **({"shape": a.shape} if a.shape else {}))
    jobs = {"saved-bytes": lambda: saved_bytes(device, s["presets"], s["lengths"]),
            "rvq-kernel": lambda: rvq_kernel(device, **s["rvq"]),
            "host-reads": lambda: host_reads(device, **pipe),
            "boundary-error": lambda: boundary_error(device, **pipe)}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False       # IEEE fp32 where fp32 is measured
        torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    recs = {name: run_item(name, jobs[name], records, device, log) for name in a.items}
    ok = all(r["ok"] for r in recs.values())
    where = records.end({"small": a.small, "device": str(device), "ok": ok,
                         "wall_s": round(time.perf_counter() - started, 3)}, recs)
    log(f"wrote {where} ({time.perf_counter() - started:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
