#!/usr/bin/env bash
# transformers' own model tests, three ways, on transformers 5.24.0 (CPU):
#   a: stock                      -p no:hfpatch
#   b: hfpatch.apply()            -p hfpatch.auto
#   c: hfpatch.apply(unpad=True)  -p hfpatch.auto, HFPATCH_UNPAD=1
# then compare.py writes the per-family counts and every test id whose outcome differs.
#
# Usage: compat/upstream/run.sh [setup|run|compare|rerun|all] [family ...]
#   rerun: the test ids that differed, again in all three runs, REPEAT (3) times
#   WORK=/tmp/up (venv, test tree, results)   TIMEOUT=300 (seconds a test)
# Test files: model + generation tests from the zucchini-nlp/transformers mirror (5.16.0.dev0, the only
# checkout of transformers' tests here), the top-level common files (test_modeling_common.py ...) from
# the 5.24.0 source package, shims in compat/upstream/shims (identical in all three runs).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WORK=${WORK:-/tmp/up}
VENV=${VENV:-$WORK/venv}
TREE=$WORK/tree
RES=${RES:-$WORK/results}
MIRROR=${MIRROR:-/work/.mirror/zucchini-nlp+transformers/repo}
TIMEOUT=${TIMEOUT:-300}
TRANSFORMERS=5.24.0
DEFAULT_FAMILIES="llama gpt2 mistral mixtral qwen2 qwen3 gemma gemma2 phi3 starcoder2 opt bloom falcon gpt_neox bart t5"
what=${1:-all}; shift || true
FAMILIES=${*:-$DEFAULT_FAMILIES}

setup() {
  mkdir -p "$WORK"
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  # torch pinned on every line: the local CPU wheel, never a CUDA build
  "$VENV/bin/pip" install -q torch==2.13.0 "transformers==$TRANSFORMERS" pytest parameterized \
    pytest-timeout pytest-xdist hypothesis httpx accelerate timeout-decorator wrapt packaging
  "$VENV/bin/pip" install -q --no-deps --force-reinstall "$REPO"   # hfpatch, not editable
  # 5.24.0's top-level test files
  if [ ! -d "$WORK/transformers-$TRANSFORMERS/tests" ]; then
    "$VENV/bin/pip" download -q --no-binary :all: --no-deps "transformers==$TRANSFORMERS" -d "$WORK/sdist"
    tar xzf "$WORK/sdist/transformers-$TRANSFORMERS.tar.gz" -C "$WORK"
  fi
  rm -rf "$TREE"; mkdir -p "$TREE"
  local paths="conftest.py tests/__init__.py tests/models/__init__.py tests/generation tests/fixtures
               tests/utils tests/exporters utils/test_module"
  paths="$paths $(git --git-dir="$MIRROR" ls-tree --name-only HEAD tests/ | grep '\.py$' | tr '\n' ' ')"
  for f in $DEFAULT_FAMILIES; do paths="$paths tests/models/$f"; done
  # shellcheck disable=SC2086
  git --git-dir="$MIRROR" archive HEAD $paths | tar x -C "$TREE"
  cp "$WORK/transformers-$TRANSFORMERS"/tests/*.py "$TREE/tests/"        # 5.24.0's common files win
  cp "$HERE/shims/distributed_testing_utils.py" "$TREE/tests/"
  mkdir -p "$TREE/src"
  ln -sfn "$("$VENV/bin/python" -c 'import transformers,os;print(os.path.dirname(transformers.__file__))')" \
    "$TREE/src/transformers"   # test_pipeline_mixin imports src/transformers: the installed 5.24.0
  cp "$HERE/shims/pytest.ini" "$TREE/pytest.ini"
  git --git-dir="$MIRROR" log -1 --format='mirror %H %s' > "$WORK/provenance.txt"
  "$VENV/bin/pip" freeze | grep -iE '^(torch|transformers|pytest|hfpatch|tokenizers|huggingface)' >> "$WORK/provenance.txt"
  echo "hfpatch from $REPO at $(git -C "$REPO" rev-parse HEAD)" >> "$WORK/provenance.txt"
}

run_one() {  # family mode
  local fam=$1 mode=$2 files
  files=$(cd "$TREE" && ls tests/models/"$fam"/test_modeling_*.py)
  local plug=(-p no:hfpatch) env=()
  case $mode in
    a) ;;
    b) plug=(-p hfpatch.auto -p hfpatch_recorder) ;;
    c) plug=(-p hfpatch.auto -p hfpatch_recorder); env=(HFPATCH_UNPAD=1) ;;
  esac
  rm -f "$RES/$fam.$mode.record.jsonl"
  local t0=$SECONDS rc=0
  # shellcheck disable=SC2086
  (cd "$TREE" && env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
     PYTHONPATH="$HERE/shims" HFPATCH_RECORD="$RES/$fam.$mode.record.jsonl" "${env[@]}" \
     timeout 5400 "$VENV/bin/python" -m pytest -p upstream_shims "${plug[@]}" -p no:cacheprovider \
     --timeout="$TIMEOUT" -q -rfE --junitxml="$RES/$fam.$mode.xml" $files) > "$RES/$fam.$mode.log" 2>&1 || rc=$?
  echo "$fam $mode rc=$rc $((SECONDS - t0))s" | tee -a "$RES/times.txt"
}

rerun() {  # the tests whose outcome differed, again in runs b and c, REPEAT times: is the difference stable?
  local ids rep mode
  ids=$("$VENV/bin/python" "$HERE/compare.py" "$RES" --ids | sort -u)
  [ -n "$ids" ] || { echo "nothing differs"; return 0; }
  mkdir -p "$RES/rerun"
  for rep in $(seq 1 "${REPEAT:-3}"); do
    for mode in a b c; do
      local plug=(-p no:hfpatch) env=()
      [ "$mode" = a ] || plug=(-p hfpatch.auto)
      [ "$mode" = c ] && env=(HFPATCH_UNPAD=1)
      # shellcheck disable=SC2086
      (cd "$TREE" && env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
         PYTHONPATH="$HERE/shims" "${env[@]}" timeout 3600 "$VENV/bin/python" -m pytest -p upstream_shims \
         "${plug[@]}" -p no:cacheprovider --timeout="$TIMEOUT" -q -rfE \
         --junitxml="$RES/rerun/$mode.$rep.xml" $ids) > "$RES/rerun/$mode.$rep.log" 2>&1 || true
      echo "rerun $rep $mode: $(tail -1 "$RES/rerun/$mode.$rep.log")"
    done
  done
}

run() {
  mkdir -p "$RES"
  for fam in $FAMILIES; do
    for mode in a b c; do run_one "$fam" "$mode"; done   # one pytest at a time (2 shared cores)
    "$VENV/bin/python" "$HERE/compare.py" "$RES" > "$RES/summary.md" || true
  done
}

case $what in
  setup) setup ;;
  run) run ;;
  compare) "$VENV/bin/python" "$HERE/compare.py" "$RES" ;;
  rerun) rerun ;;
  all) setup; run; "$VENV/bin/python" "$HERE/compare.py" "$RES" | tee "$RES/summary.md"; rerun ;;
  *) echo "usage: $0 [setup|run|compare|rerun|all] [family ...]" >&2; exit 2 ;;
esac
