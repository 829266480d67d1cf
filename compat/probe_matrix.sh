#!/usr/bin/env bash
# The architecture probe on every release: bash compat/probe_matrix.sh [RELEASE ...]
# One virtualenv (torch, pytest, hypothesis, hfpatch from the checkout) whose transformers is swapped
# release by release (compat/matrix.py installs each); for each, the tests of every covered model type
# the release ships, in its declared range or not (--outside-ranges): tests/test_architectures.py
# (hfpatch.verify on each causal LM), tests/test_decoders.py (encoder-decoder models' decoders and
# encoders), tests/test_wrappers.py (vision-language models), eager and SDPA, write
# compat/results/probe/RELEASE.xml. About an hour on one core for the 64 releases. Then: python3 compat/report.py
# A partial re-run: PROBE_K="olmo or phi-" PROBE_TAG=widened bash compat/probe_matrix.sh [RELEASE ...]
# runs only the tests pytest -k selects and writes RELEASE.TAG.xml, whose results the report takes
# over the full run's for those cells. PROBE_TESTS (default: the three files above) and PROBE_DIR
# (default compat/results/probe) run other tests the same way: with PROBE_DIR=compat/results and a
# PROBE_TAG, a partial re-run of full-suite tests, whose results the report takes over the full run's.
set -euo pipefail
cd "$(dirname "$0")/.."
releases=("$@")
[ ${#releases[@]} -gt 0 ] || mapfile -t releases < <(python3 compat/matrix.py releases)
venv=${PROBE_VENV:-.nox/probe}
[ -x "$venv/bin/python" ] || { python3 -m venv "$venv" && python3 compat/matrix.py setup "$venv/bin/python"; }
"$venv/bin/pip" install -q --no-deps --force-reinstall .
out=${PROBE_DIR:-compat/results/probe}
read -r -a tests <<< "${PROBE_TESTS:-tests/test_architectures.py tests/test_decoders.py tests/test_wrappers.py}"
mkdir -p "$out" compat/results/logs
tag=${PROBE_TAG:+.$PROBE_TAG}
select=()
[ -z "${PROBE_K:-}" ] || select=(-k "$PROBE_K")
git rev-parse --short HEAD > "$out/COMMIT$tag" 2>/dev/null || true  # the code this run tests
for release in "${releases[@]}"; do
  python3 compat/matrix.py install "$release" "$venv/bin/python"
  if OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider --tb=short "${tests[@]}" \
      "${select[@]}" -m "slow or not slow" --outside-ranges --hypothesis-profile=matrix --junitxml="$out/$release$tag.xml" \
      >"compat/results/logs/probe-$release$tag.log" 2>&1; then
    echo "$release ok"
  else
    echo "$release FAILED (see compat/results/logs/probe-$release$tag.log)"
  fi
done
