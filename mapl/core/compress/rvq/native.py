"""The CPU's fused RVQ search and encode: one C pass per (group, token) that computes every round's distances,
takes the first minimum, updates the residual and accumulates the EMA sums and counts, with the arithmetic of
the ``matmul`` kernel, so its codes, residuals and sums are those bits.

Why the same bits: the matmul kernel's distance is one bmm of [res, 1] with [-2c; ||c||^2], which MKL computes
as a chain of fused multiply-adds over the codeword dimension, the first product rounded, then + ||c||^2;
``fmaf`` is exactly rounded on every machine, so the chain here is that chain. The argmin is the first minimum
(a NaN in a row gives K - 1, as ``first_argmin_``); the sums add each token's residual in token order, as
``index_add_`` does. A BLAS that rounds otherwise would give other bits, so every layout is checked against
the matmul kernel on a seeded problem (exact ties included) before its first use, and falls back to the
matmul kernel if anything differs. Built at first use with the C compiler (``cc``, or ``$CC``) into a cache
(``$MAPL_NATIVE_CACHE``, else ~/.cache/mapl); ``MAPL_RVQ_NATIVE=0`` turns it off. Single-threaded.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["native_search", "native_available", "native_enabled"]

_SRC = r"""
#include <stdint.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* first minimum of d_k = fma-chain_j(res_j * a[j*K + k]) + q[k], k < K (a NaN anywhere: K - 1) */
static int64_t nearest_scalar(const float *res, const float *a, const float *q, int64_t K, int64_t ds) {
    float best = 0.0f; int64_t bi = 0; int nan = 0;
    for (int64_t k = 0; k < K; k++) {
        float acc = res[0] * a[k];
        for (int64_t j = 1; j < ds; j++) acc = fmaf(res[j], a[j * K + k], acc);
        float d = acc + q[k];
        if (d != d) nan = 1;
        if (k == 0 || d < best) { best = d; bi = k; }
    }
    return nan ? K - 1 : bi;
}

#ifdef __AVX2__
static inline __attribute__((always_inline)) __m256 dist8(const __m256 *xb, const float *a, const float *q,
                                                          int64_t K, int64_t ds, int64_t k) {
    __m256 acc = _mm256_mul_ps(xb[0], _mm256_loadu_ps(a + k));
    for (int64_t j = 1; j < ds; j++) acc = _mm256_fmadd_ps(xb[j], _mm256_loadu_ps(a + j * K + k), acc);
    return _mm256_add_ps(acc, _mm256_loadu_ps(q + k));
}

/* K a multiple of 16: two interleaved (value, index) accumulators, each the first minimum of its blocks;
   the lexicographic (value, index) minimum of their lanes is the first minimum of all. DS: the codeword
   width, a constant (2, the default layout) or the argument ds */
#define NEAREST_AVX2(NAME, DS)                                                                                   \
static int64_t NAME(const float *res, const float *a, const float *q, int64_t K, int64_t ds) {                 \
    __m256 xb[16];                                                                                              \
    for (int64_t j = 0; j < (DS); j++) xb[j] = _mm256_set1_ps(res[j]);                                          \
    const __m256i step = _mm256_set1_epi32(16);                                                                 \
    __m256i k0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), k1 = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15); \
    __m256 v0 = dist8(xb, a, q, K, (DS), 0), v1 = dist8(xb, a, q, K, (DS), 8);                                  \
    __m256i i0 = k0, i1 = k1;                                                                                   \
    __m256 nan = _mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q), _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q));        \
    for (int64_t k = 16; k < K; k += 16) {                                                                      \
        k0 = _mm256_add_epi32(k0, step); k1 = _mm256_add_epi32(k1, step);                                       \
        __m256 d0 = dist8(xb, a, q, K, (DS), k), d1 = dist8(xb, a, q, K, (DS), k + 8);                          \
        __m256 l0 = _mm256_cmp_ps(d0, v0, _CMP_LT_OQ), l1 = _mm256_cmp_ps(d1, v1, _CMP_LT_OQ);                  \
        v0 = _mm256_blendv_ps(v0, d0, l0); v1 = _mm256_blendv_ps(v1, d1, l1);                                   \
        i0 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i0), _mm256_castsi256_ps(k0), l0));       \
        i1 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i1), _mm256_castsi256_ps(k1), l1));       \
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(d0, d1, _CMP_UNORD_Q));                                           \
    }                                                                                                           \
    if (_mm256_movemask_ps(nan)) return K - 1;                                                                  \
    float vv[16]; int32_t ii[16];                                                                               \
    _mm256_storeu_ps(vv, v0); _mm256_storeu_ps(vv + 8, v1);                                                     \
    _mm256_storeu_si256((__m256i *)ii, i0); _mm256_storeu_si256((__m256i *)(ii + 8), i1);                       \
    float best = vv[0]; int32_t bi = ii[0];                                                                     \
    for (int l = 1; l < 16; l++)                                                                                \
        if (vv[l] < best || (vv[l] == best && ii[l] < bi)) { best = vv[l]; bi = ii[l]; }                        \
    return bi;                                                                                                  \
}
NEAREST_AVX2(nearest_avx2, ds)

/* 2-dim codewords, K a multiple of 32 up to 4096 (the default layout): the distances are stored and their
   minimum kept in four accumulators, then the first index holding the minimum is the answer */
static inline __attribute__((always_inline)) __m256 dist8_ds2(__m256 x0, __m256 x1, const float *a, const float *q,
                                                              int64_t K, int64_t k) {
    return _mm256_add_ps(_mm256_fmadd_ps(x1, _mm256_loadu_ps(a + K + k), _mm256_mul_ps(x0, _mm256_loadu_ps(a + k))),
                         _mm256_loadu_ps(q + k));
}

static int64_t nearest_ds2(const float *res, const float *a, const float *q, int64_t K) {
    float buf[4096] __attribute__((aligned(32)));
    const __m256 x0 = _mm256_set1_ps(res[0]), x1 = _mm256_set1_ps(res[1]);
    __m256 m0 = _mm256_set1_ps(INFINITY), m1 = m0, m2 = m0, m3 = m0, nan = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m256 d0 = dist8_ds2(x0, x1, a, q, K, k), d1 = dist8_ds2(x0, x1, a, q, K, k + 8);
        __m256 d2 = dist8_ds2(x0, x1, a, q, K, k + 16), d3 = dist8_ds2(x0, x1, a, q, K, k + 24);
        _mm256_store_ps(buf + k, d0); _mm256_store_ps(buf + k + 8, d1);
        _mm256_store_ps(buf + k + 16, d2); _mm256_store_ps(buf + k + 24, d3);
        m0 = _mm256_min_ps(m0, d0); m1 = _mm256_min_ps(m1, d1); m2 = _mm256_min_ps(m2, d2); m3 = _mm256_min_ps(m3, d3);
        nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(d0, d1, _CMP_UNORD_Q), _mm256_cmp_ps(d2, d3, _CMP_UNORD_Q)));
    }
    if (_mm256_movemask_ps(nan)) return K - 1;
    __m256 m = _mm256_min_ps(_mm256_min_ps(m0, m1), _mm256_min_ps(m2, m3));
    m = _mm256_min_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_min_ps(m, _mm256_shuffle_ps(m, m, 0x4e));
    m = _mm256_min_ps(m, _mm256_shuffle_ps(m, m, 0xb1));            /* every lane: the minimum (no NaN here) */
    for (int64_t k = 0; k < K; k += 32) {                              /* 32 at a time, then which 8 */
        __m256 e0 = _mm256_cmp_ps(_mm256_load_ps(buf + k), m, _CMP_EQ_OQ);
        __m256 e1 = _mm256_cmp_ps(_mm256_load_ps(buf + k + 8), m, _CMP_EQ_OQ);
        __m256 e2 = _mm256_cmp_ps(_mm256_load_ps(buf + k + 16), m, _CMP_EQ_OQ);
        __m256 e3 = _mm256_cmp_ps(_mm256_load_ps(buf + k + 24), m, _CMP_EQ_OQ);
        if (_mm256_movemask_ps(_mm256_or_ps(_mm256_or_ps(e0, e1), _mm256_or_ps(e2, e3)))) {
            uint32_t hit = (uint32_t)_mm256_movemask_ps(e0) | (uint32_t)_mm256_movemask_ps(e1) << 8
                         | (uint32_t)_mm256_movemask_ps(e2) << 16 | (uint32_t)_mm256_movemask_ps(e3) << 24;
            return k + __builtin_ctz(hit);
        }
    }
    return 0;                                                           /* unreachable: the minimum is in buf */
}

#endif

/* x (N,G,ds); cb (G,R,K,ds); a (G,R,ds,K) = -2 cb transposed; q (G,R,K) = ||c||^2.
   Out: idx (N,G,R) int64; resid (N,G,ds) the final residual (or NULL); targets (N,G,R,ds) the residual each
   round quantised (or NULL); sums (G,R,K,ds) += targets by code, counts (G,R,K) += 1 by code (NULL: neither),
   both zeroed by the caller. Blocks of NB tokens; in a block, each group's rounds, each round for every token
   (searches that do not wait on each other): each sum still adds its tokens in token order. */
#define NB 64
void rvq_search(const float *x, const float *cb, const float *a, const float *q, int64_t N, int64_t G, int64_t R,
                int64_t K, int64_t ds, int64_t *idx, float *resid, float *targets, float *sums, int64_t *counts) {
#ifdef __AVX2__
    const int vec = (K % 16 == 0) && ds <= 16, vec2 = ds == 2 && K % 32 == 0 && K <= 4096;
#else
    const int vec = 0, vec2 = 0;
#endif
    float block_res[NB * 16];
    for (int64_t n0 = 0; n0 < N; n0 += NB) {
        const int64_t n1 = n0 + NB < N ? n0 + NB : N;
        for (int64_t g = 0; g < G; g++) {
            for (int64_t n = n0; n < n1; n++)
                for (int64_t j = 0; j < ds; j++) block_res[(n - n0) * ds + j] = x[(n * G + g) * ds + j];
            for (int64_t r = 0; r < R; r++) {              /* a round for every token of the block: independent */
                const int64_t gr = g * R + r;
                const float *ar = a + gr * ds * K, *qr = q + gr * K;
                for (int64_t n = n0; n < n1; n++) {
                    float *res = block_res + (n - n0) * ds;
#ifdef __AVX2__
                    int64_t k = !vec ? nearest_scalar(res, ar, qr, K, ds)
                              : vec2 ? nearest_ds2(res, ar, qr, K) : nearest_avx2(res, ar, qr, K, ds);
#else
                    int64_t k = nearest_scalar(res, ar, qr, K, ds);
#endif
                    idx[(n * G + g) * R + r] = k;
                    if (targets) {
                        float *t = targets + ((n * G + g) * R + r) * ds;
                        for (int64_t j = 0; j < ds; j++) t[j] = res[j];
                    }
                    if (sums) {
                        float *s = sums + (gr * K + k) * ds;
                        for (int64_t j = 0; j < ds; j++) s[j] = s[j] + res[j];
                        counts[gr * K + k] += 1;
                    }
                    const float *c = cb + (gr * K + k) * ds;
                    for (int64_t j = 0; j < ds; j++) res[j] = res[j] - c[j];
                }
            }
            if (resid)
                for (int64_t n = n0; n < n1; n++)
                    for (int64_t j = 0; j < ds; j++) resid[(n * G + g) * ds + j] = block_res[(n - n0) * ds + j];
        }
    }
}
"""

MAX_SUB_DIM = 16
cpu = torch.device("cpu")     # explicit: a caller's default device (meta, cuda) must not apply here
_STATE: dict = {}


def native_enabled() -> bool:
    return os.environ.get("MAPL_RVQ_NATIVE", "1") != "0"


def _cache_dir() -> Path:
    env = os.environ.get("MAPL_NATIVE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mapl"


def _flags() -> list[str]:
    vec = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return ["-O3", "-fPIC", "-shared", "-ffp-contract=off", *(["-mavx2", "-mfma"] if vec else []), "-lm"]


def _build():
    """The loaded library, or None where no compiler or no build (the matmul kernel is used then)."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None
    flags = _flags()
    key = hashlib.sha256("\0".join([_SRC, cc, *flags]).encode()).hexdigest()[:16]
    try:
        cache = _cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        lib = cache / f"rvq_search_{key}.so"
        if not lib.exists():
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                src = Path(tmp) / "rvq_search.c"
                src.write_text(_SRC)
                out = Path(tmp) / lib.name
                subprocess.run([cc, str(src), "-o", str(out), *flags], check=True, capture_output=True, timeout=120)
                os.replace(out, lib)        # atomic: ranks building at once each load a whole file
        dll = ctypes.CDLL(str(lib))
    except (OSError, subprocess.SubprocessError):
        return None
    fn = dll.rvq_search
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 5
    return fn


def _lib():
    if "lib" not in _STATE:
        _STATE["lib"] = _build()
    return _STATE["lib"]


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _run(x: torch.Tensor, C: torch.Tensor, *, residual: bool, stats: bool):
    fn = _lib()
    N, G, ds = x.shape
    R, K = C.shape[1], C.shape[2]
    x = x.contiguous()
    C = C.contiguous()
    a = (-2.0 * C).transpose(2, 3).contiguous()                         # (G, R, ds, K), as the matmul kernel's
    q = (C * C).sum(-1).contiguous()                                    # ||c||^2 (G, R, K), as the matmul kernel's
    idx = torch.empty(N, G, R, dtype=torch.int64, device=cpu)
    resid = torch.empty(N, G, ds, dtype=torch.float32, device=cpu) if residual else None
    targets = sums = counts = None
    if stats:
        targets = torch.empty(N, G, R, ds, dtype=torch.float32, device=cpu)
        sums = torch.zeros(G, R, K, ds, dtype=torch.float32, device=cpu)
        counts = torch.zeros(G, R, K, dtype=torch.int64, device=cpu)
    fn(x.data_ptr(), C.data_ptr(), a.data_ptr(), q.data_ptr(), N, G, R, K, ds, idx.data_ptr(), _ptr(resid),
       _ptr(targets), _ptr(sums), _ptr(counts))
    return idx, resid, (targets, sums, counts) if stats else None


def _reference(x: torch.Tensor, C: torch.Tensor):
    """The matmul kernel and the EMA sums as ResidualVQ computes them without this module."""
    from .search import residual_search
    N, G, ds = x.shape
    R, K = C.shape[1], C.shape[2]
    idx, resid = residual_search(x, C, kernel="matmul", return_residual=True)
    targets = torch.empty(N, G, R, ds, device=cpu)
    res = x.clone()
    off = (torch.arange(G, device=cpu)[:, None] * R + torch.arange(R, device=cpu)) * K
    flat_cb = C.reshape(G * R * K, ds)
    flat = idx + off
    for r in range(R):
        targets[:, :, r] = res
        res -= flat_cb.index_select(0, flat[:, :, r].reshape(-1)).view(res.shape)
    f = flat.reshape(-1)
    sums = torch.zeros(G * R * K, ds, device=cpu).index_add_(0, f, targets.reshape(-1, ds)).view(G, R, K, ds)
    counts = torch.zeros(G * R * K, dtype=torch.int64, device=cpu).index_add_(0, f, torch.ones_like(f)).view(G, R, K)
    return idx, resid, (targets, sums, counts)


def _verified(G: int, R: int, K: int, ds: int) -> bool:
    """Whether this layout gives the matmul kernel's bits on a seeded problem: tokens spanning several search
    tiles and a partial one, scales from 1e-3 to 1e3, duplicated codewords and tokens on codewords (ties)."""
    key = (G, R, K, ds)
    if key not in _STATE:
        from .search import CPU_TILE_BYTES, search_tiles
        gen = torch.Generator().manual_seed(20261208)
        ts = search_tiles(G, 1 << 20, K, CPU_TILE_BYTES // 4)[1]
        N = max(8, min(2 * ts + 7, 4096, (1 << 22) // (G * K)))          # at most ~4M distances
        decay = 0.5 ** torch.arange(R, dtype=torch.float32, device=cpu)
        C = torch.randn(G, R, K, ds, generator=gen, device=cpu) * decay.view(1, R, 1, 1)
        C[:, :, 1::7] = C[:, :, 0:1]                                     # exact ties: equal codewords
        x = torch.randn(N, G, ds, generator=gen, device=cpu)              # drawn before the scales, as always
        x = x * 10.0 ** torch.randint(-3, 4, (N, 1, 1), generator=gen, device=cpu).float()
        x[: min(N, K)] = C[:, 0, : min(N, K)].transpose(0, 1)           # tokens on codewords
        got, want = _run(x, C, residual=True, stats=True), _reference(x, C)
        same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        _STATE[key] = same and all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    return _STATE[key]


def native_available(x: torch.Tensor, C: torch.Tensor) -> bool:
    """Whether :func:`native_search` gives the matmul kernel's bits for these (float32, CPU) operands."""
    if not native_enabled() or x.device.type != "cpu" or C.device.type != "cpu":
        return False
    if x.dtype != torch.float32 or C.dtype != torch.float32 or x.shape[-1] > MAX_SUB_DIM or x.shape[-1] < 1:
        return False
    if _lib() is None:
        return False
    G, R, K, ds = C.shape
    return _verified(G, R, K, ds)


def native_search(x: torch.Tensor, C: torch.Tensor, *, return_residual: bool = False, return_stats: bool = False):
    """x (N, G, ds), C (G, R, K, ds) float32 on the CPU -> indices (N, G, R) int64, the final residual (or None)
    and, with ``return_stats``, (targets (N, G, R, ds), sums (G, R, K, ds), counts (G, R, K) int64): the
    residual each round quantised, and their sums and counts by code. Call :func:`native_available` first."""
    return _run(x, C, residual=return_residual, stats=return_stats)
