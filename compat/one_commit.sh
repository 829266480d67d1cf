#!/usr/bin/env bash
# The whole release matrix at one commit: bash compat/one_commit.sh [-j JOBS] [--resume] [--at COMMIT] [RELEASE ...]
# Measures HEAD (never uncommitted changes: a dirty tree is refused), or an earlier COMMIT whose hfpatch/
# is HEAD's (a run resumed in a later session, after commits to tests or documents only), from a detached
# worktree of it, so the checkout can move on meanwhile. Per release (compat/matrix.py's, or the ones named), JOBS at a
# time (default 1: one torch thread each): a virtualenv layered on one shared base (torch and the test
# dependencies, installed once), that transformers release, the wheel of HEAD; then
# `python compat/matrix.py run RELEASE`: the probe (--outside-ranges), the suite split as compat/matrix.py
# says (the mechanics on SAMPLE only), the case count, and compat/evidence/RELEASE.json rebuilt at the
# commit, copied back here; the virtualenv is deleted (about 300 MB each). --resume skips the releases
# whose evidence here is already at this commit. Then compat/REPORT.md. pip's cache is reused.
# Logs: compat/results/logs/RELEASE.log; times: compat/results/RELEASE.times.json; the JUnit XML stays in
# the worktree's compat/results/ ($MATRIX_WORK/tree-COMMIT, kept for --resume; git worktree remove it).
# About 5 hours with -j 2 on two cores (2026-12-07; docs/compatibility.md). In the background:
#   nohup bash compat/one_commit.sh --resume > compat/results/one_commit.log 2>&1 &
set -euo pipefail
if [ -z "${ONE_COMMIT_CHECKOUT:-}" ]; then  # run a copy: the checkout's own file may change meanwhile
  copy=$(mktemp "${TMPDIR:-/tmp}/one_commit.XXXXXX")
  cp "$0" "$copy"
  ONE_COMMIT_CHECKOUT=$(cd "$(dirname "$0")/.." && pwd) exec bash "$copy" "$@"
fi
trap 'rm -f "$0"' EXIT
cd "$ONE_COMMIT_CHECKOUT"
jobs=1 resume=0 at=HEAD releases=()
while [ $# -gt 0 ]; do
  case $1 in
    -j) jobs=$2; shift 2 ;;
    -j*) jobs=${1#-j}; shift ;;
    --resume) resume=1; shift ;;
    --at) at=$2; shift 2 ;;
    -*) echo "usage: bash compat/one_commit.sh [-j JOBS] [--resume] [--at COMMIT] [RELEASE ...]" >&2; exit 2 ;;
    *) releases+=("$1"); shift ;;
  esac
done
if [ -n "$(git status --porcelain --untracked-files=no -- hfpatch tests compat pyproject.toml)" ]; then
  echo "one_commit.sh: uncommitted changes to hfpatch/, tests/, compat/ or pyproject.toml: commit them" >&2
  echo "(the matrix measures a commit, HEAD: its evidence must name the code it ran)" >&2
  exit 1
fi
here=$PWD
commit=$(git rev-parse --short "$at")
if [ -n "$(git diff --name-only "$commit" HEAD -- hfpatch)" ]; then
  echo "one_commit.sh: $commit's hfpatch/ is not HEAD's: measure HEAD" >&2
  exit 1
fi
[ ${#releases[@]} -gt 0 ] || mapfile -t releases < <(python3 compat/matrix.py releases)
work=${MATRIX_WORK:-/tmp/hfpatch-matrix}
tree=$work/tree-$commit
mkdir -p "$work" compat/results/logs
[ -d "$tree" ] || git worktree add --detach "$tree" "$commit" >/dev/null
base=$work/base
if [ ! -x "$base/bin/python" ]; then
  python3 -m venv "$base"
  python3 "$tree/compat/matrix.py" setup "$base/bin/python"
fi
wheel=$work/wheel-$commit
[ -d "$wheel" ] || "$base/bin/pip" wheel -q --no-deps -w "$wheel" "$tree"
python3 "$tree/compat/matrix.py" sample > "$work/sample-$commit"  # (MATRIX_SAMPLE: another)
export here commit tree base wheel work
run_one() {
  local release=$1 venv="$work/venv-$1" log="$here/compat/results/logs/$1.log" start=$SECONDS
  rm -rf "$venv"
  : >"$log"
  if grep -qx "$release" "$work/sample-$commit"; then  # the whole suite: a virtualenv of its own, as
    python3 -m venv "$venv"                          # users have (a launcher test copies its packages)
    python3 "$tree/compat/matrix.py" setup "$venv/bin/python" >"$log" 2>&1
  else  # the base's packages (torch, pytest, hypothesis, pip itself) after the release's own
    python3 -m venv --without-pip "$venv"
    "$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
      > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/matrix-base.pth"
  fi
  if { python3 "$tree/compat/matrix.py" install "$release" "$venv/bin/python" &&
       "$venv/bin/python" -m pip install -q --no-deps "$wheel"/hfpatch-*.whl &&
       (cd "$tree" && MATRIX_COMMIT=$commit "$venv/bin/python" compat/matrix.py run "$release"); } >>"$log" 2>&1
  then
    cp "$tree/compat/evidence/$release.json" "$here/compat/evidence/$release.json"
    cp "$tree/compat/results/$release.times.json" "$here/compat/results/" 2>/dev/null || true
    failed=$(grep -o '"fail"' "$here/compat/evidence/$release.json" | wc -l)  # (the suite's failing cells)
    echo "$release ran at $commit, $failed suite checks failed, $((SECONDS - start)) s in all: $(tail -1 "$log")"
  else
    echo "$release FAILED (see $log)"
  fi
  rm -rf "$venv"
}
export -f run_one
todo=()
for release in "${releases[@]}"; do
  if [ $resume = 1 ] && [ "$(python3 compat/evidence.py --at-commit "$release")" = "$commit" ]; then
    echo "$release already at $commit: skipped"
  else
    todo+=("$release")
  fi
done
echo "measuring ${#todo[@]} releases at $commit, $jobs at a time"
[ ${#todo[@]} -eq 0 ] || printf '%s\n' "${todo[@]}" | xargs -P "$jobs" -I{} bash -c 'run_one {}'
python3 compat/report.py
