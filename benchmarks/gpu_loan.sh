#!/usr/bin/env bash
# The one call of a GPU loan, from the repository root: gpu_check.py, then gpu.py with the time left, in 8 minutes.
#
# Writes: $OUT/loan.log, loan.json, check.jsonl, gpu.jsonl, gpu.md, gpu-loss.png (docs/gpu.md says what each decides).
#
#   bash benchmarks/gpu_loan.sh                  # on the device: every result under $OUT, 480 s in all
#   bash benchmarks/gpu_loan.sh --budget-s 300   # a shorter rerun
#   bash benchmarks/gpu_loan.sh --dry-run        # anywhere: the plan, the interpreter, the tree size to carry
#   bash benchmarks/gpu_loan.sh --cpu --out DIR  # the CPU rehearsal (make test-all runs it)
#
# It installs nothing. It picks the first interpreter whose torch sees CUDA (--cpu, --dry-run: whose torch
# imports), from $MAPL_PYTHON, then python3, python, python3.12, python3.13, python3.11, /usr/bin/python3,
# /usr/local/bin/python3, /opt/conda/bin/python, .venv/bin/python, and hands every argument to
# benchmarks/gpu_loan.py under it.
set -u
cd "$(dirname "$0")/.." || exit 2

need_cuda=1
for arg in "$@"; do
    case "$arg" in --cpu|--dry-run) need_cuda=0 ;; esac
done
if [ "$need_cuda" = 1 ]; then
    probe='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'
else
    probe='import torch'
fi

tried=""
for py in "${MAPL_PYTHON:-}" python3 python python3.12 python3.13 python3.11 /usr/bin/python3 /usr/local/bin/python3 \
          /opt/conda/bin/python .venv/bin/python; do
    [ -n "$py" ] || continue
    command -v "$py" >/dev/null 2>&1 || continue
    tried="$tried $py"
    if timeout 120 "$py" -c "$probe" >/dev/null 2>&1; then
        MAPL_LOAN_TRIED="$tried" exec "$py" benchmarks/gpu_loan.py "$@"
    fi
done

what="a torch that sees CUDA"
[ "$need_cuda" = 1 ] || what="torch"
msg="error: no interpreter here imports $what (tried:${tried:- none}); this call installs nothing"
echo "$msg" >&2
if [ -n "${OUT:-}" ] && mkdir -p "$OUT" 2>/dev/null; then
    echo "$msg" >> "$OUT/loan.log"
fi
exit 2
