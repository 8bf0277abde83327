"""`mapl data`: prepare a dataset (the DVC stage prepare), check one, or rebuild one.

The command: its flags, messages and the grid's budget notes; what prepares the data is mapl.data. The
paper's offline route (a local parquet copy) is in docs/gpu.md, every exit code in docs/failure-modes.md.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from dataclasses import fields
from pathlib import Path

from ..base.cli import run_cli
from ..base.io import OutputError
from ..core.config import load_params, load_run_config
from ..data.build import prepare
from ..data.config import DOC_SPLITS, SOURCES, TOKENIZERS, DataConfig, DataError, effective_token_config, token_config
from ..data.dataset import default_data_dir
from . import add_profile, command_parser

__all__ = ["build_parser", "config_from_args", "main", "PROG"]

PROG = "mapl data"


def build_parser() -> argparse.ArgumentParser:
    d = DataConfig()
    p = command_parser("data", "Prepare, verify or rebuild a tokenized dataset (DVC stage prepare).", """
        mapl data --profile cpu                 # the profile's data settings; resumable
        mapl data --profile cpu --verify        # re-hash every file, ignoring this host's stamps
        mapl data --source text --paths 'corpus/*.txt' --doc-split blank-line --tokenizer byte""")
    add_profile(p, None, "use this profile's data settings, not the flags")
    p.add_argument("--out", metavar="DIR", help="output folder (default: data/<dataset name>)")
    p.add_argument("--rebuild", action="store_true", help="replace an existing prepared folder")
    p.add_argument("--verify", action="store_true", help="re-hash an existing folder's files in full")
    p.add_argument("--cache-dir", metavar="DIR", help="raw downloads (default: $MAPL_CACHE_DIR)")
    p.add_argument("--progress-every", type=float, default=10.0, metavar="S", help="seconds between progress lines")
    p.add_argument("--source", choices=SOURCES, default=d.source, help="corpus source")
    p.add_argument("--paths", nargs="+", default=list(d.paths), metavar="GLOB",
                   help="files or globs (text, parquet, hf data_files)")
    p.add_argument("--hf-id", default=d.hf_id, metavar="ID", help="datasets id (source hf)")
    p.add_argument("--hf-text-field", default=d.hf_text_field, metavar="FIELD", help="text column (parquet, hf)")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default=d.tokenizer, metavar="KIND", help=" | ".join(TOKENIZERS))
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, metavar="N", help="BPE vocabulary size")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction, metavar="F",
                   help="fraction of documents held out for val")
    p.add_argument("--val-tokens", type=int, default=d.val_tokens, metavar="N",
                   help="val prefix in tokens (0: --val-fraction)")
    p.add_argument("--max-train-tokens", type=int, default=d.max_train_tokens, metavar="N", help="train cap (0: none)")
    p.add_argument("--seed", type=int, default=d.seed, help="split seed")
    p.add_argument("--doc-split", choices=DOC_SPLITS, default=d.doc_split, metavar="HOW",
                   help=f"documents of a text file: {' | '.join(DOC_SPLITS)}")
    return p


def config_from_args(args: argparse.Namespace) -> DataConfig:
    names = {f.name for f in fields(DataConfig)}
    return DataConfig(**{k: v for k, v in vars(args).items() if k in names})


def _profile_data(profile: str) -> DataConfig:
    return load_run_config(profile).data


def same_tokens(a: DataConfig, b: DataConfig) -> bool:
    return effective_token_config(token_config(a)) == effective_token_config(token_config(b))


def grid_need(profile: str) -> tuple[int, str]:
    """The most train tokens one run of the profile reads (steps x batch x context), and which run."""
    params = load_params()
    base = load_run_config(profile, params=params)
    t = base.train
    best = (t.steps * t.batch_size * t.seq_len, f"the profile's defaults: {t.steps} x {t.batch_size} x {t.seq_len}")
    for name, spec in ((params["profiles"][profile] or {}).get("runs") or {}).items():
        c = load_run_config(profile, {k: v for k, v in spec.items() if k != "group"}, params=params)
        n = c.train.steps * c.train.batch_size * c.train.seq_len
        if same_tokens(c.data, base.data) and n > best[0]:
            best = (n, f"{name}: {c.train.steps} steps x {c.train.batch_size} x {c.train.seq_len}")
    return best


def budget_notes(cfg: DataConfig, manifest: dict, need: int, who: str) -> list[str]:
    """How the prepared train shard compares with what the profile's runs read."""
    train = manifest["splits"]["train"]["tokens"]
    passes = need / train
    lines = [f"  grid: the largest run reads {need:,} train tokens ({who}) = {passes:.2f} passes over train "
             f"(data.sampling={cfg.sampling})"]
    if cfg.max_train_tokens > need:
        lines.append(f"  note: data.max_train_tokens={cfg.max_train_tokens:,} prepares more than any run reads")
    if cfg.max_train_tokens == 0 and cfg.val_tokens > 0 and passes < 1:
        lines.append(f"  note: the whole source was tokenized; data.max_train_tokens: {need} would stop at what "
                     f"the runs read")
    if passes > 1 and cfg.sampling == "uniform":
        lines.append(f"  note: with sampling=uniform about {100 * math.exp(-passes):.1f}% of the train tokens are "
                     f"never read; sampling=epochs reads every window {passes:.2f} times")
    return lines


def summary(m: dict, out: Path) -> str:
    t, v = m["splits"]["train"], m["splits"]["val"]
    lines = [f"{out}: {m['source']}",
             f"  tokenizer {m['tokenizer']['kind']}: vocab {m['vocab_size']}, eot {m['eot_id']}, dtype {m['dtype']}",
             f"  train: {t['tokens']:,} tokens, {t['documents']} documents",
             f"  val:   {v['tokens']:,} tokens, {v['documents']} documents, "
             f"unigram entropy {v['unigram_entropy']:.4f} nats"]
    if v.get("works") and len(v["works"]) <= 20:
        lines.append(f"  val works: {', '.join(v['works'])}")
    return "\n".join(lines)


def _main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (math.isfinite(args.progress_every) and args.progress_every > 0):     # was: nan or -1 taken silently
        parser.error(f"--progress-every {args.progress_every:g} is invalid: must be a finite number of seconds > 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = (_profile_data(args.profile) if args.profile else config_from_args(args)).validate()
    except (ValueError, OSError) as e:
        parser.error(str(e))            # exit 2, message names the field and what is allowed
    out = Path(args.out) if args.out else default_data_dir(cfg)
    t0 = time.perf_counter()
    try:
        manifest = prepare(cfg, out, Path(args.cache_dir) if args.cache_dir else None, rebuild=args.rebuild,
                           profile=args.profile, full_verify=args.verify, progress_every_s=args.progress_every)
    except (DataError, OutputError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    print(summary(manifest, out))
    if args.profile:
        print("\n".join(budget_notes(cfg, manifest, *grid_need(args.profile))))
    print(f"  done in {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv=None) -> int:
    """The command; a user error is one line, Ctrl-C or SIGTERM exit 130 (mapl.base.cli.run_cli)."""
    return run_cli(_main, argv, prog=PROG)
