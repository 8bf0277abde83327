"""The memory plan (mapl.core.memory) against exact tensor byte counts of built micro models."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mapl.core.config import load_run_config
from mapl.core.memory import (GiB, block_activation_bytes_per_token, check_plan, format_plan, head_activation_bytes_per_token,
                         memory_plan)
from mapl.core.model import Block, ModelConfig, rope_tables
from mapl.core.stages import build_staged_model
from mapl.core.engine import build_optimizers


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _saved_bytes(fn, exclude) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs, less those in ``exclude``."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    return sum(v for k, v in seen.items() if k not in skip), out


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_block_activations_match_saved_tensors(kv_heads):
    mc = ModelConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=4, n_kv_heads=kv_heads, ffn_hidden=192,
                     max_seq_len=32)
    blk = Block(mc)
    cos, sin = rope_tables(mc.head_dim, 32, 1e4)
    x = torch.randn(2, 32, 64, requires_grad=True)
    got, _ = _saved_bytes(lambda: blk(x, cos, sin), [*blk.parameters(), cos, sin])
    assert got == block_activation_bytes_per_token(mc, "fp32") * 2 * 32


def test_block_activation_hand_count_bf16():
    mc = ModelConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=4, n_kv_heads=1, ffn_hidden=192, max_seq_len=32)
    # fp32 residual-side norm tensors (2 norms x (x, x/rms) x 4 B x 64) + rstd, bf16 norm outputs (one per
    # linear reading them: wq, wk, wv, w1, w3), bf16 q/out/reshape (3 x 64) and k/v (2 x 16), fp32
    # log-sum-exp (4 heads), bf16 SwiGLU (4 x 192)
    hand = 2 * (2 * 4 * 64 + 4) + 5 * 2 * 64 + 2 * (3 * 64 + 2 * 16) + 4 * 4 + 2 * 4 * 192
    assert block_activation_bytes_per_token(mc, "bf16") == hand


def _saved_per_token(module, make_input, precision: str, tokens=(8, 16)) -> float:
    """Bytes per token autograd saves in ``module`` under ``precision`` (CPU bf16 autocast or fp32): the
    difference between two token counts, so what does not scale with tokens (autocast's bf16 weight
    copies, the RoPE tables) cancels out."""
    got = []
    for T in tokens:
        args = make_input(T)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            got.append(_saved_bytes(lambda: module(*args), [])[0])
    return (got[1] - got[0]) / (tokens[1] - tokens[0])


@pytest.mark.parametrize("preset", ["150M", "1B"])
def test_block_term_matches_saved_tensors_at_paper_shapes_fp32_and_bf16(preset):
    """The plan's block term against what autograd saves for one block of the paper's shapes (measured
    with saved-tensor hooks: 56,392 B per token at 150M and 125,064 B at 1B under bf16 autocast, where an
    older count said 50,248 and 112,776: it missed three of the five bf16 copies of the norm outputs)."""
    mc = ModelConfig.preset(preset)
    with torch.device("meta"):
        blk = Block(mc)
    blk = blk.to_empty(device="cpu")                     # values do not matter: only what is saved
    for p in blk.parameters():
        torch.nn.init.zeros_(p)
    cos, sin = rope_tables(mc.head_dim, 16, 1e4)

    def block_input(T):
        return torch.zeros(1, T, mc.d_model, requires_grad=True), cos[:T], sin[:T]
    assert _saved_per_token(blk, block_input, "fp32") == block_activation_bytes_per_token(mc, "fp32")
    bf16 = _saved_per_token(blk, block_input, "bf16")
    assert bf16 == pytest.approx(block_activation_bytes_per_token(mc, "bf16"), rel=0.03)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_head_term_matches_saved_tensors(precision):
    """The final norm, LM head and fp32 cross-entropy: saved bytes per token as the plan counts them
    (plus the int64 targets, which it leaves out). bf16 used to count two norms' tensors here."""
    from mapl.core.model import RMSNorm
    mc = ModelConfig(vocab_size=1000, d_model=64, n_layers=1, n_heads=4, n_kv_heads=1, ffn_hidden=192, max_seq_len=32)
    norm, out = RMSNorm(mc.d_model, mc.norm_eps), torch.nn.Linear(mc.d_model, mc.vocab_size, bias=False)

    def head_loss(x, y):
        logits = out(norm(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y)

    def head_input(T):
        return torch.randn(1, T, mc.d_model, requires_grad=True), torch.randint(0, mc.vocab_size, (T,))
    got = _saved_per_token(lambda x, y: head_loss(x, y), head_input, precision)
    assert got == head_activation_bytes_per_token(mc, precision)[0] + 8


def _cfg(method, stages=2, schedule="gpipe", **kw):
    over = {"method": method, "stages": stages, "train.schedule": schedule, **kw}
    if method not in ("none", "int8"):
        over["ratio"] = 4
    return load_run_config("micro", over).validate(256)


def _stage_forward_saved(sm, s, P, tokens_shape):
    """Bytes one micro-batch of stage s keeps: what autograd saves plus the runtime's (z_in, out)."""
    ids = torch.randint(0, 256, tokens_shape)
    z_in = None
    if s > 0:
        comp = sm.boundaries[str(s - 1)]
        z_in = torch.randn(*tokens_shape, comp.code_dim, requires_grad=True)
    exclude = list(sm.parameters()) + list(sm.buffers())

    def run():
        out = sm.stage_forward(s, z_in, ids)
        if s == P - 1:
            out = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), ids.reshape(-1))
        return out
    got, out = _saved_bytes(run, exclude)
    held = {}
    for t in ([z_in] if z_in is not None else []) + ([out] if s < P - 1 else []):
        held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return got + sum(held.values())


@pytest.mark.parametrize("method", ["none", "ssn", "mapl", "mapl-rvq"])
def test_stage_activations_match_saved_tensors(method):
    cfg = _cfg(method)
    plan = memory_plan(cfg, 256, device="cpu")
    t = cfg.train
    for st in plan.stages:
        torch.manual_seed(0)
        sm = build_staged_model(cfg, 256).prune_to_stage(st.stage)
        got = _stage_forward_saved(sm, st.stage, cfg.stages, (t.batch_size // t.micro_batches, t.seq_len))
        per_mb = (st.activations + st.head) / st.alive
        # the loss also saves its targets (tokens x 8 B), which the plan leaves out
        assert got == pytest.approx(per_mb, rel=0.03), (method, st.stage)


def _after_one_step(cfg, s):
    torch.manual_seed(0)
    sm = build_staged_model(cfg, 256).prune_to_stage(s)
    recv = list(sm.boundaries[str(s - 1)].parameters()) if s > 0 else []
    opts = build_optimizers(sm, cfg, exclude={id(p) for p in recv})
    for p in sm.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p) * 1e-3
    for o in opts:
        o.step()
    return sm, opts


@pytest.mark.parametrize("method", ["none", "ssn", "mapl", "mapl-rvq"])
def test_static_terms_are_exact(method):
    cfg = _cfg(method)
    plan = memory_plan(cfg, 256, device="cpu")
    for st in plan.stages:
        sm, opts = _after_one_step(cfg, st.stage)
        side = [sm.anchors[k] for k in sm.anchors] + [sm.boundaries[k] for k in sm.boundaries]
        side_ids = {id(t) for m in side for t in list(m.parameters()) + list(m.buffers())}
        model_t = [t for t in list(sm.parameters()) + list(sm.buffers()) if id(t) not in side_ids]
        assert st.params == _nbytes(model_t)
        assert st.grads == _nbytes(p.grad for p in sm.parameters() if p.grad is not None and id(p) not in side_ids)
        state = {id(p): _nbytes(v for v in o.state[p].values() if torch.is_tensor(v))
                 for o in opts for g in o.param_groups for p in g["params"]}
        assert st.optimizer == sum(v for k, v in state.items() if k not in side_ids)
        side_total = (_nbytes(t for m in side for t in list(m.parameters()) + list(m.buffers()))
                      + _nbytes(p.grad for m in side for p in m.parameters() if p.grad is not None)
                      + sum(v for k, v in state.items() if k in side_ids))
        assert st.compressor == side_total


def test_micro_batches_alive_per_schedule():
    gpipe = memory_plan(_cfg("none", stages=4, schedule="gpipe", **{"train.micro_batches": 4}), 256, device="cpu")
    ofob = memory_plan(_cfg("none", stages=4, schedule="1f1b", **{"train.micro_batches": 4}), 256, device="cpu")
    assert [s.alive for s in gpipe.stages] == [4, 4, 4, 4]
    assert [s.alive for s in ofob.stages] == [4, 3, 2, 1]
    assert ofob.peak.total < gpipe.peak.total


def test_checkpointing_keeps_block_inputs_only():
    cfg = _cfg("none", stages=2, schedule="gpipe")
    plain = memory_plan(cfg, 256, device="cpu")
    ckpt = memory_plan(cfg, 256, device="cpu", checkpointing=True)
    mc, t = cfg.model_config(256), cfg.train
    tokens = (t.batch_size // t.micro_batches) * t.seq_len
    s0, c0 = plain.stages[0], ckpt.stages[0]
    blocks = len(s0.layers) * block_activation_bytes_per_token(mc, "fp32") * tokens
    assert s0.activations - c0.activations == s0.alive * (blocks - len(s0.layers) * mc.d_model * 4 * tokens)


def test_head_term_counts_log_softmax_per_micro_batch():
    cfg = _cfg("none", stages=2, schedule="gpipe")
    plan = memory_plan(cfg, 256, device="cpu")
    mc, t = cfg.model_config(256), cfg.train
    tokens = (t.batch_size // t.micro_batches) * t.seq_len
    saved, _ = head_activation_bytes_per_token(mc, "fp32")
    assert plan.stages[-1].head == t.micro_batches * saved * tokens
    assert saved == 4 * (3 * mc.d_model + 1) + 4 * mc.vocab_size


def test_refusal_is_one_line_naming_stage_total_and_limit():
    plan = memory_plan(_cfg("none"), 256, device="cpu")
    worst = plan.peak
    check_plan(plan, 2 * worst.total / 0.9)                     # fits: no error
    with pytest.raises(ValueError) as e:
        check_plan(plan, worst.total)
    msg = str(e.value)
    assert "\n" not in msg and f"stage {worst.stage}" in msg
    assert f"{worst.total / GiB:.2f} GiB" in msg and f"{0.9 * worst.total / GiB:.2f} GiB" in msg


def test_format_plan_has_a_row_per_stage():
    text = format_plan(memory_plan(_cfg("mapl", stages=4, schedule="1f1b", **{"train.micro_batches": 4}), 256,
                                   device="cpu"))
    assert text.count("\n| ") == 5 and "total (GiB)" in text


def test_wire_buffers_are_two_sends_as_the_runtime_releases_them_not_a_steps_worth():
    """1B uncompressed, 1F1B, 32 micro-batches: held for the whole step, the middle stages' sends would be
    2 x 32 of 128 MiB (8.25 GiB with the receives); released one batch later they are two (0.5 GiB with the
    receives)."""
    cfg = load_run_config("paper", {"model": "1B", "method": "none", "train.schedule": "1f1b"})
    msg = 16 * 2048 * 2048 * 2                                  # one bf16 micro-batch activation (or gradient)
    plan = memory_plan(cfg)
    assert [s.buffers for s in plan.stages] == [3 * msg, 4 * msg, 4 * msg, 3 * msg]


def test_paper_shapes_agree_with_the_per_layer_estimate():
    """The per-layer estimate the paper runs were sized by: about 1.7 / 2.6 / 3.8 GiB per layer per 16 x 2048-token
    micro-batch at 150M / 500M / 1B (bf16); the calibrated count gives 1.72 / 2.60 / 3.82 GiB."""
    got = [block_activation_bytes_per_token(ModelConfig.preset(m), "bf16") * 16 * 2048 / 2**30
           for m in ("150M", "500M", "1B")]
    assert got == pytest.approx([1.72, 2.60, 3.82], abs=0.01)


@pytest.mark.slow
def test_rvq_search_transient_is_a_working_term_of_the_sender_stages():
    """MAPL+RVQ's search runs in the sender's forward: its temporaries (O(G·N) fused, the tile's
    distances with matmul, the k-means init's tile) are counted; never the (G, N, K) distance block."""
    from mapl.core.compress.rvq.search import search_transient_bytes
    cfg = load_run_config("paper", {"model": "150M", "method": "mapl-rvq", "ratio": 4, "stages": 4})
    plan = memory_plan(cfg, device="cuda")
    t, mc = cfg.train, cfg.model_config()
    N, G, K = (t.batch_size // t.micro_batches) * t.seq_len, mc.d_model // 4 // 2, cfg.compressor.rvq.codebook_size
    fused = search_transient_bytes(N, G, cfg.compressor.rvq.rounds, K, 2, kernel="fused")
    copy = 4 * 2 * G * N                                              # the fp32 copy of the bf16 Z
    for st in plan.stages[:-1]:
        assert st.detail["rvq_search"] == copy + max(fused, 256 << 20) < G * N * K * 4 // 4
        assert st.working >= st.detail["rvq_search"]
    assert plan.stages[-1].detail["rvq_search"] == 0
    assert memory_plan(_cfg("mapl"), 256, device="cpu").stages[0].detail["rvq_search"] == 0


def test_micro_batches_alive_are_read_off_the_runtimes_compute_order():
    """The plan's liveness comes from the schedule the runtime executes (mapl.core.schedule), and is
    the known closed form: GPipe holds all M graphs, 1F1B at most P - s on stage s."""
    from mapl.core.memory import _alive
    for P, M in [(2, 1), (4, 2), (4, 8), (8, 32)]:
        for s in range(P):
            assert _alive("gpipe", P, M, s) == M
            assert _alive("1f1b", P, M, s) == min(M, P - s)
            for k in (2, 3, 4):                  # the slow-link schedules: k x the warm-up, one more alive
                assert _alive(f"1f1b-x{k}", P, M, s) == min(M, k * (P - 1 - s) + 1)


# ---- cast once per norm, evaluation's peak, activation checkpointing chosen by the plan -----------------------
def _paper_block(preset):
    mc = ModelConfig.preset(preset)
    with torch.device("meta"):
        blk = Block(mc)
    blk = blk.to_empty(device="cpu")
    for p in blk.parameters():
        torch.nn.init.normal_(p, 0.0, 0.02)
    return mc, blk


@pytest.mark.parametrize("preset", ["150M", "1B"])
def test_norm_cast_once_saves_two_bf16_copies_per_block_not_five(preset):
    """``train.norm_cast: once``: what autograd saves under bf16 drops by three d-wide bf16 copies per token
    (measured), as the plan counts it; fp32 is untouched (no autocast, no cast)."""
    mc, blk = _paper_block(preset)
    cos, sin = rope_tables(mc.head_dim, 16, 1e4)

    def block_input(T):
        return torch.zeros(1, T, mc.d_model, requires_grad=True), cos[:T], sin[:T]
    blk.cast_norm_once = True
    once = _saved_per_token(blk, block_input, "bf16")
    assert _saved_per_token(blk, block_input, "fp32") == block_activation_bytes_per_token(mc, "fp32", "once")
    blk.cast_norm_once = False
    per_linear = _saved_per_token(blk, block_input, "bf16")
    assert per_linear - once == 3 * 2 * mc.d_model
    assert once == pytest.approx(block_activation_bytes_per_token(mc, "bf16", "once"), rel=0.03)


def test_norm_cast_is_opt_in_and_changes_no_forward():
    """``once`` is the paper profile's (bf16 on GPUs), not the CPU profiles': in fp32 nothing is cast, and under
    bf16 the forward is the same bits (autocast's per-linear cast of a norm output is the same rounding); only
    the backward differs, the input gradients summed in bf16 before the one cast back (its error against fp32's
    gradient was measured on CPU: reports/bench/norm-cast-cpu.jsonl)."""
    from mapl.core.config import ConfigError, config_hash
    assert load_run_config("cpu").train.norm_cast == load_run_config("micro").train.norm_cast == "per-linear"
    assert load_run_config("paper").train.norm_cast == "once" and load_run_config("paper").train.precision == "bf16"
    plain = load_run_config("micro")
    assert config_hash(load_run_config("micro", {"train.norm_cast": "per-linear"})) == config_hash(plain)
    assert config_hash(load_run_config("micro", {"train.norm_cast": "once"})) != config_hash(plain)
    with pytest.raises(ConfigError, match=r"^train\.norm_cast='twice' is invalid: .*'per-linear', 'once'"):
        load_run_config("micro", {"train.norm_cast": "twice"})
    mc = ModelConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=4, n_kv_heads=1, ffn_hidden=192, max_seq_len=32)
    torch.manual_seed(0)
    blk = Block(mc)
    cos, sin = rope_tables(mc.head_dim, 32, 1e4)
    x = torch.randn(2, 32, 64)
    out = {}
    for once in (False, True):
        blk.cast_norm_once = once
        with torch.no_grad():
            out[once, "fp32"] = blk(x, cos, sin)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out[once, "bf16"] = blk(x, cos, sin)
    assert torch.equal(out[False, "fp32"], out[True, "fp32"])                 # bitwise: nothing to cast
    assert torch.equal(out[True, "bf16"], out[False, "bf16"])                 # bitwise: the same rounding, once
    sm = build_staged_model(load_run_config("micro", {"train.norm_cast": "once"}), 256)
    assert all(b.cast_norm_once for b in sm.model.layers.values())
    assert not any(b.cast_norm_once for b in build_staged_model(plain, 256).model.layers.values())


@pytest.mark.parametrize("preset, precision", [("micro", "fp32"), ("micro", "bf16"), ("150M", "fp32")])
def test_eval_block_term_matches_the_measured_no_grad_peak(preset, precision):
    """One block's no-grad forward (evaluation): the peak of the tensors it creates, per token (the
    difference of two lengths), against the plan's count. Not bf16 at 150M on CPU: there autocast's
    bf16 weight copies (22 MB per block) move the peak to the down projection below ~700 tokens, and the
    plan's regime (32k tokens) would take a minute of CPU bf16 matmuls to reach."""
    from mapl.core.memory import eval_block_bytes_per_token
    from tests.helpers.live_bytes import live_tensor_peak
    if preset == "micro":
        mc = ModelConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=4, n_kv_heads=1, ffn_hidden=192,
                         max_seq_len=512)
        blk = Block(mc)
    else:
        mc, blk = _paper_block(preset)
    cos, sin = rope_tables(mc.head_dim, 512, 1e4)
    peaks = []
    for T in (128, 256) if preset == "micro" else (32, 64):
        x = torch.randn(1, T, mc.d_model)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            peaks.append((T, live_tensor_peak(lambda: blk(x, cos[:T], sin[:T]))[0]))
    (t0, p0), (t1, p1) = peaks
    assert (p1 - p0) / (t1 - t0) == pytest.approx(eval_block_bytes_per_token(mc, precision), rel=0.03)


def test_live_tensor_peak_counts_what_is_alive_at_once():
    from tests.helpers.live_bytes import live_tensor_peak
    a = torch.randn(1000)                                # made before: not counted, nor its views

    def fn():
        b = a * 2                                        # 4,000 B
        c = b.exp()                                      # 8,000 alive
        del b
        d = c.view(10, 100).t().contiguous()             # 8,000 alive again (c and d)
        del c
        return d + a.view(10, 100).t()                   # d and the sum: 8,000
    peak, out = live_tensor_peak(fn)
    assert peak == 8000 and out.shape == (100, 10)


def _eval_plan(**over):
    return memory_plan(load_run_config("paper", {"model": "150M", "method": "none", "stages": 4, **over}),
                       device="cuda", checkpointing=False)


def test_the_last_stage_eval_peak_matches_a_measured_evaluation():
    """A micro pipeline's last stage evaluating one batch without gradients (fp32 on CPU): the peak of
    the tensors it creates against the plan's evaluation term beyond the stage's state and wire."""
    from tests.helpers.live_bytes import live_tensor_peak
    for chunk in (0, 64):
        cfg = _cfg("mapl", **{"train.eval_batch_size": 8, "train.loss_chunk_tokens": chunk})
        plan = memory_plan(cfg, 256, device="cpu")
        st, t = plan.stages[-1], cfg.train
        sm = build_staged_model(cfg, 256).prune_to_stage(1)
        B, T = t.eval_batch_size, t.seq_len
        ids, y = torch.randint(0, 256, (B, T)), torch.randint(0, 256, (B, T))
        z = torch.randn(B, T, sm.boundaries["0"].code_dim)
        sm.eval()
        with torch.no_grad():
            got, _ = live_tensor_peak(lambda: sm.stage_loss(1, z, ids, y, chunk))
        wire = _wire_in(sm, (B, T))
        assert got == pytest.approx(st.eval_peak - st.params - st.optimizer - st.compressor - wire, rel=0.05), chunk


def _wire_in(sm, shape):
    from mapl.core.memory import _wire_bytes
    return _wire_bytes(sm.boundaries["0"], shape, "fwd") + sm.id_bytes_per_token() * shape[0] * shape[1]


def test_evaluation_in_micro_batches_bounds_the_eval_peak_and_the_plan_refuses_naming_it():
    """At eval_batch_size 64 x 2048 tokens without chunked loss the last stage's
    evaluation (fp32 logits and log-softmax of 131k tokens at V = 32k: 31 GiB) is the stage's peak; in
    micro-batches of 16 it is a quarter of that; a device it does not fit is refused naming evaluation."""
    whole = _eval_plan(**{"train.eval_micro_batch_size": 0, "train.loss_chunk_tokens": 0}).stages[-1]
    micro = _eval_plan(**{"train.eval_micro_batch_size": 16, "train.loss_chunk_tokens": 0}).stages[-1]
    V, tokens = 32000, 64 * 2048
    assert whole.eval_peak - micro.eval_peak >= 8 * V * (tokens - tokens // 4)
    assert whole.total == whole.eval_peak > whole.train_total
    plan = _eval_plan(**{"train.eval_micro_batch_size": 0, "train.loss_chunk_tokens": 0})
    with pytest.raises(ValueError, match=r"^memory plan of .* needs [\d.]+ GiB to evaluate .*eval_micro_batch_size"):
        check_plan(plan, (whole.train_total + whole.eval_peak) / 2 / 0.9)
    assert load_run_config("paper").train.eval_micro_batch_size == 16
    assert load_run_config("cpu").train.eval_micro_batch_size == 0
    assert "eval_peak" in format_plan(plan) and plan.to_dict()["stages"][-1]["eval_peak"] == whole.eval_peak


def test_activation_checkpointing_auto_is_chosen_by_the_plan():
    """'auto' turns checkpointing on exactly when the plan without it does not fit the device (less the
    10 % reserve), and stays off where the device's memory is unknown (CPU); on/off are as set."""
    from mapl.core.config import ConfigError
    from mapl.core.memory import resolve_checkpointing
    cfg = load_run_config("paper", {"model": "1B", "method": "none", "stages": 4,
                                    "train.activation_checkpointing": "auto"})
    need = memory_plan(cfg, device="cuda", checkpointing=False).peak.total
    assert need > 48e9 * 0.9                                # 1B P = 4 uncompressed: not on a 48 GB GPU
    assert resolve_checkpointing(cfg, device="cuda", device_bytes=48e9)
    assert not resolve_checkpointing(cfg, device="cuda", device_bytes=need / 0.9 + 1)
    assert not resolve_checkpointing(cfg, device="cpu")
    plan = memory_plan(cfg, device="cuda", device_bytes=48e9)
    assert plan.checkpointing and plan.peak.total < 48e9 * 0.9
    check_plan(plan, 48e9)
    assert not memory_plan(cfg, device="cuda", device_bytes=141e9).checkpointing       # fits an H200
    for mode, on in (("on", True), ("off", False)):
        fixed = load_run_config("paper", {"model": "1B", "stages": 4, "train.activation_checkpointing": mode})
        assert resolve_checkpointing(fixed, device="cuda", device_bytes=1e9) is on
    assert load_run_config("cpu").train.activation_checkpointing == "off"
    assert load_run_config("paper").train.activation_checkpointing == "auto"
    with pytest.raises(ConfigError, match=r"^train\.activation_checkpointing='yes' is invalid: .*'off', 'on', 'auto'"):
        load_run_config("micro", {"train.activation_checkpointing": "yes"})
