"""The single-process pipeline (``LocalEngine``: every stage here, each boundary through ``WireTransfer``, so it
computes bit for bit what the multi-process runtime does) and what every engine shares: the run's data, mixed
precision, the evaluation's weights."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import checkpoint
from .. import data as mdata
from .config import ConfigError, RunConfig
from .diagnostics import boundary_diagnostics
from .loop import Evaluation, LoopState, NonFiniteError, StepOutcome
# re-exported for the engines' callers
from .optimizer_recipe import build_optimizers, set_lr
from .results import build_results, describe_boundary
from .boundary_sync import meter_local_step
from .stages import build_staged_model
from .wire import ByteMeter

__all__ = ["RunData", "resolve_data_dir", "open_run_data", "batch_weight", "build_optimizers", "set_lr", "autocast_ctx",
           "eval_pieces", "stage_of_parameter", "check_projectors", "LocalEngine"]


# ---- data ----------------------------------------------------------------------------------------------
@dataclass
class RunData:
    """The run's prepared, verified dataset and its evaluation batches."""
    dataset: mdata.Dataset
    val_batches: list             # fixed evaluation batches [(x, y)]: the report set
    select_batches: list = field(default_factory=list)   # the selection set (train.select_every; may be empty)

    @property
    def manifest(self) -> dict:
        return self.dataset.manifest

    @property
    def vocab_size(self) -> int:
        return self.dataset.vocab_size

    def batch(self, step: int, t) -> tuple[torch.Tensor, torch.Tensor]:
        """The training batch of ``step``: the same on every process and resume."""
        return self.dataset.batch(step, t.batch_size, t.seq_len, t.seed)


def resolve_data_dir(cfg: RunConfig) -> Path:
    return Path(cfg.data_dir) if cfg.data_dir else mdata.default_data_dir(cfg.data)


def open_run_data(cfg: RunConfig) -> RunData:
    """The run's token shards, verified against manifest and config (``mapl data`` makes them), and eval batches."""
    ds = mdata.open_dataset(cfg.data, resolve_data_dir(cfg), profile=cfg.profile)
    t = cfg.train
    room = len(ds.val) - t.seq_len - 1
    if t.eval_offset > room:
        raise ConfigError(f"train.eval_offset={t.eval_offset} is invalid: the validation split has {len(ds.val)} "
                          f"tokens, so it must be <= {max(0, room)} (validation windows of train.seq_len={t.seq_len})")
    if t.eval_tokens > len(ds.val) - t.eval_offset:     # was read as "the whole split", silently
        raise ConfigError(f"train.eval_tokens={t.eval_tokens} is invalid: the validation split has {len(ds.val)} "
                          f"tokens from train.eval_offset={t.eval_offset} on, so it must be <= "
                          f"{len(ds.val) - t.eval_offset}, or 0 for the whole split")
    sets = {part: ds.eval_batches(t.eval_batch_size, t.seq_len, t.eval_tokens, offset=t.eval_offset,
                                  select_every=t.select_every, part=part) for part in ("report", "select")}
    if not sets["report"]:
        raise ConfigError(f"train.select_every={t.select_every} is invalid: it leaves no report window in "
                          f"{t.eval_tokens or len(ds.val)} validation tokens; use 0 or >= 2")
    return RunData(ds, sets["report"], sets["select"])


def batch_weight(y: torch.Tensor, batches: list) -> float:
    """A validation batch's weight in the mean over batches, its tokens over a full batch's: the weighted mean is
    the mean over tokens however batches are shared; full batches weigh exactly 1.0 (the plain mean, bitwise)."""
    return y.numel() / batches[0][1].numel()


def eval_pieces(x: torch.Tensor, y: torch.Tensor, seqs: int):
    """A validation batch in pieces of ``seqs`` sequences (0: one piece, share exactly 1.0), each with its share
    of the batch's tokens."""
    step = seqs or len(x)
    for i in range(0, len(x), step):
        yi = y[i:i + step]
        yield x[i:i + step], yi, yi.numel() / y.numel()


def autocast_ctx(cfg: RunConfig, device: torch.device):
    p = cfg.train.precision
    use_bf16 = p == "bf16" or (p == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()


def stage_of_parameter(name: str, split: list[list[int]]) -> int:
    """Which stage holds the parameter or buffer ``name`` of a StagedModel."""
    parts = name.split(".")
    if parts[0] in ("anchors", "boundaries"):        # a boundary is owned by its sender
        return int(parts[1])
    if parts[:2] == ["model", "layers"]:
        return next(s for s, layers in enumerate(split) if int(parts[2]) in layers)
    if parts[:2] == ["model", "tok_embeddings"]:
        return 0
    return len(split) - 1                            # final norm, head, rope tables


def check_projectors(comps: dict[int, object], step: int) -> None:
    """After the optimizer step: a learned projector must be finite (the receiver would decode garbage)."""
    for p, comp in comps.items():
        for name, prm in comp.named_parameters():
            if not torch.isfinite(prm).all():
                raise NonFiniteError(
                    f"non-finite projector {name} of boundary {p} (sender: stage {p}) after the optimizer step of "
                    f"step {step}; the last good checkpoint is kept")


def _resolve_checkpointing(cfg: RunConfig, vocab: int, device: torch.device) -> RunConfig:
    """``activation_checkpointing: auto`` decided by the memory plan: every stage on this device (off on a CPU)."""
    if cfg.train.activation_checkpointing != "auto":
        return cfg
    from .memory import memory_plan
    on = False
    if device.type == "cuda":
        plain = memory_plan(cfg, vocab, device="cuda", checkpointing=False)
        on = sum(s.total for s in plain.stages) > 0.9 * torch.cuda.get_device_properties(device).total_memory
    return replace(cfg, train=replace(cfg.train, activation_checkpointing="on" if on else "off"))


# ---- the single-process engine ----------------------------------------------------------------------
class LocalEngine:
    """Every stage in this process (a ``mapl.core.loop.Engine``)."""
    reporter = True

    def __init__(self, cfg: RunConfig, data: RunData, device: torch.device, ckpt: Path | None = None):
        self.cfg, self.data, self.device = cfg, data, device
        self.sm = build_staged_model(_resolve_checkpointing(cfg, data.vocab_size, device), data.vocab_size).to(device)
        self.opts = build_optimizers(self.sm, cfg)
        self.meter = ByteMeter()
        self.ckpt = Path(ckpt) if ckpt else None
        self.slot = checkpoint.CheckpointSlot(self.ckpt) if self.ckpt else None
        self.checkpointing = self.slot is not None

    @classmethod
    def build(cls, cfg: RunConfig, ckpt: Path | None = None, device: torch.device | None = None) -> "LocalEngine":
        """Validate (what needs no data first), open the data, build model and optimizers."""
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        cfg.validate()
        data = open_run_data(cfg)
        cfg = cfg.validate(data.vocab_size)
        device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return cls(cfg, data, device, ckpt)

    def resume(self, allow_changes: bool = False, log=print) -> LoopState | None:
        if self.slot is None:
            return None
        stale = self.slot.drop_stale()          # the run was killed before the next step confirmed it
        if stale:
            log(f"dropped the unconfirmed checkpoint {stale} (the step after it never completed)")
        if not self.ckpt.exists():
            return None
        state = checkpoint.restore(checkpoint.read(self.ckpt), self.ckpt, self.cfg, self.sm, self.opts, self.meter,
                                   allow_changes)
        self.slot.saved_step = state.step
        return state

    def train_step(self, step: int, lr_scale: float, stop_requested=lambda: False) -> StepOutcome:
        t, sm, dev = self.cfg.train, self.sm, self.device
        set_lr(self.opts, lr_scale)
        x, y = self.data.batch(step, t)
        x, y = x.to(dev), y.to(dev)
        mb = t.batch_size // t.micro_batches
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)     # on device: one host read per step
        for i in range(t.micro_batches):
            with autocast_ctx(self.cfg, dev):
                loss = sm(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb], self.meter,
                          t.loss_chunk_tokens) / t.micro_batches
            loss.backward()
            loss_sum += loss.detach()
        loss = float(loss_sum)
        if not math.isfinite(loss):
            return StepOutcome(loss, stop_requested(), self._locate_nonfinite(x, mb))
        for comp in sm.compressors():
            comp.fold_receiver_grad()
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_([p for p in sm.parameters() if p.grad is not None], t.grad_clip)
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        check_projectors(dict(enumerate(sm.compressors())), step)
        meter_local_step(sm.compressors(), self.meter)
        return StepOutcome(loss, stop_requested())

    def _locate_nonfinite(self, x: torch.Tensor, mb: int) -> str:
        """After a non-finite step loss: replay the micro-batches' forwards."""
        for i in range(self.cfg.train.micro_batches):
            where = self.sm.find_nonfinite(x[i * mb:(i + 1) * mb])
            if where:
                return f"{where} in micro-batch {i}"
        return "the loss only (activations finite)"

    @torch.no_grad()
    def evaluate(self, step: int) -> Evaluation:
        sm, dev = self.sm, self.device
        was_training = sm.training
        sm.eval()                        # compressors must not update state (RVQ EMA, k-means, sync)
        t = self.cfg.train

        def mean_loss(batches: list) -> float:
            total = torch.zeros((), dtype=torch.float64, device=dev)
            with autocast_ctx(self.cfg, dev):
                for x, y in batches:
                    w = batch_weight(y, batches)
                    for xi, yi, share in eval_pieces(x, y, t.eval_micro_batch_size):
                        total += sm(xi.to(dev), yi.to(dev), None, t.loss_chunk_tokens).double() * (w * share)
            return float(total) / sum(batch_weight(y, batches) for _, y in batches)

        out = Evaluation(mean_loss(self.data.val_batches),
                         mean_loss(self.data.select_batches) if self.data.select_batches else None)
        sm.train(was_training)
        return out

    def health(self) -> list[dict]:
        return [comp.health_report() for comp in self.sm.compressors()]

    def save(self, state: LoopState, confirmed: bool = True) -> None:
        def write(path: Path) -> None:
            checkpoint.save(path, cfg=self.cfg, model=self.sm, optimizers=self.opts, meter=self.meter, state=state,
                            last_good=self.slot.saved_step,
                            where=lambda n: f" (stage {stage_of_parameter(n.split(' of ')[-1], self.sm.split)})")
        self.slot.commit(write, state.step, confirmed)

    def confirm(self) -> None:
        self.slot.confirm()

    def drop_unconfirmed(self) -> None:
        self.slot.drop_unconfirmed()

    def results(self, state: LoopState, wall_s: float) -> dict:
        sm = self.sm
        boundaries = [describe_boundary(c, p, self.cfg, sm.id_bytes_per_token()) for p, c in enumerate(sm.compressors())]
        res = build_results(self.cfg, state, boundaries, self.meter, d_model=sm.model.cfg.d_model,
                            id_bytes_per_token=sm.id_bytes_per_token(), n_params=sum(p.numel() for p in sm.parameters()),
                            manifest=self.data.manifest, wall_s=wall_s)
        # subspace diagnostics on <= 8192 held-out tokens (cheap; the same tokens for every method)
        n_seq = max(1, 8192 // self.cfg.train.seq_len)
        res["boundary_diagnostics"] = boundary_diagnostics(
            sm, [(x[:n_seq].to(self.device), y[:n_seq]) for x, y in self.data.val_batches[:1]])
        return res
