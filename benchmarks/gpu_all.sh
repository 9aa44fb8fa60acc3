#!/usr/bin/env bash
# Run every GPU check (benchmarks/gpu_*.py) in sequence, printing everything, within about 8 minutes in all.
#   bash benchmarks/gpu_all.sh            (from the repository root; PYTHON overrides the interpreter)
# Each check gets its own time limit (BUDGET_S seconds in all, split by the share below); one that runs
# over is stopped and reported, and the next one still runs. Without CUDA each check says so: gpu_costmodel.py
# prints its CPU-side predictions and exits 0, gpu_runtime_check.py runs its host-side checks (one weight copy,
# the segments a GPU would capture, an eager step) and exits 0, gpu_ptx_ranges.py exits 2 (so this script does too).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
BUDGET_S=${BUDGET_S:-470}
START=$(date +%s)
# check: share of the budget (percent)
CHECKS="gpu_costmodel.py:40 gpu_runtime_check.py:35 gpu_ptx_ranges.py:25"
$PY -c "import torch; print('torch', torch.__version__, 'CUDA', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
status=0
for entry in $CHECKS; do
  script=${entry%%:*}; share=${entry##*:}
  [ -f "benchmarks/$script" ] || { echo "== $script: missing, skipped"; continue; }
  left=$(( BUDGET_S - ($(date +%s) - START) ))
  limit=$(( BUDGET_S * share / 100 )); [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "== $script: no time left, skipped"; continue; fi
  echo "== $script (limit ${limit} s)"
  t0=$(date +%s)
  args=""; [ "$script" = gpu_costmodel.py ] && args="--repeats 10"
  timeout --kill-after=10 "$limit" $PY "benchmarks/$script" $args
  rc=$?
  echo "== $script: exit $rc after $(( $(date +%s) - t0 )) s$([ $rc -eq 124 ] && echo ' (time limit: stopped)')"
  [ $rc -ne 0 ] && status=$rc
done
echo "== all checks done in $(( $(date +%s) - START )) s"
exit $status
