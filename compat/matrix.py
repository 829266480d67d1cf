"""The release matrix, stated once: which transformers releases it tests, how each one installs (torch
pinned: the CPU build), which ones CI runs. ``noxfile.py``, ``probe_matrix.sh``, ``run_matrix.sh``,
``report.py`` and the tests read it from here.

    python compat/matrix.py releases                  # one release a line
    python compat/matrix.py setup PYTHON              # torch and the test dependencies into PYTHON's
    python compat/matrix.py install RELEASE PYTHON    # that transformers release into PYTHON's
    python compat/matrix.py run RELEASE               # the matrix's tests of RELEASE with this Python,
                                                      # merged into compat/evidence/RELEASE.json
    python compat/matrix.py split                     # which test file runs where (ONCE, PER_RELEASE)

The split (one place, here): what varies by release runs on every release (PER_RELEASE, and the probe
files' probe tests with ``--outside-ranges``); the mechanics no release changes (ONCE: launchers,
the CLI, the documents, plugin plumbing, the compile tests beyond a smoke) run on SAMPLE only.
``compat/matrix_plugin.py`` selects the tests; ``tests/test_compat_matrix.py`` checks that every test
file is named exactly once, so a new file cannot be dropped silently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

TORCH = "torch==2.13.0"  # the CPU build on this project's machines; an unpinned torch pulls a CUDA build
TEST_DEPENDENCIES = ["wrapt", "packaging", "pytest", "hypothesis"]

# the last patch of every minor from 4.20 to 5.24, plus 4.54.0 (it starts an era: 4.54.1 behaves otherwise)
RELEASES = [
    line.strip()
    for line in (HERE / "releases.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]
NEWEST = RELEASES[-1]
CI_RELEASES = ["4.20.1", "4.40.2", "4.57.6", NEWEST]  # oldest, 4.38-4.40 static-cache era, last 4.x, newest

# transformers 4.20-4.25 pin tokenizers<0.13, which has no wheel for Python 3.11: installed without it
# (transformers imports without tokenizers; no test needs it)
NO_TOKENIZERS = ("4.20.", "4.21.", "4.22.", "4.23.", "4.24.", "4.25.")
NO_TOKENIZERS_DEPENDENCIES = [
    "huggingface_hub<1.0",
    "regex",
    "requests",
    "pyyaml",
    "tqdm",
    "filelock",
    "numpy",
]
# transformers 5.4.0 allows huggingface_hub up to 1.x, but its newest (1.33) rejects the field types of
# some of 5.4.0's own configs (OLMo, PhiMoE, ERNIE 4.5, Cohere 2: no model can be built); 1.5.0, the
# oldest it allows, builds them
HUB_PINS = {"5.4.0": "1.5.0"}


# --- the split: which tests the matrix runs on every release, which on SAMPLE only -------------------
# the releases that run the whole suite (ONCE too): the CI releases, spanning 4.20-5.24 (each adds about
# 5.5 minutes on one core: docs/compatibility.md)
SAMPLE = list(CI_RELEASES)
if "MATRIX_SAMPLE" in os.environ:  # another sample, for a measurement (MATRIX_SAMPLE= : none)
    SAMPLE = [release for release in os.environ["MATRIX_SAMPLE"].split(",") if release]
# the probe (run with --outside-ranges, every covered model type in its range or not): these files'
# tests that take the ``probe`` fixture; their other tests run with the per-release suite
PROBE_FILES = [
    "tests/test_architectures.py",
    "tests/test_decoders.py",
    "tests/test_wrappers.py",
    "tests/test_custom_models.py",
]
# run on every release: each builds models of the installed release and compares them against stock
# or against each sequence run alone
PER_RELEASE = [
    *PROBE_FILES,
    "tests/test_audit.py",
    "tests/test_bad_input.py",
    "tests/test_cache_position.py",
    "tests/test_checkpointing.py",
    "tests/test_compile.py",  # the smoke only (COMPILE_SMOKE): the rest is ONCE
    "tests/test_flash.py",
    "tests/test_generate_windows.py",
    "tests/test_invariant.py",
    "tests/test_layout.py",
    "tests/test_lifecycle.py",
    "tests/test_mixers.py",
    "tests/test_packed.py",
    "tests/test_per_call_cost.py",
    "tests/test_precision.py",
    "tests/test_rope.py",
    "tests/test_seed_scenarios.py",
    "tests/test_shadow.py",
    "tests/test_unchanged.py",
    "tests/test_unpad.py",
    "tests/test_windows.py",
]
# run on SAMPLE only (a path, or a test's node id without its parameters): what they check does not
# vary by release, and each is slow (a subprocess, a launcher, dynamo)
ONCE = {
    "tests/integrations": "the libraries users combine hfpatch with (skipped without them)",
    "tests/test_api.py": "the public API's contracts (threads, nesting)",
    "tests/test_cli.py": "the command line, a subprocess each",
    "tests/test_design.py": "the package's source",
    "tests/test_messages.py": "error messages",
    "tests/test_positions.py": "pure tensor functions",
    "tests/test_processes.py": "process launchers (spawn, DataLoader workers, torchrun)",
    "tests/test_readme.py": "the documents' examples and commands",
    "tests/test_testing.py": "the pytest plugin and hfpatch.testing",
    "tests/test_workers.py": "Ray's runtime_env plumbing",
    "tests/test_decoders.py::test_compiled_decoder_matches_eager": "dynamo on a whole decoder (30 s)",
    "tests/test_layout.py::test_flex_attention_gets_its_block_mask_from_the_layout": (
        "flex attention's kernel, compiled (40 s a test)"
    ),
    "tests/test_packed.py::test_flex_attention": "flex attention's kernel, compiled at its first use (20 s)",
    "tests/test_audit.py::test_audit_exits_with_the_commands_status_and_reports_no_calls": "a subprocess",
    "tests/test_audit.py::test_audit_command_mistakes_are_one_line": "the CLI's argument errors",
    "tests/test_shadow.py::test_hfpatch_shadow_variable_with_the_launcher": "the launcher, a subprocess",
    "tests/test_shadow.py::test_the_shadow_under_hfpatch_audit": "the audit command, a subprocess",
    "tests/test_lifecycle.py::test_eight_threads_apply_and_revert": "thread safety of the ledger",
}
# tests with the ``compile`` marker run on SAMPLE only, except this per-release smoke (I6 on every release)
ONCE_MARKERS = ["compile"]
# and the parametrized tests whose parameters say this: flex attention compiles its kernel at its first
# use in a process (20 s), whichever test that is (the releases' flex attention: the sample's 4.57-5.24)
ONCE_PARAMETERS = ["flex_attention"]
COMPILE_SMOKE = ["tests/test_compile.py::test_no_graph_break_of_its_own"]
# the probe's tests (FILE::FUNCTION, or FILE::FUNCTION[WORD OF ITS PARAMETERS]) that run on SAMPLE only
# on the releases before the one named (None: on every release): what each leaves out, and why
PROBE_ONCE: dict[str, tuple[Optional[str], str]] = {
    # before 4.36 no release reads the attention a config asks for (config._attn_implementation):
    # the SDPA tests there run the eager code, the eager tests' twins
    "tests/test_architectures.py::test_verify_covered_architecture[sdpa]": ("4.36", "no SDPA before 4.36"),
    "tests/test_architectures.py::test_packed_rows_covered_architecture[sdpa]": (
        "4.36",
        "no SDPA before 4.36",
    ),
    "tests/test_decoders.py::test_decoder_rows_equal_themselves_alone[sdpa]": ("4.36", "no SDPA before 4.36"),
    "tests/test_decoders.py::test_decoder_with_a_static_cache_rows_equal_themselves_alone[sdpa]": (
        "4.36",
        "no SDPA before 4.36",
    ),
    "tests/test_decoders.py::test_decoder_window_is_decided_by_position[sdpa]": (
        "4.36",
        "no SDPA before 4.36",
    ),
    "tests/test_wrappers.py::test_padded_prefix_continued_equals_each_row_alone[sdpa]": (
        "4.36",
        "no SDPA before 4.36",
    ),
    "tests/test_wrappers.py::test_left_padded_prompt_equals_each_row_alone[sdpa]": (
        "4.36",
        "no SDPA before 4.36",
    ),
}
# not run by the matrix at all
NOT_IN_MATRIX = {
    "tests/test_compat_report.py": "checks the committed evidence, not the installed release",
    "tests/test_compat_matrix.py": "checks this split and the matrix scripts, not the installed release",
}
ONCE_FILES = sorted(path for path in ONCE if "::" not in path)


def named(nodeid: str, names) -> bool:
    """Whether one of ``names`` (a folder, a file, a test function, or a function and a word of its
    parameters: ``FILE::FUNCTION[WORD]``) names the test ``nodeid``."""
    function, _, parameters = nodeid.partition("[")
    for name in names:
        path, _, word = name.removesuffix("]").partition("[")
        if word and word not in parameters:
            continue
        if (
            function == path
            or function.startswith(path.rstrip("/") + "/")
            or function.startswith(path + "::")
        ):
            return True
    return False


def runs_once(nodeid: str, markers: set[str]) -> bool:
    """Whether the suite's test ``nodeid`` (with ``markers``) runs on SAMPLE only."""
    parameters = nodeid.partition("[")[2]
    if any(word in parameters for word in ONCE_PARAMETERS):
        return True
    if named(nodeid, COMPILE_SMOKE):
        return False
    return named(nodeid, ONCE) or bool(markers & set(ONCE_MARKERS))


def probe_runs_once(nodeid: str, release: str) -> bool:
    """Whether the probe's test ``nodeid`` runs on SAMPLE only on ``release`` (:data:`PROBE_ONCE`)."""
    return named(nodeid, [name for name, (before, _) in PROBE_ONCE.items()
                          if before is None or _version(release) < _version(before)])  # fmt: skip


def _version(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split(".")[:3] if part.isdigit())


def install_steps(release: str) -> list[list[str]]:
    """The ``pip install`` argument lists that install ``release`` (after torch), in order."""
    if release.startswith(NO_TOKENIZERS):
        return [["--no-deps", f"transformers=={release}"], NO_TOKENIZERS_DEPENDENCIES]
    if release in HUB_PINS:
        return [[f"transformers=={release}", f"huggingface_hub=={HUB_PINS[release]}"]]
    return [[f"transformers=={release}"]]


def setup(python: str) -> None:
    """Install torch and the test dependencies into ``python``'s environment."""
    subprocess.run([python, "-m", "pip", "install", "-q", TORCH, *TEST_DEPENDENCIES], check=True)


def install(release: str, python: str) -> None:
    """Install ``release`` into ``python``'s environment, replacing the transformers it has (a newer
    tokenizers fails the old releases' import check: it goes first)."""
    pip = [python, "-m", "pip", "install", "-q"]
    if release.startswith(NO_TOKENIZERS):
        subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "tokenizers"], check=True)
    for step in install_steps(release):
        subprocess.run([*pip, *step], check=True)


def commit() -> str:
    """The code the run tests: ``MATRIX_COMMIT`` (compat/one_commit.sh sets it), else the checkout's HEAD,
    with ``-dirty`` where the checkout has uncommitted changes to the code or the tests."""
    if os.environ.get("MATRIX_COMMIT"):
        return os.environ["MATRIX_COMMIT"]
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    status = ["git", "status", "--porcelain", "--untracked-files=no", "--", "hfpatch", "tests", "compat"]
    dirty = subprocess.run([*status, "pyproject.toml"], capture_output=True, text=True, cwd=ROOT)
    return (done.stdout.strip() or "unknown") + ("-dirty" if dirty.stdout.strip() else "")


def pytest_args(release: str, part: str, junit: Path) -> list[str]:
    """The pytest arguments of one part of a release's run: ``probe`` (the probe files' probe tests,
    ``--outside-ranges``) or ``suite`` (PER_RELEASE without the probe tests; on SAMPLE, ONCE too)."""
    common = ["-q", "-p", "no:cacheprovider", "-p", "compat.matrix_plugin", "--tb=short",
              "--hypothesis-profile=matrix", f"--junitxml={junit}"]  # fmt: skip
    sample = ["--matrix-sample"] if release in SAMPLE else []
    if part == "probe":
        return [*common, "--matrix-part=probe", *sample, "-m", "slow or not slow", "--outside-ranges",
                *PROBE_FILES]  # fmt: skip
    files = [*PER_RELEASE, *(ONCE_FILES if sample else [])]
    # the inductor test runs in CI (nox -s ci), not here
    return [*common, "--matrix-part=suite", *sample, "-m", "not inductor", *files]


def run(release: str, results: Path = RESULTS) -> int:
    """The matrix on ``release`` with this Python (transformers ``release`` installed): the probe, the
    suite (split: :data:`SAMPLE`), the case count; then compat/evidence/RELEASE.json is rebuilt from
    these runs alone, at one commit. A failing test is a result; a run that did not finish is not (its
    evidence is left as it was, exit 1)."""
    import time

    import transformers

    if transformers.__version__ != release:
        sys.exit(f"transformers {transformers.__version__} is installed, not {release}")
    code = commit()
    (results / "probe").mkdir(parents=True, exist_ok=True)
    junits = {"probe": results / "probe" / f"{release}.xml", "suite": results / f"{release}.xml"}
    cases = results / f"{release}.cases.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    times = {}
    for part, junit in junits.items():
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", *pytest_args(release, part, junit)], cwd=ROOT,
                              env=env)  # fmt: skip
        times[part] = round(time.monotonic() - start)
        if done.returncode not in (0, 1):  # 0: all passed, 1: some failed (a result); else it did not run
            print(f"{release}: the {part} run ended with {done.returncode}: no evidence written")
            return 1
    start = time.monotonic()
    subprocess.run([sys.executable, str(HERE / "count_cases.py"), str(cases)], cwd=ROOT, env=env, check=True)
    times["cases"] = round(time.monotonic() - start)
    sys.path.insert(0, str(ROOT))
    from compat import evidence

    found = evidence.restart(release, code, sample=release in SAMPLE)
    evidence.merge(found, evidence.read_junit(junits["probe"]), code, probe_only=True)
    evidence.merge(found, evidence.read_junit(junits["suite"]), code)
    found["cases"] = json.loads(cases.read_text())
    evidence.save(evidence.collapse_suite(found))
    (results / f"{release}.times.json").write_text(json.dumps(times) + "\n")
    print(f"{release} at {code}: " + ", ".join(f"{part} {s} s" for part, s in times.items()))
    return 0


def split() -> str:
    """Which test file runs where, one a line (``python compat/matrix.py split``)."""
    lines = [f"every release: {path}" for path in PER_RELEASE]
    lines += [f"SAMPLE only ({', '.join(SAMPLE)}): {path}: {why}" for path, why in ONCE.items()]
    lines += [f"SAMPLE only: the {', '.join(ONCE_MARKERS)} marker, but {', '.join(COMPILE_SMOKE)}"]
    lines += [f"SAMPLE only: parameters naming {', '.join(ONCE_PARAMETERS)}"]
    lines += [
        f"the probe, SAMPLE only (before {before}): {name}: {why}"
        for name, (before, why) in PROBE_ONCE.items()
    ]
    lines += [f"not in the matrix: {path}: {why}" for path, why in NOT_IN_MATRIX.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["releases"]:
        print("\n".join(RELEASES))
    elif sys.argv[1:2] == ["sample"]:
        print("\n".join(SAMPLE))
    elif sys.argv[1:2] == ["split"]:
        print(split())
    elif sys.argv[1:2] == ["run"] and len(sys.argv) == 3:
        sys.exit(run(sys.argv[2]))
    elif sys.argv[1:2] == ["setup"] and len(sys.argv) == 3:
        setup(sys.argv[2])
    elif sys.argv[1:2] == ["install"] and len(sys.argv) == 4:
        install(sys.argv[2], sys.argv[3])
    else:
        sys.exit(
            f"usage: python {sys.argv[0]} releases | split | setup PYTHON | install RELEASE PYTHON | "
            "run RELEASE"
        )
