#!/usr/bin/env bash
# The full release matrix, then the report: bash compat/run_matrix.sh [JOBS] [RELEASE ...]
# Runs the nox session of every release in compat/matrix.py (or the ones named), JOBS at a time
# (default 2; each uses one torch thread), deletes each virtualenv after its session (about 1 GB
# each), then regenerates compat/REPORT.md from compat/evidence/ (each session merges its results there).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${1:-2}
shift || true
releases=("$@")
[ ${#releases[@]} -gt 0 ] || mapfile -t releases < <(python3 compat/matrix.py releases)
envdir=${NOX_ENVDIR:-.nox}
mkdir -p compat/results/logs
run_one() {
  local release=$1 session="matrix(transformers='$1')"
  if nox --envdir "$envdir" -s "$session" >"compat/results/logs/$release.log" 2>&1; then
    echo "$release ok"
  else
    echo "$release FAILED (see compat/results/logs/$release.log)"
  fi
  rm -rf "$envdir"/matrix-transformers-"${release//./-}"*
}
export -f run_one
export envdir
printf '%s\n' "${releases[@]}" | xargs -P "$jobs" -I{} bash -c 'run_one {}'
python3 compat/report.py
