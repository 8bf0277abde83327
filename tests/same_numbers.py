"""Same numbers: train a few short configurations with a git ref's code and with this checkout's, and compare every
loss, curve, parameter count and wire byte bit for bit. A refactor that must move no number shows it here; then
`dvc commit` records the train stages on the new code (docs/reproducing.md).

    python tests/same_numbers.py main           # exit 0: the same numbers; 1: each difference named
    python tests/same_numbers.py main --first 2 # only the first two configurations

Both checkouts train on this machine, one thread each: runs on one machine are deterministic, so any difference is
the code's (another machine's arithmetic may differ in the last digits; never compare across machines).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# every compressor and both engines, at the micro profile's shapes (seconds each)
CONFIGS = {
    "none": ["train", "--method", "none"],
    "int8": ["train", "--method", "int8"],
    "ssn": ["train", "--method", "ssn", "--ratio", "4"],
    "mapl": ["train", "--method", "mapl", "--ratio", "4"],
    "mapl-rvq-token": ["train", "--method", "mapl-rvq", "--ratio", "4", "--set", "compressor.rvq.scale=token"],
    "mapl-fixed": ["train", "--method", "mapl", "--ratio", "4", "--projector", "fixed"],
    "mapl-unconstrained-static": ["train", "--method", "mapl", "--ratio", "4", "--projector", "unconstrained",
                                  "--anchor", "static"],
    "mapl-pipeline-P2": ["pipeline", "--method", "mapl", "--ratio", "4", "--stages", "2"],
}
COMPARED = ("val_loss", "select_loss", "val_loss_curve", "train_loss_curve", "n_params", "tokens", "ratio",
            "ortho_max_err", "wire")


def train_all(checkout: Path, out: Path, names: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(checkout), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = [sys.executable, "-m", "mapl.cli"]
    subprocess.run([*run, "data", "--profile", "micro"], cwd=checkout, env=env, check=True, capture_output=True)
    for name in names:
        args = [*CONFIGS[name], "--profile", "micro", "--out", str(out / f"{name}.json"), "--ckpt",
                str(out / f"{name}.pt"), "--no-progress"]
        done = subprocess.run([*run, *args], cwd=checkout, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{checkout}: {' '.join(args)} failed (exit {done.returncode}): {done.stderr[-2000:]}")


def differences(a: Path, b: Path, names: list[str]) -> list[str]:
    out = []
    for name in names:
        ra, rb = (json.loads((d / f"{name}.json").read_text()) for d in (a, b))
        out += [f"{name}: {key} {ra.get(key)!r:.80} != {rb.get(key)!r:.80}" for key in COMPARED
                if ra.get(key) != rb.get(key)]
    return out


def compare(ref: str, first: int = 0, tree: Path = ROOT) -> list[str]:
    """The differences between ``ref``'s numbers and those of the checkout ``tree`` (its working tree)."""
    names = list(CONFIGS)[:first or None]
    with tempfile.TemporaryDirectory(prefix="mapl-same-") as tmp:
        old, runs = Path(tmp) / "ref", Path(tmp) / "runs"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old), ref], cwd=tree, check=True)
        try:
            for sub in ("ref", "tree"):
                (runs / sub).mkdir(parents=True)
            train_all(old, runs / "ref", names)
            train_all(tree, runs / "tree", names)
            return differences(runs / "ref", runs / "tree", names)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=tree, check=False)
            shutil.rmtree(old, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description="Do a git ref's code and this checkout's compute the same numbers?",
                                 epilog=__doc__.split("\n\n")[1])
    ap.add_argument("ref", help="a git ref or commit, e.g. main")
    ap.add_argument("--first", type=int, default=0, help="only the first N configurations (default: all)")
    args = ap.parse_args()
    diffs = compare(args.ref, args.first)
    print("\n".join(diffs) if diffs else f"the same numbers: {args.first or len(CONFIGS)} configurations, "
                                           f"{args.ref} and this checkout")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
