"""The adapters' declared release ranges match the evidence: compat/evidence/ (one file per release,
from the release matrix: bash compat/run_matrix.sh, the full suite on the flagship architectures; bash
compat/probe_matrix.sh, every covered model type), from which compat/REPORT.md is generated. It checks
the committed evidence, not the installed transformers, so the nox matrix sessions leave it out."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

import hfpatch
from compat.vocabulary import ABSENT, CUSTOM_NOT_PATCHED, FLAGSHIPS, NOT_PATCHED
from hfpatch.support import KNOWN_BAD, NEWEST_TESTED, TESTED, support

COMPAT = Path(__file__).resolve().parent.parent / "compat"
sys.path.insert(0, str(COMPAT))

import evidence  # noqa: E402
import report  # noqa: E402

from matrix import RELEASES  # noqa: E402

REGISTRY = hfpatch.registry()
# every adapter's model types: the probe runs causal LMs and encoder-decoder models alike (hfpatch.verify)
COVERED = [(name, alias) for name, adapter in REGISTRY.items() for alias in (name, *adapter.aliases)]
SUMMARY = report.build()


def test_report_covers_every_listed_release():
    assert list(SUMMARY) == RELEASES
    missing = [release for release, entry in SUMMARY.items() if not entry["ran"] or not entry["cases"]]
    assert not missing, f"no results for {missing}: run bash compat/run_matrix.sh"
    unprobed = [release for release, entry in SUMMARY.items() if not entry["probe"]]
    assert not unprobed, f"no probe results for {unprobed}: run bash compat/probe_matrix.sh"


def test_the_report_and_the_evidence_regenerate_identically():
    """compat/REPORT.md is what the committed evidence gives, and each evidence file is what its own
    data writes: the same results give the same bytes (no order, no float noise)."""
    committed = (COMPAT / "REPORT.md").read_text()
    history = subprocess.run(["git", "rev-parse", "HEAD"], cwd=COMPAT.parent, capture_output=True)
    if history.returncode:  # a copy without git history (an sdist, CI's second checkout): the report
        # cannot count the runtime commits between the commits it was measured at, and leaves them out
        committed = re.sub(r", \d+ runtime commits? before `[0-9a-f]+`", "", committed)
    assert committed == report.render(SUMMARY), "run python compat/report.py"
    for release in RELEASES:
        path = COMPAT / "evidence" / f"{release}.json"
        assert evidence.dumps(evidence.load(release)) == path.read_text(), path


def test_the_committed_evidence_is_small():
    files = [path for path in COMPAT.rglob("*") if path.is_file() and "results" not in path.parts]
    size = sum(path.stat().st_size for path in files if "__pycache__" not in path.parts)
    assert size <= 5 * 2**20, f"compat/ commits {size / 2**20:.1f} MB of evidence: keep it under 5 MB"


def test_newest_tested_is_the_newest_release_in_the_matrix():
    assert NEWEST_TESTED == max(RELEASES, key=Version)


@pytest.mark.parametrize("arch", FLAGSHIPS)
def test_adapter_range_matches_the_report(arch):
    adapter = REGISTRY[arch]
    ran = {release: entry for release, entry in SUMMARY.items() if entry["ran"] and entry["cases"]}
    assert ran, "compat/evidence/ holds no results: run bash compat/run_matrix.sh"
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
    probed = [(release, entry["probe"]) for release, entry in SUMMARY.items() if entry["probe"]]
    assert probed, "compat/evidence/ holds no probe results: run bash compat/probe_matrix.sh"
    if not any(model_type in probe for _, probe in probed):  # declared after the probe's last run
        pytest.skip(f"{model_type} is not in the probe's results yet: run bash compat/probe_matrix.sh")
    alias_since = dict(adapter.alias_since).get(model_type)
    for release, probe in probed:
        verdict = report.probe_verdict(probe.get(model_type, {}))
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
    """A JUnit XML of probe tests as the tests write it: {test name: "pass" | "fail" | "skip", its
    recorded properties after a space (kind=...;stock=...)}; a message that says something else."""
    body = []
    for name, spec in cases.items():
        outcome, _, properties = spec.partition(" ")
        tag = {"pass": "", "fail": "failure", "skip": "skipped"}[outcome]
        inner = f'<{tag} message="a message the report must not read: exact, absent" />' if tag else ""
        model_type, attention = name.partition("[")[2].rstrip("]").split("-")[:2]
        fields = dict(item.split("=") for item in properties.split(";") if item)
        fields = {"probe_type": model_type, "attention": attention, **fields}
        props = "".join(f'<property name="{k}" value="{v}" />' for k, v in fields.items())
        body.append(
            f'<testcase classname="tests.test_decoders" name="{name}"><properties>{props}</properties>'
            f"{inner}</testcase>"
        )
    path.write_text(f"<testsuites><testsuite>{''.join(body)}</testsuite></testsuites>")
    return path


def _cells(*paths: Path) -> dict:
    data = {"release": "0.0.0", "code": {"probe": [], "suite": []}, "reasons": [], "probe": {}, "suite": {}}
    for path in paths:
        evidence.merge(data, evidence.read_junit(path), None, probe_only=True)
    return report.probe_cells(data)


def test_a_partial_re_run_replaces_only_the_tests_it_ran(tmp_path):
    """The evidence's merge of probe runs (compat/evidence.py): a later run's result of a test replaces
    the earlier one's, a skip replaces nothing, and a cell is the worst of its tests, so a re-run of one
    test cannot hide another's failure; the verdict comes from the recorded kind, not the message."""
    static = "test_decoder_with_a_static_cache_rows_equal_themselves_alone"
    wrong = "kind=wrong with the positions;stock=0.12;hfpatch=0.12"
    rows = "test_decoder_rows_equal_themselves_alone"
    full = _junit(tmp_path / "full.xml", {
        f"{rows}[t5-eager-right-padded prefix + 1]": "fail kind=class differs",
        f"{static}[t5-eager]": f"fail {wrong}",
        f"{static}[bart-eager]": "fail kind=wrong with the positions;stock=2;hfpatch=1",
    })  # fmt: skip
    partial = _junit(tmp_path / "partial.xml", {
        f"{static}[t5-eager]": "pass kind=exact;stock=0.12;hfpatch=1e-06",
        f"{static}[bart-eager]": "skip kind=skipped",
    })  # fmt: skip
    cells = _cells(full, partial)
    assert cells["t5"]["eager"]["outcome"] == "fail"  # the scenario test's failure stands
    assert report.failure_kind(cells["t5"]) == "class differs"
    assert cells["bart"]["eager"]["outcome"] == "fail"  # a skip replaces nothing
    assert _cells(partial)["t5"]["eager"]["outcome"] == "pass"
    absent = _junit(tmp_path / "absent.xml", {f"{static}[mamba-eager]": "skip kind=absent"})
    assert "mamba" not in _cells(absent)  # (a release without the type leaves no row)
    assert report.probe_verdict(_cells(absent).get("mamba", {})) == "absent"


# the custom models copied from the release's own files (tests/test_custom_models.py): the model type
# of transformers each copies (the architecture probe's record says whether the release ships it)
COPIED = {"custom-gpt2": "gpt2", "custom-llama": "llama", "custom-qwen2": "qwen2"}


def test_custom_models_pass_wherever_they_run():
    """Every release where a custom model's test ran (tests/test_custom_models.py in the probe), it
    passed: exact with hfpatch, or left alone where it must be; except where hfpatch's own check
    refuses it (:data:`CUSTOM_NOT_PATCHED`, each measured: not patched, never patched and wrong); a
    copy of a release's model is missing exactly where the architecture probe finds that release
    without the model type."""
    verdicts = report.custom_verdicts(SUMMARY)
    if not verdicts:
        pytest.skip("no custom-model probe results: run bash compat/probe_matrix.sh")
    failing = {
        (model_type, release): report.failure_kind(SUMMARY[release]["probe"][model_type])
        for model_type, by_release in verdicts.items()
        for release, verdict in by_release.items()
        if verdict == "fail"
    }
    assert failing == dict.fromkeys(CUSTOM_NOT_PATCHED, NOT_PATCHED), (
        f"the probe's failing custom models: {failing}; declared: {sorted(CUSTOM_NOT_PATCHED)}"
    )
    for custom, model_type in COPIED.items():
        for release, verdict in verdicts.get(custom, {}).items():
            if model_type not in SUMMARY[release]["probe"]:
                continue
            copied = verdict != ABSENT
            ships = report.probe_verdict(SUMMARY[release]["probe"][model_type]) != "absent"
            assert copied == ships, f"{custom} on {release}: copied {copied}, {model_type} shipped {ships}"
