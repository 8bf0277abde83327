"""The boundary compressor of method ``mapl-rvq``: the projection, then residual VQ of z on the wire.

    >>> comp = RVQCompressor(ProjectionCompressor(d, A, "spel"), RVQSettings(sync="stream"), seed=0)
    >>> payload = comp.pack(comp.encode(x))        # sender: search, learn, sync tensors
    >>> x_hat = comp.decode(comp.unpack(payload, torch.float32))   # receiver: its own codebook copy
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import gradwire
from ..base import Compressor, _check_direction, spec_bytes, tensor_checksum
from ..bitpack import pack_bits_rows, packed_nbytes, unpack_bits_rows
from .codebook import OP_EMA, OP_INIT, OP_NONE, DeviceFlag, ResidualVQ, codebook_bits, to_device_async
from .settings import RVQSettings
from .sync import make_sync

__all__ = ["RVQCompressor"]

_HEADER = ((3,), torch.int64)        # [sender codebook version, op, T]
SCALE_DTYPE = torch.bfloat16         # the per-token scale of scale="token" (settings.py says what each scale does)


class _PendingSync(NamedTuple):
    """The sync tensors of the sender's last training message, applied to its shadow of the receiver's copy
    at the next ``pack`` (``search_with="receiver"``): what the receiver applies after decoding it."""
    version: int
    op: int
    tensors: list
    indices: torch.Tensor


class RVQCompressor(Compressor):
    """Projection (``inner``) + residual VQ of z on the wire. Method ``mapl-rvq``.

    In-graph ``encode``/``decode``/``code_dim`` are the inner projection's. On the wire:

    forward payload (``payload_roles("fwd")`` in brackets)::

        [data] codes   uint8 (B, ceil(T*G*R*log2K/8))  indices, bit-packed per sequence (padding only
                                                        to the last byte of each sequence)
        [data] scales  bf16  (B, T)  per-token RMS of z (``scale="token"`` only; absent for "none")
        [sync] header  int64 (3,)   [sender codebook version, op, T]
        [sync] ...     the sync strategy's tensors (mapl/core/compress/rvq/sync.py), fixed shapes
                       independent of (B, T)

    Codebook values travel in the codebooks' dtype (float32), so the receiver copy can become
    bit-identical to the sender's (checksums). Backward payload: the r-wide gradient in ``grad_dtype``
    (bf16 by default; not quantised).

    Order of operations. ``pack(z)``: (1) search -> indices; (2) if training: EMA update (version
    v+1), or the k-means init on the first training message; (3) sync tensors read from the
    *updated* codebooks (the message carrying the init carries the whole codebook, in every mode).
    ``unpack(payload)``: (1) unpack indices; (2) decode with the receiver copy; (3) apply the sync tensors to the
    receiver copy. So message i is decoded with what messages < i delivered. The very first training message, whose indices come
    from the pre-k-means codebooks, is decoded with the equally pre-k-means receiver copy.

    Host reads: none per message (tests/test_gpu_path.py counts them; on CUDA, benchmarks/gpu/ too). ``pack``
    and ``payload_spec`` keep host-side mirrors of versions and cursors, fixed-shape revivals, counts
    without ``bincount``. ``unpack`` never reads the header: T follows from the codes' row length (a layout
    of at least 8 bits per token; below that the header is read, one device-to-host copy per message), the
    op is the one the receiver expects (:meth:`_expected_op`), the version is applied on the device; the
    header is compared with what the receiver used on the device too, and a disagreement (a lost, reordered
    or corrupted message) is reported by :meth:`check_sync`.

    ``search_with`` (config default ``"receiver"``): searches the sender's *shadow* of the receiver
    copy (the sender applies its own sync tensors of message i to the shadow at pack i+1, so the
    shadow equals what the receiver decodes message i+1 with): encoder and decoder codebooks always
    match and stream staleness only delays learning, at no extra bytes or compute; the EMA then learns
    the centroids of the shadow's cells (k-means with delayed assignments). ``"sender"`` searches the
    sender's learned codebooks, so a stream-synced receiver decodes some indices with stale codewords
    until they are streamed again. For ``full`` the two are equivalent; ``mirrored`` keeps the copies
    identical at search time, so it always searches the sender's.

    ``max_staleness`` (config default None = the sync mode's own bound: ``2*ceil(K/n)`` for stream, 0
    for full and mirrored): :meth:`check_sync` raises beyond it, or on a mirrored version gap.

    ``sync_payload``/``apply_sync``/``checksum`` are the inner projector's (A is synced after each
    optimizer step by the caller); codebook state travels in the forward payload and is checked with
    :meth:`codebook_checksums` / :meth:`check_sync`. Codebooks learn only in ``pack`` in training
    mode. In eval nothing is synced: an evaluation message carries zero-valued sync tensors (the
    shapes stay static) that the receiver does not apply, so when and on how much text a run
    evaluates never changes its training.
    """

    method = "mapl-rvq"

    def __init__(self, inner: Compressor, settings: RVQSettings | None = None, *, seed: int = 0):
        if not isinstance(inner, Compressor):
            raise TypeError(f"inner must be a Compressor, got {type(inner).__name__}")
        q = RVQSettings() if settings is None else settings
        if not isinstance(q, RVQSettings):
            raise TypeError(f"settings must be an RVQSettings, got {type(q).__name__}")
        super().__init__(inner.d_model)
        codebook_bits(q.codebook_size)
        self.settings, self.inner, self.scale, self.grad_dtype = q, inner, q.scale, q.grad_dtype
        self.rvq = ResidualVQ(**q.codebook_args(inner.code_dim, seed))     # the sender's codebooks (learned)
        self.recv = ResidualVQ(**q.codebook_args(inner.code_dim, seed))    # the receiver's copy: identical at version 0
        self.sync = make_sync(q.sync, self.rvq, q.stream_fraction)
        # mirrored EMA keeps the receiver copy equal to the sender's at search time: the same thing
        self.search_with = "sender" if q.sync == "mirrored" else q.search_with
        self.max_staleness = self.sync.default_max_staleness() if q.max_staleness is None else int(q.max_staleness)
        self._pending: _PendingSync | None = None
        self._bad_header = DeviceFlag()     # a received header disagreed with what the receiver used
        self._expected: dict = {}           # (op, T, device) -> the header fields a receiver expects, on the device
        self._stats = {"microbatches": 0, "sync_bytes": 0, "data_bytes": 0, "tokens": 0,
                       "rel_mse": float("nan"), "batch_perplexity": float("nan")}
        self._outlier = None     # health window: quantisation error of each message's largest-|z| token

    def get_extra_state(self):
        stats = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in self._stats.items()}
        # stored as a plain tuple: checkpoints hold no class of this package
        return {"stats": stats, "pending": None if self._pending is None else tuple(self._pending)}

    def set_extra_state(self, state) -> None:
        self._stats = dict(state["stats"])
        self._pending = None if state["pending"] is None else _PendingSync(*state["pending"])

    # ---- in-graph: the projection ----------------------------------------------------------
    @property
    def code_dim(self) -> int:
        return self.inner.code_dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.encode(x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.inner.decode(z)

    # ---- wire layout -----------------------------------------------------------------------
    def payload_spec(self, lead_shape: tuple[int, ...], direction: str,
                     pending: int = 0) -> list[tuple[tuple[int, ...], torch.dtype]]:
        _check_direction(direction)
        B, T = lead_shape
        if direction == "bwd":
            return gradwire.spec(self.grad_wire, (B, T), self.code_dim, self.grad_dtype)
        codes = ((B, packed_nbytes(T * self.rvq.groups * self.rvq.rounds, self.rvq.bits)), torch.uint8)
        scales = [((B, T), SCALE_DTYPE)] * self._n_scales
        return [codes, *scales, _HEADER, *self.sync.spec(with_init=self._init_is_next(pending))]

    def _init_is_next(self, pending: int = 0) -> bool:
        """Whether the next message carries the k-means init (the first training message, before any
        init was made or received). Sender and receiver objects agree on it from their own state: the
        sender has not initialised ``rvq``, the receiver has not received the init into ``recv`` and has
        no earlier message still pending (a look-ahead receive is posted before the init arrives)."""
        return self.training and pending == 0 and not (self.rvq.host_initted or self.recv.host_initted)

    def payload_roles(self, direction: str) -> list[str]:
        _check_direction(direction)
        if direction == "bwd":
            return ["data"] * len(gradwire.spec(self.grad_wire, (1, 1), self.code_dim, self.grad_dtype))
        return ["data"] * (1 + self._n_scales) + ["sync"] * (1 + len(self.sync.spec()))

    @property
    def _n_scales(self) -> int:
        return int(self.scale == "token")

    def wire_bytes_per_token(self, direction: str) -> float:
        """fwd: ``G*R*log2(K)/8`` -- exact when ``T*G*R*log2(K)`` is a multiple of 8, otherwise each
        sequence carries < 1 byte of padding; sync bytes are apart (:meth:`sync_bytes_per_microbatch`).
        bwd: ``r * sizeof(grad_dtype)`` (2r for bf16)."""
        return self.wire_efficiency_floor(direction) / 8

    def wire_efficiency_floor(self, direction: str) -> float:
        """fwd: the indices, ``G*R*log2(K)`` bits per token (+ the bf16 scale with ``scale="token"``);
        bwd: r values in ``grad_dtype``."""
        _check_direction(direction)
        if direction == "fwd":
            return float(self.rvq.bits_per_token + self._n_scales * torch.finfo(SCALE_DTYPE).bits)
        return gradwire.floor_bits(self.grad_wire, self.code_dim, self.grad_dtype)

    def sync_bytes_per_microbatch(self) -> int:
        """Declared codebook-sync bytes piggybacked on every forward message (independent of B, T)."""
        return spec_bytes([_HEADER, *self.sync.spec()])

    def one_off_sync_bytes(self) -> int:
        """Extra bytes of the message that carries the k-means init (stream: the whole codebook, so
        the receiver does not decode with pre-init codewords for a whole stream cycle)."""
        if not self.rvq.kmeans_init:
            return 0
        return spec_bytes(self.sync.spec(with_init=True)) - spec_bytes(self.sync.spec())

    # ---- wire: forward -----------------------------------------------------------------------
    def _shadow_codebooks(self) -> torch.Tensor | None:
        """The codebooks to search with: the sender's (None) or its shadow of the receiver copy,
        brought up to date with the sync tensors of the previous message."""
        if self.search_with != "receiver":
            return None
        if self._pending is not None:
            self.sync.apply(self.recv, *self._pending)   # idempotent if this object's unpack already did
            self._pending = None
        return self.recv.codebooks

    @torch.no_grad()
    def pack(self, z: torch.Tensor) -> list[torch.Tensor]:
        if z.dim() != 3 or z.shape[-1] != self.code_dim:
            raise ValueError(f"pack expects z of shape (B, T, {self.code_dim}), got {tuple(z.shape)}")
        z = z.detach()
        B, T, _ = z.shape
        scales, u = self._normalise(z)                                          # u: what the codes quantise
        search_cb = self._shadow_codebooks()
        idx, resid = self.rvq.search(u, codebooks=search_cb, return_residual=True)     # (B, T, G, R)
        codes = pack_bits_rows(idx.reshape(B, -1), self.rvq.bits, check=False)   # search output is in range
        op = self.rvq.update(u, idx, codebooks=search_cb) if self.training else None
        op_code = OP_NONE if op is None else op["op"]
        header = to_device_async(torch.tensor([self.rvq.host_version, op_code, T], dtype=torch.int64, device="cpu"), z.device)
        if not self.training:
            # evaluation sends the sync tensors' shapes (static messages) but no codebook change: a
            # slice sent here would move the stream's cursor and refresh the receiver early, so how
            # often and on how many batches a run evaluates would change its training
            sync = [torch.zeros(shape, dtype=dtype, device=z.device) for shape, dtype in self.sync.spec()]
            data = [codes, *scales]
            self._record(z, u, idx, resid, scales, op, data, [header, *sync])
            return [*data, header, *sync]
        sync = self.sync.sender_tensors(self.rvq, op)
        if self.search_with == "receiver":
            self._pending = _PendingSync(self.rvq.host_version, op_code, [t.clone() for t in sync], idx)
        data = [codes, *scales]
        self._record(z, u, idx, resid, scales, op, data, [header, *sync])
        return [*data, header, *sync]

    def _normalise(self, z: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """([scales on the wire], what the quantiser sees). ``scale="token"``: s_t = RMS of z_t, rounded
        to bf16 *before* dividing, so sender and receiver scale by the same number."""
        if self.scale == "none":
            return [], z
        s = z.float().pow(2).mean(-1).sqrt().clamp_min(1e-12).to(SCALE_DTYPE)   # (B, T); bf16 keeps fp32's range
        return [s], z / s.to(z.dtype).unsqueeze(-1)

    def _record(self, z, u, idx, resid, scales, op, data, sync) -> None:
        """Running statistics for :meth:`diagnostics` and :meth:`health_report` (kept as tensors: no
        host sync per message)."""
        st = self._stats
        n = z.shape[0] * z.shape[1]
        st["microbatches"] += 1
        st["tokens"] += n
        st["data_bytes"] += sum(t.numel() * t.element_size() for t in data)
        st["sync_bytes"] += sum(t.numel() * t.element_size() for t in sync)
        st["rel_mse"] = resid.float().pow(2).sum() / u.float().pow(2).sum().clamp_min(1e-30)
        self._record_outlier(z, resid if not scales else resid * scales[0].to(resid.dtype).unsqueeze(-1))
        counts = op["counts"] if op is not None and "counts" in op else self.rvq.code_counts(idx)
        p = counts.float() / n
        st["batch_perplexity"] = torch.exp(-(p * p.clamp_min(1e-30).log()).sum(-1)).mean()

    def _record_outlier(self, z: torch.Tensor, err: torch.Tensor) -> None:
        """The decoding error (in z's units) of the message's token with the largest |z|: absolute
        (max over its r values) and relative (norm / norm). Window maxima, kept as tensors."""
        zt = z.detach().float().reshape(-1, z.shape[-1])
        t = zt.abs().amax(-1).argmax().view(1)        # a 1-element index: [0-d tensor] would read it on the host
        e = err.float().reshape(-1, z.shape[-1])[t][0]
        absolute, relative = e.abs().amax(), e.norm() / zt[t][0].norm().clamp_min(1e-30)
        w = self._outlier
        self._outlier = [absolute, relative] if w is None else [torch.maximum(w[0], absolute),
                                                                torch.maximum(w[1], relative)]
    @torch.no_grad()
    def unpack(self, payload: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        n = 1 + self._n_scales
        codes, scales, header, sync = payload[0], payload[1:n], payload[n], payload[n + 1:]
        G, R, bits = self.rvq.groups, self.rvq.rounds, self.rvq.bits
        B, nb = codes.shape
        T = self._message_tokens(nb, header)
        op = self._expected_op()
        self._check_header(header, op, T)
        idx = unpack_bits_rows(codes, bits, T * G * R).view(B, T, G, R)
        z_q = self.recv.lookup(idx).to(dtype)             # always the receiver's copy
        if scales:
            z_q = z_q * scales[0].to(dtype).unsqueeze(-1)
        if self.training:                                 # evaluation messages carry no sync (see pack)
            self.sync.apply(self.recv, header[0], op, sync, idx)
        return z_q

    def _message_tokens(self, nb: int, header: torch.Tensor) -> int:
        """T of a message whose codes hold ``nb`` bytes per sequence: ``ceil(T * bits_per_token / 8)`` is
        one-to-one for >= 8 bits per token, so T is the row length's; a narrower layout reads the header."""
        per_token = self.rvq.bits_per_token
        if per_token >= 8:
            return 8 * nb // per_token
        T = int(header[2])                                # the one host read of a sub-byte layout
        if packed_nbytes(T * self.rvq.groups * self.rvq.rounds, self.rvq.bits) != nb:
            raise ValueError(f"RVQ message header says T={T}, but the codes hold {nb} bytes per sequence")
        return T

    def _expected_op(self) -> int:
        """The codebook op of the next message as the sender makes it: none in evaluation; in training the
        k-means init until the receiver copy holds one (the sender initialises at its first training
        message), an EMA step after. The receiver applies this op and checks the header's on the device."""
        if not self.training:
            return OP_NONE
        return OP_INIT if not self.recv.host_initted else OP_EMA

    def _check_header(self, header: torch.Tensor, op: int, T: int) -> None:
        """Queue the comparison of the header's [op, T] with what this receiver uses (no host read); only
        mirrored sync computes from the op, so only there does a different op count."""
        key = (op, T, header.device)
        if key not in self._expected:
            self._expected[key] = to_device_async(torch.tensor([op, T], dtype=torch.int64, device="cpu"),
                                                  header.device)
        differs = header[1:] != self._expected[key]
        self._bad_header.raise_if(differs.any() if self.sync.name == "mirrored" else differs[1])

    # ---- wire: backward (the gradient on z: grad_dtype, or int8 with compressor.grad_wire) ----------
    def pack_grad(self, g: torch.Tensor) -> list[torch.Tensor]:
        return gradwire.pack(self.grad_wire, g, self.grad_dtype)

    def unpack_grad(self, payload: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return gradwire.unpack(self.grad_wire, payload, dtype)

    # ---- shared state: the projector's (A after each optimizer step) ---------------------------
    @property
    def learned(self) -> bool:
        return self.inner.learned

    def sync_payload(self) -> dict[str, torch.Tensor]:
        return self.inner.sync_payload()

    def apply_sync(self, payload: dict[str, torch.Tensor]) -> None:
        self.inner.apply_sync(payload)

    def sync_bytes_per_step(self) -> int:
        return self.inner.sync_bytes_per_step()

    def receiver_grad_bytes_per_step(self) -> int:
        return self.inner.receiver_grad_bytes_per_step()

    def fold_receiver_grad(self) -> None:
        self.inner.fold_receiver_grad()

    def basis(self) -> torch.Tensor | None:
        return self.inner.basis()

    def checksum(self) -> int:
        return self.inner.checksum()

    # ---- codebook consistency ----------------------------------------------------------------
    def codebook_checksums(self) -> tuple[int, int]:
        """(CRC32 of the sender's codebooks, CRC32 of the receiver's copy): equal iff bit-identical."""
        return tensor_checksum(self.rvq.codebooks), tensor_checksum(self.recv.codebooks)

    def staleness(self) -> int:
        """Versions the receiver copy is behind the newest sender version it has heard of."""
        return self.sync.staleness(self.recv)

    def check_sync(self, *, raise_on_error: bool = True) -> dict:
        """Staleness vs ``max_staleness`` and (mirrored) version gaps; raises RuntimeError on either
        unless ``raise_on_error=False``. ``identical`` compares the two copies held by this object
        (meaningful where one object plays both sides, as in the single-process pipeline)."""
        s = self.staleness()
        crc_s, crc_r = self.codebook_checksums()
        desync, bad_header = self.sync.desync, self._bad_header.read()
        rep = {"staleness": s, "max_staleness": self.max_staleness, "desync": desync, "bad_header": bad_header,
               "sender_crc": crc_s, "receiver_crc": crc_r, "identical": crc_s == crc_r}
        rep["ok"] = s <= self.max_staleness and not desync and not bad_header
        if raise_on_error and not rep["ok"]:
            why = ("mirrored version gap" if desync else
                   "a message header disagreed with the receiver (token count or codebook op: a lost, reordered "
                   "or corrupted message)" if bad_header else f"staleness {s} > max_staleness {self.max_staleness}")
            raise RuntimeError(f"RVQ codebook sync ({self.sync.name}): {why}")
        return rep

    @torch.no_grad()
    def health_report(self) -> dict:
        """The projection's window (max |z|, RMS) plus the quantiser's: the largest codeword norm of the
        sender's codebooks and of the receiver copy this object holds (the sender's shadow of it when it
        searches with the receiver's, the receiver's own on the receiving side), their distance relative
        to the sender's norm, the last batch's code perplexity and the window's largest decoding error
        of a message's largest-|z| token (absolute and relative)."""
        rep = super().health_report()
        cs, cr = self.rvq.codebooks.float(), self.recv.codebooks.float()
        w, self._outlier = self._outlier, None
        rep.update({
            "codeword_max_sender": float(cs.norm(dim=-1).amax()),
            "codeword_max_receiver": float(cr.norm(dim=-1).amax()),
            "codebook_gap_rel": float((cs - cr).norm() / cs.norm().clamp_min(1e-30)),
            "batch_perplexity": float(self._stats["batch_perplexity"]),
            "outlier_err_max": None if w is None else float(w[0]),
            "outlier_err_rel": None if w is None else float(w[1]),
        })
        return rep

    def diagnostics(self) -> dict:
        cs = self.rvq.cluster_size.float()
        p = cs / cs.sum(-1, keepdim=True).clamp_min(1e-30)
        ppl = torch.exp(-(p * p.clamp_min(1e-30).log()).sum(-1))            # (G, R)
        thr = self.rvq.dead_code_threshold if self.rvq.dead_code_threshold > 0 else 1e-3
        dead = (cs < thr).float().mean(-1) * 100.0                          # (G, R)
        st = self._stats
        crc_s, crc_r = self.codebook_checksums()
        return {
            **self.inner.diagnostics(),
            "rvq_groups": self.rvq.groups, "rvq_rounds": self.rvq.rounds, "rvq_codebook_size": self.rvq.codebook_size,
            "rvq_sync": self.sync.name, "rvq_scale": self.scale,
            "codebook_perplexity_mean": float(ppl.mean()), "codebook_perplexity_min": float(ppl.min()),
            "codebook_perplexity_per_round": ppl.mean(0).tolist(),
            "dead_code_pct": float(dead.mean()), "dead_code_pct_max": float(dead.max()),
            "dead_code_pct_per_round": dead.mean(0).tolist(),
            "batch_perplexity_mean": float(st["batch_perplexity"]), "rel_mse": float(st["rel_mse"]),
            "codebook_version": self.rvq.host_version, "staleness": self.staleness(),
            "max_staleness": self.max_staleness, "codebooks_identical": crc_s == crc_r,
            "sync_bytes_total": st["sync_bytes"], "data_bytes_total": st["data_bytes"],
            "microbatches": st["microbatches"],
        }
