"""`mapl data`: prepare a dataset (the DVC stage prepare), check one, or rebuild one (the code is mapl.data)."""
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
from ..core.config import load_run_config
from ..data.build import prepare
from ..data.config import DOC_SPLITS, SOURCES, TOKENIZERS, DataConfig, DataError
from ..data.dataset import default_data_dir
from . import add_profile, command_parser

__all__ = ["build_parser", "config_from_args", "main", "PROG"]

PROG = "mapl data"


def build_parser() -> argparse.ArgumentParser:
    d = DataConfig()
    p = command_parser("data", "Prepare, verify or rebuild a tokenized dataset (DVC stage prepare).", """
        mapl data --profile cpu                 # every dataset the profile's runs read; resumable
        mapl data --profile cpu --verify        # re-hash every file, ignoring this host's stamps
        mapl data --source text --paths 'corpus/*.txt' --doc-split blank-line --tokenizer byte""")
    add_profile(p, None, "every dataset this profile's runs read (with --out: its own data settings), not the flags")
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
        if args.profile and not args.out:
            folders = profile_datasets(args.profile)
        else:
            cfg = (load_run_config(args.profile).data if args.profile else config_from_args(args)).validate()
            folders = {Path(args.out) if args.out else default_data_dir(cfg): cfg}
    except (ValueError, OSError) as e:
        parser.error(str(e))            # exit 2, message names the field and what is allowed
    for out, cfg in folders.items():
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
        print(f"  done in {time.perf_counter() - t0:.1f} s")
    return 0


def profile_datasets(profile: str) -> dict[Path, DataConfig]:
    """Folder -> data settings of every dataset the profile reads: its own ``data:`` first, then each other one a run
    of params.yaml trains on (a corpus study's). Training never builds data, so the prepare stage builds them all."""
    from ..orchestration.groups import profile_runs, spec_config
    from ..core.config import load_params
    params = load_params()
    own = load_run_config(profile).data.validate()
    folders = {default_data_dir(own): own}
    for name, spec in profile_runs(profile, params).items():
        cfg = spec_config(profile, {"name": name, **spec}, params)
        folders.setdefault(Path(cfg.data_dir) if cfg.data_dir else default_data_dir(cfg.data), cfg.data.validate())
    return folders


def main(argv=None) -> int:
    return run_cli(_main, argv, prog=PROG)
