"""One call on one GPU that answers issue 22's open questions before a paper run: ~1-2 minutes on an H200.

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
* ``host-reads``: device-to-host reads in one training micro-batch through a boundary, per method
  (aten ops that must read the device: ``_local_scalar_dense``, ``nonzero``, ``masked_select``,
  ``unique``, copies to the CPU), the first micro-batch and a later one; on CUDA also the syncs
  ``torch.cuda.set_sync_debug_mode`` reports;
* ``boundary-error``: ||decode(received) - sent|| / ||sent|| per method at one boundary, fp32 and bf16
  autocast on the same weights (the residual stream stays fp32 under bf16).

Every measurement runs at a short sequence on a randomly initialised model: shapes, not training,
decide each of these numbers. Exit 0 when every item was measured, 1 when one failed (its error is in
its JSON), 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mapl.core.config import load_run_config
from mapl.base.io import atomic_write_json
from mapl.core.memory import block_activation_bytes_per_token
from mapl.core.model import Block, ModelConfig, rope_tables
from mapl.core.stages import build_staged_model

__all__ = ["main", "saved_bytes", "rvq_kernel", "host_reads", "boundary_error", "HostReads"]

METHODS = {"none": 1.0, "int8": 1.0, "ssn": 4.0, "mapl": 4.0, "mapl-rvq": 4.0}
ITEMS = ("saved-bytes", "rvq-kernel", "host-reads", "boundary-error")
# device-to-host reads: ops whose result the host must wait for (a value, or a data-dependent shape)
HOST_READ_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                 "unique_consecutive", "unique_dim", "repeat_interleave")


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
class HostReads(TorchDispatchMode):
    """Counts the aten calls in it that read the device from the host (by op name), and copies to the CPU
    of tensors that live elsewhere."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in HOST_READ_OPS or self._to_cpu(name, args, kwargs) or self._mask_index(name, args):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **kwargs)

    @staticmethod
    def _mask_index(name: str, args) -> bool:
        """Indexing by a boolean mask (``x[x > 0]``): the result's size is the mask's count, read by the host."""
        if name not in ("index", "index_put", "index_put_", "_index_put_impl_") or len(args) < 2:
            return False
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())

    @staticmethod
    def _to_cpu(name: str, args, kwargs) -> bool:
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "_to_copy" and src is not None:
            dev = kwargs.get("device")
            return dev is not None and torch.device(dev).type == "cpu" and src.device.type != "cpu"
        if name == "copy_" and src is not None and len(args) > 1 and isinstance(args[1], torch.Tensor):
            return src.device.type == "cpu" and args[1].device.type != "cpu"
        return False

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _count_reads(fn, device: torch.device) -> dict:
    """Host reads of one call of ``fn``: the dispatch count and, on CUDA, the sync debug mode's warnings."""
    mode = HostReads()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with mode:
                fn()
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught) if device.type == "cuda" else None
    return {"reads": mode.total, "by_op": dict(mode.counts), "cuda_syncs": syncs}


def _micro_batch(sm, ids: torch.Tensor, y: torch.Tensor, device: torch.device) -> None:
    """One training micro-batch of the single-process pipeline: forward through every wire, backward."""
    with _autocast(device, "bf16" if device.type == "cuda" else "fp32"):
        loss = sm(ids, y)
    loss.backward()


def host_reads(device: torch.device, profile: str, model: str, vocab: int, shape: tuple[int, int],
               micro_batches: int = 3) -> dict:
    """For each method, P = 2 in one process: one training micro-batch (stage 0, the boundary's pack and
    unpack both ways, stage 1 with its loss, backward) counted for the first and the last of
    ``micro_batches`` (the first includes MAPL+RVQ's k-means start)."""
    rows = []
    for method, ratio in METHODS.items():
        cfg = load_run_config(profile, {"model": model, "method": method, "ratio": ratio, "stages": 2,
                                        "train.loss_chunk_tokens": 0})
        sm = build_staged_model(cfg, vocab).to(device)
        sm.train()
        g = torch.Generator().manual_seed(0)
        counts = []
        for m in range(micro_batches):
            ids = torch.randint(0, vocab, shape, generator=g).to(device)
            y = torch.randint(0, vocab, shape, generator=g).to(device)
            step = functools.partial(_micro_batch, sm, ids, y, device)
            if m in (0, micro_batches - 1):
                counts.append(_count_reads(step, device))
            else:
                step()
        rows.append({"method": method, "ratio": ratio, "first": counts[0], "later": counts[-1]})
        del sm
    return {"shape": list(shape), "model": model, "rows": rows,
            "methods_without_reads": [r["method"] for r in rows if r["later"]["reads"] == 0]}


# ---- 4. bf16 vs fp32 boundary error ---------------------------------------------------------------------
def boundary_error(device: torch.device, profile: str, model: str, vocab: int, shape: tuple[int, int]) -> dict:
    """||decode(unpack(pack(z))) - h|| / ||h|| at the one boundary of P = 2 (h: the residual the projector
    sees, the anchor removed), fp32 and bf16 autocast, the same weights and tokens."""
    rows = []
    for method, ratio in METHODS.items():
        cfg = load_run_config(profile, {"model": model, "method": method, "ratio": ratio, "stages": 2})
        sm = build_staged_model(cfg, vocab).to(device)
        sm.eval()
        ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1)).to(device)
        errs = {}
        for precision in ("fp32", "bf16"):
            with torch.no_grad(), _autocast(device, precision):
                h = sm.boundary_input(0, None, ids).float()
                comp = sm.boundaries["0"]
                z = sm.stage_forward(0, None, ids)
                x = comp.unpack(comp.pack(z), z.dtype)
                errs[precision] = float((comp.decode(x).float() - h).norm() / h.norm())
        rows.append({"method": method, "ratio": ratio, **errs, "bf16_over_fp32": errs["bf16"] / max(errs["fp32"], 1e-12)})
        del sm
    return {"shape": list(shape), "model": model, "rows": rows}


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


def run_item(name: str, fn, out: Path, device: torch.device, log) -> dict:
    """Measure one item and write ``<out>/check-<name>.json`` at once (its error instead, if it fails)."""
    t0 = time.perf_counter()
    try:
        rec = {"item": name, "ok": True, **fn()}
    except Exception as e:           # noqa: BLE001 -- one failed item must not cost the others their loan time
        rec = {"item": name, "ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    rec.update(device=str(device), wall_s=round(time.perf_counter() - t0, 3),
               gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None, torch=torch.__version__)
    atomic_write_json(out / f"check-{name}.json", rec)
    log(f"[{rec['wall_s']:7.1f}s] {'done' if rec['ok'] else 'FAILED'} {name}")
    return rec


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "gpu", help="folder for check-*.json")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--small", action="store_true", help="micro shapes: the CPU rehearsal the tests run")
    ap.add_argument("--items", default=",".join(ITEMS), help=f"comma-separated subset of {', '.join(ITEMS)}")
    a = ap.parse_args(argv)
    items = [i for i in a.items.split(",") if i]
    bad = [i for i in items if i not in ITEMS]
    if bad:
        ap.error(f"--items {','.join(bad)} is invalid: allowed {', '.join(ITEMS)}")
    if a.device not in ("cuda", "cpu"):
        ap.error(f"--device {a.device} is invalid: allowed cuda, cpu")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; use --device cpu --small for the CPU rehearsal")
    a.items = items
    return a


def main(argv=None, log=print) -> int:
    a = parse_args(argv)
    device, s = torch.device(a.device), _settings(a.small)
    a.out.mkdir(parents=True, exist_ok=True)
    pipe = s["pipe"]
    jobs = {"saved-bytes": lambda: saved_bytes(device, s["presets"], s["lengths"]),
            "rvq-kernel": lambda: rvq_kernel(device, **s["rvq"]),
            "host-reads": lambda: host_reads(device, pipe["profile"], pipe["model"], pipe["vocab"], pipe["shape"]),
            "boundary-error": lambda: boundary_error(device, pipe["profile"], pipe["model"], pipe["vocab"],
                                                     pipe["shape"])}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False       # IEEE fp32 where fp32 is measured
        torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    recs = {name: run_item(name, jobs[name], a.out, device, log) for name in a.items}
    atomic_write_json(a.out / "check.json", {"small": a.small, "device": str(device),
                                             "wall_s": round(time.perf_counter() - started, 3), "items": recs})
    log(f"wrote {a.out / 'check.json'} ({time.perf_counter() - started:.1f} s)")
    return 0 if all(r["ok"] for r in recs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
