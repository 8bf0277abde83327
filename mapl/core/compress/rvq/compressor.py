"""The boundary compressor of ``mapl-rvq``: the projection in-graph, then residual VQ of z on the wire."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..base import Compressor, _check_direction, spec_bytes, tensor_checksum
from ..bitpack import pack_bits_rows, packed_nbytes, unpack_bits_rows
from .codebook import OP_EMA, OP_INIT, OP_NONE, DeviceFlag, ResidualVQ, to_device_async
from .settings import RVQSettings
from .sync import make_sync

__all__ = ["RVQCompressor"]

_HEADER = ((3,), torch.int64)        # [sender codebook version, op, T]
SCALE_DTYPE = torch.bfloat16         # the per-token scale of scale="token" (settings.py says what each scale does)


class _PendingSync(NamedTuple):
    """The sender's last sync tensors, applied to its shadow of the receiver's copy at the next ``pack``."""
    version: int
    op: int
    tensors: list
    indices: torch.Tensor


class RVQCompressor(Compressor):
    """Projection (``inner``) + residual VQ of z on the wire (docs/architecture.md, "RVQ").

    Forward payload: [data] codes, uint8 (B, ceil(T*G*R*log2K/8)), bit-packed per sequence; [data] scales, bf16
    (B, T), with ``scale="token"`` only; [sync] header, int64 [sender version, op, T]; [sync] the sync strategy's
    tensors (fixed shapes). Backward: the r-wide gradient, as the projection's. ``pack`` searches, learns (training
    only) and reads the sync tensors from the updated codebooks; ``unpack`` decodes with the receiver's copy,
    then applies the sync tensors, so message i is decoded with what messages < i delivered. Neither reads the
    device per message.
    """

    method = "mapl-rvq"

    def __init__(self, inner: Compressor, settings: RVQSettings | None = None, *, seed: int = 0):
        q = RVQSettings() if settings is None else settings
        super().__init__(inner.d_model)
        self.settings, self.inner, self.scale = q, inner, q.scale
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
            return super().payload_spec(lead_shape, direction)
        codes = ((B, packed_nbytes(T * self.rvq.groups * self.rvq.rounds, self.rvq.bits)), torch.uint8)
        scales = [((B, T), SCALE_DTYPE)] * self._n_scales
        return [codes, *scales, _HEADER, *self.sync.spec(with_init=self._init_is_next(pending))]

    def _init_is_next(self, pending: int = 0) -> bool:
        """Whether the next message carries the k-means init, which sender and receiver judge from their own
        state (a receiver with an earlier receive still pending was posted before the init arrived)."""
        return self.training and pending == 0 and not (self.rvq.host_initted or self.recv.host_initted)

    def payload_roles(self, direction: str) -> list[str]:
        _check_direction(direction)
        if direction == "bwd":
            return super().payload_roles(direction)
        return ["data"] * (1 + self._n_scales) + ["sync"] * (1 + len(self.sync.spec()))

    @property
    def _n_scales(self) -> int:
        return int(self.scale == "token")

    def wire_bytes_per_token(self, direction: str) -> float:
        """fwd: G*R*log2(K)/8 (each sequence adds < 1 byte of padding; sync bytes apart); bwd: r wire_dtype values."""
        return self.wire_efficiency_floor(direction) / 8

    def wire_efficiency_floor(self, direction: str) -> float:
        _check_direction(direction)
        if direction == "fwd":
            return float(self.rvq.bits_per_token + self._n_scales * torch.finfo(SCALE_DTYPE).bits)
        return super().wire_efficiency_floor(direction)

    def sync_bytes_per_microbatch(self) -> int:
        return spec_bytes([_HEADER, *self.sync.spec()])

    def one_off_sync_bytes(self) -> int:
        """Extra bytes of the message carrying the k-means init (stream: the whole codebook, once)."""
        if not self.rvq.kmeans_init:
            return 0
        return spec_bytes(self.sync.spec(with_init=True)) - spec_bytes(self.sync.spec())

    # ---- wire: forward -----------------------------------------------------------------------
    def _shadow_codebooks(self) -> torch.Tensor | None:
        """The codebooks to search: the sender's (None) or its shadow of the receiver's copy, brought up to date.

        Searching the shadow (``search_with="receiver"``), encoder and decoder codebooks always match: stream
        staleness only delays learning. ``"sender"`` makes a stream-synced receiver decode some indices with
        stale codewords until they are streamed again."""
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
        learn = self.training and self.rvq.host_initted                         # an EMA step follows the search
        found = self.rvq.search(u, codebooks=search_cb, return_residual=True, return_stats=learn)
        idx, resid, stats = found if learn else (*found, None)                   # idx (B, T, G, R)
        codes = pack_bits_rows(idx.reshape(B, -1), self.rvq.bits, check=False)   # search output is in range
        op = self.rvq.update(u, idx, codebooks=search_cb, stats=stats) if self.training else None
        op_code = OP_NONE if op is None else op["op"]
        header = to_device_async(torch.tensor([self.rvq.host_version, op_code, T], dtype=torch.int64, device="cpu"), z.device)
        if self.training:
            sync = self.sync.sender_tensors(self.rvq, op)
            if self.search_with == "receiver":
                self._pending = _PendingSync(self.rvq.host_version, op_code, [t.clone() for t in sync], idx)
        else:
            # zeros of the sync shapes: a slice sent here would move the stream's cursor, so how often a run
            # evaluates would change its training
            sync = [torch.zeros(shape, dtype=dtype, device=z.device) for shape, dtype in self.sync.spec()]
        data = [codes, *scales]
        self._record(z, u, idx, resid, scales, op, data, [header, *sync])
        return [*data, header, *sync]

    def _normalise(self, z: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """([scales on the wire], what the quantiser sees). s_t = RMS of z_t is rounded to bf16 before dividing,
        so sender and receiver scale by the same number."""
        if self.scale == "none":
            return [], z
        s = z.float().pow(2).mean(-1).sqrt().clamp_min(1e-12).to(SCALE_DTYPE)   # (B, T); bf16 keeps fp32's range
        return [s], z / s.to(z.dtype).unsqueeze(-1)

    def _record(self, z, u, idx, resid, scales, op, data, sync) -> None:
        """Running statistics for :meth:`diagnostics` and :meth:`health_report`, kept as tensors."""
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
        """Window maxima of the decoding error of each message's largest-|z| token (absolute, relative)."""
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
        """T from the codes' row length (one-to-one for >= 8 bits a token); a narrower layout reads the header."""
        per_token = self.rvq.bits_per_token
        if per_token >= 8:
            return 8 * nb // per_token
        T = int(header[2])                                # the one host read of a sub-byte layout
        if packed_nbytes(T * self.rvq.groups * self.rvq.rounds, self.rvq.bits) != nb:
            raise ValueError(f"RVQ message header says T={T}, but the codes hold {nb} bytes per sequence")
        return T

    def _expected_op(self) -> int:
        """The op of the next message as the sender makes it (the header's is checked on the device, not read)."""
        if not self.training:
            return OP_NONE
        return OP_INIT if not self.recv.host_initted else OP_EMA

    def _check_header(self, header: torch.Tensor, op: int, T: int) -> None:
        """Queue the comparison of the header's [op, T] with what this receiver used (read by ``check_sync``);
        only mirrored sync computes from the op."""
        key = (op, T, header.device)
        if key not in self._expected:
            self._expected[key] = to_device_async(torch.tensor([op, T], dtype=torch.int64, device="cpu"),
                                                  header.device)
        differs = header[1:] != self._expected[key]
        self._bad_header.raise_if(differs.any() if self.sync.name == "mirrored" else differs[1])

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
        """CRC32 of the sender's codebooks and of the receiver's copy."""
        return tensor_checksum(self.rvq.codebooks), tensor_checksum(self.recv.codebooks)

    def staleness(self) -> int:
        return self.sync.staleness(self.recv)

    def check_sync(self, *, raise_on_error: bool = True) -> dict:
        """Staleness against ``max_staleness``, version gaps and bad headers; RuntimeError unless
        ``raise_on_error=False``. ``identical`` compares the two copies this object holds."""
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
        """The projection's window plus codeword norms of both copies, their gap, the last batch's perplexity and
        the window's largest-|z| token's decoding error."""
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
