"""The memory plan of a pipeline run: bytes per stage, before anything is allocated (docs/pipeline.md, "Memory
plan", says where each term comes from). The runtime prints it and, on a GPU, refuses a stage that does not fit
(:func:`check_plan`); ``train.activation_checkpointing: auto`` asks it whether checkpointing is needed."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from .compress.base import spec_bytes
from .config import RunConfig
from .model import ModelConfig
from .schedule import POSTS_AHEAD, schedule_ops

__all__ = ["GiB", "StageMemory", "MemoryPlan", "memory_plan", "format_plan", "check_plan",
           "block_activation_bytes_per_token", "head_activation_bytes_per_token", "resolve_precision",
           "resolve_checkpointing", "eval_block_bytes_per_token"]

GiB = 1024 ** 3
# optimizer state in multiples of the parameter bytes (+ scalars per parameter tensor)
_STATE_MULT = {"Muon": 1, "SPEL": 1, "AdamW": 2, "Adam": 2}
_STATE_SCALARS = {"AdamW": 4, "Adam": 4}          # AdamW keeps a float32 'step' tensor per parameter


def resolve_precision(precision: str, device: str) -> str:
    """``train.precision`` (validated by the config) -> 'fp32' | 'bf16' ('auto': bf16 on CUDA)."""
    return precision if precision != "auto" else ("bf16" if device.startswith("cuda") else "fp32")


def block_activation_bytes_per_token(mc: ModelConfig, precision: str, norm_cast: str = "per-linear") -> int:
    """Bytes one block saves for backward, per token (calibrated against autograd's saved tensors)."""
    d, q, kv, f, H = mc.d_model, mc.n_heads * mc.head_dim, mc.n_kv_heads * mc.head_dim, mc.ffn_hidden, mc.n_heads
    if precision == "fp32":
        return 4 * (2 * (3 * d + 1) + 3 * q + 2 * kv + H + 4 * f)
    # bf16: per norm x and x/rms fp32 (8d) + rstd; its bf16 output once per linear reading it (3 + 2 copies
    # of 2d; one per norm when cast once); attention bf16 + lse fp32; SwiGLU bf16
    copies = 2 if norm_cast == "once" else 5
    return 2 * (8 * d + 4) + copies * 2 * d + 2 * (3 * q + 2 * kv) + 4 * H + 2 * 4 * f


def eval_block_bytes_per_token(mc: ModelConfig, precision: str) -> int:
    """Peak bytes per token of one block's no-grad forward beyond its input, as tests/helpers/live_bytes.py measures."""
    d, f = mc.d_model, mc.ffn_hidden
    return 4 * (2 * d + 3 * f) if precision == "fp32" else 8 * d + 6 * f


def head_activation_bytes_per_token(mc: ModelConfig, precision: str) -> tuple[int, int]:
    """(saved, transient) bytes per token of the final norm, head and loss of one micro-batch: saved the norm's
    tensors and log-softmax's output; transient the logits and two V-wide gradients (bf16: their copies too)."""
    d, V = mc.d_model, mc.vocab_size
    if precision == "fp32":
        return 4 * (3 * d + 1) + 4 * V, 8 * V
    return 10 * d + 4 + 4 * V, 10 * V             # one norm: x, x/rms fp32, rstd, one bf16 output copy


def _loss_chunked(tokens: int, chunk: int) -> bool:
    return 0 < chunk < tokens


def _head_terms(mc: ModelConfig, precision: str, tokens: int, chunk: int) -> tuple[int, int]:
    """(saved per micro-batch, transient) bytes of the head and loss. A chunked loss keeps nothing V-wide but the
    norm's fp32 output; one chunk's V-wide tensors (and under bf16 the head's weight copy) are the transient."""
    saved, transient = head_activation_bytes_per_token(mc, precision)
    if not _loss_chunked(tokens, chunk):
        return saved * tokens, transient * tokens
    v_saved, bf16 = 4 * mc.vocab_size, precision == "bf16"
    kept = saved - v_saved + (2 * mc.d_model if bf16 else 0)
    return kept * tokens, (v_saved + transient) * chunk + (2 * mc.d_model * mc.vocab_size if bf16 else 0)


def _weight_bytes(module: torch.nn.Module) -> int:
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(2 * t.numel() for t in tensors if t.dim() == 2)


@dataclass
class StageMemory:
    """Bytes of one stage at its peak (``total``: what :func:`check_plan` compares with the device)."""
    stage: int
    layers: list[int]
    alive: int                    # micro-batches whose activations are held at the peak
    params: int = 0               # model parameters and buffers (fp32)
    grads: int = 0
    optimizer: int = 0
    activations: int = 0          # blocks (and stage input/output) of the micro-batches alive
    head: int = 0                 # embedding ids / final norm + log-softmax of the micro-batches alive
    working: int = 0              # transient: one micro-batch's backward/loss, or the optimizer step beyond them
    compressor: int = 0           # anchors, projector copies, RVQ codebooks (+ grads, optimizer state)
    buffers: int = 0              # wire send/receive buffers
    eval_peak: int = 0            # evaluation, between steps: state + one evaluation micro-batch (not a term)
    detail: dict = field(default_factory=dict)

    @property
    def train_total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.activations + self.head + self.working
                + self.compressor + self.buffers)

    @property
    def total(self) -> int:
        return max(self.train_total, self.eval_peak)

    def terms(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("stage", "layers", "alive", "detail", "eval_peak")}


@dataclass
class MemoryPlan:
    run: str
    precision: str
    schedule: str
    micro_batches: int
    tokens_per_micro_batch: int
    checkpointing: bool
    stages: list[StageMemory]

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    def to_dict(self) -> dict:
        return {"run": self.run, "precision": self.precision, "schedule": self.schedule,
                "micro_batches": self.micro_batches, "tokens_per_micro_batch": self.tokens_per_micro_batch,
                "checkpointing": self.checkpointing,
                "stages": [{"stage": s.stage, "layers": s.layers, "alive": s.alive, **s.terms(),
                            "eval_peak": s.eval_peak, "total": s.total, "detail": s.detail} for s in self.stages]}


def _alive(schedule: str, stages: int, micro: int, s: int) -> int:
    """Micro-batches whose graphs stage s holds at once, read off its compute order (GPipe: M; 1F1B: P - s)."""
    alive = most = 0
    for kind, _ in schedule_ops(schedule, stages, micro, s):
        alive += 1 if kind == "F" else -1
        most = max(most, alive)
    return most


def _module_bytes(module: torch.nn.Module) -> tuple[int, int]:
    every = sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
    train = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return every, train


def _optimizer_bytes(opts, params: set[int] | None = None) -> int:
    """State bytes the optimizers hold after their first step (of ``params`` ids, or all)."""
    total = 0
    for opt in opts:
        name = type(opt).__name__
        if name not in _STATE_MULT:
            raise ValueError(f"memory plan: optimizer {name} has no state size here; add it to mapl.core.memory._STATE_MULT")
        for g in opt.param_groups:
            for p in g["params"]:
                if params is None or id(p) in params:
                    total += _STATE_MULT[name] * p.numel() * p.element_size() + _STATE_SCALARS.get(name, 0)
    return total


def _opt_transient(opts, device: str) -> int:
    """Temporaries of one optimizer step: 2x the largest tensor; on CUDA at least AdamW's foreach group."""
    per_tensor, adam_group = 0, 0
    for opt in opts:
        for g in opt.param_groups:
            sizes = [p.numel() * p.element_size() for p in g["params"]]
            per_tensor = max([per_tensor, *sizes])
            if type(opt).__name__ in ("AdamW", "Adam"):
                adam_group = max(adam_group, sum(sizes))
    return max(2 * per_tensor, adam_group if device.startswith("cuda") else 0)


def _static_terms(cfg: RunConfig, vocab: int, s: int, device: str) -> tuple[StageMemory, object]:
    """Parameters, gradients, optimizer and compressor state of stage s, from a meta build of the stage as the runtime
    holds it (its optimizers leave the receiver's copy of boundary s-1 to the sender)."""
    from .stages import build_staged_model
    from .optimizer_recipe import build_optimizers
    with torch.device("meta"):
        sm = build_staged_model(cfg, vocab).prune_to_stage(s)
    recv = {id(p) for p in sm.boundaries[str(s - 1)].parameters()} if s > 0 else set()
    opts = build_optimizers(sm, cfg, exclude=recv)
    st = StageMemory(stage=s, layers=list(sm.split[s]), alive=0)
    side = [sm.anchors[k] for k in sm.anchors] + [sm.boundaries[k] for k in sm.boundaries]
    side_ids = {id(p) for m in side for p in m.parameters()}
    side_bytes = sum(_module_bytes(m)[0] for m in side)
    side_train = sum(_module_bytes(m)[1] for m in side)
    every, train = _module_bytes(sm)
    st.params, st.grads = every - side_bytes, train - side_train
    st.optimizer = _optimizer_bytes(opts) - _optimizer_bytes(opts, side_ids)
    st.compressor = side_bytes + side_train + _optimizer_bytes(opts, side_ids)
    st.detail = {"opt_transient": _opt_transient(opts, device), "stage_weight_bf16": _weight_bytes(sm.model.layers),
                 "ids_on_wire": sm.ids_on_wire, "id_bytes": sm.id_bytes_per_token()}
    return st, sm


def _wire_bytes(comp, mb_shape: tuple[int, int], direction: str) -> int:
    return spec_bytes(comp.payload_spec(mb_shape, direction))


def _boundary_terms(sm, s: int, P: int, tokens: int, matmul_bytes: int) -> tuple[int, int]:
    """Per micro-batch alive: (the stage's input and output tensors, ids) bytes; a learned projector also keeps
    encode's d-wide fp32 input."""
    d = sm.model.cfg.d_model
    extra = 0
    if s > 0:
        comp = sm.boundaries[str(s - 1)]
        if comp.code_dim != d:
            extra += comp.code_dim * matmul_bytes * tokens
    if s < P - 1:
        comp = sm.boundaries[str(s)]
        extra += comp.code_dim * (4 if comp.code_dim == d else matmul_bytes) * tokens
        if any(p.requires_grad for p in comp.parameters()):
            extra += d * 4 * tokens
    uses_ids = s == 0 or any(p.requires_grad for p in sm.anchors[str(s)].parameters())
    return extra, (8 * tokens if uses_ids else 0)


def _stage_plan(cfg: RunConfig, vocab: int, s: int, precision: str, checkpointing: bool, device: str) -> StageMemory:
    st, sm = _static_terms(cfg, vocab, s, device)
    t, P, mc = cfg.train, cfg.stages, sm.model.cfg
    tokens = (t.batch_size // t.micro_batches) * t.seq_len
    st.alive = alive = _alive(t.schedule, P, t.micro_batches, s)
    matmul_bytes = 4 if precision == "fp32" else 2
    blk = block_activation_bytes_per_token(mc, precision, t.norm_cast) * tokens
    n_blocks = len(st.layers)
    weights = 0
    # the head's bf16 weight copy, kept per micro-batch in flight unless the loss is chunked (then a transient)
    head_copy = (2 * mc.d_model * mc.vocab_size if precision == "bf16" and s == P - 1
                 and not _loss_chunked(tokens, t.loss_chunk_tokens) else 0)
    if precision == "bf16":          # autocast's bf16 weight copies, one set per micro-batch in flight
        weights = st.detail["stage_weight_bf16"] + head_copy
    if checkpointing:                # a checkpointed block keeps its fp32 input; one block is recomputed at a time
        per_mb = n_blocks * mc.d_model * 4 * tokens
        one_block = blk + (weights // max(1, n_blocks) if weights else 0)
        weights = head_copy
    else:
        per_mb, one_block = n_blocks * blk, blk
    edge, ids = _boundary_terms(sm, s, P, tokens, matmul_bytes)
    st.activations = alive * (per_mb + edge + weights)
    head_saved, head_work = _head_terms(mc, precision, tokens, t.loss_chunk_tokens)
    st.head = alive * (ids + (head_saved if s == P - 1 else 0))
    st.detail["rvq_search"] = _rvq_search_bytes(cfg, sm, s, tokens, precision, device)
    act_working = max(one_block, head_work if s == P - 1 else 0, st.detail["rvq_search"])
    # the optimizer step runs after the activations are freed: its temporaries count only beyond them
    st.working = max(act_working, st.detail["opt_transient"] - st.activations - st.head)
    # the deep 1F1B schedules post each gradient's receive with its forward's send: one per graph alive
    grad_recvs = alive if t.schedule in POSTS_AHEAD else 1
    st.buffers = _buffer_bytes(sm, s, P, (t.batch_size // t.micro_batches, t.seq_len), grad_recvs)
    st.detail.update(block_bytes_per_micro_batch=blk, micro_batch_tokens=tokens)
    st.eval_peak = _eval_peak(cfg, sm, st, s, precision, device)
    return st


def _eval_peak(cfg: RunConfig, sm, st: StageMemory, s: int, precision: str, device: str) -> int:
    """Stage s's peak while it evaluates one micro-batch (no graph, no gradients)."""
    t, P, mc = cfg.train, cfg.stages, sm.model.cfg
    seqs = min(t.eval_micro_batch_size or t.eval_batch_size, t.eval_batch_size)
    tokens = seqs * t.seq_len
    # the fp32 stream, then whichever is larger: a block's temporaries, or (last stage) the final norm's
    # output with one chunk's fp32 logits and log-softmax (a bf16 logits block is freed by its fp32 copy)
    head = 4 * mc.d_model * tokens + 8 * mc.vocab_size * min(tokens, t.loss_chunk_tokens or tokens)
    stream = (2 if sm.anchors[str(s)].kind != "none" else 1) * 4 * mc.d_model * tokens   # + the anchor, kept
    work = stream + max(eval_block_bytes_per_token(mc, precision) * tokens, head if s == P - 1 else 0)
    if precision == "bf16":
        work += st.detail["stage_weight_bf16"] + (2 * mc.d_model * mc.vocab_size if s == P - 1 else 0)
    shape, pieces = (seqs, t.seq_len), -(-t.eval_batch_size // seqs)
    ids = sm.id_bytes_per_token() * tokens
    wire = 0
    if s > 0:                        # one receive (+ token ids)
        wire += _wire_bytes(sm.boundaries[str(s - 1)], shape, "fwd") + ids
    if s < P - 1:                    # the sends of one evaluation batch, completed before the next
        wire += pieces * (_wire_bytes(sm.boundaries[str(s)], shape, "fwd") + ids)
    return st.params + st.optimizer + st.compressor + work + wire


def _rvq_search_bytes(cfg: RunConfig, sm, s: int, tokens: int, precision: str, device: str) -> int:
    """Transient bytes of the RVQ search stage s runs as boundary s's sender (0 for other methods)."""
    if cfg.compressor.method != "mapl-rvq" or s == cfg.stages - 1:
        return 0
    from .compress.rvq.search import search_transient_bytes, tile_budget
    q = sm.boundaries[str(s)].rvq
    search = search_transient_bytes(tokens, q.groups, q.rounds, q.codebook_size, q.sub_dim, kernel=q.search_kernel,
                                    tile_bytes=q.tile_bytes, device=device)
    kmeans_tile = 4 * tile_budget(q.tile_bytes, torch.float32, torch.device(device))   # its assign is always tiled
    fp32_copy = 4 * q.dim * tokens if precision == "bf16" else 0
    return fp32_copy + max(search, kmeans_tile)


def _buffer_bytes(sm, s: int, P: int, mb_shape, grad_recvs: int = 1) -> int:
    """Two sends held (the runtime completes each one batch later) plus one receive per direction (``grad_recvs``
    gradient receives where they are posted ahead)."""
    ids = sm.id_bytes_per_token() * mb_shape[0] * mb_shape[1]
    total, sends = 0, []
    if s < P - 1:                    # forward sends (+ token ids), gradient receives
        comp = sm.boundaries[str(s)]
        sends.append(_wire_bytes(comp, mb_shape, "fwd") + ids)
        total += grad_recvs * _wire_bytes(comp, mb_shape, "bwd")
    if s > 0:                        # gradient sends, forward receives
        comp = sm.boundaries[str(s - 1)]
        sends.append(_wire_bytes(comp, mb_shape, "bwd"))
        total += _wire_bytes(comp, mb_shape, "fwd") + ids
    return total + 2 * max(sends, default=0)


def memory_plan(cfg: RunConfig, vocab_size: int | None = None, *, device: str = "cuda",
                checkpointing: bool | None = None, device_bytes: float | None = None) -> MemoryPlan:
    """Bytes per stage of ``cfg`` on ``device`` ('cuda' or 'cpu'). ``vocab_size``: default the preset's;
    ``checkpointing``: default the config's ('auto' resolved against ``device_bytes``)."""
    mc = cfg.model_config(vocab_size)
    cfg = cfg.validate(mc.vocab_size)
    prec = resolve_precision(cfg.train.precision, device)
    if checkpointing is None:
        checkpointing = resolve_checkpointing(cfg, mc.vocab_size, device=device, device_bytes=device_bytes)
    stages = [_stage_plan(cfg, mc.vocab_size, s, prec, checkpointing, device) for s in range(cfg.stages)]
    t = cfg.train
    return MemoryPlan(run=cfg.name(), precision=prec, schedule=t.schedule, micro_batches=t.micro_batches,
                      tokens_per_micro_batch=(t.batch_size // t.micro_batches) * t.seq_len,
                      checkpointing=checkpointing, stages=stages)


def resolve_checkpointing(cfg: RunConfig, vocab_size: int | None = None, *, device: str = "cuda",
                          device_bytes: float | None = None, reserve_frac: float = 0.10) -> bool:
    """``train.activation_checkpointing`` as set; 'auto': on exactly when the plan without it does not fit
    ``device_bytes`` less the reserve, off when the device's memory is unknown (a CPU host)."""
    mode = cfg.train.activation_checkpointing
    if mode != "auto":
        return mode == "on"
    if not device_bytes:
        return False
    plain = memory_plan(cfg, vocab_size, device=device, checkpointing=False)
    return plain.peak.total > device_bytes * (1.0 - reserve_frac)


def _gib(x: float) -> str:
    return f"{x / GiB:.2f}"


def format_plan(plan: MemoryPlan) -> str:
    names = list(plan.stages[0].terms()) + ["eval_peak"]
    head = (f"memory plan {plan.run}: {plan.precision}, {plan.schedule}, {plan.micro_batches} micro-batches of "
            f"{plan.tokens_per_micro_batch} tokens, activation checkpointing {'on' if plan.checkpointing else 'off'}")
    lines = [head, "", "| stage | layers | alive | " + " | ".join(names) + " | total (GiB) |",
             "|" + "---|" * (len(names) + 4)]
    for s in plan.stages:
        lay = f"{s.layers[0]}-{s.layers[-1]}" if len(s.layers) > 1 else str(s.layers[0])
        lines.append(f"| {s.stage} | {lay} | {s.alive} | " + " | ".join(_gib(v) for v in s.terms().values())
                     + f" | {_gib(s.eval_peak)} | {_gib(s.total)} |")
    return "\n".join(lines) + "\n"


def check_plan(plan: MemoryPlan, device_bytes: float, reserve_frac: float = 0.10) -> None:
    """Refuse (a one-line ValueError) a plan whose largest stage exceeds the device memory less a margin (a CUDA
    context and fragmentation take the rest)."""
    if not device_bytes > 0:
        raise ValueError(f"device memory {device_bytes!r} is invalid: must be > 0 bytes")
    limit = device_bytes * (1.0 - reserve_frac)
    worst = plan.peak
    if worst.total <= limit:
        return
    allows = f"but the device allows {_gib(limit)} GiB ({_gib(device_bytes)} GiB less {reserve_frac:.0%} reserve)"
    if worst.eval_peak > worst.train_total:
        raise ValueError(
            f"memory plan of {plan.run} does not fit: stage {worst.stage} needs {_gib(worst.total)} GiB to "
            f"evaluate (training needs {_gib(worst.train_total)} GiB) {allows}; try a smaller "
            f"train.eval_micro_batch_size, train.loss_chunk_tokens or more stages")
    big = max(worst.terms().items(), key=lambda kv: kv[1])
    raise ValueError(
        f"memory plan of {plan.run} does not fit: stage {worst.stage} needs {_gib(worst.total)} GiB "
        f"(largest term {big[0]} {_gib(big[1])} GiB) {allows}; try train.schedule=1f1b, "
        f"activation checkpointing, smaller micro-batches (more of them) or more stages")

