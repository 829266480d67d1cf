"""The adapters' declared release ranges match the evidence: compat/summary.json, generated with
compat/REPORT.md from the release matrix (bash compat/run_matrix.sh: the full suite on the flagship
architectures; bash compat/probe_matrix.sh: hfpatch.verify on every covered model type). It checks
the committed report, not the installed transformers, so the nox matrix sessions leave it out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from packaging.version import Version

import hfpatch
from hfpatch.support import KNOWN_BAD, NEWEST_TESTED, TESTED, support

from expectations import FLAGSHIPS

COMPAT = Path(__file__).resolve().parent.parent / "compat"
sys.path.insert(0, str(COMPAT))

from matrix import RELEASES, probe_verdict  # noqa: E402

REGISTRY = hfpatch.registry()
# every adapter's model types: the probe runs causal LMs and encoder-decoder models alike (hfpatch.verify)
COVERED = [(name, alias) for name, adapter in REGISTRY.items() for alias in (name, *adapter.aliases)]
SUMMARY_FILE = COMPAT / "summary.json"
SUMMARY = json.loads(SUMMARY_FILE.read_text()) if SUMMARY_FILE.exists() else {}


def test_report_covers_every_listed_release():
    assert SUMMARY_FILE.exists(), "no compat/summary.json: run bash compat/run_matrix.sh"
    assert list(SUMMARY) == RELEASES
    missing = [release for release, entry in SUMMARY.items() if not entry["ran"] or "cases" not in entry]
    assert not missing, f"no results for {missing}: run bash compat/run_matrix.sh"
    unprobed = [release for release, entry in SUMMARY.items() if "probe" not in entry]
    assert not unprobed, f"no probe results for {unprobed}: run bash compat/probe_matrix.sh"


def test_newest_tested_is_the_newest_release_in_the_matrix():
    assert NEWEST_TESTED == max(RELEASES, key=Version)


@pytest.mark.parametrize("arch", FLAGSHIPS)
def test_adapter_range_matches_the_report(arch):
    adapter = REGISTRY[arch]
    ran = {release: entry for release, entry in SUMMARY.items() if entry["ran"] and "cases" in entry}
    assert ran, "compat/summary.json holds no results: run bash compat/run_matrix.sh"
    for release, entry in ran.items():
        verdict = support(adapter, Version(release))
        present = entry["cases"][arch]["present"]
        cells = entry["cells"].get(arch, {})
        states = {column: cell[0] for column, cell in cells.items()}
        if verdict.level == TESTED:
            assert present, f"{arch} is declared tested on {release}, which does not ship it"
            assert states.get("I1") == "pass", f"{arch} on {release}: padding invariant {states.get('I1')}"
            assert "fail" not in states.values(), f"{arch} on {release}: {states}"
            count = entry["cases"][arch]
            assert count["hfpatch_wrong"] == 0, f"{arch} on {release}: {count}"
        elif verdict.level == KNOWN_BAD:
            assert present
        else:
            assert not present, (
                f"{release} ships {arch}, but {adapter.versions} leaves it out: widen the range"
            )
            assert set(states.values()) <= {"n/a"}


def test_no_unexplained_failure():
    for release, entry in SUMMARY.items():
        for arch, cells in entry.get("cells", {}).items():
            for column, (state, _) in cells.items():
                if state == "fail":
                    adapter = REGISTRY.get(arch)
                    assert adapter and support(adapter, Version(release)).level == KNOWN_BAD, (
                        release,
                        arch,
                        column,
                    )


@pytest.mark.parametrize("name, model_type", COVERED, ids=[alias for _, alias in COVERED])
def test_probed_range_matches_the_report(name, model_type):
    """Every release where the declaration patches the class passes the probe, and every release where
    the probe passes is patched: a range may have holes (known-bad releases, each with its reason), but
    only where the probe fails. An alias verified from a later release (``alias_since``) is held to
    its own range; it may lack the model type where the class ships (absent)."""
    adapter = REGISTRY[name]
    probed = [(release, entry["probe"]) for release, entry in SUMMARY.items() if "probe" in entry]
    assert probed, "compat/summary.json holds no probe results: run bash compat/probe_matrix.sh"
    if not any(model_type in probe for _, probe in probed):  # declared after the probe's last run
        pytest.skip(f"{model_type} is not in the probe's results yet: run bash compat/probe_matrix.sh")
    alias_since = dict(adapter.alias_since).get(model_type)
    for release, probe in probed:
        verdict = probe_verdict(probe.get(model_type, {}))
        level = support(adapter, Version(release)).level
        if model_type == name:
            if level == TESTED:
                assert verdict == "pass", (
                    f"{model_type} is declared tested on {release}; the probe: {verdict}"
                )
            else:
                assert verdict != "pass", (
                    f"{model_type} passes the probe on {release} but is not patched there"
                )
        elif level == TESTED and (alias_since is None or Version(release) >= Version(alias_since)):
            assert verdict in ("pass", "absent"), f"{model_type} is tested on {release}; the probe: {verdict}"


def _junit(path: Path, cases: dict[str, str]) -> Path:
    """A JUnit XML of probe tests: {test name: "pass" | "fail: MESSAGE" | "skip: MESSAGE"}."""
    body = []
    for name, outcome in cases.items():
        kind, _, message = outcome.partition(": ")
        tag = {"pass": "", "fail": "failure", "skip": "skipped"}[kind]
        inner = f'<{tag} message="{message}" />' if tag else ""
        body.append(f'<testcase classname="tests.test_decoders" name="{name}">{inner}</testcase>')
    path.write_text(f"<testsuites><testsuite>{''.join(body)}</testsuite></testsuites>")
    return path


def test_a_partial_re_run_replaces_only_the_tests_it_ran(tmp_path):
    """The report's merge of probe runs (compat/report.py): a later run's result of a test replaces the
    earlier one's, a skip replaces nothing, and a cell is the worst of its tests, so a re-run of one
    test cannot hide another's failure."""
    from report import merge_probes

    static = "test_decoder_with_a_static_cache_rows_equal_themselves_alone"
    full = _junit(tmp_path / "full.xml", {
        "test_decoder_rows_equal_themselves_alone[t5-eager-right-padded prefix + 1]": "fail: ValueError: x",
        f"{static}[t5-eager]": "fail: AssertionError: t5 (eager), StaticCache: hfpatch 0.12, stock 0.12",
        f"{static}[bart-eager]": "fail: AssertionError: bart (eager), StaticCache: hfpatch 1, stock 2",
    })  # fmt: skip
    partial = _junit(tmp_path / "partial.xml", {
        f"{static}[t5-eager]": "pass",
        f"{static}[bart-eager]": "skip: not run here",
    })  # fmt: skip
    cells = merge_probes([full, partial])
    assert cells["t5"]["eager"]["outcome"] == "fail"  # the scenario test's failure stands
    assert cells["t5"]["eager"]["message"].startswith("ValueError")
    assert cells["bart"]["eager"]["outcome"] == "fail"  # a skip replaces nothing
    assert merge_probes([partial])["t5"]["eager"]["outcome"] == "pass"
