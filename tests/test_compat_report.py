"""The adapters' declared release ranges match the evidence: compat/summary.json, generated with
compat/REPORT.md from a full run of the release matrix (bash compat/run_matrix.sh). It checks the
committed report, not the installed transformers, so the nox matrix sessions leave it out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from packaging.version import Version

from hfpatch import engine
from hfpatch.gates import KNOWN_BAD, NEWEST_TESTED, TESTED, support, upstream_bugs_on

COMPAT = Path(__file__).resolve().parent.parent / "compat"
ARCHS = tuple(engine._registry)
RELEASES = [
    line.strip()
    for line in (COMPAT / "releases.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]
SUMMARY_FILE = COMPAT / "summary.json"
SUMMARY = json.loads(SUMMARY_FILE.read_text()) if SUMMARY_FILE.exists() else {}


def test_report_covers_every_listed_release():
    assert SUMMARY_FILE.exists(), "no compat/summary.json: run bash compat/run_matrix.sh"
    assert list(SUMMARY) == RELEASES
    missing = [release for release, entry in SUMMARY.items() if not entry["ran"] or "cases" not in entry]
    assert not missing, f"no results for {missing}: run bash compat/run_matrix.sh"


def test_newest_tested_is_the_newest_release_in_the_matrix():
    assert NEWEST_TESTED == max(RELEASES, key=Version)


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_range_matches_the_report(arch):
    adapter = engine._registry[arch]
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
            if not upstream_bugs_on(adapter, Version(release)):
                assert count["hfpatch_wrong"] == 0, f"{arch} on {release}: {count}"
            assert count["hfpatch_wrong"] <= count["stock_wrong"], f"{arch} on {release}: {count}"
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
                    adapter = engine._registry.get(arch)
                    assert adapter and support(adapter, Version(release)).level == KNOWN_BAD, (
                        release,
                        arch,
                        column,
                    )
