"""Greedy residual nearest-codeword search, the bulk of an RVQ message's cost.

Round r quantises, per group, the residual of rounds < r: argmin_k ||c_k||^2 - 2 x.c_k (ties: the first
minimum). Kernels (``compressor.rvq.search_kernel``): ``matmul``, one batched matmul per tile and round, then an
argmin (exact, cache-friendly on a CPU; on a GPU it writes every distance to memory); ``fused``, the same argmin
compiled into one kernel that never stores the distances; ``auto``, fused on a GPU and, on a CPU, the C kernel of
``native.py`` (the matmul kernel's bits, with the EMA sums in the same pass), else matmul. All are exact; matmul
and fused can differ only on exact ties computed with different rounding.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from ...config import RVQ_SEARCH_KERNELS

__all__ = ["SEARCH_KERNELS", "CPU_TILE_BYTES", "GPU_TILE_BYTES", "residual_search", "search_tiles", "tile_budget",
           "first_argmin_", "uses_fused", "fused_allowed", "search_transient_bytes", "warm_fused_search"]

SEARCH_KERNELS = RVQ_SEARCH_KERNELS
CPU_TILE_BYTES = 4 << 20          # the "auto" tile budget (bytes of one tile's distance block) on a CPU
GPU_TILE_BYTES = 256 << 20        # ... and on a GPU


def first_argmin_(d: torch.Tensor, rev: torch.Tensor) -> torch.Tensor:
    """``d.argmin(-1)`` (first minimum on ties), overwriting ``d``; ``rev = arange(K, 0, -1)`` in d's dtype.

    ATen's CPU argmin is a scalar loop (~0.8 ns a value); this is four vectorised passes (~0.25 ns): d <- (d <= min)
    * (K - k), whose largest entry is the first minimum. Exact (K <= 2**16 is exact in float32).
    """
    if d.is_cuda:
        return d.argmin(-1)
    K = d.shape[-1]
    m = d.amin(-1, keepdim=True)
    d.le_(m).mul_(rev)
    return (K - d.amax(-1).to(torch.int64)).clamp_(0, K - 1)


def _nearest_fused(res: torch.Tensor, C: torch.Tensor, c2: torch.Tensor) -> torch.Tensor:
    """argmin_k ||c_k||^2 - 2 res.c_k, res (g, n, ds), C (g, K, ds), c2 (g, K) -> (g, n). Written so torch.compile
    fuses it into one kernel (the distances stay in registers); only ever run compiled."""
    dot = (res.unsqueeze(2) * C.unsqueeze(1)).sum(-1)
    return (c2.unsqueeze(1) - 2.0 * dot).argmin(-1)


_COMPILED: dict[str, object] = {}


def _fused_kernel():
    """:func:`_nearest_fused`, compiled on first use. ``dynamic=False`` keeps the codeword dimension static: a
    symbolic one made inductor materialise the (G, N, K) distances (+516 MiB per call at G=128, N=4,096)."""
    if "nearest" not in _COMPILED:
        _COMPILED["nearest"] = torch.compile(_nearest_fused, dynamic=False, fullgraph=True)
    return _COMPILED["nearest"]


def _tokens_symbolic(res: torch.Tensor) -> torch.Tensor:
    """Mark the token dimension dynamic: batches of any size share one compiled kernel (n = 1 gets its own)."""
    torch._dynamo.maybe_mark_dynamic(res, 1)
    return res


def search_tiles(n_groups: int, n_tokens: int, K: int, budget_elems: int) -> tuple[int, int]:
    """(groups, tokens) per tile so its (groups, tokens, K) distances hold about ``budget_elems`` values: all
    groups while that leaves >= 16 tokens per tile, else fewer groups rather than fewer tokens."""
    ts = budget_elems // (n_groups * K)
    if ts >= min(16, n_tokens):
        return n_groups, max(1, ts)
    gs = max(1, min(n_groups, budget_elems // (16 * K)))
    return gs, max(1, budget_elems // (gs * K))


def tile_budget(tile_bytes: int, dtype: torch.dtype, device: torch.device) -> int:
    budget = tile_bytes or (GPU_TILE_BYTES if device.type == "cuda" else CPU_TILE_BYTES)
    return max(1, budget // dtype.itemsize)


def uses_fused(kernel: str, device: torch.device | str) -> bool:
    return kernel == "fused" or (kernel == "auto" and torch.device(device).type == "cuda")


def fused_allowed() -> bool:
    """Not under a (non-infrastructure) dispatch mode (a host-read counter, a FLOP counter, a memory probe): dynamo
    skips the frame there, and ``fullgraph=True`` turns that into an error that poisons the frame for the rest
    of the process (torch 2.11-2.13)."""
    return not is_in_torch_dispatch_mode(include_infra_modes=False)


def search_transient_bytes(n_tokens: int, groups: int, rounds: int, K: int, ds: int, *, kernel: str = "auto",
                           tile_bytes: int = 0, device: torch.device | str = "cpu", itemsize: int = 4) -> int:
    """Peak bytes one :func:`residual_search` with ``return_residual`` allocates beyond its input: codebooks,
    residuals, indices and gathered codewords; the matmul kernel adds its tile's distance block."""
    G, N, R = groups, n_tokens, rounds
    fixed = R * G * K * ds * itemsize + G * N * (ds + 1) * itemsize + 2 * N * G * R * 8 + N * G * ds * itemsize
    per_round = 2 * G * N * 8 + G * N * ds * itemsize
    if uses_fused(kernel, device):
        return fixed + per_round
    budget = tile_budget(tile_bytes, torch.float32 if itemsize == 4 else torch.float64, torch.device(device))
    gs, ts = search_tiles(G, N, K, budget)
    gs, ts = min(gs, G), min(ts, N)
    block = gs * ts * K * itemsize + 2 * gs * ts * itemsize
    return fixed + R * G * (ds + 1) * K * itemsize + per_round + block


@torch.no_grad()                         # as ResidualVQ.search: grad mode is part of the compiled guard
def warm_fused_search(groups: int, K: int, ds: int, dtype: torch.dtype, device: torch.device | str) -> None:
    """Compile the fused kernel now (tens of seconds cold), not in the first step under the comm timeout."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, groups, ds, generator=g).to(device=device, dtype=dtype)
    C = torch.randn(groups, 1, K, ds, generator=g).to(device=device, dtype=dtype)
    residual_search(x, C, kernel="fused")


def residual_search(x: torch.Tensor, C: torch.Tensor, *, kernel: str = "auto", tile_bytes: int = 0,
                    return_residual: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (N, G, ds), codebooks C (G, R, K, ds) -> indices (N, G, R) int64 and the final residual (or None)."""
    N, G, ds = x.shape
    R, K, dev, dt = C.shape[1], C.shape[2], x.device, x.dtype
    xt = x.transpose(0, 1)                                              # (G, N, ds) view
    Cr = [C[:, r].contiguous() for r in range(R)]                       # (G, K, ds) per round
    fused = uses_fused(kernel, dev) and fused_allowed()
    nearest = _nearest(Cr, fused)
    idx = torch.empty(N, G, R, dtype=torch.int64, device=dev)
    resid = torch.empty(N, G, ds, dtype=dt, device=dev) if return_residual else None
    # fused: no distance block to bound, one tile
    gs, ts = (G, max(1, N)) if fused else search_tiles(G, N, K, tile_budget(tile_bytes, dt, dev))
    for g0 in range(0, G, gs):
        g1 = min(G, g0 + gs)
        goff = torch.arange(g0, g1, device=dev)[:, None] * K            # row offsets into (G*K, ds)
        for s in range(0, N, ts):
            n = min(ts, N - s)
            res_aug = torch.ones(g1 - g0, n, ds + 1, dtype=dt, device=dev)
            res_aug[..., :ds] = xt[g0:g1, s:s + n]
            idx[s:s + n, g0:g1] = _search_tile(res_aug, nearest, Cr, goff, g0, g1)
            if resid is not None:
                resid[s:s + n, g0:g1] = res_aug[..., :ds].transpose(0, 1)
    return idx, resid


def _nearest(Cr: list[torch.Tensor], fused: bool):
    """``f(res_aug, r, g0, g1) -> (g1-g0, n)``: round r's nearest codewords for groups g0:g1 (res_aug = [res, 1])."""
    c2 = [(c * c).sum(-1) for c in Cr]                                  # ||c||^2 (G, K) per round
    if fused:
        kernel = _fused_kernel()
        return lambda res_aug, r, g0, g1: kernel(_tokens_symbolic(res_aug[..., :-1]), Cr[r][g0:g1], c2[r][g0:g1])
    # augmented codebooks [-2 c ; ||c||^2] (G, ds+1, K): with res_aug = [res, 1] one bmm gives
    # ||c||^2 - 2 res.c directly (no broadcast copy of ||c||^2 into the output, as baddbmm does)
    Ca = [torch.cat([-2.0 * c.transpose(1, 2), q.unsqueeze(1)], 1).contiguous() for c, q in zip(Cr, c2)]
    K, dev, dt = Cr[0].shape[1], Cr[0].device, Cr[0].dtype
    rev = torch.arange(K, 0, -1, device=dev, dtype=dt)                 # K - k
    return lambda res_aug, r, g0, g1: first_argmin_(torch.bmm(res_aug, Ca[r][g0:g1]), rev)


def _search_tile(res_aug: torch.Tensor, nearest, Cr: list[torch.Tensor], goff: torch.Tensor, g0: int,
                 g1: int) -> torch.Tensor:
    """Every round of one tile: its residual ``res_aug[..., :-1]`` updated in place; the indices (n, gs, R)."""
    res = res_aug[..., :-1]                                             # (gs, n, ds) view
    G, K, ds = Cr[0].shape
    out = torch.empty(res.shape[1], res.shape[0], len(Cr), dtype=torch.int64, device=res.device)
    for r, cr in enumerate(Cr):
        i = nearest(res_aug, r, g0, g1)                                 # (gs, n)
        out[:, :, r] = i.T
        res -= cr.view(G * K, ds).index_select(0, (i + goff).view(-1)).view(res.shape)
    return out
