#!/usr/bin/env bash
# The architecture probe on every release: bash compat/probe_matrix.sh [RELEASE ...]
# One virtualenv (torch, pytest, hypothesis, hfpatch from the checkout) whose transformers is swapped
# release by release (compat/matrix.py installs each); for each, the tests of every covered model type
# the release ships, in its declared range or not (--outside-ranges): tests/test_architectures.py
# (hfpatch.verify on each causal LM), tests/test_decoders.py (encoder-decoder models' decoders and
# encoders), tests/test_wrappers.py (vision-language models), eager and SDPA, and
# tests/test_custom_models.py (models outside transformers' classes: renamed copies of the release's own
# GPT-2, Llama and Qwen2 files, registered and as remote code, a from-scratch causal LM, and two that
# hfpatch must leave alone; probe types custom-KIND, skipped where the release has nothing to copy), write
# compat/results/probe/RELEASE.xml (not committed), and merge its probe tests into
# compat/evidence/RELEASE.json (compat/evidence.py). About 1.5 hours on one core for the 64 releases
# (the custom-model file alone: about 15 s a release, besides installing it).
# Then: python3 compat/report.py
# A partial re-run: PROBE_K="olmo or phi-" PROBE_TAG=widened bash compat/probe_matrix.sh [RELEASE ...]
# runs only the tests pytest -k selects (RELEASE.TAG.xml); their results replace the earlier ones of
# those tests only. PROBE_TESTS (default: the four files above) runs other probe tests the same way,
# e.g. PROBE_TESTS=tests/test_custom_models.py PROBE_TAG=custom bash compat/probe_matrix.sh
set -euo pipefail
cd "$(dirname "$0")/.."
releases=("$@")
[ ${#releases[@]} -gt 0 ] || mapfile -t releases < <(python3 compat/matrix.py releases)
venv=${PROBE_VENV:-.nox/probe}
[ -x "$venv/bin/python" ] || { python3 -m venv "$venv" && python3 compat/matrix.py setup "$venv/bin/python"; }
"$venv/bin/pip" install -q --no-deps --force-reinstall .
out=compat/results/probe
read -r -a tests <<< "${PROBE_TESTS:-tests/test_architectures.py tests/test_decoders.py tests/test_wrappers.py tests/test_custom_models.py}"
mkdir -p "$out" compat/results/logs
tag=${PROBE_TAG:+.$PROBE_TAG}
select=()
[ -z "${PROBE_K:-}" ] || select=(-k "$PROBE_K")
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)  # the code this run tests
for release in "${releases[@]}"; do
  python3 compat/matrix.py install "$release" "$venv/bin/python"
  if OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider --tb=short "${tests[@]}" \
      "${select[@]}" -m "slow or not slow" --outside-ranges --hypothesis-profile=matrix --junitxml="$out/$release$tag.xml" \
      >"compat/results/logs/probe-$release$tag.log" 2>&1; then
    echo "$release ok"
  else
    echo "$release FAILED (see compat/results/logs/probe-$release$tag.log)"
  fi
  echo "$commit" > "$out/$release$tag.commit"
  python3 compat/evidence.py --probe "$release" "$out/$release$tag.xml" >/dev/null
done
