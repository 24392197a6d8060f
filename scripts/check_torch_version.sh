#!/usr/bin/env bash
# Run the test suite on one torch release, on a clean clone of HEAD, and record the outcome.
#
#     scripts/check_torch_version.sh 2.13.0
#
# Makes a fresh virtual environment in a temporary directory, installs torch==VERSION and
# autofit with its test extras there, runs the README's test command, and appends one row to
# results/torch_versions.md: the version, the commit, the date and pytest's last line.
# pyproject.toml's torch floor is the oldest version recorded here as passing. On a machine
# whose package index offers only CUDA builds of an old release, this downloads several GB.
set -euo pipefail
version=${1:?usage: scripts/check_torch_version.sh TORCH_VERSION}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/autofit"
cd "$work/autofit"
commit=$(git rev-parse --short HEAD)
export OMP_WAIT_POLICY=PASSIVE DS_BUILD_OPS=0
python3 -m venv .venv
. .venv/bin/activate
pip install -q "torch==$version" -e '.[test,hf]' >"$work/pip.log" 2>&1 || { tail -5 "$work/pip.log"; exit 1; }
installed=$(python -c "import torch; print(torch.__version__)")
start=$(date +%s)
set +e
python -m pytest -q -p no:cacheprovider >"$work/pytest.log" 2>&1
status=$?
set -e
summary=$(tail -n 1 "$work/pytest.log" | tr -d '=' | sed 's/^ *//; s/ *$//')
minutes=$(( ($(date +%s) - start + 30) / 60 ))
log="$repo/results/torch_versions.md"
if [ ! -f "$log" ]; then
    printf '# Test suite by torch release\n\nEach row: `scripts/check_torch_version.sh VERSION` on a clean clone of the commit named.\n\n| torch | commit | date | exit | pytest | minutes |\n|---|---|---|---|---|---|\n' >"$log"
fi
printf '| %s | %s | %s | %s | %s | %s |\n' "$installed" "$commit" "$(date -u +%Y-%m-%d)" "$status" "$summary" "$minutes" >>"$log"
echo "torch $installed: $summary (exit $status); recorded in results/torch_versions.md"
exit $status
