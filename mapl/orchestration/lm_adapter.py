"""A finished run as an lm-evaluation-harness model: its checkpoint restored into the staged model, every boundary
through its compressor as training sent it (encode -> pack -> unpack -> decode, the anchors added back, RVQ's
codebooks in eval mode), scored with the run's own tokenizer.

Here in orchestration, beside ``rescore.score_run``, which restores checkpoints the same way: the core's modules are
the training fingerprint, and an evaluation adapter changes no run's numbers. The uncompressed run is scored by the
same code, so a difference between two runs' scores is their compressors' (and training's).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from ..base.settings import build
from ..core import checkpoint
from ..core.config import RunConfig
from ..core.engine import LocalEngine, autocast_ctx, resolve_data_dir
from ..core.stages import StagedModel

__all__ = ["RestoredRun", "recorded_config", "restore_run", "declared_wire", "MaplLM"]


@dataclass
class RestoredRun:
    """A finished run's model in eval mode, its config, tokenizer and device."""
    cfg: RunConfig
    model: StagedModel
    tokenizer: object               # tokenizers.Tokenizer, the one the run's data folder was tokenized with
    device: torch.device
    step: int


def recorded_config(config: dict, where: str) -> RunConfig:
    """The run config a checkpoint or results JSON recorded (fields added since then at their defaults)."""
    return build(RunConfig, checkpoint.with_added_fields(config, RunConfig().to_dict()), where)


def restore_run(ckpt: Path, cfg: RunConfig | None = None, device: torch.device | None = None) -> RestoredRun:
    """The finished run of checkpoint ``ckpt``; ``cfg`` (default: the checkpoint's own) must be the config that wrote it,
    else a one-line CheckpointError names the fields that differ (another model shape among them)."""
    from tokenizers import Tokenizer

    from ..data import TOKENIZER_FILE
    ck = checkpoint.read(ckpt)
    cfg = cfg or recorded_config(ck["config"], f"checkpoint {ckpt}")
    engine = LocalEngine.build(cfg, device=device)            # opens the run's data: its vocabulary and tokenizer
    # restore() rather than engine.resume(): resume drops an unconfirmed checkpoint beside it, and an evaluation
    # changes no file of the run
    state = checkpoint.restore(ck, Path(ckpt), engine.cfg, engine.sm, engine.opts, engine.meter)
    if state.step != engine.cfg.train.steps:
        raise checkpoint.CheckpointError(f"checkpoint {ckpt} is at step {state.step} of {engine.cfg.train.steps}: not a "
                                         "finished run; finish it (rerun its training command) before evaluating it")
    tok = Tokenizer.from_file(str(resolve_data_dir(engine.cfg) / TOKENIZER_FILE))
    engine.sm.eval()                 # compressors keep their state: no RVQ EMA or k-means update, no sync
    return RestoredRun(engine.cfg, engine.sm, tok, engine.device, state.step)


def declared_wire(run: RestoredRun) -> dict:
    """The compressors' declared bytes per token (forward, per boundary and their mean) and the token-id bytes."""
    comps = run.model.compressors()
    fwd = [c.wire_bytes_per_token("fwd") for c in comps]
    d = run.model.model.cfg.d_model
    mean = sum(fwd) / len(fwd) if fwd else None
    return {"fwd_bytes_per_token": mean, "fwd_bytes_per_token_per_boundary": fwd,
            "id_bytes_per_token": run.model.id_bytes_per_token(), "uncompressed_bytes_per_token": 2 * d,
            "wire_ratio": 2 * d / mean if mean else 1.0}


class MaplLM(TemplateLM):
    """lm-eval's ``LM`` over a :class:`RestoredRun`. lm-eval's ``TemplateLM`` splits each (context, continuation)
    into tokens; this class scores token lists in batches, the longest first, contexts cut from the left to the
    run's ``train.seq_len`` (the positions it was trained on) as lm-eval's own models do."""

    backend = "causal"

    def __init__(self, run: RestoredRun, batch_size: int | None = None):
        super().__init__()
        self.run = run
        self._device = run.device
        self.batch_size = int(batch_size or run.cfg.train.eval_batch_size)
        self.max_length = run.cfg.train.seq_len
        from ..data import eot_id
        self._eot = eot_id(run.tokenizer)
        run.tokenizer.encode_special_tokens = True       # text that spells "<|endoftext|>" stays text, as in training

    @property
    def eot_token_id(self) -> int:
        return self._eot             # documents were separated by it in training: the prefix of an empty context

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.run.tokenizer.encode(string, add_special_tokens=False).ids

    def _log_probs(self, inputs: list[list[int]]) -> torch.Tensor:
        """Log-probabilities (B, T, V), fp32, of right-padded ``inputs``: causal attention and per-token compressors
        leave a sequence's scores unchanged by the padding after it."""
        T = max(map(len, inputs))
        ids = torch.full((len(inputs), T), self._eot, dtype=torch.long)
        for i, seq in enumerate(inputs):
            ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        with torch.no_grad(), autocast_ctx(self.run.cfg, self._device):
            logits = self.run.model(ids.to(self._device))
        return F.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-likelihood of the continuation, whether greedy decoding gives it) per (key, context, continuation)."""
        longest_first = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        out = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="mapl loglikelihood")
        for chunk in longest_first.get_batched(n=self.batch_size):
            for _, _, cont in chunk:
                if not 0 < len(cont) <= self.max_length:
                    raise ValueError(f"a continuation of {len(cont)} tokens cannot be scored in the run's context of "
                                     f"{self.max_length} tokens")
            inputs = [(ctx + cont)[-(self.max_length + 1):][:-1] for _, ctx, cont in chunk]
            logp = self._log_probs(inputs)
            for (key, _, cont), inp, rows in zip(chunk, inputs, logp):
                n = len(cont)
                scored = rows[len(inp) - n:len(inp)]                       # the positions predicting the continuation
                target = torch.tensor(cont, dtype=torch.long, device=scored.device)
                answer = (float(scored.gather(-1, target[:, None]).sum()), bool((scored.argmax(-1) == target).all()))
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                out.append(answer)
            bar.update(len(chunk))
        bar.close()
        return longest_first.get_original(out)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's total log-likelihood in disjoint windows of the run's context (lm-eval's rolling windows)."""
        windows, owner = [], []
        for k, (string,) in enumerate(req.args for req in requests):
            for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(string), self.prefix_token_id, self.max_length, context_len=1)):
                windows.append((None, ctx, pred))
                owner.append(k)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for k, (ll, _) in zip(owner, scores):
            totals[k] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError("mapl eval scores log-likelihoods only (multiple-choice and perplexity tasks): "
                                  "generation tasks (output_type generate_until) are not supported")
