#!/usr/bin/env bash
# The GPU checks for a short loan of a CUDA machine, in one call, most wanted first, within 9.8 minutes:
#   1. scripts/gpu_check.py, parts a and c: the estimate against the card on the workloads whose CUDA paths
#      changed last (offload on gpt-tiny and hf-gpt2, lstm-lm with cuDNN off, a grouped-query Llama), and a
#      gpt2 search at 8 GB (its first real trial shows the device probe running beside profiling);
#   2. scripts/gpu_grid.py: the search grid on the card, every strategy replayed there;
#   3. scripts/gpu_first_use.py, parts imports and concurrent: where a cold search's first use goes.
# From the repository root, with the wheels gpu_check.py's docstring lists in .whl/ (optuna for part c and
# the grid, nvidia-ml-py for the context, torchao for offload):
#     OUT=/tmp/gpu bash scripts/gpu_loan.sh      (give the call at least 590 s)
# Writes at most 8 files under $OUT (what a loan's call brings back): gpu/gpu_check.md, gpu/gpu_check.csv,
# gpu/search-gpt2-8GB.tar.gz (the search's tables), the grid's four files under grid/, and loan.log
# (the three scripts' output).
set -u
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_loan: the wheels in .whl/ did not install" >&2; exit 1; }
    export PYTHONPATH=/tmp/site:.
fi
export PYTHONUNBUFFERED=1
log="$OUT/loan.log"
{
    echo "== gpu_check (parts a, c) $(date -u +%H:%M:%S)"
    timeout 220 python3 -W ignore scripts/gpu_check.py --out "$OUT/gpu" --parts a,c \
        --workloads gpt-tiny,hf-gpt2,lstm-lm,hf:llama --time-limit 200
    # the search's own folder has more files than a call brings back: its tables travel as one archive
    # (best.json, trials.csv, summary.md: when each trial started, so autofit's own cost can be read), the
    # pictures stay behind
    if [ -d "$OUT/gpu/search-gpt2-8GB" ]; then
        tar -czf "$OUT/gpu/search-gpt2-8GB.tar.gz" -C "$OUT/gpu" --exclude='*.png' --exclude='*.html' search-gpt2-8GB
    fi
    rm -rf /tmp/gpu-loan-search && mv "$OUT/gpu/search-gpt2-8GB" /tmp/gpu-loan-search 2>/dev/null
    echo "== gpu_grid $(date -u +%H:%M:%S)"
    timeout 310 python3 -W ignore scripts/gpu_grid.py --out "$OUT/grid" --time-limit 290
    echo "== gpu_first_use $(date -u +%H:%M:%S)"
    timeout 50 python3 -W ignore scripts/gpu_first_use.py --parts imports,concurrent
    echo "== done $(date -u +%H:%M:%S)"
} > "$log" 2>&1
tail -5 "$log"
